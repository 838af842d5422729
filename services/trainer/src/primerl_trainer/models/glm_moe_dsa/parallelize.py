"""GLM-5: GLM-4.5's composition (Qwen3-MoE's: expert parallel first, then activation
checkpointing, compile and FSDP2). The indexers' frozen weights are sharded with their block."""

from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe

parallelize_glm_moe_dsa = parallelize_qwen3_moe
