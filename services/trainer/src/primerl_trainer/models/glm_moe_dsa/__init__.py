"""GLM-5 (`glm_moe_dsa`): model, Hugging Face state-dict adapter, parallelize function."""
