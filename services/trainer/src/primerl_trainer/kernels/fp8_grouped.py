"""Fused grouped block-scaled FP8 products for a layer of experts: the "scaled_mm" backend of
kernels.fp8_linear.fp8_grouped_linear, in Triton, with no host sync and no loop over the
experts on the host (the expert offsets stay on the device).

The operands are quantized as fp8_linear's module docstring tables, and exactly as its
"emulated" backend quantizes them expert by expert (the same values and scales, bit for bit):

- forward y = x @ W^T and input gradient dx = dy @ W: an "M-grouped" product. The left
  operand in 1x128 tiles along the contraction (quantize_rows_1x128 of the whole [N, K]
  tensor: a row's tiles do not depend on its expert), each expert's weight in 128x128 blocks
  (W for the forward, W^T for dx: the blocks of W^T are W's transposed, quantized here
  straight into the transposed layout). The rows are cut into tiles of M_GROUPED's BLOCK_M
  rows restarted at each expert's first row, so that no tile straddles two experts; a
  device-side map gives each tile its expert and rows, and the launch covers an upper bound of
  tiles (ceil(N/BLOCK_M) + E), the programs past the real count exiting at once.
- weight gradient dW[e] = dy_e^T @ x_e: a "K-grouped" product, contracting over the expert's
  tokens. dy^T and x^T are quantized in 1x128 tiles along the tokens, the tile grid restarted
  at each expert's first token (as quantize_rows_1x128(dy_e.t()) does per expert): an
  expert's last tile is partial and counts as zero-padded. The quantizer writes the tiles
  transposed (tokens contiguous) into a buffer where every tile starts at a multiple of 128,
  zero rows filling the partial ones, so the product reads whole, aligned 128-token steps.

Each product sums one 128-wide step of the contraction in FP8 (tl.dot, float32 out), scales it
by the two operands' scales and accumulates in float32 (DeepSeek-V3's promotion of the partial
sums every 128), and rounds once to the output dtype. Triton is imported only when a kernel
first runs (TRITON_INTERPRET=1 runs them on CPU tensors, as the tests do). With `deep_gemm`, the
M-grouped products run on DeepGEMM's kernel instead where it takes their shape
(kernels.deep_gemm_grouped: the same operands, the same products).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from primerl_common.weights.fp8 import quantize_rows_1x128
from primerl_trainer.kernels import deep_gemm_grouped as dg
from primerl_trainer.kernels.fp8_weight_cache import WEIGHT_CACHE
from primerl_trainer.kernels.grouped_weight_grad import add_grouped_weight_grad, grouped_weight_grad

__all__ = ["expert_tiles", "grouped_backward", "grouped_forward", "quantize_expert_weights", "quantize_token_tiles"]

TILE = 128  # the quantization block and the products' contraction step
_FP8 = torch.float8_e4m3fn
# The products' launch settings (BLOCK_M: the rows of an M-grouped tile; bench/fp8_kernels.py
# measures the alternatives on a GPU).
M_GROUPED = {"BLOCK_M": 64, "BLOCK_N": 128, "num_warps": 4, "num_stages": 3}
K_GROUPED = {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}


def grouped_forward(
    x_NI: torch.Tensor, w_EOI: torch.Tensor, offsets_E: torch.Tensor, *, deep_gemm: bool = False
) -> torch.Tensor:
    """y [N, O] in x's dtype: rows of expert e times w_EOI[e]^T; rows past offsets_E[-1] are zero.
    `deep_gemm`: the product on DeepGEMM's kernel where it takes the shape (kernels.deep_gemm_grouped)."""
    xq, xs = quantize_rows_1x128(x_NI)
    wq, ws = WEIGHT_CACHE.quantized(w_EOI, quantize_expert_weights, transpose=False)
    if deep_gemm and dg.fits(x_NI.shape[1], w_EOI.shape[1], x_NI.dtype):
        return dg.m_grouped(xq, xs, wq, ws, dg.padded_rows(offsets_E, x_NI.shape[0]))
    tiles = expert_tiles(offsets_E, x_NI.shape[0], M_GROUPED["BLOCK_M"])
    return _m_grouped(xq, xs, wq, ws, tiles, transposed_weight=False, out_dtype=x_NI.dtype)


