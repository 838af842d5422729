"""HF-named weights -> the layouts an engine loads.

WEIGHT_FORMAT_KERNEL is vLLM's own parameter layout for Qwen3 and Qwen3-MoE (names as
vLLM 0.32 registers them): q/k/v projections fused into `qkv_proj` (rows q, then k, then
v), gate and up projections into `gate_up_proj` (gate rows first), and each MoE layer's
experts stacked into `experts.routed_experts.w13_weight` [E, 2*I, H] (gate rows, then up
rows, per expert) and `w2_weight` [E, H, I]. Every other tensor keeps its HF name.

WEIGHT_FORMAT_KERNEL_FP8 is the kernel layout with the weights of the linear layers
vLLM's block-FP8 method quantizes (qkv, o, gate_up, down, experts) in float8_e4m3fn plus a
float32 `<name>_scale_inv` per weight, [ceil(out/128), ceil(in/128)] (with a leading
expert dimension for stacked experts). Fused weights are quantized whole: vLLM requires
every fused part but the last to be a multiple of 128 rows, so no block straddles two
parts. Embeddings, norms, the MoE router (`mlp.gate`) and lm_head stay as they are.
"""

from __future__ import annotations

import dataclasses
import re
from collections import defaultdict

import torch

from primerl.common.v1 import tensor_pb2
from primerl_weight_broadcaster.fp8 import quantize_blockwise

__all__ = ["FORMAT_NAMES", "ConvertedWeights", "convert", "format_name"]

# Lower-case format names, as in the inference capabilities ("weights.format.<name>") and the config.
FORMAT_NAMES = {
    tensor_pb2.WEIGHT_FORMAT_HF: "hf",
    tensor_pb2.WEIGHT_FORMAT_KERNEL: "kernel",
    tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8: "kernel_fp8",
}

# <prefix>.{q,k,v}_proj.<weight|bias> -> <prefix>.qkv_proj.<...>, and gate/up likewise.
_FUSED = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_PART = re.compile(r"^(?P<prefix>.+)\.(?P<part>q_proj|k_proj|v_proj|gate_proj|up_proj)\.(?P<suffix>weight|bias)$")
_EXPERT = re.compile(r"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight$")
# Kernel-format names whose weights vLLM's block-FP8 linear and MoE methods hold in FP8.
_QUANTIZED = re.compile(r"\.(qkv_proj|o_proj|gate_up_proj|down_proj)\.weight$|\.(w13_weight|w2_weight)$")


def format_name(weight_format: int) -> str:
    return FORMAT_NAMES.get(weight_format) or tensor_pb2.WeightFormat.Name(weight_format)


@dataclasses.dataclass(frozen=True)
class ConvertedWeights:
    tensors: dict[str, torch.Tensor]
    # The HF tensors each converted tensor is made from (it changes when any of them does).
    sources: dict[str, tuple[str, ...]]


def convert(tensors: dict[str, torch.Tensor], weight_format: int) -> ConvertedWeights:
    """`tensors` (HF names) in `weight_format`; ValueError when they do not fit it."""
    if weight_format == tensor_pb2.WEIGHT_FORMAT_HF:
        return ConvertedWeights(tensors, {name: (name,) for name in tensors})
    if weight_format == tensor_pb2.WEIGHT_FORMAT_KERNEL:
        return _to_kernel(tensors)
    if weight_format == tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8:
        return _quantize(_to_kernel(tensors))
    raise ValueError(f"cannot convert to {format_name(weight_format)}")


def _to_kernel(tensors: dict[str, torch.Tensor]) -> ConvertedWeights:
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, tuple[str, ...]] = {}
    fused: dict[str, dict[str, str]] = defaultdict(dict)  # kernel name -> part -> HF name
    experts: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))
    for name, tensor in tensors.items():
        if match := _EXPERT.match(name):
            experts[match["prefix"]][int(match["index"])][match["proj"]] = name
        elif match := _PART.match(name):
            target = "qkv_proj" if match["part"] in _FUSED["qkv_proj"] else "gate_up_proj"
            fused[f"{match['prefix']}.{target}.{match['suffix']}"][match["part"]] = name
        else:
            out[name], sources[name] = tensor, (name,)

    for kernel_name, parts in fused.items():
        order = _FUSED["qkv_proj" if ".qkv_proj." in kernel_name else "gate_up_proj"]
        missing = [part for part in order if part not in parts]
        if missing:
            raise ValueError(f"cannot build {kernel_name}: {', '.join(missing)} missing")
        names = tuple(parts[part] for part in order)
        out[kernel_name] = torch.cat([tensors[n] for n in names], dim=0)
        sources[kernel_name] = names

    for prefix, by_index in experts.items():
        num_experts = max(by_index) + 1
        gate_up: list[torch.Tensor] = []
        down: list[torch.Tensor] = []
        names: list[str] = []
        for index in range(num_experts):
            projs = by_index.get(index, {})
            missing = [p for p in ("gate_proj", "up_proj", "down_proj") if p not in projs]
            if missing:
                raise ValueError(f"cannot stack {prefix}: expert {index} lacks {', '.join(missing)}")
            gate_up.append(torch.cat([tensors[projs["gate_proj"]], tensors[projs["up_proj"]]], dim=0))
            down.append(tensors[projs["down_proj"]])
            names += [projs["gate_proj"], projs["up_proj"], projs["down_proj"]]
        w13, w2 = f"{prefix}.routed_experts.w13_weight", f"{prefix}.routed_experts.w2_weight"
        out[w13], out[w2] = torch.stack(gate_up), torch.stack(down)
        sources[w13] = tuple(n for n in names if not n.endswith(".down_proj.weight"))
        sources[w2] = tuple(n for n in names if n.endswith(".down_proj.weight"))
    return ConvertedWeights(out, sources)


def _quantize(kernel: ConvertedWeights) -> ConvertedWeights:
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, tuple[str, ...]] = {}
    for name, tensor in kernel.tensors.items():
        out[name], sources[name] = tensor, kernel.sources[name]
        if not _QUANTIZED.search(name):
            continue
        if tensor.dim() == 2:
            quantized, scale_inv = quantize_blockwise(tensor)
        else:  # stacked experts: one 2-D weight per expert
            pairs = [quantize_blockwise(expert) for expert in tensor]
            quantized, scale_inv = torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])
        out[name] = quantized
        out[f"{name}_scale_inv"], sources[f"{name}_scale_inv"] = scale_inv, kernel.sources[name]
    return ConvertedWeights(out, sources)
