"""HF-named weights -> the layouts an engine loads.

WEIGHT_FORMAT_KERNEL is the parameter layout of vLLM 0.32's model class for the weights'
family (its HF config `model_type`, which the publish names; kernel_layouts.py holds one
layout per family): sibling projections fused into one parameter (q/k/v into `qkv_proj`,
rows q, then k, then v; gate and up into `gate_up_proj`, gate rows first, where vLLM fuses
them), each MoE layer's experts stacked into `experts.routed_experts.w13_weight` [E, 2*I, H]
(gate rows, then up rows, per expert; non-gated experts: up rows alone, [E, I, H]) and
`w2_weight` [E, H, I], and the family's renames.
Every other tensor keeps its HF name.

WEIGHT_FORMAT_KERNEL_FP8 is the kernel layout with the weights of the linear layers
vLLM's block-FP8 method quantizes (per family: attention, MLP and expert projections) in
float8_e4m3fn plus a float32 `<name>_scale_inv` per weight, [ceil(out/128), ceil(in/128)]
(with a leading expert dimension for stacked experts). Fused weights are quantized whole:
vLLM requires every fused part but the last to be a multiple of 128 rows, so no block
straddles two parts. Embeddings, norms, routers and lm_head stay as they are.

A publish may hold weights already in block FP8 (primerl_common.weights.fp8_blocks: the trainer's
`publish.fp8_blocks`): such a weight and its `<name>_scale_inv` are fused and stacked as they
are for WEIGHT_FORMAT_KERNEL_FP8 (the blocks the quantizer would make of the fused weight: the
parts are whole blocks), quantized nowhere; a kernel weight vLLM keeps unquantized, or a fusion
that mixes block-FP8 and other parts, is dequantized (and quantized whole where FP8). For the
other formats the pairs are dequantized to the publish's dtype.
"""

from __future__ import annotations

import dataclasses
import re
from collections import Counter, defaultdict

import torch

from primerl.common.v1 import tensor_pb2
from primerl_common.weights.fp8 import dequantize_blockwise, quantize_blockwise
from primerl_common.weights.fp8_blocks import SCALE_SUFFIX, block_pairs, dequantized_pairs
from primerl_weight_broadcaster.kernel_layouts import ExpertStacking, KernelLayout, layout_of

__all__ = ["FORMAT_NAMES", "ConvertedWeights", "convert", "format_name"]

# Lower-case format names, as in the inference capabilities ("weights.format.<name>") and the config.
FORMAT_NAMES = {
    tensor_pb2.WEIGHT_FORMAT_HF: "hf",
    tensor_pb2.WEIGHT_FORMAT_KERNEL: "kernel",
    tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8: "kernel_fp8",
}


def format_name(weight_format: int) -> str:
    return FORMAT_NAMES.get(weight_format) or tensor_pb2.WeightFormat.Name(weight_format)


@dataclasses.dataclass(frozen=True)
class ConvertedWeights:
    tensors: dict[str, torch.Tensor]
    # The HF tensors each converted tensor is made from (it changes when any of them does).
    sources: dict[str, tuple[str, ...]]


def convert(tensors: dict[str, torch.Tensor], weight_format: int, model_type: str = "") -> ConvertedWeights:
    """`tensors` (HF names of a `model_type` model; "": Qwen3 or Qwen3-MoE) in
    `weight_format`; ValueError when they do not fit it."""
    pairs = block_pairs(tensors)
    if pairs and weight_format == tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8:
        fused = _kernel_from_pairs(tensors, pairs, _fp8_layout(model_type))
        if fused is not None:
            return fused
    if pairs:  # the other formats, or pairs that do not fuse as they are
        return _with_scales(
            _convert(dequantized_pairs(tensors, pairs, _dtype_of(tensors)), weight_format, model_type), pairs
        )
    return _convert(tensors, weight_format, model_type)


def _convert(tensors: dict[str, torch.Tensor], weight_format: int, model_type: str) -> ConvertedWeights:
    if weight_format == tensor_pb2.WEIGHT_FORMAT_HF:
        return ConvertedWeights(tensors, {name: (name,) for name in tensors})
    if weight_format == tensor_pb2.WEIGHT_FORMAT_KERNEL:
        return _to_kernel(tensors, layout_of(model_type))
    if weight_format == tensor_pb2.WEIGHT_FORMAT_KERNEL_FP8:
        layout = _fp8_layout(model_type)
        return _quantize(_to_kernel(tensors, layout), layout)
    raise ValueError(f"cannot convert to {format_name(weight_format)}")


