"""Weight loads of CPU linear layers straight from the update's mapped files (engine process).

On CPU, vLLM computes an unquantized linear layer through a oneDNN handle that holds the
weight reordered into its own blocked layout; the layer's `weight` parameter is emptied
(`dispatch_cpu_unquantized_gemm(remove_weight=True)`). vLLM's layerwise reload of such a layer
makes a fresh weight tensor, copies the update into it through the weight loaders, builds a
new handle from it, and copies the (empty) result back: two passes over every byte and fresh
memory to fault in. Here the new handle is built from the update's bytes where they lie (a
view of the mapped staging file or shared-memory folder): one pass, the reorder, which is
what any new handle costs. Fused layers (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`)
load from one view when their HF parts lie back to back in the file (the weight broadcaster
and the staging file keep them in the order they were published: q, k, v), else from one
copy into a buffer kept for the next update.

Only for layers whose handle vLLM builds with oneDNN (unquantized, one tensor-parallel rank,
no bias, no LoRA wrapper, not zentorch or the AMX small-GEMM kernel); every other tensor
goes through vLLM's reload as before. The result is the handle a fresh engine builds from
the same weights, bit for bit.

Keep imports here to torch and vLLM: this module runs in vLLM's engine process.
"""

from __future__ import annotations

import collections
import dataclasses
from collections.abc import Sequence

import torch

__all__ = ["LinearLoad", "split_linear_loads"]

# HF parts of vLLM's fused linear layers, in the order of the layer's `output_sizes`.
_FUSED_PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


@dataclasses.dataclass
class LinearLoad:
    """One linear layer's new weight: its parts (one, or the fused layer's HF parts in order)."""

    module_name: str
    layer: torch.nn.Module
    parts: list[tuple[str, torch.Tensor]]

    def apply(self, scratch: dict[tuple[tuple[int, ...], torch.dtype], torch.Tensor]) -> None:
        """Builds the layer's new oneDNN handle from the parts; `scratch`: buffers kept between
        updates, for parts that must be joined (no fresh memory to fault in each time)."""
        from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

        layer = self.layer
        kept = layer.weight  # the emptied parameter: the layer keeps this very object, as a reload does
        shape, dtype = _full_shape(layer), kept.dtype
        weight = _adjacent_view(self.parts, shape, dtype)
        if weight is None:
            weight = scratch.get((shape, dtype))
            if weight is None:
                weight = scratch[(shape, dtype)] = torch.empty(shape, dtype=dtype)
            row = 0
            for _, part in self.parts:
                weight[row : row + part.shape[0]].copy_(part)
                row += part.shape[0]
        layer.weight = torch.nn.Parameter(weight, requires_grad=False)
        dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        # Checked before: this layer's handle is oneDNN's, which holds its own copy.
        assert layer.weight.numel() == 0, f"{self.module_name}: the CPU GEMM kept the weight"
        layer.weight = kept


def split_linear_loads(
    model: torch.nn.Module, weights: Sequence[tuple[str, torch.Tensor]]
) -> tuple[list[LinearLoad], list[tuple[str, torch.Tensor]]]:
    """(the layers loaded here, the tensors left for vLLM's reload); all of them the latter but
    on CPU. `weights`: HF or kernel-format names (whole engine modules, as an update carries)."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return [], list(weights)
    groups: dict[str, list[tuple[str, torch.Tensor]]] = collections.defaultdict(list)
    for name, tensor in weights:
        module_name, _, parameter = name.rpartition(".")
        parent, _, leaf = module_name.rpartition(".")
        if parameter == "weight":
            fused = next((fused for fused, parts in _FUSED_PARTS.items() if leaf in parts), None)
            groups[f"{parent}.{fused}" if fused else module_name].append((name, tensor))
    loads, taken = [], set()
    for module_name, parts in groups.items():
        layer = _repackable_layer(model, module_name)
        if layer is None:
            continue
        ordered = _ordered_parts(module_name, layer, dict(parts))
        if ordered is not None:
            loads.append(LinearLoad(module_name, layer, ordered))
            taken.update(name for name, _ in ordered)
    return loads, [(name, tensor) for name, tensor in weights if name not in taken]


def _repackable_layer(model: torch.nn.Module, module_name: str) -> torch.nn.Module | None:
    """The layer, if its weight lives in a oneDNN handle that `LinearLoad.apply` can rebuild."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
    from vllm.model_executor.layers.utils import check_cpu_sgl_kernel
    from vllm.platforms import CpuArchEnum, current_platform

    try:
        layer = model.get_submodule(module_name)
    except AttributeError:
        return None
    if (
        not isinstance(layer, LinearBase)  # also a LoRA wrapper, which is not one
        or not isinstance(layer.quant_method, UnquantizedLinearMethod)
        or layer.tp_size != 1
        or getattr(layer, "bias", None) is not None
        or getattr(layer, "_cpu_skip_gemm_dispatch", False)
        or layer.weight.numel() != 0  # not emptied: not on a oneDNN handle
        or not ops._supports_onednn
        or current_platform.is_zen_cpu()
        or current_platform.get_cpu_architecture() == CpuArchEnum.POWERPC
    ):
        return None
    shape = _full_shape(layer)
    if len(shape) != 2 or check_cpu_sgl_kernel(shape[0], shape[1], layer.weight.dtype):
        return None
    return layer


def _full_shape(layer: torch.nn.Module) -> tuple[int, ...]:
    """The weight's shape as the layer created it (vLLM records it for reloads)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    return tuple(get_layerwise_info(layer).restore_metadata[0]["weight"].shape)


def _ordered_parts(
    module_name: str, layer: torch.nn.Module, parts: dict[str, torch.Tensor]
) -> list[tuple[str, torch.Tensor]] | None:
    """The tensors that make the layer's weight, in row order; None unless they make exactly
    it (any other case goes through vLLM's loaders, which know it)."""
    rows, columns = _full_shape(layer)
    parent, _, leaf = module_name.rpartition(".")
    whole = f"{module_name}.weight"
    if whole in parts:  # kernel format, or a layer HF does not split
        ordered = [(whole, parts[whole])] if len(parts) == 1 else None
    elif leaf in _FUSED_PARTS and len(parts) == len(_FUSED_PARTS[leaf]):
        names = [f"{parent}.{part}.weight" for part in _FUSED_PARTS[leaf]]
        if set(names) != set(parts) or [parts[n].shape[0] for n in names] != list(layer.output_sizes):
            return None
        ordered = [(name, parts[name]) for name in names]
    else:
        return None
    if ordered is None or sum(t.shape[0] for _, t in ordered) != rows:
        return None
    if any(t.dim() != 2 or t.shape[1] != columns or not t.is_floating_point() for _, t in ordered):
        return None
    return ordered


def _adjacent_view(
    parts: list[tuple[str, torch.Tensor]], shape: tuple[int, ...], dtype: torch.dtype
) -> torch.Tensor | None:
    """The parts as one [rows, columns] tensor without a copy, when they lie back to back in
    one storage in the layer's dtype; else None."""
    first = parts[0][1]
    end = first.data_ptr()
    for _, part in parts:
        if part.dtype != dtype or not part.is_contiguous() or part.data_ptr() != end:
            return None
        if part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return None
        end += part.numel() * part.element_size()
    return first.as_strided(shape, (shape[1], 1))
