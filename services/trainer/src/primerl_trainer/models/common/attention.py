"""Causal self-attention over batched or packed sequences, behind one backend switch.

Packed rows hold several samples whose position ids restart; a token may attend only to
earlier tokens of its own sample. A sample boundary is wherever a position id is not its
predecessor + 1 (the rule transformers uses too). The mask is built once per forward from
the position ids and handed to every layer.

Backends:
- "sdpa": F.scaled_dot_product_attention, meant for CPUs and tests. Without position ids
  every row is one causal sequence (`is_causal`, flash kernels). On the CPU packed rows are
  attended one sample (document) at a time, O(sum of squared sample lengths): the samples of
  the whole batch in groups of similar lengths, each group one causal call over its samples
  padded at the end to one length (`DocumentBatches`; padding at the end is invisible to a
  sample's own queries under a causal mask); their bounds are read to the host once per
  forward, when the mask is built (rows of one sample each are causal rows). Elsewhere a
  boolean block-diagonal causal mask [B, 1, T, T] keeps samples apart: right on every device,
  one shape for compiled blocks, but O(T^2) memory and no flash kernel.
- "flex": flex_attention with a document BlockMask, which skips the blocks outside a sample.
  The GPU path for packed training; compiled there (eager flex is a slow reference).

A row given with its `RowLayout` (distributed/context_parallel.py; the trainer always gives
one) may be one rank's share of a longer row under context parallel: the queries are this
rank's tokens, the keys and values those of the whole row, gathered over the cp group in
every layer, and the mask is the same rule by row index: query i (row index q_pos[i]) sees
key j when j <= q_pos[i] and both lie in one sample. With a layout, "sdpa" on a row that is one
sample needs no mask at all (causal per contiguous chunk of queries, lower right: on GPUs
cuDNN's kernels, as plain causal attention, through distributed/cp_attention.py), a packed
row on one rank goes per document on the CPU as above, and otherwise takes a dense mask
[1, 1, t, T]; "flex" builds its BlockMask from per-block bounds, never an O(T^2) mask.

Two variants for families that need them (GPT-OSS, and any with sliding-window layers):
- Sliding window: a layer with window w lets query i see key j only when also i - j < w (w keys
  counting itself, transformers' rule). The mask is built with the windows the model's layers
  use (`sliding_windows`), and each layer names its own (`attention(..., sliding_window=w)`).
  Row index distance is position distance within a sample, so packed rows and context parallel
  keep the rule. "sdpa" then carries a dense mask (no is_causal / cuDNN chunk path); per document,
  one [P, P] mask for a group whose padded length P is longer than the window.
- Attention sinks: a learned logit per head that joins the softmax's denominator and adds no
  value (`attention(..., sinks=s)`). "flex" takes the log-sum-exp with the output and rescales
  by sigmoid(lse - s) (its backward takes the lse's gradient: exact and fused on GPUs); "sdpa"
  runs an explicit masked softmax with the sink column (O(T^2), or per group of documents on the
  CPU; the correct path for CPUs and tests).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, create_block_mask, flex_attention

from primerl_trainer.config_types import ATTENTION_BACKENDS, AttentionBackend
from primerl_trainer.distributed.cp_attention import chunked_causal_attention, supports_chunked_causal_attention
from primerl_trainer.distributed.cp_collectives import gather_sequence

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout

_compiled_flex_attention = None
# flex_attention's tile (queries and keys per block).
_FLEX_BLOCK = 128
# How documents are grouped for "sdpa" (`_document_groups`), in query-key pairs: the overhead of
# one group (its gathers and attention call) and of one query row. Chosen by timing the forward
# and backward of 2,048-token rows of samples of 20-60, 30-120 and 5-300 tokens on a 2-core CPU
# (4 heads of 64, and 16 of 128), against groups of equal lengths only (2-3x slower there) and
# one group padded to the longest (up to 2x slower).
_GROUP_COST = 16384
_QUERY_COST = 64


@dataclass(frozen=True)
class DocumentBatches:
    """The documents (samples) of a packed batch as "sdpa" attends them: in groups, each one
    causal attention call over its documents padded at the end to one length P, by repeating
    their last token (a document's queries never see a later key, so the padding changes none
    of their outputs; the pad queries' outputs are dropped, and so no gradient flows from them).

    `token_index`: per group [n, P] int64, the flat index (row * T + t) of each document's tokens.
    `output_index`: [B * T] int64, where each token's output lies in the groups' outputs
    [n * P, ...] concatenated in order. `allowed`: per group, [P, P] bool (a sliding window
    shorter than P), or None for plain causal."""

    token_index: tuple[torch.Tensor, ...]
    output_index: torch.Tensor
    allowed: tuple[torch.Tensor | None, ...]

    def with_window(self, window: int | None) -> DocumentBatches:
        """The same groups, masked with a sliding window of `window` keys (None: none)."""
        allowed = []
        for index in self.token_index:
            padded_len = index.shape[1]
            in_window = window is None or window >= padded_len
            allowed.append(None if in_window else _causal_mask(padded_len, window, device=index.device))
        return replace(self, allowed=tuple(allowed))


@dataclass(frozen=True)
class AttentionMask:
    """Per-forward mask for one backend: for "sdpa" `documents` (packed rows on the CPU, one cp
    rank) or `dense` (other packed rows, sliding windows), neither for causal rows; `block` for
    "flex".

    Context parallel: keys and values are gathered over the process group named
    `cp_group_name` (`cp_size` ranks, this one `cp_rank`) into row order. "sdpa" with none of
    `documents`, `dense` and a group: causal over each row; with a group and no `dense`: the local queries
    are two equal chunks, rank r's chunks r and 2cp-1-r of the row, each causal (lower right)
    over the keys up to its end.

    `windowed`: the same rows' masks with each sliding window the model's layers use."""

    backend: AttentionBackend
    dense: torch.Tensor | None = None
    block: BlockMask | None = None
    cp_group_name: str | None = None
    cp_size: int = 1
    cp_rank: int = 0
    windowed: Mapping[int, AttentionMask] = field(default_factory=dict)
    documents: DocumentBatches | None = None

    def with_window(self, sliding_window: int | None) -> AttentionMask:
        """This mask, or its variant with `sliding_window` (None: the full causal one)."""
        if sliding_window is None:
            return self
        if sliding_window not in self.windowed:
            raise ValueError(
                f"sliding_window {sliding_window} was not among the mask's sliding_windows {sorted(self.windowed)}"
            )
        return self.windowed[sliding_window]


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] index of the sample each token belongs to, counted from 0 in each row."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(dim=1) - 1


def build_attention_mask(
    position_ids: torch.Tensor | None,
    *,
    backend: AttentionBackend,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    layout: RowLayout | None = None,
    cp_group: dist.ProcessGroup | None = None,
    sliding_windows: Collection[int] = (),
) -> AttentionMask:
    """The mask for `backend`; `position_ids=None` means one sample per row. With `layout`
    (one row, batch_size 1) the mask is the layout's: see `_row_layout_mask`. `sliding_windows`:
    the windows (in keys, >= 1) some layers use; their masks come in `windowed`."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attn_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    for window in sliding_windows:
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"sliding_window must be a positive number of keys, got {window!r}")

    # "sdpa" on the CPU attends packed rows per document, except a row split over cp ranks.
    documents = None
    if backend == "sdpa" and torch.device(device).type == "cpu":
        if layout is not None and layout.cp_size == 1:
            documents = _document_batches(layout.document_ids[None], device=device)
        elif layout is None and position_ids is not None:
            documents = _document_batches(document_ids(position_ids), device=device)
            if documents is None:
                position_ids = None  # every row is one sample: causal rows

    def build(window: int | None) -> AttentionMask:
        if documents is not None:
            return AttentionMask(backend, documents=documents.with_window(window))
        if layout is not None:
            return _row_layout_mask(layout, backend=backend, cp_group=cp_group, device=device, window=window)
        return _batch_mask(
            position_ids, backend=backend, batch_size=batch_size, seq_len=seq_len, device=device, window=window
        )

    windowed = {window: build(window) for window in sorted(set(sliding_windows))}
    return replace(build(None), windowed=windowed)


