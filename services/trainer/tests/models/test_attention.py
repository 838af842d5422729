"""common.attention's "sdpa" over packed rows, one group of documents at a time: the same outputs
and gradients as the dense document-causal mask, with sliding windows, sinks and GQA, over
batches of rows and over a row's layout; and when it is (not) taken."""

from __future__ import annotations

import pytest
import torch

from primerl_trainer.distributed.context_parallel import RowLayout
from primerl_trainer.models.common.attention import (
    AttentionMask,
    _document_groups,
    attention,
    build_attention_mask,
    document_ids,
)

CPU = torch.device("cpu")
HEAD_DIM = 8
# Two rows of 41 tokens: samples of different lengths (some equal, one of a single token), and
# one sample alone.
ROWS = ([5, 9, 1, 9, 12, 3, 2], [41])


def positions(*rows: list[int]) -> torch.Tensor:
    return torch.stack([torch.cat([torch.arange(n) for n in lengths]) for lengths in rows])


def dense_mask(position_ids: torch.Tensor, window: int | None) -> AttentionMask:
    """The reference: the explicit [B, 1, T, T] document-causal (windowed) mask."""
    docs = document_ids(position_ids)
    rows = torch.arange(position_ids.shape[1])
    allowed = (rows[:, None] >= rows) & (docs[:, :, None] == docs[:, None, :])
    if window is not None:
        allowed &= rows[:, None] - rows < window
    return AttentionMask("sdpa", dense=allowed[:, None])


def outputs_and_grads(mask: AttentionMask, inputs: list[torch.Tensor], window: int | None, with_sinks: bool):
    q, k, v, sinks = (x.detach().requires_grad_() for x in inputs)
    out = attention(q, k, v, mask, sliding_window=window, sinks=sinks if with_sinks else None)
    # A loss that weighs every output element differently.
    (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
    grads = [q.grad, k.grad, v.grad] + ([sinks.grad] if with_sinks else [])
    return out, grads


def random_inputs(batch_size: int, seq_len: int, num_heads: int, num_kv_heads: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(batch_size, seq_len, num_heads, HEAD_DIM, generator=generator)
    k, v = (torch.randn(batch_size, seq_len, num_kv_heads, HEAD_DIM, generator=generator) for _ in range(2))
    return [q, k, v, torch.randn(num_heads, generator=generator)]


@pytest.mark.parametrize("window", [None, 1, 4, 10])
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(2, 2), (4, 2)])
@pytest.mark.parametrize("layout", [False, True])
def test_per_document_attention_matches_the_dense_mask(
    window: int | None, with_sinks: bool, num_heads: int, num_kv_heads: int, layout: bool
) -> None:
    position_ids = positions(ROWS[0]) if layout else positions(*ROWS)
    batch_size, seq_len = position_ids.shape
    mask = build_attention_mask(
        None if layout else position_ids,
        backend="sdpa",
        batch_size=batch_size,
        seq_len=seq_len,
        device=CPU,
        layout=RowLayout.of(position_ids[0], cp_rank=0, cp_size=1) if layout else None,
        sliding_windows=() if window is None else (window,),
    )
    assert mask.with_window(window).documents is not None and mask.with_window(window).dense is None
    inputs = random_inputs(batch_size, seq_len, num_heads, num_kv_heads)

    out, grads = outputs_and_grads(mask, inputs, window, with_sinks)
    expected_out, expected_grads = outputs_and_grads(dense_mask(position_ids, window), inputs, None, with_sinks)

    torch.testing.assert_close(out, expected_out, atol=1e-5, rtol=0)
    for grad, expected in zip(grads, expected_grads, strict=True):
        torch.testing.assert_close(grad, expected, atol=1e-5, rtol=0)


def test_rows_of_one_sample_stay_causal_rows() -> None:
    position_ids = positions([16], [16])
    mask = build_attention_mask(position_ids, backend="sdpa", batch_size=2, seq_len=16, device=CPU)
    assert mask.documents is None and mask.dense is None
    layout = RowLayout.of(position_ids[0], cp_rank=0, cp_size=1)
    mask = build_attention_mask(None, backend="sdpa", batch_size=1, seq_len=16, device=CPU, layout=layout)
    assert mask.documents is None and mask.dense is None


def test_off_the_cpu_packed_rows_keep_the_dense_mask() -> None:
    # One mask shape for compiled blocks (and "flex" is the GPU path for packed rows).
    meta = torch.device("meta")
    mask = build_attention_mask(positions(*ROWS).to(meta), backend="sdpa", batch_size=2, seq_len=41, device=meta)
    assert mask.documents is None and mask.dense is not None and mask.dense.shape == (2, 1, 41, 41)


def test_document_groups_pad_similar_lengths_together_and_keep_long_ones_apart() -> None:
    groups = _document_groups([56, 1000, 50, 56, 40, 1000])
    assert groups == [(1000, [1, 5]), (56, [0, 2, 3, 4])]
    # Every document in exactly one group, no longer than the group's padded length.
    lengths = [7, 300, 2, 2, 64, 65, 1, 900, 40]
    groups = _document_groups(lengths)
    assert sorted(doc for _, docs in groups for doc in docs) == list(range(len(lengths)))
    assert all(lengths[doc] <= padded_len for padded_len, docs in groups for doc in docs)
