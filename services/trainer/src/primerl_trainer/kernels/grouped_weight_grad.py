"""The experts' weight gradient added into the weight's `.grad` inside the product, in the
weights' dtype: dW[e] = dy[rows of e]^T @ x[rows of e] (models.moe's bf16 grouped products, and
model.fp8_weight_grad "model_dtype"; kernels.fp8_grouped adds its FP8 one likewise).

Handed to autograd instead, a weight gradient is written out and then read back with the held
gradient to add them: with gradient accumulation over micro-batches that addition moves 6 bytes
per expert parameter (3.6 GB per layer at bench/trainer_throughput.py's MoE shape) on every
micro-batch after the first. Here the kernel reads the held gradient in its epilogue, sums in
float32 and rounds once. The callers are custom ops, opaque to torch.compile, so the side effect
on `.grad` is never traced.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: autograd's own weight gradients
    triton = None

__all__ = ["add_grouped_weight_grad", "adds_into_grad", "grouped_weight_grad"]

# Tile of the weight-gradient kernel: (output rows, output columns, token rows per step), warps, stages.
WEIGHT_GRAD_CONFIG = (128, 128, 64, 4, 3)


def adds_into_grad(w_EOI: torch.Tensor) -> bool:
    """Whether a product's backward may add w's gradient into w.grad itself: on CUDA with
    Triton, for a leaf weight that wants a gradient (not a LoRA parametrization, not a DTensor,
    no gradient hooks, which would not see it)."""
    hooked = not torch.compiler.is_compiling() and bool(
        w_EOI._backward_hooks or getattr(w_EOI, "_post_accumulate_grad_hooks", None)
    )
    return (
        triton is not None
        and w_EOI.is_cuda
        and w_EOI.is_leaf
        and w_EOI.requires_grad
        and torch.is_grad_enabled()
        and not isinstance(w_EOI, DTensor)
        and not hooked
    )


def grouped_weight_grad(grad_NO: torch.Tensor, x_NI: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
    """[E, O, I]: grad[rows of e]^T @ x[rows of e] (zero for an expert without rows)."""
    return torch._grouped_mm(grad_NO.contiguous().t(), x_NI.contiguous(), offs=offsets_E)


def add_grouped_weight_grad(
    w_EOI: torch.Tensor, grad_NO: torch.Tensor, x_NI: torch.Tensor, offsets_E: torch.Tensor
) -> None:
    """w.grad[e] += grad[rows of e]^T @ x[rows of e] (offsets_E: each expert's end), or w.grad
    set to that where there is none yet (torch._grouped_mm's); an expert without rows adds 0."""
    if w_EOI.grad is None:
        w_EOI.grad = grouped_weight_grad(grad_NO, x_NI, offsets_E).to(w_EOI.dtype)
        return
    grad_NO, x_NI = grad_NO.contiguous(), x_NI.contiguous()
    out_EOI = w_EOI.grad
    num_experts, out_dim, in_dim = out_EOI.shape
    assert out_EOI.is_contiguous()
    block_o, block_i, block_n, num_warps, num_stages = WEIGHT_GRAD_CONFIG
    grid = (triton.cdiv(out_dim, block_o) * triton.cdiv(in_dim, block_i), num_experts)
    _grouped_weight_grad_kernel[grid](
        out_EOI, grad_NO, x_NI, offsets_E, out_dim, in_dim,
        BLOCK_O=block_o, BLOCK_I=block_i, BLOCK_N=block_n,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip


if triton is not None:

    @triton.jit
    def _grouped_weight_grad_kernel(
        out_ptr,
        grad_ptr,
        x_ptr,
        offsets_ptr,
        out_dim,
        in_dim,
        BLOCK_O: tl.constexpr,
        BLOCK_I: tl.constexpr,
        BLOCK_N: tl.constexpr,
    ):
        """One program per (output tile, expert): runs over the expert's token rows."""
        expert = tl.program_id(1)
        tiles_i = tl.cdiv(in_dim, BLOCK_I)
        tile_o, tile_i = tl.program_id(0) // tiles_i, tl.program_id(0) % tiles_i
        start = tl.load(offsets_ptr + expert - 1, mask=expert > 0, other=0).to(tl.int64)
        end = tl.load(offsets_ptr + expert).to(tl.int64)
        cols_o = tile_o * BLOCK_O + tl.arange(0, BLOCK_O)
        cols_i = tile_i * BLOCK_I + tl.arange(0, BLOCK_I)
        acc = tl.zeros((BLOCK_O, BLOCK_I), dtype=tl.float32)
        for row in range(start, end, BLOCK_N):
            rows = row + tl.arange(0, BLOCK_N)
            in_rows = rows[:, None] < end
            g = tl.load(
                grad_ptr + rows[:, None] * out_dim + cols_o[None, :],
                mask=in_rows & (cols_o[None, :] < out_dim),
                other=0.0,
            )
            x = tl.load(
                x_ptr + rows[:, None] * in_dim + cols_i[None, :], mask=in_rows & (cols_i[None, :] < in_dim), other=0.0
            )
            acc = tl.dot(tl.trans(g), x, acc)
        out_ptrs = out_ptr + expert.to(tl.int64) * out_dim * in_dim + cols_o[:, None] * in_dim + cols_i[None, :]
        mask = (cols_o[:, None] < out_dim) & (cols_i[None, :] < in_dim)
        acc += tl.load(out_ptrs, mask=mask).to(tl.float32)
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=mask)
