"""Laguna (`laguna`): model, Hugging Face state-dict adapter, parallelize function."""