def _in_window(q_idx: torch.Tensor, kv_idx: torch.Tensor, window: int | None) -> torch.Tensor | bool:
    return True if window is None else q_idx - kv_idx < window


def _causal_mask(seq_len: int, window: int | None, *, device: torch.device) -> torch.Tensor:
    """[seq_len, seq_len] bool: query i sees key j <= i (and i - j < window)."""
    rows = torch.arange(seq_len, device=device)
    return (rows[:, None] >= rows) & _in_window(rows[:, None], rows, window)


def _document_batches(docs: torch.Tensor, *, device: torch.device) -> DocumentBatches | None:
    """The groups of the documents of rows with document ids `docs` [B, T] (non-decreasing along
    each row), on `device`; None when every row is one document."""
    num_rows, row_len = docs.shape
    # The bounds as Python ints, once per forward for every layer (off the CPU, a host sync).
    docs = docs.cpu()
    starts = torch.ones_like(docs, dtype=torch.bool)
    starts[:, 1:] = docs[:, 1:] != docs[:, :-1]
    starts = starts.flatten().nonzero().flatten()
    if starts.numel() == num_rows:
        return None
    lengths = torch.diff(starts, append=starts.new_full((1,), num_rows * row_len))
    token_index, output_index, offset = [], torch.empty(num_rows * row_len, dtype=torch.long), 0
    for padded_len, members in _document_groups(lengths.tolist()):
        group_starts, group_lengths = starts[members], lengths[members]
        steps = torch.arange(padded_len)
        index = group_starts[:, None] + torch.minimum(steps, group_lengths[:, None] - 1)
        real = steps < group_lengths[:, None]
        output_index[index[real]] = offset + torch.arange(index.numel()).view(index.shape)[real]
        token_index.append(index.to(device))
        offset += index.numel()
    return DocumentBatches(tuple(token_index), output_index.to(device), (None,) * len(token_index))


