"""Qwen3 (dense): model, Hugging Face state-dict adapter, parallelize function."""
