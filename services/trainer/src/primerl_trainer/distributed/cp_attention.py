"""Causal attention of a cp rank's query chunks over the keys of the whole row, through the
kernels plain causal attention takes (cuDNN's on Hopper).

A chunk of queries at row indices [s, e) attends to keys [0, e): causal, aligned lower right.
cuDNN's causal mask is aligned top left, so the chunk is computed as two plain attentions: its
queries over keys [0, s) with no mask (every one of those keys is earlier) and over keys [s, e),
causal (a square, where both alignments agree). With each part's output o_i and the log-sum-exp
l_i of its scaled scores:

    l = logaddexp(l_1, l_2),    o = exp(l_1 - l) o_1 + exp(l_2 - l) o_2.

The backward runs each part's kernel backward with the merged o and l. A fused attention backward
recomputes the probabilities as exp(score - l) and takes rowsum(do * o) from each probability's
gradient; both are of the whole softmax row, so with the merged o and l each part yields exactly
its terms of dq (summed over the parts) and of dk, dv (at its own keys).

Kernels: cuDNN's on CUDA (bfloat16, float16), the CPU flash kernel on the CPU (any float dtype).
Both take keys and values with fewer heads than the queries as they are. Both directions are
custom ops, so compiled blocks call them as they are.
"""

from collections.abc import Sequence

import torch

__all__ = ["chunked_causal_attention", "supports_chunked_causal_attention"]

_HALF_DTYPES = (torch.bfloat16, torch.float16)


def supports_chunked_causal_attention(q: torch.Tensor, chunk_len: int) -> bool:
    """Whether `chunked_causal_attention` has kernels for queries like `q` [B, H, t, D] in chunks
    of `chunk_len`. cuDNN takes no single key (every part has at least chunk_len keys) and head
    dims up to 128 in multiples of 8 (the limits torch's SDPA dispatch checks)."""
    if q.device.type == "cpu":
        return q.dtype.is_floating_point and chunk_len >= 1
    return q.is_cuda and q.dtype in _HALF_DTYPES and q.shape[-1] % 8 == 0 and q.shape[-1] <= 128 and chunk_len >= 2


def chunked_causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_starts: Sequence[int]
) -> torch.Tensor:
    """q [B, H, n*c, D]: n chunks of c queries, chunk i at row indices [query_starts[i],
    query_starts[i] + c); k and v [B, Hkv, N, D]: the row's keys and values (H a multiple of Hkv,
    N at least every chunk's end) -> [B, H, n*c, D]: each query attends to the keys at row
    indices up to its own, scaled by 1/sqrt(D). Differentiable in q, k and v."""
    starts = list(query_starts)  # ints, or symbolic ones under torch.compile: not specialized
    if not starts or q.shape[2] % len(starts):
        raise ValueError(f"query_starts: {q.shape[2]} queries do not make {len(starts)} equal chunks")
    chunk_len = q.shape[2] // len(starts)
    if min(starts) < 0 or max(starts) + chunk_len > k.shape[2]:
        raise ValueError(f"query_starts: chunks of {chunk_len} queries at {starts} outside {k.shape[2]} keys")
    if q.shape[1] % k.shape[1] or k.shape != v.shape:
        raise ValueError(f"keys {tuple(k.shape)} and values {tuple(v.shape)} do not fit queries {tuple(q.shape)}")
    return _attention(q, k, v, starts)[0]


def _lse_dtype(q: torch.Tensor) -> torch.dtype:
    return torch.float32 if q.dtype in _HALF_DTYPES else q.dtype


def _chunks(q: torch.Tensor, query_starts: list[int]):
    """(rows of q, first key, end key) of each chunk."""
    chunk_len = q.shape[2] // len(query_starts)
    for i, start in enumerate(query_starts):
        yield slice(i * chunk_len, (i + 1) * chunk_len), start, start + chunk_len


def _unit_last_stride(x: torch.Tensor) -> torch.Tensor:
    # cuDNN reads any layout whose head dim is contiguous (the model's always is).
    return x if x.stride(-1) == 1 else x.contiguous()