def _document_groups(lengths: list[int]) -> list[tuple[int, list[int]]]:
    """Documents of these lengths in groups of similar lengths: (padded length, document
    indices) per group, the cheapest split by the cost model of `_GROUP_COST` and `_QUERY_COST`
    (n documents padded to P cost n * P * (P + _QUERY_COST), plus _GROUP_COST a group): a group
    is a run of the distinct lengths in order, found exactly by dynamic programming."""
    distinct = sorted(set(lengths), reverse=True)
    counts = [0] * len(distinct)
    rank = {length: i for i, length in enumerate(distinct)}
    for length in lengths:
        counts[rank[length]] += 1
    # best[j]: the cheapest cost of the first j distinct lengths; cut[j]: where its last group starts.
    best, cut = [0.0] + [float("inf")] * len(distinct), [0] * (len(distinct) + 1)
    for end in range(1, len(distinct) + 1):
        num_docs = 0
        for start in range(end - 1, -1, -1):
            num_docs += counts[start]
            padded = distinct[start]
            cost = best[start] + _GROUP_COST + num_docs * padded * (padded + _QUERY_COST)
            if cost < best[end]:
                best[end], cut[end] = cost, start
    runs, end = [], len(distinct)
    while end > 0:
        runs.insert(0, (cut[end], end))
        end = cut[end]
    group_of_rank = [group for group, (start, end) in enumerate(runs) for _ in range(start, end)]
    members: list[list[int]] = [[] for _ in runs]
    for doc, length in enumerate(lengths):
        members[group_of_rank[rank[length]]].append(doc)
    return [(distinct[start], docs) for (start, _), docs in zip(runs, members, strict=True)]


