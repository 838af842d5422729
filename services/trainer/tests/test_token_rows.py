"""kernels.token_rows: the Triton kernels (run by Triton's interpreter on the CPU, in a child
process: the interpreter is chosen when the kernels are defined) against the PyTorch reference."""

import pytest
import torch

from primerl_trainer.kernels import token_rows

from .triton_interpreter import check_in_interpreter


def _check_against_reference() -> None:
    assert token_rows._INTERPRET and token_rows.triton is not None
    generator = torch.Generator().manual_seed(0)
    # bf16: the interpreter rounds float32 to bf16 its own way (one bf16 ulp from torch's).
    for dtype, tolerance in ((torch.float32, 1e-6), (torch.bfloat16, 8e-3)):
        # 8: a routing row (scores); 40: a block larger than the row (masked columns); 1500: several
        # column blocks.
        for num_cols in (8, 40, 1500):
            rows = torch.randn(30, num_cols, generator=generator).to(dtype)
            index = torch.randint(0, 30, (12, 3), generator=generator)
            weights = torch.randn(12, 3, generator=generator).to(dtype)
            valid = torch.rand(12, 3, generator=generator) > 0.3
            assert torch.equal(token_rows.gather_rows(rows, index[:, 0]), rows[index[:, 0]])
            # Rows read from, and written into, column slices of wider buffers (the packed dispatch).
            wide = torch.randn(30, num_cols + 6, generator=generator).to(dtype)
            out = torch.full((12, num_cols + 5), 7.0, dtype=dtype)
            token_rows.gather_rows(wide[:, 2 : 2 + num_cols], index[:, 0], out=out[:, 1 : 1 + num_cols])
            assert torch.equal(out[:, 1 : 1 + num_cols], wide[index[:, 0], 2 : 2 + num_cols])
            assert (out[:, 0] == 7).all() and (out[:, 1 + num_cols :] == 7).all()
            torch.testing.assert_close(
                token_rows.gather_sum_rows(wide[:, 2 : 2 + num_cols], index, valid_TK=index > 10),
                token_rows.gather_sum_rows(wide[:, 2 : 2 + num_cols].contiguous(), index, valid_TK=index > 10),
                rtol=0,
                atol=0,
            )
            for w, v in ((None, None), (weights, None), (None, valid), (weights, valid)):
                fused = token_rows.gather_sum_rows(rows, index, w, v)
                reference = token_rows.gather_sum_rows(rows, index, w, v, fused=False)
                assert fused.dtype == dtype
                torch.testing.assert_close(fused, reference, rtol=tolerance, atol=tolerance)
            grad = torch.randn(12, num_cols, generator=generator).to(dtype)
            token = torch.randint(0, 12, (30,), generator=generator)
            row_weights = torch.randn(30, generator=generator).to(dtype)
            fused = token_rows.scaled_rows_and_dots(grad, rows, token, row_weights)
            reference = token_rows.scaled_rows_and_dots(grad, rows, token, row_weights, fused=False)
            torch.testing.assert_close(fused[0], reference[0], rtol=tolerance, atol=tolerance)
            torch.testing.assert_close(fused[1], reference[1], rtol=1e-5, atol=1e-4)
    # No rows: nothing launched.
    assert token_rows.gather_rows(rows, index[:0, 0]).shape == (0, num_cols)


@pytest.mark.skipif(token_rows.triton is None, reason="needs Triton")
def test_fused_row_kernels_equal_the_reference() -> None:
    check_in_interpreter("test_token_rows")


def test_the_cpu_takes_the_reference_path() -> None:
    rows = torch.randn(5, 4)
    assert not token_rows.fused_rows_available(rows) or token_rows._INTERPRET
    index = torch.tensor([[0, 4], [2, 2]])
    torch.testing.assert_close(token_rows.gather_sum_rows(rows, index), rows[index].sum(1))
