"""Qwen3-VL and Qwen3-VL-MoE: their language model's composition (Qwen3's; Qwen3-MoE's with
expert parallel first). FP8, activation checkpointing and compile apply to the decoder blocks;
FSDP2 shards each block as a unit, and the vision tower with the root: it runs once per forward,
before the first block, and stays eager."""

from typing import Any

from primerl_trainer.models.qwen3.parallelize import parallelize_qwen3
from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from primerl_trainer.models.qwen3_vl.model import Qwen3VLModel, Qwen3VLMoeModel


def parallelize_qwen3_vl(model: Qwen3VLModel, **kwargs: Any) -> Qwen3VLModel:
    """In place; returns the model. The arguments are parallelize_qwen3's."""
    return parallelize_qwen3(model, **kwargs)


def parallelize_qwen3_vl_moe(model: Qwen3VLMoeModel, **kwargs: Any) -> Qwen3VLMoeModel:
    """In place; returns the model. The arguments are parallelize_qwen3_moe's."""
    return parallelize_qwen3_moe(model, **kwargs)
