"""Laguna: Qwen3-MoE's composition (expert parallel first, then activation checkpointing,
compile and FSDP2). The routed experts are split over the ep mesh and sharded over efsdp; the
shared expert, the attention's output gates, the router (its correction bias is a buffer,
replicated) and the dense layers are sharded with their block like any other parameter."""

from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe

parallelize_laguna = parallelize_qwen3_moe
