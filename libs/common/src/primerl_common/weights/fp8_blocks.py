"""Published weights as block FP8 pairs: a 2-D weight `name` in float8_e4m3fn with its float32
scales `name_scale_inv` (weights.fp8's 128x128 blocks, the names of a block-FP8 checkpoint).

The trainer publishes the weights of its linear layers so (`publish.fp8_blocks`), quantized on
its own device by the quantizer the weight broadcaster's kernel_fp8 format uses, so the
broadcaster stacks and fuses the blocks rather than quantizing again, and the publish moves
about half the bytes. Only weights of whole 128x128 blocks are sent so: fusing such weights
(q, k and v; gate and up) concatenates whole blocks, the same blocks the broadcaster would
quantize in the fused weight.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

import torch

from primerl_common.weights.fp8 import BLOCK, FP8_DTYPE, dequantize_blockwise, quantize_blockwise, scale_shape

__all__ = ["SCALE_SUFFIX", "block_pairs", "dequantized_pairs", "to_block_pairs", "whole_blocks"]

SCALE_SUFFIX = "_scale_inv"


def whole_blocks(tensor: torch.Tensor) -> bool:
    """A 2-D floating-point weight (not FP8 already) of whole 128x128 blocks."""
    return (
        tensor.dim() == 2
        and tensor.is_floating_point()
        and tensor.element_size() > 1
        and tensor.shape[0] % BLOCK == 0
        and tensor.shape[1] % BLOCK == 0
    )


def to_block_pairs(
    named_tensors: Iterable[tuple[str, torch.Tensor]], wanted: Callable[[str], bool]
) -> Iterator[tuple[str, torch.Tensor]]:
    """`named_tensors` with each weight that `wanted` names and `whole_blocks` takes as its pair:
    (name, float8 values), then (name + SCALE_SUFFIX, float32 scales), quantized where it lies
    (weights.fp8.quantize_blockwise: the same bits on a GPU and on the CPU). Meta tensors give
    meta pairs (what a publish announces)."""
    for name, tensor in named_tensors:
        if not (wanted(name) and whole_blocks(tensor)):
            yield name, tensor
            continue
        if tensor.is_meta:
            yield name, torch.empty(tensor.shape, dtype=FP8_DTYPE, device="meta")
            yield name + SCALE_SUFFIX, torch.empty(scale_shape(*tensor.shape), dtype=torch.float32, device="meta")
            continue
        quantized, scale_inv = quantize_blockwise(tensor)
        yield name, quantized
        yield name + SCALE_SUFFIX, scale_inv


def block_pairs(tensors: Mapping[str, torch.Tensor]) -> dict[str, str]:
    """Weight name -> its scales' name, for each pair in `tensors`: a 2-D float8_e4m3fn weight
    and float32 scales of its blocks' shape."""
    pairs = {}
    for name, tensor in tensors.items():
        scales = tensors.get(name + SCALE_SUFFIX)
        if tensor.dtype != FP8_DTYPE or tensor.dim() != 2 or scales is None:
            continue
        if scales.dtype != torch.float32 or tuple(scales.shape) != scale_shape(*tensor.shape):
            raise ValueError(
                f"{name + SCALE_SUFFIX}: the scales of a {tuple(tensor.shape)} block-FP8 weight are float32 of shape "
                f"{scale_shape(*tensor.shape)}, got {scales.dtype} {tuple(scales.shape)}"
            )
        pairs[name] = name + SCALE_SUFFIX
    return pairs


def dequantized_pairs(
    tensors: Mapping[str, torch.Tensor], pairs: Mapping[str, str], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """`tensors` with each pair of `pairs` (block_pairs') as its weight in `dtype`, scales dropped."""
    scale_names = set(pairs.values())
    return {
        name: dequantize_blockwise(tensor, tensors[pairs[name]]).to(dtype) if name in pairs else tensor
        for name, tensor in tensors.items()
        if name not in scale_names
    }
