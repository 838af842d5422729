"""Causal self-attention over batched or packed sequences, behind one backend switch.

Packed rows hold several samples whose position ids restart; a token may attend only to
earlier tokens of its own sample. A sample boundary is wherever a position id is not its
predecessor + 1 (the rule transformers uses too). The mask is built once per forward from
the position ids and handed to every layer.

Backends:
- "sdpa": F.scaled_dot_product_attention. Without position ids every row is one causal
  sequence (`is_causal`, flash kernels on GPU). With position ids a boolean block-diagonal
  causal mask [B, 1, T, T] keeps samples apart: right on every device, but O(T^2) memory
  and no flash kernel, so meant for CPU and tests.
- "flex": flex_attention with a document BlockMask, which skips the blocks outside a sample.
  The GPU path for packed training; compiled there (eager flex is a slow reference).
"""

from dataclasses import dataclass
from typing import Literal, get_args

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

AttentionBackend = Literal["sdpa", "flex"]
ATTENTION_BACKENDS: tuple[str, ...] = get_args(AttentionBackend)

_compiled_flex_attention = None


@dataclass(frozen=True)
class AttentionMask:
    """Per-forward mask for one backend: `dense` for "sdpa" (None: plain causal rows),
    `block` for "flex"."""

    backend: AttentionBackend
    dense: torch.Tensor | None = None
    block: BlockMask | None = None


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[B, T] index of the sample each token belongs to, counted from 0 in each row."""
    starts = torch.ones_like(position_ids, dtype=torch.bool)
    starts[:, 1:] = position_ids[:, 1:] != position_ids[:, :-1] + 1
    return starts.cumsum(dim=1) - 1


def build_attention_mask(
    position_ids: torch.Tensor | None, *, backend: AttentionBackend, batch_size: int, seq_len: int, device: torch.device
) -> AttentionMask:
    """The mask for `backend`; `position_ids=None` means one sample per row."""
    if backend not in ATTENTION_BACKENDS:
        raise ValueError(f"attn_backend must be one of {ATTENTION_BACKENDS}, got {backend!r}")
    if backend == "sdpa":
        if position_ids is None:
            return AttentionMask(backend)
        docs = document_ids(position_ids)
        causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
        return AttentionMask(backend, dense=((docs[:, :, None] == docs[:, None, :]) & causal).unsqueeze(1))

    if position_ids is None:
        docs = torch.zeros(batch_size, seq_len, dtype=torch.long, device=device)
    else:
        docs = document_ids(position_ids)

    def document_causal(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
        return (q_idx >= kv_idx) & (docs[b, q_idx] == docs[b, kv_idx])

    return AttentionMask(backend, block=create_block_mask(document_causal, batch_size, None, seq_len, seq_len, device))


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
    """q [B, T, Hq, D], k and v [B, T, Hkv, D] (Hq a multiple of Hkv) -> [B, T, Hq, D],
    scaled by 1/sqrt(D)."""
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    if mask.backend == "sdpa":
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask.dense, is_causal=mask.dense is None, enable_gqa=True
        )
    else:
        out = _flex_attention(q.device)(q, k, v, block_mask=mask.block, enable_gqa=True)
    return out.transpose(1, 2)


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
