"""Row moves of expert parallel's dispatch and combine as single passes (Triton, on CUDA): a row
gather, a weighted sum of gathered rows accumulated in float32, and the combine's backward (each
copy's scaled gradient row and its dot product with the copy). Eager PyTorch spends several
passes on each (a gather, a cast, a product and a sum per term, each reading and writing whole
float32 rows) and its row gather (`aten::index`) runs at a fraction of the memory bandwidth.

The plain PyTorch paths (kernels.gather) are the reference: taken on the CPU, without Triton, and
when `fused` is False. Both accumulate in float32 in the order k = 0, 1, ...; the fused ones may
round a product and a sum as one (FMA), a difference of about one float32 ulp."""

from __future__ import annotations

import os

import torch

from primerl_trainer.kernels.gather import accumulation_dtype, gather_sum

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None

__all__ = ["fused_rows_available", "gather_rows", "gather_sum_rows", "scaled_rows_and_dots"]

# Columns per program: 2 KiB of bf16 per row load.
BLOCK_D = 1024
# Triton's interpreter runs the kernels on CPU tensors (the CPU tests check them that way).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def fused_rows_available(x: torch.Tensor) -> bool:
    """Whether the Triton kernels run for tensors like `x` (CUDA, float32 or half precision)."""
    return (
        triton is not None
        and (x.is_cuda or _INTERPRET)
        and x.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and x.dim() == 2
    )


def gather_rows(
    x_TD: torch.Tensor, index_R: torch.Tensor, *, out: torch.Tensor | None = None, fused: bool = True
) -> torch.Tensor:
    """x_TD[index_R] for a 2-D x (a row per index), into `out` when given ([R, D], rows of any
    stride, columns contiguous). x's rows may be strided too (a column slice of a wider buffer)."""
    if not (fused and fused_rows_available(x_TD)) or x_TD.shape[1] == 0:
        if out is None:
            return x_TD[index_R]
        return out.copy_(x_TD[index_R])
    return _gather_sum(x_TD, index_R[:, None], None, None, out)


def gather_sum_rows(
    rows_ND: torch.Tensor,
    index_TK: torch.Tensor,
    weights_TK: torch.Tensor | None = None,
    valid_TK: torch.Tensor | None = None,
    *,
    fused: bool = True,
) -> torch.Tensor:
    """out[t] = sum over k (where valid_TK[t, k], when given) of weights[t, k] (1 when None) *
    rows[index_TK[t, k]], in rows' dtype, accumulated in float32. Index entries that are not valid
    must still lie in range (the reference reads them and multiplies by 0). rows may be strided
    (a column slice of a wider buffer)."""
    if not (fused and fused_rows_available(rows_ND)) or rows_ND.shape[1] == 0 or index_TK.shape[1] == 0:
        if valid_TK is None:
            return gather_sum(rows_ND, index_TK, weights_TK)
        if weights_TK is None:
            return gather_sum(rows_ND, index_TK, valid_TK)
        return gather_sum(rows_ND, index_TK, torch.where(valid_TK, weights_TK, 0))
    return _gather_sum(rows_ND, index_TK, weights_TK, valid_TK)


