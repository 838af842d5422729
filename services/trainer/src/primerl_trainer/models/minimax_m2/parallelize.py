"""MiniMax-M2: Qwen3-MoE's composition (expert parallel first, then activation checkpointing,
compile and FSDP2). The routed experts are split over the ep mesh and sharded over efsdp; the
attention (its whole-projection q/k norms included) and the router (its correction bias is a
buffer, replicated) are sharded with their block like any other parameter."""

from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe

parallelize_minimax_m2 = parallelize_qwen3_moe
