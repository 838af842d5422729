"""Nemotron-H parameter names <-> Hugging Face's (the hub's `backbone.` names, which transformers
also writes): every layer's `norm` and `mixer`; the Mamba-2 mixer's tensors under `attention.`
with the same names, attention's q/k/v/o as Qwen3's, the dense MLP's and shared expert's up/down as
`w3`/`w2`, the router under `moe.router`, and the experts, which the hub stores one by one
(`mixer.experts.{e}.up_proj/down_proj`) and the own model stacks (`moe.experts.w13` = up,
`moe.experts.w2` = down); stacked ones (`mixer.experts.up_proj` [E, F, D], `down_proj` [E, D, F],
transformers' in-memory layout) load too. Multi-token-prediction tensors (`mtp.*`) are dropped on
load, as transformers drops them. Values pass through untouched, so HF -> own -> HF is bit-exact."""

import re
from collections import defaultdict
from typing import ClassVar

import torch

from primerl_trainer.models.nemotron_h.model import NemotronHModelArgs
from primerl_trainer.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

_LAYER = "backbone.layers.{}"
_MAMBA = ("in_proj.weight", "conv1d.weight", "conv1d.bias", "dt_bias", "A_log", "D", "norm.weight", "out_proj.weight")
_HF_EXPERT = re.compile(r"backbone\.layers\.(\d+)\.mixer\.experts\.(\d+)\.(up_proj|down_proj)\.weight")
_OWN_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w13|w2)")


class NemotronHStateDictAdapter(Qwen3StateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        "backbone.embeddings.weight": "tok_embeddings.weight",
        "backbone.norm_f.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
        f"{_LAYER}.norm.weight": "layers.{}.norm.weight",
        **{f"{_LAYER}.mixer.{name}": f"layers.{{}}.attention.{name}" for name in _MAMBA},
        **{f"{_LAYER}.mixer.{p}_proj.weight": f"layers.{{}}.attention.w{p}.weight" for p in "qkvo"},
        f"{_LAYER}.mixer.up_proj.weight": "layers.{}.feed_forward.w3.weight",
        f"{_LAYER}.mixer.down_proj.weight": "layers.{}.feed_forward.w2.weight",
        f"{_LAYER}.mixer.gate.weight": "layers.{}.moe.router.gate.weight",
        f"{_LAYER}.mixer.gate.e_score_correction_bias": "layers.{}.moe.router.e_score_correction_bias",
        f"{_LAYER}.mixer.shared_experts.up_proj.weight": "layers.{}.shared_experts.w3.weight",
        f"{_LAYER}.mixer.shared_experts.down_proj.weight": "layers.{}.shared_experts.w2.weight",
        # Stacked experts load as they are (export writes them per expert).
        f"{_LAYER}.mixer.experts.up_proj": "layers.{}.moe.experts.w13",
        f"{_LAYER}.mixer.experts.down_proj": "layers.{}.moe.experts.w2",
    }
    args: NemotronHModelArgs

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        experts: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
        rest = {}
        for key, value in hf_state_dict.items():
            if key.startswith("mtp."):
                continue
            match = _HF_EXPERT.fullmatch(key)
            if match is None:
                rest[key] = value
            else:
                layer, expert, proj = match.groups()
                experts[layer][int(expert), proj] = value
        state_dict = super().from_hf(rest)
        experts_range = range(self.args.num_experts)
        expected = {(e, proj) for e in experts_range for proj in ("up_proj", "down_proj")}
        for layer, weights in experts.items():
            if weights.keys() != expected:
                missing, unexpected = sorted(expected - weights.keys()), sorted(weights.keys() - expected)
                raise ValueError(
                    f"layer {layer} must hold experts 0..{self.args.num_experts - 1} with up and down projections; "
                    f"missing {missing[:4]}, unexpected {unexpected[:4]}"
                )
            state_dict[f"layers.{layer}.moe.experts.w13"] = torch.stack([weights[e, "up_proj"] for e in experts_range])
            state_dict[f"layers.{layer}.moe.experts.w2"] = torch.stack([weights[e, "down_proj"] for e in experts_range])
        return state_dict

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rest, hf_state_dict = {}, {}
        for key, value in state_dict.items():
            match = _OWN_EXPERTS.fullmatch(key)
            if match is None:
                rest[key] = value
                continue
            layer, name = match.groups()
            proj = "up_proj" if name == "w13" else "down_proj"
            for expert, weight in enumerate(value.unbind(0)):
                hf_state_dict[f"backbone.layers.{layer}.mixer.experts.{expert}.{proj}.weight"] = weight
        return super().to_hf(rest) | hf_state_dict