def _batch_mask(
    position_ids: torch.Tensor | None,
    *,
    backend: AttentionBackend,
    batch_size: int,
    seq_len: int,
    device: torch.device,
    window: int | None,
) -> AttentionMask:
    if backend == "sdpa":
        if position_ids is None and window is None:
            return AttentionMask(backend)
        allowed = _causal_mask(seq_len, window, device=device)
        if position_ids is None:
            return AttentionMask(backend, dense=allowed[None, None])
        docs = document_ids(position_ids)
        return AttentionMask(backend, dense=((docs[:, :, None] == docs[:, None, :]) & allowed).unsqueeze(1))

    if position_ids is None:
        docs = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    else:
        docs = document_ids(position_ids)

    def document_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx]) & _in_window(q_idx, kv_idx, window)

    return AttentionMask(backend, block=create_block_mask(document_causal, batch_size, None, seq_len, seq_len, device))


def _row_layout_mask(
    layout: RowLayout,
    *,
    backend: AttentionBackend,
    cp_group: dist.ProcessGroup | None,
    device: torch.device,
    window: int | None = None,
) -> AttentionMask:
    """The mask of this rank's queries (the layout's tokens) over the keys of the whole row."""
    if layout.cp_size > 1:
        if cp_group is None or dist.get_world_size(cp_group) != layout.cp_size:
            raise ValueError(f"a row split over {layout.cp_size} ranks needs a cp group of that size")
        cp = {"cp_group_name": cp_group.group_name, "cp_size": layout.cp_size, "cp_rank": layout.cp_rank}
    else:
        cp = {}
    if backend == "sdpa" and layout.single_document and window is None:
        return AttentionMask(backend, **cp)
    q_positions = layout.global_positions.to(device)
    docs = layout.document_ids.to(device)
    if backend == "sdpa":
        keys = torch.arange(layout.padded_len, device=device)
        dense = (
            (q_positions[:, None] >= keys)
            & (docs[q_positions][:, None] == docs)
            & _in_window(q_positions[:, None], keys, window)
        )
        return AttentionMask(backend, dense=dense[None, None], **cp)

    def document_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        q_pos = q_positions[q_idx]
        return (q_pos >= kv_idx) & (docs[q_pos] == docs[kv_idx]) & _in_window(q_pos, kv_idx, window)

    return AttentionMask(backend, block=_document_block_mask(document_causal, q_positions, docs, window=window), **cp)


