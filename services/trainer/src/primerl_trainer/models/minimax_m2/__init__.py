"""MiniMax-M2 (`minimax_m2`): model, Hugging Face state-dict adapter, parallelize function."""
