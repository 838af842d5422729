"""Qwen3.5-MoE parameter names <-> Hugging Face's: Qwen3-MoE's mapping (attention, router gate,
experts stacked as `moe.experts.w13`/`w2`) plus the DeltaNet layers (`linear_attn.*` ->
`attention.*`, same names inside), the shared expert and its gate.

Checkpoint layouts: the text model's (`qwen3_5_moe_text`: `model.layers.*`) and the hub's
multimodal one (`qwen3_5_moe`), whose language model sits under `model.language_model.` beside the
vision tower (`model.visual.*`) and the multi-token-prediction layers (`mtp.*`). The trainer
trains the language model only: the vision tower and MTP tensors are dropped on load, as
transformers' causal LM drops them, and absent from exports, which name the rest as the
checkpoint did. Experts load from per-expert tensors (what transformers writes) or from stacked
ones (`mlp.experts.gate_up_proj` [E, 2F, D], `mlp.experts.down_proj` [E, D, F]) and are exported
per expert. Values pass through untouched, so HF -> own -> HF is bit-exact for the rest."""

from typing import ClassVar

import torch

from primerl_trainer.models.qwen3_5_moe.model import Qwen3_5MoeModelArgs
from primerl_trainer.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter

_LANGUAGE_MODEL, _TEXT_MODEL = "model.language_model.", "model."
_DROPPED_PREFIXES = ("model.visual.", "mtp.")
_LINEAR_ATTENTION = ("in_proj_qkv.weight", "in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "conv1d.weight")
_LINEAR_ATTENTION += ("dt_bias", "A_log", "norm.weight", "out_proj.weight")


class Qwen3_5MoeStateDictAdapter(Qwen3MoeStateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **Qwen3MoeStateDictAdapter.from_hf_map,
        **{f"model.layers.{{}}.linear_attn.{name}": f"layers.{{}}.attention.{name}" for name in _LINEAR_ATTENTION},
        "model.layers.{}.mlp.shared_expert.gate_proj.weight": "layers.{}.shared_experts.w1.weight",
        "model.layers.{}.mlp.shared_expert.up_proj.weight": "layers.{}.shared_experts.w3.weight",
        "model.layers.{}.mlp.shared_expert.down_proj.weight": "layers.{}.shared_experts.w2.weight",
        "model.layers.{}.mlp.shared_expert_gate.weight": "layers.{}.shared_experts_gate.weight",
        # Stacked experts load as they are (export writes them per expert).
        "model.layers.{}.mlp.experts.gate_up_proj": "layers.{}.moe.experts.w13",
        "model.layers.{}.mlp.experts.down_proj": "layers.{}.moe.experts.w2",
    }
    args: Qwen3_5MoeModelArgs

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = {}
        for key, value in hf_state_dict.items():
            if key.startswith(_DROPPED_PREFIXES):
                continue
            if self.args.multimodal:
                if not key.startswith((_LANGUAGE_MODEL, "lm_head.")):
                    raise ValueError(f"unexpected tensor {key!r} in a multimodal Qwen3.5-MoE checkpoint")
                key = key.replace(_LANGUAGE_MODEL, _TEXT_MODEL, 1)
            text[key] = value
        return super().from_hf(text)

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf_state_dict = super().to_hf(state_dict)
        if not self.args.multimodal:
            return hf_state_dict
        return {
            key.replace(_TEXT_MODEL, _LANGUAGE_MODEL, 1) if key.startswith(_TEXT_MODEL) else key: value
            for key, value in hf_state_dict.items()
        }
