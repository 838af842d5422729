"""GPT-OSS: Qwen3-MoE's composition (expert parallel first, then activation checkpointing,
compile and FSDP2). The routed experts (their biases included, split on the expert dim like
the weights) go over the ep mesh and are sharded over efsdp; attention (biases, sinks) and the
router (weight and bias) are sharded with their block like any other parameter."""

from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe

parallelize_gpt_oss = parallelize_qwen3_moe
