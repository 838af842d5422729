"""Qwen3-VL parameter names <-> Hugging Face's.

The hub's checkpoints hold the language model under `model.language_model.` (Qwen3's names
below it, mapped by Qwen3's adapter), `lm_head.weight`, and the vision tower under
`model.visual.`, whose names the own tower keeps (`visual.`). The one reshape: the patch
embedding's Conv3d weight [dim, C, t, p, p] is the own linear map's [dim, C * t * p * p], a view.

Qwen3-VL-MoE adds the routers (`mlp.gate.weight`) and the experts, which the hub stores fused
and transposed: `mlp.experts.gate_up_proj` [E, D, 2F] (gate columns, then up) and
`mlp.experts.down_proj` [E, F, D], the own `moe.experts.w13` [E, 2F, D] and `w2` [E, D, F]
transposed (made contiguous: a copy of the same values). transformers 5 saves its in-memory
layout instead, the own one: both load, told apart by shape as transformers does (a square
[E, D, D] is taken as the own layout, as there), and exports write the hub's, which vLLM reads.

Values are otherwise untouched, so HF -> own -> HF is bit-exact for checkpoints in the hub's
layout."""

from typing import ClassVar

import torch

from primerl_trainer.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from primerl_trainer.models.qwen3_vl.model import Qwen3VLModelArgs, Qwen3VLMoeModelArgs

_LANGUAGE_MODEL, _TEXT_MODEL = "model.language_model.", "model."
_HF_VISUAL, _OWN_VISUAL = "model.visual.", "visual."
_PATCH_EMBED = "visual.patch_embed.proj.weight"
_EXPERTS = (".moe.experts.w13", ".moe.experts.w2")


class Qwen3VLStateDictAdapter(Qwen3StateDictAdapter):
    args: Qwen3VLModelArgs | Qwen3VLMoeModelArgs

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text, visual = {}, {}
        for key, value in hf_state_dict.items():
            if key.startswith(_HF_VISUAL):
                visual[key.replace(_HF_VISUAL, _OWN_VISUAL, 1)] = value
            elif key.startswith(_LANGUAGE_MODEL):
                text[key.replace(_LANGUAGE_MODEL, _TEXT_MODEL, 1)] = value
            elif key == "lm_head.weight":
                text[key] = value
            else:
                raise ValueError(f"unexpected tensor {key!r} in a {type(self.args).__name__} checkpoint")
        if _PATCH_EMBED in visual:
            visual[_PATCH_EMBED] = visual[_PATCH_EMBED].flatten(1)
        return super().from_hf(text) | visual

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        text = {key: value for key, value in state_dict.items() if not key.startswith(_OWN_VISUAL)}
        hf_state_dict = {
            key.replace(_TEXT_MODEL, _LANGUAGE_MODEL, 1) if key.startswith(_TEXT_MODEL) else key: value
            for key, value in super().to_hf(text).items()
        }
        vision = self.args.vision
        patch_shape = (vision.in_channels, vision.temporal_patch_size, vision.patch_size, vision.patch_size)
        for key, value in state_dict.items():
            if key.startswith(_OWN_VISUAL):
                value = value.unflatten(1, patch_shape) if key == _PATCH_EMBED else value
                hf_state_dict[key.replace(_OWN_VISUAL, _HF_VISUAL, 1)] = value
        return hf_state_dict


class Qwen3VLMoeStateDictAdapter(Qwen3VLStateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **Qwen3VLStateDictAdapter.from_hf_map,
        "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
        "model.layers.{}.mlp.experts.gate_up_proj": "layers.{}.moe.experts.w13",
        "model.layers.{}.mlp.experts.down_proj": "layers.{}.moe.experts.w2",
    }
    args: Qwen3VLMoeModelArgs

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state_dict = super().from_hf(hf_state_dict)
        args = self.args
        own_shapes = {
            ".moe.experts.w13": (args.num_experts, 2 * args.moe_hidden_dim, args.dim),
            ".moe.experts.w2": (args.num_experts, args.dim, args.moe_hidden_dim),
        }
        for key, value in state_dict.items():
            suffix = next((suffix for suffix in own_shapes if key.endswith(suffix)), None)
            if suffix is not None and tuple(value.shape) != own_shapes[suffix]:
                state_dict[key] = _swap_last_dims(value)
        return state_dict

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().to_hf(
            {key: _swap_last_dims(value) if key.endswith(_EXPERTS) else value for key, value in state_dict.items()}
        )


def _swap_last_dims(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.transpose(-1, -2).contiguous()
