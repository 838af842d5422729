"""Repository-wide pytest setup: CPU-friendly vLLM defaults and the `gpu` marker."""

import os
import pathlib
import tempfile

import pytest

# Set before any test imports vLLM; values already in the environment win.
# - VLLM_CPU_KVCACHE_SPACE=1 (GiB): otherwise the CPU worker sizes its KV cache at
#   0.9 of the NUMA node's memory and refuses to start on a shared box.
# - VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR kept between runs, out of the home folder:
#   on a cache miss vLLM inspects each model architecture in a subprocess (~10 s each
#   on two cores); entries are keyed by the hash of vLLM's model file, so reuse is safe.
# - VLLM_ENABLE_V1_MULTIPROCESSING=0: engines run in the test process (executor "uni").
# - no usage-report thread and no model hub: a missing local file fails at once.
_cache = pathlib.Path(os.environ.get("PRIMERL_TEST_CACHE", pathlib.Path(tempfile.gettempdir()) / "primerl-test-cache"))
for _name, _value in {
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CACHE_ROOT": str(_cache / "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": str(_cache / "torchinductor"),
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)


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