def _document_block_mask(
    mask_mod, q_positions: torch.Tensor, docs: torch.Tensor, *, window: int | None = None
) -> BlockMask:
    """The BlockMask of the causal same-document rule for queries at row indices `q_positions`
    over keys 0..len(docs)-1, from each tile's bounds (document ids never decrease along the
    row): a tile is empty when no query comes at or after its first key or their documents do
    not overlap (or, with a window, every query lies `window` or more past its last key), full
    when every query comes after every key and all are of one document (and within the window
    of every key), partial (mask_mod applied per element) otherwise."""
    num_queries, num_keys = q_positions.numel(), docs.numel()
    q_docs = docs[q_positions]

    def tile_bounds(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Padded by repeating the last value (F.pad's fill is a float: int64's max would wrap).
        tail = values[-1:].expand(-values.numel() % _FLEX_BLOCK)
        tiles = torch.cat((values, tail)).view(-1, _FLEX_BLOCK)
        return tiles.amin(1), tiles.amax(1)

    q_pos_low, q_pos_high = tile_bounds(q_positions)
    q_doc_low, q_doc_high = tile_bounds(q_docs)
    key_starts = torch.arange(0, num_keys, _FLEX_BLOCK, device=docs.device)
    key_ends = (key_starts + _FLEX_BLOCK).clamp(max=num_keys) - 1
    k_doc_low, k_doc_high = docs[key_starts], docs[key_ends]
    visible = (
        (q_pos_high[:, None] >= key_starts) & (q_doc_high[:, None] >= k_doc_low) & (q_doc_low[:, None] <= k_doc_high)
    )
    full = (
        (q_pos_low[:, None] >= key_ends)
        & (q_doc_low == q_doc_high)[:, None]
        & (k_doc_low == k_doc_high)
        & (q_doc_low[:, None] == k_doc_low)
    )
    if window is not None:
        visible &= q_pos_low[:, None] - key_ends < window
        full &= q_pos_high[:, None] - key_starts < window
    partial = visible & ~full

    def ordered(blocks: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Per query tile: how many key tiles, and their indices first (the rest are ignored).
        indices = torch.argsort(blocks.to(torch.int8), dim=1, descending=True, stable=True)
        return blocks.sum(1).to(torch.int32)[None, None], indices.to(torch.int32)[None, None]

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=_FLEX_BLOCK,
        mask_mod=mask_mod,
        seq_lengths=(num_queries, num_keys),
    )


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: AttentionMask,
    *,
    sliding_window: int | None = None,
    sinks: torch.Tensor | None = None,
) -> torch.Tensor:
    """q [B, T, Hq, D], k and v [B, T, Hkv, D] (Hq a multiple of Hkv) -> [B, T, Hq, D],
    scaled by 1/sqrt(D). Under context parallel (B = 1) the keys and values of every cp rank
    are gathered first: one collective of both per layer. `sliding_window`: this layer's window
    (the mask must have been built with it); `sinks` [Hq]: per-head sink logits."""
    mask = mask.with_window(sliding_window)
    if sinks is not None and tuple(sinks.shape) != (q.shape[2],):
        raise ValueError(f"sinks must hold one logit per query head ({q.shape[2]}), got shape {list(sinks.shape)}")
    if mask.documents is not None:
        return _document_attention(q, k, v, mask.documents, sinks)
    if mask.cp_group_name is not None:
        kv = gather_sequence(torch.cat((k, v), dim=-1)[0], mask.cp_group_name, mask.cp_size)[None]
        k, v = kv.chunk(2, dim=-1)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask.backend == "flex":
        if sinks is None:
            out = _flex_attention(q.device)(q, k, v, block_mask=mask.block, enable_gqa=True)
        else:
            out, aux = _flex_attention(q.device)(
                q, k, v, block_mask=mask.block, enable_gqa=True, return_aux=AuxRequest(lse=True)
            )
            # softmax over [scores, sink] = softmax over scores * e^lse / (e^lse + e^sink).
            dtype = torch.promote_types(q.dtype, torch.float32)
            scale = torch.sigmoid(aux.lse.to(dtype) - sinks.to(dtype)[None, :, None])
            out = (out.to(dtype) * scale[..., None]).to(q.dtype)
    elif mask.dense is not None or mask.cp_size == 1:
        out = _masked_attention(q, k, v, mask.dense, sinks)
    elif sinks is not None:
        out = _attention_with_sinks(q, k, v, _causal_chunks_mask(mask, q.shape[2], k.shape[2], q.device), sinks)
    else:
        out = _causal_chunks_attention(q, k, v, cp_size=mask.cp_size, cp_rank=mask.cp_rank)
    return out.transpose(1, 2)


def _document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, documents: DocumentBatches, sinks: torch.Tensor | None
) -> torch.Tensor:
    """`attention` of q [B, T, Hq, D], k and v [B, T, Hkv, D] one group of documents at a time."""
    batch_size, seq_len = q.shape[:2]
    q, k, v = q.flatten(0, 1), k.flatten(0, 1), v.flatten(0, 1)
    outs = []
    for index, allowed in zip(documents.token_index, documents.allowed, strict=True):
        group_q, group_k, group_v = (x.index_select(0, index.flatten()).unflatten(0, index.shape) for x in (q, k, v))
        out = _masked_attention(
            group_q.transpose(1, 2), group_k.transpose(1, 2), group_v.transpose(1, 2), allowed, sinks
        )
        outs.append(out.transpose(1, 2).flatten(0, 1))
    return torch.cat(outs).index_select(0, documents.output_index).unflatten(0, (batch_size, seq_len))