def _forward_kernel(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse [B, H, t]) of one plain attention (causal: aligned top left)."""
    if q.is_cuda:
        q, k, v = (_unit_last_stride(x) for x in (q, k, v))
        result = torch.ops.aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, causal, False)
    else:
        result = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal)
    # cuDNN's lse is [B, H, t, 1].
    return result[0], result[1].reshape(q.shape[:3])


def _backward_kernel(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv) of one plain attention given the output and lse [B, H, t] of the whole rows."""
    if q.is_cuda:
        grad, q, k, v, out = (_unit_last_stride(x) for x in (grad, q, k, v, out))
        # The dropout seed and offset are not read without dropout; no bias, not nested.
        unused = torch.zeros((), dtype=torch.int64, device=q.device)
        return torch.ops.aten._scaled_dot_product_cudnn_attention_backward(
            grad, q, k, v, out, lse.unsqueeze(-1), unused, unused, None, None, None, q.shape[2], k.shape[2], 0.0, causal
        )
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(grad, q, k, v, out, lse, 0.0, causal)


@torch.library.custom_op("primerl::chunked_causal_attention", mutates_args=())
def _attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_starts: list[int]
) -> tuple[torch.Tensor, torch.Tensor]:
    out = torch.empty_like(q)
    lse = q.new_empty(q.shape[:3], dtype=_lse_dtype(q))
    for rows, start, end in _chunks(q, query_starts):
        queries = q[:, :, rows]
        chunk_out, chunk_lse = _forward_kernel(queries, k[:, :, start:end], v[:, :, start:end], True)
        if start > 0:
            past_out, past_lse = _forward_kernel(queries, k[:, :, :start], v[:, :, :start], False)
            # exp(l_1 - l) with l = logaddexp(l_1, l_2), and o_2 + w (o_1 - o_2) = w o_1 + (1 - w) o_2.
            weight = torch.sigmoid(chunk_lse - past_lse).unsqueeze(-1)
            chunk_out = torch.lerp(past_out.to(weight.dtype), chunk_out.to(weight.dtype), weight)
            chunk_lse = torch.logaddexp(chunk_lse, past_lse)
        out[:, :, rows] = chunk_out
        lse[:, :, rows] = chunk_lse
    return out, lse


@_attention.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, query_starts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))


@torch.library.custom_op("primerl::chunked_causal_attention_backward", mutates_args=())
def _attention_backward(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    query_starts: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    accumulate = _lse_dtype(q)
    dq = torch.empty_like(q)
    # Every chunk's parts add to the keys they read: summed at float32 or finer, rounded once.
    dk = torch.zeros(k.shape, dtype=accumulate, device=k.device)
    dv = torch.zeros(v.shape, dtype=accumulate, device=v.device)
    for rows, start, end in _chunks(q, query_starts):
        queries, chunk_grad, chunk_out = q[:, :, rows], grad[:, :, rows], out[:, :, rows]
        chunk_lse = lse[:, :, rows].contiguous()
        chunk_dq, chunk_dk, chunk_dv = _backward_kernel(
            chunk_grad, queries, k[:, :, start:end], v[:, :, start:end], chunk_out, chunk_lse, True
        )
        dk[:, :, start:end] += chunk_dk
        dv[:, :, start:end] += chunk_dv
        if start > 0:
            past_dq, past_dk, past_dv = _backward_kernel(
                chunk_grad, queries, k[:, :, :start], v[:, :, :start], chunk_out, chunk_lse, False
            )
            chunk_dq = chunk_dq.to(accumulate) + past_dq
            dk[:, :, :start] += past_dk
            dv[:, :, :start] += past_dv
        dq[:, :, rows] = chunk_dq
    return dq, torch.empty_like(k).copy_(dk), torch.empty_like(v).copy_(dv)


@_attention_backward.register_fake
def _(
    grad: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    query_starts: list[int],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, ctx.query_starts = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)


def _backward(ctx, grad_out: torch.Tensor, grad_lse: torch.Tensor | None):
    # The lse is the backward's input only; chunked_causal_attention does not return it.
    q, k, v, out, lse = ctx.saved_tensors
    dq, dk, dv = _attention_backward(grad_out, q, k, v, out, lse, ctx.query_starts)
    return dq, dk, dv, None


_attention.register_autograd(_backward, setup_context=_setup_context)
