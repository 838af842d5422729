"""GPT-OSS (`gpt_oss`): model, Hugging Face state-dict adapter (with MXFP4 expert loading), parallelize function."""
