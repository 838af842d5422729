"""Block FP8 (float8_e4m3fn with float32 scales), DeepSeek-V3's recipe, in two shapes:

- weights in 128x128 blocks (`quantize_blockwise`): the layout vLLM's block-FP8 linear
  layers load, values plus a `weight_scale_inv` of shape [ceil(out/128), ceil(in/128)];
- activations in 1x128 tiles (`quantize_rows_1x128`): one scale per row and 128 columns,
  scales of shape [rows, ceil(cols/128)].

Each scale is its block's amax / 448 (the multiplier that dequantizes, 0 for an all-zero
block; a weight block's computed as amax times the float32 reciprocal of 448 on every device,
as CUDA computes the division); partial edge blocks count as zero-padded. The weight
broadcaster quantizes published weights with this module, the trainer the operands of its FP8
matrix products.

Both quantizers run a fused Triton kernel on CUDA tensors (one read of the input, one write
of the result) and the PyTorch reference elsewhere; the two agree bit for bit.
"""

from __future__ import annotations

import functools

import torch

__all__ = [
    "BLOCK",
    "FP8_MAX",
    "dequantize_blockwise",
    "dequantize_rows_1x128",
    "quantize_blockwise",
    "quantize_blockwise_reference",
    "quantize_rows_1x128",
    "quantize_rows_1x128_reference",
]

BLOCK = 128
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448


def _check(tensor: torch.Tensor, what: str = "weight") -> None:
    if tensor.dim() != 2:
        raise ValueError(f"block FP8 quantizes 2-D {what}s, got shape {tuple(tensor.shape)}")
    if not tensor.dtype.is_floating_point or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        raise ValueError(f"cannot quantize a {tensor.dtype} {what}")