def _fp8_layout(model_type: str) -> KernelLayout:
    layout = layout_of(model_type)
    if layout.fp8_linear is None:
        raise ValueError(f"no block-FP8 kernel format for model_type {layout.model_type!r}: {layout.no_fp8_reason}")
    return layout


def _dtype_of(tensors: dict[str, torch.Tensor]) -> torch.dtype:
    """The dtype most of the publish's other weights are in (block-FP8 pairs are dequantized to
    it; a few float32 buffers, such as routers' correction biases, do not decide it)."""
    found = Counter(
        t.dtype
        for name, t in tensors.items()
        if t.is_floating_point() and t.element_size() >= 2 and not name.endswith(SCALE_SUFFIX)
    )
    return found.most_common(1)[0][0] if found else torch.bfloat16


def _with_scales(converted: ConvertedWeights, pairs: dict[str, str]) -> ConvertedWeights:
    """`converted` with each block-FP8 weight's scales among the sources of what it went into."""
    sources = {
        name: tuple(s for source in names for s in ((source, pairs[source]) if source in pairs else (source,)))
        for name, names in converted.sources.items()
    }
    return ConvertedWeights(converted.tensors, sources)


def _kernel_from_pairs(
    tensors: dict[str, torch.Tensor], pairs: dict[str, str], layout: KernelLayout
) -> ConvertedWeights | None:
    """WEIGHT_FORMAT_KERNEL_FP8 of a publish holding block-FP8 `pairs`, their blocks fused and
    stacked as the weights are; None when a fusion mixes block-FP8 and other parts."""
    scale_names = set(pairs.values())
    try:
        kernel = _to_kernel({n: t for n, t in tensors.items() if n not in scale_names}, layout)
        # The scales go where their weights go: keyed by the weights' names, converted alike.
        scales = _to_kernel({name: tensors[scale] for name, scale in pairs.items()}, layout).tensors
    except (ValueError, RuntimeError):  # a part of a fusion missing from the pairs; float8 cat with bf16
        return None
    return _with_scales(_quantize(kernel, layout, scales), pairs)


def _to_kernel(tensors: dict[str, torch.Tensor], layout: KernelLayout) -> ConvertedWeights:
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, tuple[str, ...]] = {}
    fusions = [(fusion, fusion.pattern()) for fusion in layout.fusions]
    experts = _Experts(layout.experts)
    fused: dict[str, dict[str, str]] = defaultdict(dict)  # kernel name -> part -> HF name
    parts_of: dict[str, tuple[str, ...]] = {}
    for name, tensor in tensors.items():
        if experts.take(name):
            continue
        for fusion, pattern in fusions:
            if match := pattern.match(name):
                kernel_name = f"{match['prefix']}.{fusion.fused}.{match['suffix']}"
                fused[kernel_name][match["part"]] = name
                parts_of[kernel_name] = fusion.parts
                break
        else:
            out[name], sources[name] = tensor, (name,)

    for kernel_name, parts in fused.items():
        missing = [part for part in parts_of[kernel_name] if part not in parts]
        if missing:
            raise ValueError(f"cannot build {kernel_name}: {', '.join(missing)} missing")
        names = tuple(parts[part] for part in parts_of[kernel_name])
        out[kernel_name] = torch.cat([tensors[n] for n in names], dim=0)
        sources[kernel_name] = names

    for kernel_name, (tensor, names) in experts.stack(tensors).items():
        out[kernel_name], sources[kernel_name] = tensor, names
    renamed = {name: layout.rename(name) for name in out}
    return ConvertedWeights(
        {renamed[name]: tensor for name, tensor in out.items()},
        {renamed[name]: names for name, names in sources.items()},
    )


