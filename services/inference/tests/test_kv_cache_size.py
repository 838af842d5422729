"""The CPU KV cache's size when nothing sets it: what max_num_seqs full-length sequences need,
from the model's KV bytes per token as vLLM's ModelConfig reads them from config.json, between
a small floor and engine.cpu_kv_cache_max_gib (never most of the machine)."""

import json
import pathlib

import pytest

from primerl_inference.kv_cache_size import MIN_CPU_KV_CACHE_BYTES, cpu_kv_cache_bytes, kv_bytes_per_token

from .serving import tiny_model

GIB = 2**30


def test_the_size_is_what_the_sequences_need_between_the_floor_and_the_cap() -> None:
    def size(bytes_per_token: int, max_num_seqs: int, max_model_len: int, max_gib: float = 4) -> int:
        return cpu_kv_cache_bytes(
            bytes_per_token=bytes_per_token,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
            max_bytes=int(max_gib * GIB),
        )

    # Qwen3-8B in bfloat16: 36 layers x K and V x 8 KV heads x 128 x 2 bytes = 144 KiB a token.
    qwen3_8b = 36 * 2 * 8 * 128 * 2
    assert 8 * 4096 * qwen3_8b == int(4.5 * GIB)
    assert size(qwen3_8b, 8, 4096, max_gib=8) == int(4.5 * GIB)  # what 8 sequences of 4096 tokens need...
    assert size(qwen3_8b, 8, 4096, max_gib=4) == 4 * GIB  # ...capped
    assert size(qwen3_8b, 64, 40960) == 4 * GIB  # its defaults would need 360 GiB
    assert size(1024, 4, 512) == MIN_CPU_KV_CACHE_BYTES  # a tiny model: the floor
    assert size(1024, 4, 512, max_gib=0.125) == GIB // 8  # the cap wins over the floor


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_bytes_per_token_come_from_the_models_config(model_root: pathlib.Path, kind: str) -> None:
    from vllm.config import ModelConfig, ParallelConfig

    model_dir = tiny_model(model_root, kind)
    hf = json.loads((model_dir / "config.json").read_text())
    head_dim = hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]
    expected = hf["num_hidden_layers"] * 2 * hf["num_key_value_heads"] * head_dim * 4  # float32

    model_config = ModelConfig(model=str(model_dir), dtype="float32", enforce_eager=True)

    assert kv_bytes_per_token(model_config, ParallelConfig(), 4) == expected
