"""Model registry: Hugging Face `model_type` -> own implementation, and loading / export in
Hugging Face's formats.

    model = load_model("/models/Qwen3-30B-A3B", impl="auto", dtype=torch.bfloat16, device="cuda")
    out = model(input_ids, position_ids, routed_experts=replayed)   # -> CausalLMOutput
    tensors = export_hf_state_dict(model)                           # hub names

impl (as in prime-rl): "custom" = the own implementation (ValueError if the model type has
none), "hf" = transformers' model, "auto" = own where registered, else transformers'.
"""

import json
import os
import pathlib
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from safetensors.torch import load_file
from torch import nn

from primerl_trainer.config_types import IMPLS, Impl
from primerl_trainer.models.afmoe.model import AfmoeModel, AfmoeModelArgs
from primerl_trainer.models.afmoe.parallelize import parallelize_afmoe
from primerl_trainer.models.afmoe.state_dict_adapter import AfmoeStateDictAdapter
from primerl_trainer.models.common.attention import AttentionBackend
from primerl_trainer.models.glm4_moe.model import Glm4MoeModel, Glm4MoeModelArgs
from primerl_trainer.models.glm4_moe.parallelize import parallelize_glm4_moe
from primerl_trainer.models.glm4_moe.state_dict_adapter import Glm4MoeStateDictAdapter
from primerl_trainer.models.glm_moe_dsa.model import GlmMoeDsaModel, GlmMoeDsaModelArgs
from primerl_trainer.models.glm_moe_dsa.parallelize import parallelize_glm_moe_dsa
from primerl_trainer.models.glm_moe_dsa.state_dict_adapter import GlmMoeDsaStateDictAdapter
from primerl_trainer.models.gpt_oss.model import GptOssModel, GptOssModelArgs
from primerl_trainer.models.gpt_oss.parallelize import parallelize_gpt_oss
from primerl_trainer.models.gpt_oss.state_dict_adapter import GptOssStateDictAdapter
from primerl_trainer.models.hf import HFCausalLM
from primerl_trainer.models.laguna.model import LagunaModel, LagunaModelArgs
from primerl_trainer.models.laguna.parallelize import parallelize_laguna
from primerl_trainer.models.laguna.state_dict_adapter import LagunaStateDictAdapter
from primerl_trainer.models.minimax_m2.model import MiniMaxM2Model, MiniMaxM2ModelArgs
from primerl_trainer.models.minimax_m2.parallelize import parallelize_minimax_m2
from primerl_trainer.models.minimax_m2.state_dict_adapter import MiniMaxM2StateDictAdapter
from primerl_trainer.models.moe import ExpertsImpl
from primerl_trainer.models.nemotron_h.model import NemotronHModel, NemotronHModelArgs
from primerl_trainer.models.nemotron_h.parallelize import parallelize_nemotron_h
from primerl_trainer.models.nemotron_h.state_dict_adapter import NemotronHStateDictAdapter
from primerl_trainer.models.qwen3.model import Qwen3Model, Qwen3ModelArgs
from primerl_trainer.models.qwen3.parallelize import parallelize_qwen3
from primerl_trainer.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from primerl_trainer.models.qwen3_5_moe.model import Qwen3_5MoeModel, Qwen3_5MoeModelArgs
from primerl_trainer.models.qwen3_5_moe.parallelize import parallelize_qwen3_5_moe
from primerl_trainer.models.qwen3_5_moe.state_dict_adapter import Qwen3_5MoeStateDictAdapter
from primerl_trainer.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs
from primerl_trainer.models.qwen3_moe.parallelize import parallelize_qwen3_moe
from primerl_trainer.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter
from primerl_trainer.models.qwen3_vl.model import Qwen3VLModel, Qwen3VLModelArgs, Qwen3VLMoeModel, Qwen3VLMoeModelArgs
from primerl_trainer.models.qwen3_vl.parallelize import parallelize_qwen3_vl, parallelize_qwen3_vl_moe
from primerl_trainer.models.qwen3_vl.state_dict_adapter import Qwen3VLMoeStateDictAdapter, Qwen3VLStateDictAdapter

