"""Qwen3-MoE parameter names <-> Hugging Face's: Qwen3's mapping plus the experts, which
the hub stores one by one (`mlp.experts.{e}.gate_proj/up_proj/down_proj`) and the own model
stacks (`moe.experts.w13` = gate rows then up rows, `moe.experts.w2` = down).

Stacking copies; splitting returns views of the stacked tensors. Either way the values are
untouched, so HF -> own -> HF is bit-exact."""

import re
from collections import defaultdict
from typing import ClassVar

import torch

from primerl_trainer.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter
from primerl_trainer.models.qwen3_moe.model import Qwen3MoeModelArgs

_HF_EXPERT = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_OWN_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w13|w2)")


class Qwen3MoeStateDictAdapter(Qwen3StateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **Qwen3StateDictAdapter.from_hf_map,
        "model.layers.{}.mlp.gate.weight": "layers.{}.moe.router.gate.weight",
    }
    args: Qwen3MoeModelArgs

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        experts: dict[str, dict[tuple[int, str], torch.Tensor]] = defaultdict(dict)
        rest = {}
        for key, value in hf_state_dict.items():
            match = _HF_EXPERT.fullmatch(key)
            if match is None:
                rest[key] = value
            else:
                layer, expert, proj = match.groups()
                experts[layer][int(expert), proj] = value
        state_dict = super().from_hf(rest)
        experts_range = range(self.args.num_experts)
        expected = {(e, proj) for e in experts_range for proj in ("gate_proj", "up_proj", "down_proj")}
        for layer, weights in experts.items():
            if weights.keys() != expected:
                missing = sorted(expected - weights.keys())
                unexpected = sorted(weights.keys() - expected)
                raise ValueError(
                    f"layer {layer} must hold experts 0..{self.args.num_experts - 1} with gate, up and down "
                    f"projections; missing {missing[:4]}, unexpected {unexpected[:4]}"
                )
            state_dict[f"layers.{layer}.moe.experts.w13"] = torch.stack(
                [torch.cat([weights[e, "gate_proj"], weights[e, "up_proj"]]) for e in experts_range]
            )
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
            prefix = f"model.layers.{layer}.mlp.experts"
            for expert, weight in enumerate(value.unbind(0)):
                if name == "w13":
                    gate, up = weight.chunk(2)
                    hf_state_dict[f"{prefix}.{expert}.gate_proj.weight"] = gate
                    hf_state_dict[f"{prefix}.{expert}.up_proj.weight"] = up
                else:
                    hf_state_dict[f"{prefix}.{expert}.down_proj.weight"] = weight
        return super().to_hf(rest) | hf_state_dict
