"""vLLM on a shared CPU box, for the tests and the benches: its environment, and engines in
this process that leave the process as they found it.

The environment is read by vLLM at import, so it is set before vLLM is imported (in this
process, or in the environment of a service process); values already in the environment win.

- VLLM_CPU_KVCACHE_SPACE=1 (GiB): otherwise the CPU worker sizes its KV cache at 0.9 of the
  NUMA node's memory and refuses to start on a shared box.
- VLLM_CACHE_ROOT, TORCHINDUCTOR_CACHE_DIR kept between runs, out of the home folder: on a cache
  miss vLLM inspects each model architecture in a subprocess (~10 s each on two cores); entries
  are keyed by the hash of vLLM's model file, so tests and benches share them safely.
- VLLM_ENABLE_V1_MULTIPROCESSING=0: an engine runs in its service's process (executor "uni").
- VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS=1: vLLM-cpu's engine process lingers in native teardown
  for seconds after SIGTERM and is killed after this long (default 5).
- no usage-report thread and no model hub: a missing local file fails at once.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pathlib
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM

__all__ = ["in_process_llm", "local_cache_dir", "local_vllm_env", "restored_process_state", "set_local_vllm_env"]


def local_cache_dir() -> pathlib.Path:
    """What tests and benches keep between runs (vLLM's caches, tiny models):
    $PRIMERL_TEST_CACHE, default <tmp>/primerl-test-cache."""
    return pathlib.Path(
        os.environ.get("PRIMERL_TEST_CACHE", pathlib.Path(tempfile.gettempdir()) / "primerl-test-cache")
    )


def local_vllm_env() -> dict[str, str]:
    """The settings, with the values the environment has already."""
    cache = local_cache_dir()
    defaults = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_CACHE_ROOT": str(cache / "vllm"),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
        "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        "VLLM_WORKER_SHUTDOWN_TIMEOUT_SECONDS": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
    }
    return {name: os.environ.get(name, value) for name, value in defaults.items()}


def set_local_vllm_env() -> None:
    """Sets them in this process's environment (before vLLM is imported)."""
    os.environ.update(local_vllm_env())


@contextlib.contextmanager
def restored_process_state() -> Iterator[None]:
    """Around an engine started in this process: vLLM's CPU platform rewrites process state
    for its workers, os.environ (LD_PRELOAD with tcmalloc and libgomp, inherited by every
    later subprocess), torch's thread count and torch.set_num_threads (made a no-op). Puts
    them back for what runs after."""
    import torch  # here: the settings above are read before torch or vLLM is imported

    environ, num_threads, set_num_threads = dict(os.environ), torch.get_num_threads(), torch.set_num_threads
    try:
        yield
    finally:
        gc.collect()
        os.environ.clear()
        os.environ.update(environ)
        torch.set_num_threads = set_num_threads
        torch.set_num_threads(num_threads)


@contextlib.contextmanager
def in_process_llm(model_dir: str | os.PathLike[str], **settings: Any) -> Iterator[LLM]:
    """A vLLM engine on `model_dir` in this process (executor "uni"; `settings`: LLM's other
    arguments), shut down on exit, with the process state restored."""
    from vllm import LLM

    with restored_process_state():
        llm = LLM(model=str(model_dir), **{"distributed_executor_backend": "uni", **settings})
        try:
            yield llm
        finally:
            llm.llm_engine.engine_core.shutdown()
            del llm
