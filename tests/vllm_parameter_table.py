"""Prints, as JSON, the parameters (name -> shape, as created, before any weight is loaded)
of vLLM's model class for each model folder named on the command line, the model built on
the meta device with tensor parallel 1. Run as a separate process (tests/test_family_serving.py
does): it sets up vLLM's distributed state, which an engine started later in the same process
would find taken.

    python tests/vllm_parameter_table.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

from primerl_common.local_vllm import local_vllm_env

os.environ.update(local_vllm_env())  # before vLLM is imported

import torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import initialize_model


def parameter_table(model_dir: str) -> dict[str, list[int]]:
    model_config = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config)
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        model = initialize_model(vllm_config=vllm_config)
    return {name: list(parameter.shape) for name, parameter in model.named_parameters()}


def main(model_dirs: list[str]) -> None:
    with set_current_vllm_config(VllmConfig()), tempfile.TemporaryDirectory() as scratch:
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{scratch}/init", backend="gloo"
        )
        initialize_model_parallel(1, 1)
    tables = {model_dir: parameter_table(model_dir) for model_dir in model_dirs}
    print(json.dumps(tables))


if __name__ == "__main__":
    main(sys.argv[1:])