def _masked_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor | None, sinks: torch.Tensor | None
) -> torch.Tensor:
    """q [B, Hq, T, D], k and v [B, Hkv, S, D], allowed [.., T, S] bool or None for causal (upper
    left, as `is_causal`), sinks [Hq] or None."""
    if sinks is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed, is_causal=allowed is None, enable_gqa=True)
    if allowed is None:
        allowed = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device).tril()
    return _attention_with_sinks(q, k, v, allowed, sinks)


def _causal_chunks_mask(mask: AttentionMask, num_queries: int, num_keys: int, device: torch.device) -> torch.Tensor:
    """The boolean mask [num_queries, num_keys] of this rank's chunks r and 2cp-1-r of a
    one-sample row under context parallel, each causal up to its own end."""
    chunk_len = num_queries // 2
    rows = torch.arange(num_queries, device=device)
    chunk_starts = torch.where(
        rows < chunk_len, mask.cp_rank * chunk_len, (2 * mask.cp_size - 2 - mask.cp_rank) * chunk_len
    )
    return (rows + chunk_starts)[:, None] >= torch.arange(num_keys, device=device)


def _attention_with_sinks(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, allowed: torch.Tensor, sinks: torch.Tensor
) -> torch.Tensor:
    """q [B, Hq, T, D], k and v [B, Hkv, S, D], allowed [.., T, S] bool, sinks [Hq]: softmax
    (at least float32) over the allowed scores and the head's sink, which then drops out."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    scores = scores.masked_fill(~allowed, float("-inf"))
    sink_column = sinks.to(scores.dtype)[None, :, None, None].expand(*scores.shape[:-1], 1)
    dtype = torch.promote_types(scores.dtype, torch.float32)
    probs = torch.cat((scores, sink_column), dim=-1).softmax(dim=-1, dtype=dtype)[..., :-1]
    return probs.to(v.dtype) @ v


def _causal_chunks_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, cp_size: int, cp_rank: int
) -> torch.Tensor:
    """q [B, H, t, D] this rank's chunks r and 2cp-1-r of a one-sample row, k and v the whole
    row: each chunk attends causally to the keys up to its own end (lower right)."""
    chunk_len = q.shape[2] // 2
    starts = (cp_rank * chunk_len, (2 * cp_size - 1 - cp_rank) * chunk_len)
    if supports_chunked_causal_attention(q, chunk_len):
        # cuDNN's kernels on GPUs (those of plain causal attention), the flash kernel on the CPU.
        return chunked_causal_attention(q, k, v, starts)
    outs = []
    for query_chunk, start in zip(q.split(chunk_len, dim=2), starts, strict=True):
        num_keys = start + chunk_len
        keys, values = k[:, :, :num_keys], v[:, :, :num_keys]
        if start == 0:
            out = F.scaled_dot_product_attention(query_chunk, keys, values, is_causal=True, enable_gqa=True)
        elif query_chunk.is_cuda and query_chunk.dtype in (torch.bfloat16, torch.float16) and q.shape[-1] % 8 == 0:
            # Where cuDNN's kernels are not taken (one-token chunks, head dims over 128): the flash
            # kernel, whose causal mask is lower right when there are more keys than queries.
            # (torch.nn.attention.bias's causal_lower_right does the same, but torch.compile
            # cannot trace it.)
            out = torch.ops.aten._scaled_dot_product_flash_attention(query_chunk, keys, values, 0.0, True)[0]
        else:
            # No fused kernel (CUDA float32): an explicit mask of this chunk's queries.
            mask = torch.ones(chunk_len, num_keys, dtype=torch.bool, device=q.device).tril(start)
            out = F.scaled_dot_product_attention(query_chunk, keys, values, attn_mask=mask, enable_gqa=True)
        outs.append(out)
    return torch.cat(outs, dim=2)


def _flex_attention(device: torch.device):
    # Inside a compiled block flex_attention is compiled with the block. Eager callers get
    # a compiled copy, made once per process and only off the CPU: the CPU build needs a
    # C++ toolchain and minutes of compiling for what tests run once.
    global _compiled_flex_attention
    if device.type == "cpu" or torch.compiler.is_compiling():
        return flex_attention
    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex_attention
