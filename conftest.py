"""Repository-wide pytest setup: CPU-friendly vLLM defaults and the `gpu` marker."""

import os
import pathlib
import tempfile

import pytest

# vLLM on CPU takes ~10 GiB of KV cache unless told otherwise, and its caches
# must stay out of the home folder (the same defaults the Makefile exports).
_cache = pathlib.Path(os.environ.get("PRIMERL_TEST_CACHE", pathlib.Path(tempfile.gettempdir()) / "primerl-test-cache"))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", str(_cache / "vllm"))
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_cache / "torchinductor"))


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
