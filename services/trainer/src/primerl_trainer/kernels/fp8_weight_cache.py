"""`model.fp8_weight_cache`: the experts' quantized weight blocks kept through an optimizer step
(kernels.fp8_grouped asks WEIGHT_CACHE for them; the trainer enables it and clears it)."""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch

__all__ = ["WEIGHT_CACHE", "QuantizedWeightCache"]

Quantizer = Callable[..., tuple[torch.Tensor, torch.Tensor]]


class QuantizedWeightCache:
    """`model.fp8_weight_cache`: each expert weight's 128x128 blocks (W's for the forward, W^T's for
    the input gradient) quantized once and reused until the weight changes, rather than on every
    micro-batch: a step of N micro-batches quantizes each weight once, not N times (at 256 rows an
    expert the quantizers took more GPU time than bf16's whole products: bench/fp8_kernels.py).

    A kept entry is used only for the same tensor object at the same version counter (every
    in-place write bumps it: the optimizer's update, a load); the trainer also drops every entry
    before each optimizer step (`clear`), so none outlives its step, and an entry goes with its
    weight. The cost is memory: one float8 copy of every expert weight in each layout (2 bytes a
    parameter) held through the step. Meant for weights that stay whole on the device; under FSDP
    resharding after the forward, the gathered weights change version at every all-gather and
    their copies would hold, unsharded, the memory FSDP frees (leave it off there).
    Off by default: `enabled` False quantizes on every call."""

    def __init__(self) -> None:
        self.enabled = False
        self._entries: dict[tuple[int, bool], tuple[weakref.ref, int, torch.Tensor, torch.Tensor]] = {}

    def quantized(
        self, w_EOI: torch.Tensor, quantize: Quantizer, *, transpose: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """quantize(w_EOI, transpose=transpose) (kernels.fp8_grouped.quantize_expert_weights), from
        the cache where it holds them."""
        if not self.enabled:
            return quantize(w_EOI, transpose=transpose)
        key = (id(w_EOI), transpose)
        entry = self._entries.get(key)
        if entry is not None and entry[0]() is w_EOI and entry[1] == w_EOI._version:
            return entry[2], entry[3]
        quantized, scales = quantize(w_EOI, transpose=transpose)
        entries = self._entries
        self._entries[key] = (
            weakref.ref(w_EOI, lambda _: entries.pop(key, None)),
            w_EOI._version,
            quantized,
            scales,
        )
        return quantized, scales

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)


WEIGHT_CACHE = QuantizedWeightCache()
