"""Row gathers summed over a small second dimension, the building block of moving token copies
between token order and expert order (models.moe, distributed.expert_parallel): every output row
has known sources, so backwards are gathers too, never autograd's scatter-add (a sort or atomics
per call, and a summation order that changes from run to run)."""

from __future__ import annotations

import torch

__all__ = ["accumulation_dtype", "gather_sum"]


def gather_sum(rows_ND: torch.Tensor, index_TK: torch.Tensor, weights_TK: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum over k of weights[t, k] * rows[index_TK[t, k]] (weights default to 1),
    accumulated in float32 in the order k = 0, 1, ...

    Written as K gathers of [T, D] added one after the other, not as one [T, K, D] gather
    summed over K: compiled, the K terms become one element-wise kernel with K independent row
    loads per output, where inductor's reduction over the dimension of size K ran at about a
    fifth of the memory bandwidth."""
    dtype = accumulation_dtype(rows_ND)
    out_TD = None
    for k in range(index_TK.shape[1]):
        term_TD = rows_ND[index_TK[:, k]].to(dtype)
        if weights_TK is not None:
            term_TD = term_TD * weights_TK[:, k, None].to(dtype)
        out_TD = term_TD if out_TD is None else out_TD + term_TD
    if out_TD is None:
        return rows_ND.new_zeros(index_TK.shape[0], *rows_ND.shape[1:])
    return out_TD.to(rows_ND.dtype)


def accumulation_dtype(x: torch.Tensor) -> torch.dtype:
    """float32 for half precisions, else x's own (float64 stays float64)."""
    return torch.promote_types(x.dtype, torch.float32)
