"""chunked_causal_attention (distributed/cp_attention.py): query chunks over the keys up to each
chunk's end, as two plain attentions merged by their log-sum-exps, equals masked softmax
attention in its output and its q, k and v gradients (float64 to 1e-10, float32 to 1e-5), on
the CPU flash kernels; the custom ops pass torch.library.opcheck and trace under torch.compile."""

from __future__ import annotations

import math

import pytest
import torch

from primerl_trainer.distributed.cp_attention import chunked_causal_attention

# (query starts, chunk length, query heads, key/value heads, keys)
CASES = [
    ([0, 24], 8, 4, 2, 32),  # cp=2 rank 0: chunks 0 and 3
    ([8, 16], 8, 4, 4, 32),  # cp=2 rank 1: chunks 1 and 2
    ([0], 16, 2, 1, 16),  # one chunk from 0: causal only
    ([5, 37, 19], 6, 6, 2, 48),  # uneven starts, out of order, keys past every chunk's end
    ([1], 3, 8, 1, 4),  # one key before the chunk
]


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, starts: list[int]) -> torch.Tensor:
    """Softmax attention with an explicit mask: query at row index p sees keys 0..p."""
    chunk_len = q.shape[2] // len(starts)
    groups = q.shape[1] // k.shape[1]
    keys, values = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    positions = torch.cat([torch.arange(start, start + chunk_len) for start in starts])
    scores = q @ keys.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(positions[:, None] < torch.arange(k.shape[2]), float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


def _inputs(starts: list[int], chunk_len: int, heads: int, kv_heads: int, num_keys: int, dtype: torch.dtype):
    """q as the model hands it (a [B, T, H, D] tensor transposed), k and v halves of one tensor."""
    generator = torch.Generator().manual_seed(len(starts) * 100 + num_keys)
    q = torch.randn(2, chunk_len * len(starts), heads, 8, generator=generator, dtype=dtype).transpose(1, 2)
    kv = torch.randn(2, num_keys, kv_heads, 16, generator=generator, dtype=dtype)
    k, v = (half.transpose(1, 2) for half in kv.chunk(2, dim=-1))
    return [x.detach().requires_grad_() for x in (q, k, v)]


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize(("starts", "chunk_len", "heads", "kv_heads", "num_keys"), CASES)
def test_chunks_attend_to_every_key_up_to_their_own_with_exact_gradients(
    starts: list[int], chunk_len: int, heads: int, kv_heads: int, num_keys: int, dtype: torch.dtype, tolerance: float
) -> None:
    q, k, v = _inputs(starts, chunk_len, heads, kv_heads, num_keys, dtype)
    out = chunked_causal_attention(q, k, v, starts)
    expected = _reference(q, k, v, starts)
    torch.testing.assert_close(out, expected, rtol=0, atol=tolerance)
    grad = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    expected_grads = torch.autograd.grad(expected, (q, k, v), grad)
    for name, got, want in zip("qkv", grads, expected_grads, strict=True):
        assert got.shape == want.shape, name
        torch.testing.assert_close(got, want, rtol=0, atol=tolerance, msg=lambda m, name=name: f"d{name}: {m}")
    # Keys after the last chunk's end are seen by no query.
    last_end = max(starts) + chunk_len
    assert not grads[1][:, :, last_end:].any() and not grads[2][:, :, last_end:].any()


def test_the_custom_ops_pass_opcheck() -> None:
    q, k, v = _inputs([4, 12], 4, 4, 2, 16, torch.float64)
    torch.library.opcheck(torch.ops.primerl.chunked_causal_attention.default, (q, k, v, [4, 12]))


def test_a_compiled_caller_gets_the_same_values_and_gradients() -> None:
    # cp=2 rank 0's chunks, from the shapes (symbolic when compiled with dynamic shapes).
    q, k, v = _inputs([0, 24], 8, 4, 2, 32, torch.float64)

    def block(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        chunk_len = q.shape[2] // 2
        return chunked_causal_attention(q * 2, k, v, [0, 3 * chunk_len]).sum(dim=1)

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True, dynamic=True)
    out, expected = compiled(q, k, v), block(q, k, v)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    grad = torch.randn_like(out)
    for got, want in zip(
        torch.autograd.grad(out, (q, k, v), grad), torch.autograd.grad(expected, (q, k, v), grad), strict=True
    ):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)


def test_chunks_that_do_not_fit_the_keys_are_refused() -> None:
    q, k, v = _inputs([0, 8], 8, 2, 2, 16, torch.float64)
    with pytest.raises(ValueError, match="query_starts"):
        chunked_causal_attention(q, k, v, [0, 9])
    with pytest.raises(ValueError, match="query_starts"):
        chunked_causal_attention(q, k, v, [0, 4, 8])