def scale_shape(out_features: int, in_features: int, block: int = BLOCK) -> tuple[int, int]:
    return -(-out_features // block), -(-in_features // block)


def quantize_blockwise_reference(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain PyTorch version: pad, amax per block, divide, cast."""
    _check(weight)
    rows, cols = weight.shape
    blocks_m, blocks_n = scale_shape(rows, cols, block)
    padded = torch.zeros(blocks_m * block, blocks_n * block, dtype=torch.float32, device=weight.device)
    padded[:rows, :cols] = weight
    tiles = padded.view(blocks_m, block, blocks_n, block)
    # amax times 1/448 in float32: what CUDA computes for amax / 448 (a multiplication by the
    # divisor's reciprocal) and the Triton kernel matches, so a CPU gives a GPU's bits too.
    scale_inv = tiles.abs().amax(dim=(1, 3)) * (1.0 / FP8_MAX)
    divisor = torch.where(scale_inv > 0, scale_inv, torch.ones_like(scale_inv))[:, None, :, None]
    quantized = (tiles / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(blocks_m * block, blocks_n * block)[:rows, :cols].contiguous(), scale_inv


def dequantize_blockwise(quantized: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 weight = fp8 value * its block's scale."""
    rows, cols = quantized.shape
    if tuple(scale_inv.shape) != scale_shape(rows, cols, block):
        raise ValueError(f"scale shape {tuple(scale_inv.shape)} does not fit a {rows}x{cols} weight")
    scales = scale_inv.repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return quantized.to(torch.float32) * scales


def quantize_blockwise(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn weight, float32 scale_inv); fused kernel on CUDA."""
    _check(weight)
    if weight.is_cuda and block == BLOCK:
        return _quantize_triton(weight)
    return quantize_blockwise_reference(weight, block)


@functools.cache
def _kernel():  # Triton is imported only where a GPU uses it.
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_block_quantize(
        x_ptr, q_ptr, s_ptr, rows, cols, stride_x, stride_xc, stride_q, blocks_n, BLOCK: tl.constexpr, SUB: tl.constexpr
    ):
        # One program per 128x128 block, read in row slices of SUB: the first
        # pass finds the block's amax, the second re-reads the slices (from L2)
        # and quantizes. Slices keep registers low, so more programs, and more
        # loads, are in flight per SM than with the whole block in registers
        # (measured on an H200: 0.77-0.86 of copy bandwidth against 0.59-0.66).
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        offs_n = pid_n * BLOCK + tl.arange(0, BLOCK)
        amax = tl.zeros([SUB, BLOCK], dtype=tl.float32)
        for r in tl.static_range(0, BLOCK, SUB):
            offs_m = pid_m * BLOCK + r + tl.arange(0, SUB)
            mask = (offs_m[:, None] < rows) & (offs_n[None, :] < cols)
            x = tl.load(x_ptr + offs_m[:, None] * stride_x + offs_n[None, :] * stride_xc, mask=mask, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.max(amax) * (1.0 / 448.0)  # as the reference: the same bits on every device
        divisor = tl.where(scale > 0, scale, 1.0)
        for r in tl.static_range(0, BLOCK, SUB):
            offs_m = pid_m * BLOCK + r + tl.arange(0, SUB)
            mask = (offs_m[:, None] < rows) & (offs_n[None, :] < cols)
            x_offs = offs_m[:, None] * stride_x + offs_n[None, :] * stride_xc
            x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
            # Correctly rounded division, as the reference does, so both agree bit for bit.
            q = tl.clamp(tl.math.div_rn(x, divisor), -448.0, 448.0)
            tl.store(q_ptr + offs_m[:, None] * stride_q + offs_n[None, :], q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + pid_m * blocks_n + pid_n, scale)

    return fp8_block_quantize


def _quantize_triton(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # Any strides: a transposed weight is read as it lies (a contiguous one's column stride
    # of 1 is specialized by Triton, so its loads are as before).
    rows, cols = weight.shape
    blocks_m, blocks_n = scale_shape(rows, cols)
    quantized = torch.empty(rows, cols, dtype=FP8_DTYPE, device=weight.device)
    scale_inv = torch.empty(blocks_m, blocks_n, dtype=torch.float32, device=weight.device)
    _kernel()[(blocks_m, blocks_n)](
        weight,
        quantized,
        scale_inv,
        rows,
        cols,
        weight.stride(0),
        weight.stride(1),
        quantized.stride(0),
        blocks_n,
        BLOCK=BLOCK,
        SUB=64,
        num_warps=8,
    )
    return quantized, scale_inv


# ---- Activations: 1x128 tiles (one scale per row and 128 columns).


def rows_scale_shape(rows: int, cols: int, block: int = BLOCK) -> tuple[int, int]:
    return rows, -(-cols // block)


def _outer_major(scales: torch.Tensor) -> torch.Tensor:
    """The same [rows, tiles] values stored column by column (stride (1, rows)): the layout
    torch's block-scaled matrix products take for 1x128 scales."""
    return scales.t().contiguous().t()


def quantize_rows_1x128_reference(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain PyTorch version: pad the columns, amax per tile, divide, cast."""
    _check(x, "activation")
    rows, cols = x.shape
    _, tiles = rows_scale_shape(rows, cols, block)
    padded = torch.zeros(rows, tiles * block, dtype=torch.float32, device=x.device)
    padded[:, :cols] = x
    view = padded.view(rows, tiles, block)
    scales = view.abs().amax(dim=2) / FP8_MAX
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales))[:, :, None]
    quantized = (view / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return quantized.view(rows, tiles * block)[:, :cols].contiguous(), _outer_major(scales)


def dequantize_rows_1x128(quantized: torch.Tensor, scales: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """float32 activation = fp8 value * its tile's scale."""
    rows, cols = quantized.shape
    if tuple(scales.shape) != rows_scale_shape(rows, cols, block):
        raise ValueError(f"scale shape {tuple(scales.shape)} does not fit {rows}x{cols} activations")
    return quantized.to(torch.float32) * scales.repeat_interleave(block, 1)[:, :cols]


def quantize_rows_1x128(x: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn values [rows, cols], contiguous; float32 scales [rows, ceil(cols/128)],
    stored column-major); fused kernel on CUDA. `x` may be a strided view (a transpose
    quantizes along the other dimension without a copy)."""
    _check(x, "activation")
    if x.is_cuda and block == BLOCK:
        return _quantize_rows_triton(x)
    return quantize_rows_1x128_reference(x, block)


@functools.cache
def _rows_kernel():  # Triton is imported only where a GPU uses it.
    import triton
    import triton.language as tl

    @triton.jit
    def fp8_rows_quantize(
        x_ptr,
        q_ptr,
        s_ptr,
        rows,
        cols,
        stride_xr,
        stride_xc,
        stride_qr,
        stride_st,
        ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        # One program per ROWS rows of one 128-column tile; the row offsets are 64-bit, a
        # transposed input's row stride is 1 and its column stride can be large.
        offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        tile = tl.program_id(1)
        offs_c = tile * BLOCK + tl.arange(0, BLOCK)
        mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols)
        x_offs = offs_r[:, None].to(tl.int64) * stride_xr + offs_c[None, :].to(tl.int64) * stride_xc
        x = tl.load(x_ptr + x_offs, mask=mask, other=0.0).to(tl.float32)
        # The scale as torch's tensor / 448 rounds it, the values with a correctly rounded
        # division as the reference's tensor / tensor: both agree bit for bit.
        scale = tl.max(tl.abs(x), axis=1) / 448.0
        divisor = tl.where(scale > 0, scale, 1.0)
        q = tl.clamp(tl.math.div_rn(x, divisor[:, None]), -448.0, 448.0)
        q_offs = offs_r[:, None].to(tl.int64) * stride_qr + offs_c[None, :]
        tl.store(q_ptr + q_offs, q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + offs_r + tile.to(tl.int64) * stride_st, scale, mask=offs_r < rows)

    return fp8_rows_quantize


def _quantize_rows_triton(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = x.shape
    _, tiles = rows_scale_shape(rows, cols)
    quantized = torch.empty(rows, cols, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(tiles, rows, dtype=torch.float32, device=x.device).t()
    if quantized.numel() == 0:
        return quantized, scales
    rows_per_program = 32
    _rows_kernel()[(-(-rows // rows_per_program), tiles)](
        x,
        quantized,
        scales,
        rows,
        cols,
        x.stride(0),
        x.stride(1),
        quantized.stride(0),
        scales.stride(1),
        ROWS=rows_per_program,
        BLOCK=BLOCK,
        num_warps=4,
    )
    return quantized, scales