def grouped_backward(
    dy_NO: torch.Tensor,
    x_NI: torch.Tensor,
    w_EOI: torch.Tensor,
    offsets_E: torch.Tensor,
    need_x: bool,
    need_w: bool,
    *,
    deep_gemm: bool = False,
    weight_grad: str = "fp8",
    into_grad: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(dx [N, I] in x's dtype, dW [E, O, I] in W's dtype), None where not needed; an expert
    without rows gets a zero weight gradient. `deep_gemm`: dx as grouped_forward's product.
    `weight_grad` "model_dtype": dW from the unquantized dy and x (torch._grouped_mm's), not in
    FP8. `into_grad` (kernels.grouped_weight_grad.adds_into_grad of w): dW is added into w.grad
    inside the product (or becomes it where there is none) and None returned."""
    dx = dw = None
    if need_x:
        dyq, dys = quantize_rows_1x128(dy_NO)
        wtq, wts = WEIGHT_CACHE.quantized(w_EOI, quantize_expert_weights, transpose=True)
        if deep_gemm and dg.fits(dy_NO.shape[1], x_NI.shape[1], x_NI.dtype):
            # W^T's blocks are W's transposed: their scales too.
            dx = dg.m_grouped(dyq, dys, wtq, wts.transpose(1, 2), dg.padded_rows(offsets_E, x_NI.shape[0]))
        else:
            tiles = expert_tiles(offsets_E, x_NI.shape[0], M_GROUPED["BLOCK_M"])
            dx = _m_grouped(dyq, dys, wtq, wts, tiles, transposed_weight=True, out_dtype=x_NI.dtype)
    if need_w and weight_grad == "model_dtype":
        if into_grad:
            add_grouped_weight_grad(w_EOI, dy_NO, x_NI, offsets_E)
        else:
            dw = grouped_weight_grad(dy_NO, x_NI, offsets_E).to(w_EOI.dtype)
    elif need_w:
        tiles = expert_tiles(offsets_E, x_NI.shape[0])
        dytq, dyts = quantize_token_tiles(dy_NO, tiles)
        xtq, xts = quantize_token_tiles(x_NI, tiles)
        held = w_EOI.grad if into_grad else None
        dw = _k_grouped(dytq, dyts, xtq, xts, tiles, out_dtype=w_EOI.dtype, add_to=held)
        if into_grad:
            if held is None:
                w_EOI.grad = dw
            dw = None
    return dx, dw


class ExpertTiles:
    """The rows cut into tiles of `tile_rows` restarted at each expert's first row, on the
    device: per tile (an upper bound of num_tiles of them) its expert and rows [row_start,
    row_end), an empty range past the real count; per expert its first tile and its number of
    tiles. The weight gradient's token tiles are tiles of TILE (its quantization's)."""

    def __init__(self, offsets_E: torch.Tensor, num_rows: int, tile_rows: int = TILE) -> None:
        num_experts = offsets_E.shape[0]
        self.tile_rows = tile_rows
        self.num_tiles = -(-num_rows // tile_rows) + num_experts
        ends_E = offsets_E.to(torch.int64)
        starts_E = F.pad(ends_E[:-1], (1, 0))
        tile_count_E = (ends_E - starts_E + tile_rows - 1) // tile_rows
        tile_end_E = tile_count_E.cumsum(0)
        tile_begin_E = tile_end_E - tile_count_E
        tile_T = torch.arange(self.num_tiles, device=offsets_E.device)
        expert_T = torch.searchsorted(tile_end_E, tile_T, right=True).clamp_(max=num_experts - 1)
        real_T = tile_T < tile_end_E[-1]
        row_start_T = starts_E[expert_T] + (tile_T - tile_begin_E[expert_T]) * tile_rows
        self.expert_T = expert_T.to(torch.int32)
        self.row_start_T = torch.where(real_T, row_start_T, 0).to(torch.int32)
        self.row_end_T = torch.where(real_T, ends_E[expert_T], 0).to(torch.int32)
        self.tile_begin_E = tile_begin_E.to(torch.int32)
        self.tile_count_E = tile_count_E.to(torch.int32)


def expert_tiles(offsets_E: torch.Tensor, num_rows: int, tile_rows: int = TILE) -> ExpertTiles:
    if num_rows >= 2**31 - TILE:
        raise ValueError(f"fp8_grouped_linear: {num_rows} rows do not fit the kernels' 32-bit row indices")
    return ExpertTiles(offsets_E, num_rows, tile_rows)


def quantize_expert_weights(w_EOI: torch.Tensor, *, transpose: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Each expert's weight in 128x128 blocks: (float8 values [E, O, I], or W^T's [E, I, O]
    with `transpose`, contiguous; float32 scales [E, ceil(O/128), ceil(I/128)], W's blocks in
    both cases), as quantize_blockwise of each w_EOI[e] (bit for bit)."""
    num_experts, rows, cols = w_EOI.shape
    blocks_r, blocks_c = -(-rows // TILE), -(-cols // TILE)
    layout = (cols, rows) if transpose else (rows, cols)
    quantized = torch.empty(num_experts, *layout, dtype=_FP8, device=w_EOI.device)
    scales = torch.empty(num_experts, blocks_r, blocks_c, dtype=torch.float32, device=w_EOI.device)
    if quantized.numel() == 0:
        return quantized, scales.zero_()
    q_strides = (quantized.stride(0), quantized.stride(2), quantized.stride(1)) if transpose else quantized.stride()
    _kernels().weight_quantize[(blocks_c, blocks_r, num_experts)](
        w_EOI, quantized, scales, rows, cols, *w_EOI.stride(), *q_strides, BLOCK=TILE, num_warps=8
    )
    return quantized, scales


def quantize_token_tiles(t_NC: torch.Tensor, tiles: ExpertTiles) -> tuple[torch.Tensor, torch.Tensor]:
    """t^T in 1x128 tiles along the tokens, per tile of `tiles` (restarted at each expert):
    (float8 values [C, num_tiles * 128], tile j in columns [128 j, 128 j + 128), zeros past
    its rows; float32 scales [num_tiles, C]). Tiles past the real count are left unwritten."""
    if tiles.tile_rows != TILE:
        raise ValueError(f"token tiles are {TILE} rows (the quantization's), not {tiles.tile_rows}")
    num_cols = t_NC.shape[1]
    quantized = torch.empty(num_cols, tiles.num_tiles * TILE, dtype=_FP8, device=t_NC.device)
    scales = torch.empty(tiles.num_tiles, num_cols, dtype=torch.float32, device=t_NC.device)
    cols_per_program = 64
    _kernels().token_quantize[(-(-num_cols // cols_per_program), tiles.num_tiles)](
        t_NC,
        quantized,
        scales,
        tiles.row_start_T,
        tiles.row_end_T,
        num_cols,
        t_NC.stride(0),
        t_NC.stride(1),
        quantized.stride(0),
        BLOCK=TILE,
        COLS=cols_per_program,
        num_warps=4,
    )
    return quantized, scales


def _m_grouped(
    aq: torch.Tensor,
    as_: torch.Tensor,
    bq: torch.Tensor,
    bs: torch.Tensor,
    tiles: ExpertTiles,
    *,
    transposed_weight: bool,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    """out[r] = a[r] @ b[expert of r]^T: a [N, K] in 1x128 tiles (scales [N, ceil(K/128)]), b
    [E, Nout, K] in 128x128 blocks whose scales are bs [E, ceil(Nout/128), ceil(K/128)], or
    bs's transpose where b holds W^T (`transposed_weight`)."""
    rows, depth = aq.shape
    num_out = bq.shape[1]
    out = torch.zeros(rows, num_out, dtype=out_dtype, device=aq.device)
    if rows == 0 or num_out == 0:
        return out
    bs_e, bs_n, bs_k = bs.stride()
    if transposed_weight:
        bs_n, bs_k = bs_k, bs_n
    config = {key: value for key, value in M_GROUPED.items() if key != "BLOCK_M"}  # the tiles' rows
    _kernels().m_grouped[(-(-num_out // config["BLOCK_N"]), tiles.num_tiles)](
        aq,
        as_,
        bq,
        bs,
        out,
        tiles.expert_T,
        tiles.row_start_T,
        tiles.row_end_T,
        num_out,
        depth,
        aq.stride(0),
        aq.stride(1),
        as_.stride(0),
        as_.stride(1),
        *bq.stride(),
        bs_e,
        bs_n,
        bs_k,
        out.stride(0),
        out.stride(1),
        BLOCK_M=tiles.tile_rows,
        BLOCK_K=TILE,
        **config,
    )
    return out


def _k_grouped(
    aq: torch.Tensor,
    as_: torch.Tensor,
    bq: torch.Tensor,
    bs: torch.Tensor,
    tiles: ExpertTiles,
    *,
    out_dtype: torch.dtype,
    add_to: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[e] = sum over e's token tiles of a^T-tile @ b-tile, scaled: aq [M, L] and bq [Nout, L]
    from quantize_token_tiles, with scales [num_tiles, M] and [num_tiles, Nout]. `add_to`
    [E, M, Nout] contiguous: the product is added into it (summed in float32 with its values,
    rounded once) and it is returned."""
    num_m, num_n = aq.shape[0], bq.shape[0]
    num_experts = tiles.tile_count_E.shape[0]
    if add_to is not None and (add_to.shape != (num_experts, num_m, num_n) or not add_to.is_contiguous()):
        raise ValueError(f"k_grouped: cannot add [{num_experts}, {num_m}, {num_n}] into {tuple(add_to.shape)}")
    out = torch.empty(num_experts, num_m, num_n, dtype=out_dtype, device=aq.device) if add_to is None else add_to
    if out.numel() == 0:
        return out
    grid = (-(-num_n // K_GROUPED["BLOCK_N"]), -(-num_m // K_GROUPED["BLOCK_M"]), num_experts)
    _kernels().k_grouped[grid](
        aq,
        as_,
        bq,
        bs,
        out,
        tiles.tile_begin_E,
        tiles.tile_count_E,
        num_m,
        num_n,
        aq.stride(0),
        as_.stride(0),
        bq.stride(0),
        bs.stride(0),
        *out.stride(),
        BLOCK_K=TILE,
        ACCUMULATE=add_to is not None,
        **K_GROUPED,
    )
    return out


class _Kernels:
    def __init__(self) -> None:
        import triton
        import triton.language as tl

        @triton.jit
        def weight_quantize(
            w_ptr,
            q_ptr,
            s_ptr,
            rows,
            cols,
            stride_we,
            stride_wr,
            stride_wc,
            stride_qe,
            stride_qr,
            stride_qc,
            BLOCK: tl.constexpr,
        ):
            # One program per 128x128 block of one expert, written through q's strides (W's
            # layout, or W^T's: the same block transposed); scales [E, blocks_r, blocks_c].
            pid_c = tl.program_id(0)
            pid_r = tl.program_id(1)
            expert = tl.program_id(2).to(tl.int64)
            offs_r = pid_r * BLOCK + tl.arange(0, BLOCK)
            offs_c = pid_c * BLOCK + tl.arange(0, BLOCK)
            mask = (offs_r[:, None] < rows) & (offs_c[None, :] < cols)
            w_offs = expert * stride_we + offs_r[:, None].to(tl.int64) * stride_wr + offs_c[None, :] * stride_wc
            x = tl.load(w_ptr + w_offs, mask=mask, other=0.0).to(tl.float32)
            # As primerl_common.weights.fp8 rounds them: bit for bit with its reference.
            scale = tl.max(tl.max(tl.abs(x), axis=1), axis=0) * (1.0 / 448.0)  # as quantize_blockwise
            divisor = tl.where(scale > 0, scale, 1.0)
            q = tl.clamp(tl.math.div_rn(x, divisor), -448.0, 448.0)
            q_offs = expert * stride_qe + offs_r[:, None].to(tl.int64) * stride_qr + offs_c[None, :] * stride_qc
            tl.store(q_ptr + q_offs, q.to(tl.float8e4nv), mask=mask)
            num_blocks_r = tl.num_programs(1)
            num_blocks_c = tl.num_programs(0)
            tl.store(s_ptr + (expert * num_blocks_r + pid_r) * num_blocks_c + pid_c, scale)

        @triton.jit
        def token_quantize(
            t_ptr,
            q_ptr,
            s_ptr,
            row_start_ptr,
            row_end_ptr,
            cols,
            stride_tr,
            stride_tc,
            stride_q,
            BLOCK: tl.constexpr,
            COLS: tl.constexpr,
        ):
            # One program per token tile and COLS columns: amax over the tile's rows per column,
            # written transposed (tokens contiguous) at the tile's 128-column slot of q.
            pid_c = tl.program_id(0)
            tile = tl.program_id(1)
            row_start = tl.load(row_start_ptr + tile)
            row_end = tl.load(row_end_ptr + tile)
            if row_start >= row_end:
                return
            offs_r = tl.arange(0, BLOCK)
            offs_c = pid_c * COLS + tl.arange(0, COLS)
            rows = row_start + offs_r
            c_mask = offs_c < cols
            mask = (rows[:, None] < row_end) & c_mask[None, :]
            t_offs = rows[:, None].to(tl.int64) * stride_tr + offs_c[None, :].to(tl.int64) * stride_tc
            x = tl.load(t_ptr + t_offs, mask=mask, other=0.0).to(tl.float32)
            scale = tl.max(tl.abs(x), axis=0) / 448.0
            divisor = tl.where(scale > 0, scale, 1.0)
            q = tl.clamp(tl.math.div_rn(x, divisor[None, :]), -448.0, 448.0)
            q_offs = offs_c[None, :].to(tl.int64) * stride_q + tile.to(tl.int64) * BLOCK + offs_r[:, None]
            tl.store(q_ptr + q_offs, q.to(tl.float8e4nv), mask=c_mask[None, :])
            tl.store(s_ptr + tile.to(tl.int64) * cols + offs_c, scale, mask=c_mask)

        @triton.jit
        def m_grouped(
            a_ptr,
            as_ptr,
            b_ptr,
            bs_ptr,
            c_ptr,
            expert_ptr,
            row_start_ptr,
            row_end_ptr,
            num_out,
            depth,
            stride_am,
            stride_ak,
            stride_asm,
            stride_ask,
            stride_be,
            stride_bn,
            stride_bk,
            stride_bse,
            stride_bsn,
            stride_bsk,
            stride_cm,
            stride_cn,
            BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr,
        ):
            # One program per (output columns, row tile); the row tile lies in one expert.
            pid_n = tl.program_id(0)
            tile = tl.program_id(1)
            row_start = tl.load(row_start_ptr + tile)
            row_end = tl.load(row_end_ptr + tile)
            if row_start >= row_end:
                return
            expert = tl.load(expert_ptr + tile).to(tl.int64)
            offs_m = row_start + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tl.arange(0, BLOCK_K)
            m_mask = offs_m < row_end
            n_mask = offs_n < num_out
            a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_am + offs_k[None, :] * stride_ak
            b_ptrs = b_ptr + expert * stride_be + offs_n[None, :].to(tl.int64) * stride_bn + offs_k[:, None] * stride_bk
            as_ptrs = as_ptr + offs_m.to(tl.int64) * stride_asm
            # Each column's own weight block row: a tile of any BLOCK_N may span several.
            bs_ptrs = bs_ptr + expert * stride_bse + (offs_n // BLOCK_K) * stride_bsn
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for kb in range(0, tl.cdiv(depth, BLOCK_K)):
                k_mask = offs_k < depth - kb * BLOCK_K
                a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
                b = tl.load(b_ptrs, mask=k_mask[:, None] & n_mask[None, :], other=0.0)
                a_scale = tl.load(as_ptrs + kb * stride_ask, mask=m_mask, other=0.0)
                b_scale = tl.load(bs_ptrs + kb * stride_bsk, mask=n_mask, other=0.0)
                acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
                a_ptrs += BLOCK_K * stride_ak
                b_ptrs += BLOCK_K * stride_bk
            c_ptrs = c_ptr + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])

        @triton.jit
        def k_grouped(
            a_ptr,
            as_ptr,
            b_ptr,
            bs_ptr,
            c_ptr,
            tile_begin_ptr,
            tile_count_ptr,
            num_m,
            num_n,
            stride_a,
            stride_as,
            stride_b,
            stride_bs,
            stride_ce,
            stride_cm,
            stride_cn,
            BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr,
            BLOCK_K: tl.constexpr,
            ACCUMULATE: tl.constexpr,
        ):
            # One program per (output block, expert), over the expert's token tiles: a and b
            # are [features, tokens] with each tile's 128 tokens contiguous (zeros past its rows);
            # ACCUMULATE: c's values are added to the sum before it is rounded and stored.
            pid_n = tl.program_id(0)
            pid_m = tl.program_id(1)
            expert = tl.program_id(2).to(tl.int64)
            tile_begin = tl.load(tile_begin_ptr + expert)
            tile_count = tl.load(tile_count_ptr + expert)
            offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
            offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_k = tile_begin.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
            m_mask = offs_m < num_m
            n_mask = offs_n < num_n
            a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * stride_a + offs_k[None, :]
            b_ptrs = b_ptr + offs_n[None, :].to(tl.int64) * stride_b + offs_k[:, None]
            as_ptrs = as_ptr + tile_begin.to(tl.int64) * stride_as + offs_m
            bs_ptrs = bs_ptr + tile_begin.to(tl.int64) * stride_bs + offs_n
            acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
            for _ in range(0, tile_count):
                a = tl.load(a_ptrs, mask=m_mask[:, None], other=0.0)
                b = tl.load(b_ptrs, mask=n_mask[None, :], other=0.0)
                a_scale = tl.load(as_ptrs, mask=m_mask, other=0.0)
                b_scale = tl.load(bs_ptrs, mask=n_mask, other=0.0)
                acc += tl.dot(a, b) * (a_scale[:, None] * b_scale[None, :])
                a_ptrs += BLOCK_K
                b_ptrs += BLOCK_K
                as_ptrs += stride_as
                bs_ptrs += stride_bs
            c_ptrs = c_ptr + expert * stride_ce + offs_m[:, None].to(tl.int64) * stride_cm + offs_n[None, :] * stride_cn
            c_mask = m_mask[:, None] & n_mask[None, :]
            if ACCUMULATE:
                acc += tl.load(c_ptrs, mask=c_mask, other=0.0).to(tl.float32)
            tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=c_mask)

        self.weight_quantize = weight_quantize
        self.token_quantize = token_quantize
        self.m_grouped = m_grouped
        self.k_grouped = k_grouped


@functools.cache  # Triton is imported, and the kernels defined, where a product first runs.
def _kernels() -> _Kernels:
    return _Kernels()