# Vision-language model types: only the own implementation takes their images.
_IMAGE_TEXT_TYPES = frozenset({"qwen3_vl", "qwen3_vl_moe"})


@dataclass(frozen=True)
class ModelSpec:
    """What the trainer needs to build, load, shard and export one architecture."""

    model_type: str
    model_cls: type[Qwen3Model]
    args_cls: type[Qwen3ModelArgs]
    state_dict_adapter_cls: type[Qwen3StateDictAdapter]
    parallelize_fn: Callable[..., nn.Module]


MODEL_SPECS: dict[str, ModelSpec] = {
    spec.model_type: spec
    for spec in (
        ModelSpec("qwen3", Qwen3Model, Qwen3ModelArgs, Qwen3StateDictAdapter, parallelize_qwen3),
        ModelSpec("qwen3_moe", Qwen3MoeModel, Qwen3MoeModelArgs, Qwen3MoeStateDictAdapter, parallelize_qwen3_moe),
        ModelSpec("glm4_moe", Glm4MoeModel, Glm4MoeModelArgs, Glm4MoeStateDictAdapter, parallelize_glm4_moe),
        ModelSpec("minimax_m2", MiniMaxM2Model, MiniMaxM2ModelArgs, MiniMaxM2StateDictAdapter, parallelize_minimax_m2),
        # The hub's multimodal checkpoints (the language model is trained) and text-only ones.
        *(
            ModelSpec(name, Qwen3_5MoeModel, Qwen3_5MoeModelArgs, Qwen3_5MoeStateDictAdapter, parallelize_qwen3_5_moe)
            for name in ("qwen3_5_moe", "qwen3_5_moe_text")
        ),
        ModelSpec("gpt_oss", GptOssModel, GptOssModelArgs, GptOssStateDictAdapter, parallelize_gpt_oss),
        ModelSpec("afmoe", AfmoeModel, AfmoeModelArgs, AfmoeStateDictAdapter, parallelize_afmoe),
        ModelSpec("laguna", LagunaModel, LagunaModelArgs, LagunaStateDictAdapter, parallelize_laguna),
        ModelSpec(
            "glm_moe_dsa", GlmMoeDsaModel, GlmMoeDsaModelArgs, GlmMoeDsaStateDictAdapter, parallelize_glm_moe_dsa
        ),
        ModelSpec("nemotron_h", NemotronHModel, NemotronHModelArgs, NemotronHStateDictAdapter, parallelize_nemotron_h),
        # Multimodal: the vision tower and the language model (models/qwen3_vl).
        ModelSpec("qwen3_vl", Qwen3VLModel, Qwen3VLModelArgs, Qwen3VLStateDictAdapter, parallelize_qwen3_vl),
        ModelSpec(
            "qwen3_vl_moe", Qwen3VLMoeModel, Qwen3VLMoeModelArgs, Qwen3VLMoeStateDictAdapter, parallelize_qwen3_vl_moe
        ),
    )
}


