"""Trinity / AFMoE (`afmoe`): model, Hugging Face state-dict adapter, parallelize function."""
