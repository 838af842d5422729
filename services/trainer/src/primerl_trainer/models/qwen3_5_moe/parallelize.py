"""Qwen3.5-MoE: Qwen3-MoE's composition (expert parallel first, then activation checkpointing,
compile and FSDP2). The routed experts are split over the ep mesh and sharded over efsdp; the
DeltaNet layers (projections, convolution, decay parameters), the shared expert and its gate
are sharded with their block like any other parameter. No context parallel (model.py)."""

from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe

parallelize_qwen3_5_moe = parallelize_qwen3_moe