class _Experts:
    """Collects one family's HF expert tensors and stacks them per MoE layer."""

    def __init__(self, stacking: ExpertStacking | None) -> None:
        self._stacking = stacking
        if stacking is None:
            self._pattern = None
        elif stacking.stacked:
            self._pattern = re.compile(
                r"^(?P<prefix>.+\.experts)\.(?P<proj>gate_up_proj|gate_up_proj_bias|down_proj|down_proj_bias)$"
            )
        else:
            projections = "|".join(re.escape(p) for p in (stacking.gate, stacking.up, stacking.down) if p)
            self._pattern = re.compile(rf"^(?P<prefix>.+\.experts)\.(?P<index>\d+)\.(?P<proj>{projections})\.weight$")
        # experts prefix -> expert index (0 when stacked) -> projection -> HF name
        self._found: dict[str, dict[int, dict[str, str]]] = defaultdict(lambda: defaultdict(dict))

    def take(self, name: str) -> bool:
        if self._pattern is None or not (match := self._pattern.match(name)):
            return False
        index = int(match["index"]) if "index" in match.groupdict() else 0
        self._found[match["prefix"]][index][match["proj"]] = name
        return True

    def stack(self, tensors: dict[str, torch.Tensor]) -> dict[str, tuple[torch.Tensor, tuple[str, ...]]]:
        """Kernel name -> (tensor, the HF names it is made from)."""
        stacking = self._stacking
        out: dict[str, tuple[torch.Tensor, tuple[str, ...]]] = {}
        for prefix, by_index in self._found.items():
            assert stacking is not None
            target = f"{prefix}.routed_experts"
            if stacking.stacked:
                found = by_index[0]
                missing = [p for p in ("gate_up_proj", "down_proj") if p not in found]
                if missing:
                    raise ValueError(f"cannot stack {prefix}: {', '.join(missing)} missing")
                # [E, H, 2*I] and [E, I, H] as the hub stores them; vLLM holds [E, 2*I, H], [E, H, I].
                for proj, kernel in (("gate_up_proj", "w13"), ("down_proj", "w2")):
                    weight = tensors[found[proj]].transpose(1, 2).contiguous()
                    out[f"{target}.{kernel}_weight"] = (weight, (found[proj],))
                    if (bias := found.get(f"{proj}_bias")) is not None:
                        out[f"{target}.{kernel}_bias"] = (tensors[bias], (bias,))
                continue
            gate_up: list[torch.Tensor] = []
            down: list[torch.Tensor] = []
            gate_up_names: list[str] = []
            down_names: list[str] = []
            # Non-gated experts (gate None): w13 holds the up rows alone.
            w13_parts = tuple(p for p in (stacking.gate, stacking.up) if p)
            for index in range(max(by_index) + 1):
                projs = by_index.get(index, {})
                missing = [p for p in (*w13_parts, stacking.down) if p not in projs]
                if missing:
                    raise ValueError(f"cannot stack {prefix}: expert {index} lacks {', '.join(missing)}")
                gate_up.append(torch.cat([tensors[projs[p]] for p in w13_parts], dim=0))
                down.append(tensors[projs[stacking.down]])
                gate_up_names += [projs[p] for p in w13_parts]
                down_names.append(projs[stacking.down])
            out[f"{target}.w13_weight"] = (torch.stack(gate_up), tuple(gate_up_names))
            out[f"{target}.w2_weight"] = (torch.stack(down), tuple(down_names))
        return out


def _quantize(
    kernel: ConvertedWeights, layout: KernelLayout, blocks: dict[str, torch.Tensor] | None = None
) -> ConvertedWeights:
    """The layout's FP8 weights of `kernel` quantized, but those already in block FP8 (their
    scales in `blocks`, by kernel name), which are kept; a block-FP8 weight the layout keeps
    unquantized is dequantized."""
    quantized_names = layout.fp8_pattern()
    blocks = blocks or {}
    dtype = _dtype_of(kernel.tensors)
    out: dict[str, torch.Tensor] = {}
    sources: dict[str, tuple[str, ...]] = {}
    for name, tensor in kernel.tensors.items():
        out[name], sources[name] = tensor, kernel.sources[name]
        if name in blocks:
            if quantized_names.search(name):
                out[f"{name}{SCALE_SUFFIX}"], sources[f"{name}{SCALE_SUFFIX}"] = blocks[name], kernel.sources[name]
            else:
                out[name] = _per_matrix(dequantize_blockwise, tensor, blocks[name]).to(dtype)
            continue
        if not quantized_names.search(name):
            continue
        out[name], scale_inv = _per_matrix(quantize_blockwise, tensor)
        out[f"{name}{SCALE_SUFFIX}"], sources[f"{name}{SCALE_SUFFIX}"] = scale_inv, kernel.sources[name]
    return ConvertedWeights(out, sources)


def _per_matrix(function, *tensors: torch.Tensor):
    """`function` of 2-D tensors, or of each expert's matrix of stacked [E, ...] ones, stacked."""
    if tensors[0].dim() == 2:
        return function(*tensors)
    results = [function(*matrices) for matrices in zip(*tensors, strict=True)]
    if isinstance(results[0], tuple):
        return tuple(torch.stack(parts) for parts in zip(*results, strict=True))
    return torch.stack(results)
