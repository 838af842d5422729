"""Repository-wide pytest setup: CPU-friendly vLLM defaults, plaintext services and the `gpu` marker."""

import os

import pytest

from primerl_common.local_vllm import set_local_vllm_env

# Before any test imports vLLM (see primerl_common.local_vllm); values already in the environment win.
set_local_vllm_env()

# Tests serve on loopback without certificates: they say plaintext (tls.mode), as the local
# demo does; the security tests give their services mTLS explicitly (arguments beat this).
for _service in ("orchestrator", "trainer", "inference", "router", "weight_broadcaster", "kvstore"):
    os.environ.setdefault(f"PRIMERL_{_service.upper()}_TLS__MODE", "plaintext")


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if any("gpu" in item.keywords for item in items) and not _has_cuda():
        skip = pytest.mark.skip(reason="needs a CUDA GPU")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
