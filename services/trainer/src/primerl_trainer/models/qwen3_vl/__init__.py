"""Qwen3-VL (`qwen3_vl`) and Qwen3-VL-MoE (`qwen3_vl_moe`): vision tower, models, Hugging Face
state-dict adapters, parallelize functions."""
