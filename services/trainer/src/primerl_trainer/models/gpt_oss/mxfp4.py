"""MXFP4 (OCP microscaling FP4) as GPT-OSS checkpoints store their experts: blocks of 32 values
share one power-of-two scale. `blocks` [..., G, 16] uint8 hold two e2m1 codes per byte (value 2i
in the low nibble, 2i + 1 in the high one); `scales` [..., G] uint8 hold exponents biased by 127.
The last dim of the result is G * 32.

`quantize_mxfp4` is the inverse for tests and tools: each block's scale is the smallest power of
two that brings its largest magnitude within e2m1's 6, and values round to the nearest code."""

import torch

# e2m1 codes 0..15: sign bit 3, then the eight magnitudes.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
SCALE_BIAS = 127
BLOCK = 32
_BLOCKS_PER_SLICE = 1 << 20


def dequantize_mxfp4(
    blocks: torch.Tensor, scales: torch.Tensor, *, dtype: torch.dtype = torch.bfloat16
) -> torch.Tensor:
    """blocks [..., G, 16] and scales [..., G] (uint8) -> [..., G * 32] in `dtype` (bfloat16 and
    float32 hold every MXFP4 value exactly)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(
            f"MXFP4 blocks [..., G, 16] must match scales [..., G]: got {list(blocks.shape)} and {list(scales.shape)}"
        )
    table = torch.tensor(E2M1_VALUES, dtype=dtype, device=blocks.device)
    flat_blocks, flat_scales = blocks.reshape(-1, BLOCK // 2), scales.reshape(-1)
    out = torch.empty(flat_scales.numel(), BLOCK, dtype=dtype, device=blocks.device)
    # In slices of blocks: the codes' index tensor would otherwise be 4 bytes per weight.
    for start in range(0, flat_scales.numel(), _BLOCKS_PER_SLICE):
        part = flat_blocks[start : start + _BLOCKS_PER_SLICE]
        codes = torch.stack((part & 0x0F, part >> 4), dim=-1).flatten(-2).int()
        exponents = flat_scales[start : start + _BLOCKS_PER_SLICE].to(torch.int32) - SCALE_BIAS
        torch.ldexp(table[codes], exponents[:, None].to(dtype), out=out[start : start + _BLOCKS_PER_SLICE])
    return out.view(*scales.shape[:-1], scales.shape[-1] * BLOCK)


def quantize_mxfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., N] (N a multiple of 32) -> (blocks [..., N / 32, 16], scales [..., N / 32])."""
    if weight.shape[-1] % BLOCK:
        raise ValueError(f"MXFP4 needs the last dim to be a multiple of {BLOCK}, got {weight.shape[-1]}")
    groups = weight.float().unflatten(-1, (-1, BLOCK))
    amax = groups.abs().amax(dim=-1)
    # Smallest e with amax / 2^e <= 6.
    exponents = torch.where(amax > 0, torch.ceil(torch.log2(amax / 6.0)), torch.zeros_like(amax)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponents)[..., None]
    magnitudes = torch.tensor(E2M1_VALUES[:8], device=weight.device)
    codes = (scaled.abs()[..., None] - magnitudes).abs().argmin(dim=-1)
    codes = codes + 8 * (scaled < 0)
    codes = codes.to(torch.uint8).unflatten(-1, (-1, 2))
    blocks = codes[..., 0] | (codes[..., 1] << 4)
    return blocks, (exponents.to(torch.int32) + SCALE_BIAS).to(torch.uint8)
