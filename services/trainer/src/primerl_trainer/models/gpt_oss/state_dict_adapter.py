"""GPT-OSS parameter names <-> Hugging Face's.

The hub stores each layer's experts fused: `mlp.experts.gate_up_proj` [E, D, 2F] (input-major,
gate and up columns interleaved: gate j at 2j, up j at 2j + 1) with `gate_up_proj_bias` [E, 2F]
alike, `down_proj` [E, F, D] and `down_proj_bias` [E, D]. The own model holds GroupedExperts'
layout: `w13` [E, 2F, D] (gate rows, then up rows), `w2` [E, D, F], and the biases `w13_bias`
[E, 2F] (gate, then up) and `w2_bias`. Loading de-interleaves and transposes (copies); export
interleaves back. Values are untouched, so HF -> own -> HF is bit-exact.

MXFP4 checkpoints (the hub's `openai/gpt-oss-*`, `quantization_config.quant_method` "mxfp4")
store the two expert weights as `<proj>_blocks` [E, out, in / 32, 16] uint8 (two 4-bit e2m1
codes per byte, the low nibble first) and `<proj>_scales` [E, out, in / 32] uint8 (a power-of-two
exponent per 32 values, biased by 127), output-major. They are dequantized on load (mxfp4.py),
into bfloat16, which holds every MXFP4 value exactly; the loader then casts to the training dtype.
Export always writes the unquantized Hugging Face names (`gate_up_proj`, `down_proj`) in the
model's dtype (bf16 or float32 as trained), never MXFP4.
"""

import re
from typing import ClassVar

import torch

from primerl_trainer.models.gpt_oss.model import GptOssModelArgs
from primerl_trainer.models.gpt_oss.mxfp4 import dequantize_mxfp4
from primerl_trainer.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

_HF_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)(_bias|_blocks|_scales)?")
_OWN_EXPERTS = re.compile(r"layers\.(\d+)\.moe\.experts\.(w13|w2)(_bias)?")


class GptOssStateDictAdapter(Qwen3StateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **{
            hf: own for hf, own in Qwen3StateDictAdapter.from_hf_map.items() if ".mlp." not in hf and "_norm." not in hf
        },
        "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
        "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
        "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
        "model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
        "model.layers.{}.self_attn.sinks": "layers.{}.attention.sinks",
        "model.layers.{}.mlp.router.weight": "layers.{}.moe.router.gate.weight",
        "model.layers.{}.mlp.router.bias": "layers.{}.moe.router.gate.bias",
    }
    args: GptOssModelArgs

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        experts: dict[str, dict[str, torch.Tensor]] = {}
        rest = {}
        for key, value in hf_state_dict.items():
            match = _HF_EXPERTS.fullmatch(key)
            if match is None:
                rest[key] = value
            else:
                layer, proj, suffix = match.groups()
                experts.setdefault(layer, {})[proj + (suffix or "")] = value
        state_dict = super().from_hf(rest)
        for layer, tensors in experts.items():
            state_dict |= self._experts_from_hf(layer, tensors)
        return state_dict

    def _experts_from_hf(self, layer: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        weights = {}
        for proj in ("gate_up_proj", "down_proj"):
            if {f"{proj}_blocks", f"{proj}_scales"} <= tensors.keys():
                # Output-major already: [E, out, in].
                weights[proj] = dequantize_mxfp4(tensors.pop(f"{proj}_blocks"), tensors.pop(f"{proj}_scales"))
            elif proj in tensors:
                weights[proj] = tensors.pop(proj).transpose(1, 2)
        expected = {"gate_up_proj", "down_proj"}
        if weights.keys() != expected or tensors.keys() != {"gate_up_proj_bias", "down_proj_bias"}:
            raise ValueError(
                f"layer {layer} must hold mlp.experts.gate_up_proj and down_proj (or their MXFP4 _blocks and "
                f"_scales) with their _bias; got {sorted(weights)} and {sorted(tensors)}"
            )
        gate_up, gate_up_bias = weights["gate_up_proj"], tensors["gate_up_proj_bias"]
        prefix = f"layers.{layer}.moe.experts"
        return {
            f"{prefix}.w13": torch.cat((gate_up[:, 0::2], gate_up[:, 1::2]), dim=1),
            f"{prefix}.w13_bias": torch.cat((gate_up_bias[:, 0::2], gate_up_bias[:, 1::2]), dim=1),
            f"{prefix}.w2": weights["down_proj"].contiguous(),
            f"{prefix}.w2_bias": tensors["down_proj_bias"],
        }

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        rest, hf_state_dict = {}, {}
        for key, value in state_dict.items():
            match = _OWN_EXPERTS.fullmatch(key)
            if match is None:
                rest[key] = value
                continue
            layer, name, bias = match.groups()
            prefix = f"model.layers.{layer}.mlp.experts"
            if name == "w2":
                hf_state_dict[f"{prefix}.down_proj{bias or ''}"] = value if bias else value.transpose(1, 2)
            else:
                gate, up = value.chunk(2, dim=1)
                # Gate j and up j side by side: interleaved along the output dim.
                interleaved = torch.stack((gate, up), dim=2).flatten(1, 2)
                hf_state_dict[f"{prefix}.gate_up_proj{bias or ''}"] = (
                    interleaved if bias else interleaved.transpose(1, 2)
                )
        return super().to_hf(rest) | hf_state_dict
