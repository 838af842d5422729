"""Nemotron-H: Qwen3-MoE's composition (expert parallel first, then activation checkpointing,
compile and FSDP2). The routed experts are split over the ep mesh and sharded over efsdp; the
Mamba-2 layers, attention, dense MLPs and shared experts are sharded with their block. Compile
takes the blocks without fullgraph: Mamba-2's scan stays out of the graph (mamba2.Mamba2.core)."""

from typing import Any

from primerl_trainer.models.nemotron_h.model import NemotronHModel
from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe


def parallelize_nemotron_h(model: NemotronHModel, **kwargs: Any) -> NemotronHModel:
    """In place; returns the model. The arguments are parallelize_qwen3_moe's."""
    return parallelize_qwen3_moe(model, compile_fullgraph=False, **kwargs)
