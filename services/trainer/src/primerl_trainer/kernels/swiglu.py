"""The experts' SwiGLU, silu(gate) * up, as one Triton pass each way (models.moe.GroupedExperts)."""

import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs: the plain expression
    triton = None

__all__ = ["FUSED_SWIGLU", "SwiGLURows", "fused_swiglu_available"]

# The experts' SwiGLU, silu(gate) * up, as one Triton pass each way when the experts run eagerly
# on CUDA (under expert parallel, inside the dispatcher, which compiled blocks leave to eager):
# eager PyTorch spends three kernels forward (silu, product) and four backward (two products,
# silu's backward, the gate and up gradients' concatenation), each over every row, and under
# expert parallel's padded copies (distributed.expert_parallel) half the rows are padding. The
# passes here stop at the first row past the last expert's (offsets[-1], read on the device) and
# round once, from float32, as the compiled blocks' fused kernel does. Compiled code keeps the
# plain expression, which inductor fuses itself.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
FUSED_SWIGLU = True  # False: the plain expression everywhere (A/B timing)


def fused_swiglu_available(gate_up: torch.Tensor) -> bool:
    return (
        FUSED_SWIGLU
        and triton is not None
        and (gate_up.is_cuda or _INTERPRET)
        and not torch.compiler.is_compiling()
        and gate_up.dim() == 2
        and gate_up.dtype in (torch.bfloat16, torch.float16, torch.float32)
        and gate_up.shape[1] % 2 == 0
    )


class SwiGLURows(torch.autograd.Function):
    """gate_up [N, 2F] (gate columns, then up) -> silu(gate) * up [N, F] for the rows before
    end_1[0]; the rows from there on (padding) are left unwritten, forward and backward."""

    @staticmethod
    def forward(ctx, gate_up_N2F: torch.Tensor, end_1: torch.Tensor) -> torch.Tensor:
        gate_up_N2F = gate_up_N2F.contiguous()
        num_rows, hidden = gate_up_N2F.shape[0], gate_up_N2F.shape[1] // 2
        out_NF = gate_up_N2F.new_empty(num_rows, hidden)
        if num_rows and hidden:
            block = min(SWIGLU_BLOCK, triton.next_power_of_2(hidden))
            _swiglu_kernel[(num_rows, triton.cdiv(hidden, block))](
                gate_up_N2F, out_NF, out_NF, end_1, hidden, BACKWARD=False, BLOCK=block, num_warps=4
            )
        ctx.save_for_backward(gate_up_N2F, end_1)
        return out_NF

    @staticmethod
    def backward(ctx, grad_NF: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        gate_up_N2F, end_1 = ctx.saved_tensors
        grad_NF = grad_NF.contiguous()
        num_rows, hidden = grad_NF.shape
        grad_N2F = torch.empty_like(gate_up_N2F)
        if num_rows and hidden:
            block = min(SWIGLU_BLOCK, triton.next_power_of_2(hidden))
            _swiglu_kernel[(num_rows, triton.cdiv(hidden, block))](
                gate_up_N2F, grad_NF, grad_N2F, end_1, hidden, BACKWARD=True, BLOCK=block, num_warps=4
            )
        return grad_N2F, None


SWIGLU_BLOCK = 1024

if triton is not None:

    @triton.jit
    def _swiglu_kernel(
        gate_up_ptr, h_ptr, grad_gate_up_ptr, end_ptr, hidden, BACKWARD: tl.constexpr, BLOCK: tl.constexpr
    ):
        """One program per (row, block of columns). Forward: h = silu(g) * u. Backward, h_ptr
        holding h's gradient dh: dg = dh * u * s * (1 + g * (1 - s)), du = dh * silu(g), s = sigmoid(g)."""
        row = tl.program_id(0).to(tl.int64)
        if row < tl.load(end_ptr).to(tl.int64):
            cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
            mask = cols < hidden
            g = tl.load(gate_up_ptr + row * 2 * hidden + cols, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(gate_up_ptr + row * 2 * hidden + hidden + cols, mask=mask, other=0.0).to(tl.float32)
            s = tl.sigmoid(g)
            if BACKWARD:
                dh = tl.load(h_ptr + row * hidden + cols, mask=mask, other=0.0).to(tl.float32)
                dg = dh * u * s * (1.0 + g * (1.0 - s))
                du = dh * g * s
                out_type = grad_gate_up_ptr.dtype.element_ty
                tl.store(grad_gate_up_ptr + row * 2 * hidden + cols, dg.to(out_type), mask=mask)
                tl.store(grad_gate_up_ptr + row * 2 * hidden + hidden + cols, du.to(out_type), mask=mask)
            else:
                tl.store(h_ptr + row * hidden + cols, (g * s * u).to(h_ptr.dtype.element_ty), mask=mask)