def load_model(
    path: str | os.PathLike[str],
    *,
    impl: Impl = "auto",
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    attn_backend: AttentionBackend = "sdpa",
    experts_impl: ExpertsImpl = "auto",
) -> nn.Module:
    """Loads a Hugging Face checkpoint folder (config.json + safetensors).

    dtype None takes the config's. `attn_backend` and `experts_impl` apply to the own
    implementations (see common/attention.py and moe.py)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    path = pathlib.Path(path)
    config = read_hf_config(path)
    model_type = config.get("model_type")
    dtype = dtype or _config_dtype(config)
    if impl == "hf" and model_type in _IMAGE_TEXT_TYPES:
        # HFCausalLM wraps transformers' causal LMs and passes no images.
        raise ValueError(
            f"model.impl 'hf' runs text models; model_type {model_type!r} takes images: use 'auto' or 'custom'"
        )
    if impl == "hf" or (impl == "auto" and model_type not in MODEL_SPECS):
        return _load_hf_model(path, dtype=dtype, device=device)
    if model_type not in MODEL_SPECS:
        raise ValueError(f"impl='custom' has no implementation of model_type {model_type!r}: {sorted(MODEL_SPECS)}")

    spec = MODEL_SPECS[model_type]
    args = spec.args_cls.from_hf_config(config)
    if isinstance(args, Qwen3MoeModelArgs):
        args = replace(args, experts_impl=experts_impl)
    # Built on the meta device (no memory, no init) and given the checkpoint's tensors
    # themselves (assign=True): no copy, and nothing is left uninitialised.
    with torch.device("meta"):
        model = spec.model_cls(args, attn_backend=attn_backend).to(dtype)
    state_dict = spec.state_dict_adapter_cls(args).from_hf(read_hf_state_dict(path, device=device))
    missing = model.state_dict().keys() - state_dict.keys()
    unexpected = state_dict.keys() - model.state_dict().keys()
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {path} does not fit {spec.model_cls.__name__}: "
            f"missing {sorted(missing)[:5]}, unexpected {sorted(unexpected)[:5]}"
        )
    model.load_state_dict({key: value.to(_load_dtype(key, dtype)) for key, value in state_dict.items()}, assign=True)
    return model


def export_hf_state_dict(
    model: nn.Module, state_dict: dict[str, torch.Tensor] | None = None
) -> dict[str, torch.Tensor]:
    """The model's tensors under Hugging Face's checkpoint names.

    `state_dict` defaults to model.state_dict(); pass a gathered full state dict for a
    model sharded with FSDP. Tensors are not copied (expert splits are views)."""
    if isinstance(model, HFCausalLM):
        return model.hf_state_dict(state_dict)
    spec = model_spec_of(model)
    return spec.state_dict_adapter_cls(model.args).to_hf(model.state_dict() if state_dict is None else state_dict)


def model_spec_of(model: nn.Module) -> ModelSpec:
    """The spec of an own model, also once FSDP has subclassed its type."""
    by_class = {spec.model_cls: spec for spec in MODEL_SPECS.values()}
    for cls in type(model).__mro__:
        if cls in by_class:
            return by_class[cls]
    raise ValueError(f"{type(model).__name__} is not a registered own model")


def read_hf_config(path: str | os.PathLike[str]) -> dict[str, Any]:
    config_path = pathlib.Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{path} is not a Hugging Face model folder: no config.json")
    return json.loads(config_path.read_text())


def read_hf_state_dict(path: str | os.PathLike[str], *, device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder: the shards named by model.safetensors.index.json,
    or model.safetensors."""
    path = pathlib.Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    elif (path / "model.safetensors").is_file():
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{path} has no model.safetensors or model.safetensors.index.json")
    state_dict: dict[str, torch.Tensor] = {}
    for name in files:
        state_dict |= load_file(path / name, device=str(device))
    return state_dict


def _load_dtype(key: str, dtype: torch.dtype) -> torch.dtype:
    # A router's correction bias stays float32 (as transformers keeps it): it decides between
    # experts whose scores differ by less than bf16 resolves.
    return torch.float32 if key.endswith(".e_score_correction_bias") else dtype


def _config_dtype(config: dict[str, Any]) -> torch.dtype:
    name = config.get("dtype") or config.get("torch_dtype") or "float32"
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"config.json names an unknown dtype {name!r}")
    return dtype


def _load_hf_model(path: pathlib.Path, *, dtype: torch.dtype, device: torch.device | str) -> HFCausalLM:
    from transformers import AutoModelForCausalLM

    hf_model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="sdpa")
    return HFCausalLM(hf_model.to(device))
