"""Qwen3-MoE: model, Hugging Face state-dict adapter, parallelize function."""
