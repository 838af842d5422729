"""Qwen3.5-MoE: Qwen3-MoE's composition (expert parallel first, then activation checkpointing,
compile and FSDP2). The routed experts are split over the ep mesh and sharded over efsdp; the
DeltaNet layers (projections, convolution, decay parameters), the shared expert and its gate
are sharded with their block like any other parameter. Compile takes the blocks without
fullgraph: the DeltaNet's scan stays out of the graph (gated_delta_net.GatedDeltaNet.core)."""

from typing import Any

from primerl_trainer.models.qwen3_5_moe.model import Qwen3_5MoeModel
from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe


def parallelize_qwen3_5_moe(model: Qwen3_5MoeModel, **kwargs: Any) -> Qwen3_5MoeModel:
    """In place; returns the model. The arguments are parallelize_qwen3_moe's."""
    return parallelize_qwen3_moe(model, compile_fullgraph=False, **kwargs)
