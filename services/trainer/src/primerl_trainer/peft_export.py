"""The trainer's LoRA adapter as a PEFT adapter folder (`export.adapter_dir`), written when it stops.

The folder is what `peft.PeftModel.from_pretrained(base, folder)` reads: adapter_config.json
(LORA, CAUSAL_LM, r, lora_alpha, the adapted modules' leaf names) and adapter_model.safetensors
under PEFT's names (`lora.lora_adapter_tensors`). The base is the model at model.path; the
adapter applied to it computes what the trainer's adapted model does.

MoE families: transformers 5 fuses the routed experts into stacked parameters, and PEFT (0.21)
converts per-expert adapters onto them for the families in `PEFT_EXPERT_MODEL_TYPES` only, by
renaming every gate_proj, up_proj and down_proj target to the fused experts. So an adapter on the
routed experts loads for those families only (elsewhere PEFT drops it silently or fails), and one
on dense or shared-expert MLPs loads for every family but those (where PEFT drops it silently).
`check_peft_exportable` refuses both when the trainer starts, rather than writing an adapter PEFT
half ignores when it stops. Measured on the tiny models of each family (peft 0.21.2, transformers
5.19): experts load for qwen3_moe, glm4_moe, minimax_m2, afmoe, glm_moe_dsa; are dropped for
laguna, qwen3_5_moe_text, nemotron_h; fail for gpt_oss.

Written like the Hugging Face export (hf_export.staged_folder): a reader sees a whole folder or
none. Collective: every rank gathers its shards of the LoRA tensors; rank 0 writes.
"""

from __future__ import annotations

import logging
import os
import pathlib
import re
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn
from torch.nn.utils import parametrize

from primerl_trainer.export import exported_tensors, gather_state_dict
from primerl_trainer.hf_export import staged_folder, write_export_info, write_json
from primerl_trainer.lora import LINEAR_TARGETS, ExpertsLoRA
from primerl_trainer.models import read_hf_config

__all__ = [
    "ADAPTER_CONFIG_FILE",
    "ADAPTER_WEIGHTS_FILE",
    "PEFT_EXPERT_MODEL_TYPES",
    "check_peft_exportable",
    "export_peft_adapter",
    "peft_adapter_config",
]

logger = logging.getLogger(__name__)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
# Model types whose MLP adapters PEFT (0.21) converts onto transformers 5's fused experts (its
# transformers_weight_conversion); test_export_peft loads Qwen3-MoE and GLM-4.5 ones.
PEFT_EXPERT_MODEL_TYPES = frozenset({"qwen3_moe", "glm4_moe", "minimax_m2", "afmoe", "glm_moe_dsa"})
# The own modules of dense MLPs and shared experts (lora targets gate, up, down).
_MLP_SUFFIXES = tuple(suffix for target in ("gate", "up", "down") for suffix in LINEAR_TARGETS[target])
# base_model.model.<module>.lora_A.weight -> <module>
_PEFT_NAME = re.compile(r"base_model\.model\.(?P<module>.+)\.lora_[AB]\.weight")


def check_peft_exportable(model: nn.Module, *, model_type: str) -> None:
    """ValueError naming lora.target_modules when PEFT would load the model's adapter onto this
    family's transformers model with some of it dropped (see the module's docstring)."""
    adapts_experts = any(isinstance(module, ExpertsLoRA) for module in model.modules())
    adapts_mlps = any(
        name.endswith(_MLP_SUFFIXES) and parametrize.is_parametrized(module, "weight")
        for name, module in model.named_modules()
    )
    if adapts_experts and model_type not in PEFT_EXPERT_MODEL_TYPES:
        raise ValueError(
            f"export.adapter_dir: lora.target_modules adapts the routed experts ('experts'), which peft cannot load "
            f"for model_type {model_type!r} (only {', '.join(sorted(PEFT_EXPERT_MODEL_TYPES))}); drop 'experts' "
            "from lora.target_modules or export the merged model (export.hf_dir) instead"
        )
    if adapts_mlps and model_type in PEFT_EXPERT_MODEL_TYPES:
        raise ValueError(
            f"export.adapter_dir: lora.target_modules adapts dense or shared-expert MLPs ('gate', 'up', 'down'), "
            f"which peft retargets to the routed experts of model_type {model_type!r}, dropping them; drop them from "
            "lora.target_modules or export the merged model (export.hf_dir) instead"
        )


def peft_adapter_config(tensor_names: list[str], *, rank: int, alpha: float, base_model: str | None) -> dict[str, Any]:
    """adapter_config.json for an adapter holding `tensor_names` (PEFT's names): target_modules
    are the adapted modules' leaf names, as PEFT matches them (a suffix of the module path)."""
    modules = set()
    for name in tensor_names:
        match = _PEFT_NAME.fullmatch(name)
        assert match is not None, f"not a PEFT LoRA tensor name: {name}"
        modules.add(match["module"].rsplit(".", 1)[-1])
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": sorted(modules),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "modules_to_save": None,
    }


def export_peft_adapter(
    model: nn.Module,
    *,
    source_dir: str | os.PathLike[str],
    out_dir: str | os.PathLike[str],
    rank: int,
    alpha: float,
    dtype: torch.dtype,
    is_destination: bool,
    step: int,
) -> pathlib.Path | None:
    """Gathers the model's LoRA tensors and, on the destination rank, writes them as a PEFT adapter
    folder at `out_dir` for the base model at `source_dir`; returns it there (None elsewhere).
    Every rank must call it."""
    check_peft_exportable(model, model_type=str(read_hf_config(source_dir).get("model_type", "")))
    source = gather_state_dict(model, kind="adapter", is_destination=is_destination)
    tensors = exported_tensors(model, source, kind="adapter", dtype=dtype, lora_scale=None)
    # The adapter is small (rank x (in + out) per weight): held whole, for one file.
    adapter = {name: tensor.contiguous().cpu() for name, tensor in tensors}
    if not is_destination:
        return None
    if not adapter:
        raise ValueError("the model has no LoRA weights to export (lora.enabled false?)")
    source_path = pathlib.Path(source_dir)
    out = pathlib.Path(out_dir)
    config = peft_adapter_config(list(adapter), rank=rank, alpha=alpha, base_model=str(source_path.resolve()))
    with staged_folder(out) as staging:
        save_file(adapter, staging / ADAPTER_WEIGHTS_FILE, metadata={"format": "pt"})
        write_json(staging / ADAPTER_CONFIG_FILE, config)
        write_export_info(staging, step=step, source=source_path, num_tensors=len(adapter))
    logger.info("exported the LoRA adapter of step %d as a PEFT folder", step, extra={"path": str(out)})
    return out
