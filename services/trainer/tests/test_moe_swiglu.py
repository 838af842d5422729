"""The experts' fused SwiGLU (kernels.swiglu.SwiGLURows, Triton, run by Triton's interpreter on the
CPU in a child process: the interpreter is chosen when the kernel is defined) against the plain
expression, forward and backward, on the rows before the end it is given."""

import pytest
import torch

from primerl_trainer.kernels import swiglu

from .triton_interpreter import check_in_interpreter


def _check_against_reference() -> None:
    assert swiglu._INTERPRET and swiglu.triton is not None
    generator = torch.Generator().manual_seed(0)
    # 40: a block wider than the row (masked columns); 1500: several column blocks.
    for hidden in (40, 1500):
        gate_up = torch.randn(9, 2 * hidden, generator=generator)
        grad = torch.randn(9, hidden, generator=generator)
        for end in (9, 6, 0):
            assert swiglu.fused_swiglu_available(gate_up)
            fused_in = gate_up.clone().requires_grad_()
            out = swiglu.SwiGLURows.apply(fused_in, torch.tensor([end], dtype=torch.int32))
            out.backward(grad)
            plain_in = gate_up.clone().requires_grad_()
            gate, up = plain_in.chunk(2, dim=-1)
            wanted = torch.nn.functional.silu(gate) * up
            wanted.backward(grad)
            torch.testing.assert_close(out[:end], wanted[:end], rtol=1e-6, atol=1e-6)
            torch.testing.assert_close(fused_in.grad[:end], plain_in.grad[:end], rtol=1e-5, atol=1e-6)


@pytest.mark.skipif(swiglu.triton is None, reason="needs Triton")
def test_fused_swiglu_equals_the_plain_expression() -> None:
    check_in_interpreter("test_moe_swiglu")


def test_the_cpu_keeps_the_plain_expression() -> None:
    assert not swiglu.fused_swiglu_available(torch.randn(3, 8)) or swiglu._INTERPRET
