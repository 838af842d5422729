"""Qwen3.5-MoE (`qwen3_5_moe`, Gated DeltaNet hybrid): model, Hugging Face state-dict adapter, parallelize function."""
