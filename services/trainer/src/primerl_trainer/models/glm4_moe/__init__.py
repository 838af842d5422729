"""GLM-4.5 / INTELLECT-3 (`glm4_moe`): model, Hugging Face state-dict adapter, parallelize function."""