def scaled_rows_and_dots(
    grad_TD: torch.Tensor, rows_RD: torch.Tensor, token_R: torch.Tensor, weights_R: torch.Tensor, *, fused: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """The backward of out[t] = sum of w_r * rows[r] over the rows r of token t, row by row:
    (grad[token_R] * weights_R in rows' dtype, the float32 dot products rows[r] . grad[token_R[r]])."""
    if not (fused and fused_rows_available(rows_RD)) or rows_RD.shape[1] == 0:
        dtype = accumulation_dtype(rows_RD)
        grad_copies_RD = grad_TD[token_R].to(dtype)
        grad_rows_RD = (grad_copies_RD * weights_R[:, None].to(dtype)).to(rows_RD.dtype)
        return grad_rows_RD, (rows_RD.to(dtype) * grad_copies_RD).sum(dim=-1)
    grad_TD, rows_RD = grad_TD.contiguous(), rows_RD.contiguous()
    num_rows, num_cols = rows_RD.shape
    grad_rows_RD = torch.empty_like(rows_RD)
    dots_R = torch.empty(num_rows, dtype=torch.float32, device=rows_RD.device)
    if num_rows:
        _scaled_rows_and_dots_kernel[(num_rows,)](
            grad_TD, rows_RD, token_R.contiguous(), weights_R.contiguous(), grad_rows_RD, dots_R, num_cols,
            BLOCK_D=min(BLOCK_D, triton.next_power_of_2(num_cols)), num_warps=4,
        )  # fmt: skip
    return grad_rows_RD, dots_R


def _gather_sum(
    rows_ND: torch.Tensor,
    index_TK: torch.Tensor,
    weights_TK: torch.Tensor | None,
    valid_TK: torch.Tensor | None,
    out_TD: torch.Tensor | None = None,
) -> torch.Tensor:
    rows_ND, index_TK = _unit_column_stride(rows_ND), index_TK.contiguous()
    num_out, width = index_TK.shape
    num_cols = rows_ND.shape[1]
    if out_TD is None:
        out_TD = rows_ND.new_empty(num_out, num_cols)
    assert out_TD.shape == (num_out, num_cols) and out_TD.stride(1) == 1, (out_TD.shape, out_TD.stride())
    if num_out == 0:
        return out_TD
    block = min(BLOCK_D, triton.next_power_of_2(num_cols))
    _gather_sum_kernel[(num_out, triton.cdiv(num_cols, block))](
        rows_ND, index_TK,
        index_TK if weights_TK is None else weights_TK.contiguous(),
        index_TK if valid_TK is None else valid_TK.contiguous().view(torch.uint8),
        out_TD, num_cols, rows_ND.stride(0), out_TD.stride(0),
        WIDTH=width, HAS_WEIGHTS=weights_TK is not None, HAS_VALID=valid_TK is not None, BLOCK_D=block, num_warps=4,
    )  # fmt: skip
    return out_TD


def _unit_column_stride(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(1) == 1 or x.shape[1] == 1 else x.contiguous()


if triton is not None:

    @triton.jit
    def _gather_sum_kernel(
        rows_ptr,
        index_ptr,
        weights_ptr,
        valid_ptr,
        out_ptr,
        num_cols,
        rows_stride,
        out_stride,
        WIDTH: tl.constexpr,
        HAS_WEIGHTS: tl.constexpr,
        HAS_VALID: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program per (output row, block of columns)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        in_cols = cols < num_cols
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for k in tl.static_range(WIDTH):
            src = tl.load(index_ptr + row * WIDTH + k).to(tl.int64)
            mask = in_cols
            if HAS_VALID:
                mask = mask & (tl.load(valid_ptr + row * WIDTH + k).to(tl.int32) + tl.zeros_like(cols) != 0)
            term = tl.load(rows_ptr + src * rows_stride + cols, mask=mask, other=0.0).to(tl.float32)
            if HAS_WEIGHTS:
                term = term * tl.load(weights_ptr + row * WIDTH + k).to(tl.float32)
            acc += term
        tl.store(out_ptr + row * out_stride + cols, acc.to(out_ptr.dtype.element_ty), mask=in_cols)

    @triton.jit
    def _scaled_rows_and_dots_kernel(
        grad_ptr, rows_ptr, token_ptr, weights_ptr, grad_rows_ptr, dots_ptr, num_cols, BLOCK_D: tl.constexpr
    ):
        """One program per copy row: its scaled gradient row and its dot product."""
        row = tl.program_id(0).to(tl.int64)
        token = tl.load(token_ptr + row).to(tl.int64)
        weight = tl.load(weights_ptr + row).to(tl.float32)
        dot = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, num_cols, BLOCK_D):
            cols = start + tl.arange(0, BLOCK_D)
            mask = cols < num_cols
            grad = tl.load(grad_ptr + token * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
            x = tl.load(rows_ptr + row * num_cols + cols, mask=mask, other=0.0).to(tl.float32)
            scaled = (grad * weight).to(grad_rows_ptr.dtype.element_ty)
            tl.store(grad_rows_ptr + row * num_cols + cols, scaled, mask=mask)
            dot += x * grad
        tl.store(dots_ptr + row, tl.sum(dot, axis=0))
