"""DeepSeek sparse attention (DSA, DeepSeek-V3.2 and GLM-5): an "indexer" scores every earlier
key of a query's sample and the attention keeps the `index_topk` best only.

Indexer (`LightningIndexer`): from the attention's normed query latent, `num_heads` small
queries (wq_b -> [H, head_dim]); from the hidden states one key (wk, then LayerNorm `k_norm`);
the first `rope_dim` dims of both rotated (interleaved, as MLA's); per head relu(q . k) *
head_dim^-0.5, summed over heads with per-token weights weights_proj(x) * H^-0.5, all in float32.
Keys outside the query's sample or in its future score -inf; the top-k by score are selected (all
of the visible ones when fewer). The selection has no gradient (transformers computes it under
no_grad; DeepSeek trains the indexer by a separate objective that RL does not use). Queries are
scored in chunks (`_SCORES_PER_CHUNK`), so that the per-head scores never hold [B, T, H, T] at
once; the indexer runs eagerly under torch.compile.

A selection (`TokenSelection`) is kept as the boolean mask [B, T, T] of the keys each query
attends to (visible and selected), and reported as the selected keys' positions within the
sample [B, T, K] (ascending, -1 after the last), the form inference records: replaying it
(`TokenSelection.replayed`) rebuilds the same mask, so the trainer attends to the keys the
sampler attended to, as router replay does for experts.

Backends: "sdpa" takes the mask as a dense boolean mask (O(T^2), the CPU reference); "flex"
builds a BlockMask whose mask_mod reads it. Selected keys are scattered over the whole sample,
so few blocks are skipped beyond causality: the gain over sdpa on GPUs is the fused kernel, not
sparsity. The [B, T, T] masks (one per full indexer layer, plus the visibility mask) cost T^2
bytes each: 256 MiB per layer at 16k tokens. (A kernel that gathers the selected keys, as
DeepSeek's FlashMLA sparse kernels do, is what would make the attention itself sparse.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import create_block_mask

from primerl_trainer.models.common.attention import AttentionBackend, AttentionMask, document_ids
from primerl_trainer.models.common.mla import apply_interleaved_rope


@dataclass(frozen=True)
class VisibleKeys:
    """Per forward: which keys each query may see at all (earlier or itself, same sample)."""

    backend: AttentionBackend
    # [B, T, T] bool.
    allowed: torch.Tensor
    # [B, T] position of each token within its sample.
    position_ids: torch.Tensor

    @classmethod
    def of(cls, position_ids: torch.Tensor, *, backend: AttentionBackend) -> VisibleKeys:
        docs = document_ids(position_ids)
        rows = torch.arange(position_ids.shape[1], device=position_ids.device)
        allowed = (rows[:, None] >= rows) & (docs[:, :, None] == docs[:, None, :])
        return cls(backend, allowed, position_ids)


@dataclass(frozen=True)
class TokenSelection:
    # [B, T, T] bool: the keys each query attends to.
    attended: torch.Tensor
    # [B, T, K] int64: their positions within the sample, ascending, -1 after the last.
    positions: torch.Tensor

    @classmethod
    def replayed(cls, positions: torch.Tensor, visible: VisibleKeys) -> TokenSelection:
        """From recorded positions [B, T, K] within each query's sample (-1: none): the key at
        position p is pos(query) - p rows before the query. Positions outside the query's sample
        or past the query select nothing (and are reported as -1)."""
        query_positions = visible.position_ids[..., None]
        rows = torch.arange(positions.shape[1], device=positions.device)[None, :, None] - (query_positions - positions)
        rows = rows.clamp(0, positions.shape[1] - 1)
        valid = (positions >= 0) & (positions <= query_positions) & visible.allowed.gather(-1, rows)
        # Invalid entries scatter nothing (counted as 0).
        counts = torch.zeros(visible.allowed.shape, dtype=torch.int32, device=positions.device)
        chosen = counts.scatter_add_(-1, rows, valid.to(torch.int32)) > 0
        return cls(chosen, _ascending(positions, valid))

    def attention_mask(self) -> AttentionMask:
        """The mask of `common.attention.attention` for the "sdpa" backend."""
        return AttentionMask("sdpa", dense=self.attended.unsqueeze(1))

    # Built eagerly (outside a compiled block): its mask_mod reads a [B, T, T] tensor.
    @torch.compiler.disable
    def flex_attention_mask(self) -> AttentionMask:
        attended = self.attended
        batch_size, seq_len, _ = attended.shape

        def selected(b: torch.Tensor, h: torch.Tensor, q_idx: torch.Tensor, kv_idx: torch.Tensor) -> torch.Tensor:
            return attended[b, q_idx, kv_idx]

        block = create_block_mask(selected, batch_size, None, seq_len, seq_len, attended.device)
        return AttentionMask("flex", block=block)


def _ascending(positions: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The valid positions of each row [.., K] ascending, then -1."""
    big = torch.iinfo(torch.int64).max
    ordered = torch.where(valid, positions, big).sort(dim=-1).values
    return ordered.masked_fill(ordered == big, -1)


# Per-head index scores held at once (float32): 1 GiB.
_SCORES_PER_CHUNK = 2**28


class LightningIndexer(nn.Module):
    def __init__(self, *, dim: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int, top_k: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim, self.rope_dim, self.top_k = num_heads, head_dim, rope_dim, top_k
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(dim, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(dim, num_heads, bias=False)

    @torch.no_grad()
    def scores(self, q: torch.Tensor, k: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """Index scores [B, t, T] float32 of queries q [B, t, H, D] (weights [B, t, H]) over keys k [B, T, D]."""
        # [B, t, H, D] @ [B, 1, D, T] -> [B, t, H, T], summed over H by the weights.
        per_head = F.relu(q @ k.transpose(-1, -2).unsqueeze(1)) * self.head_dim**-0.5
        return (weights.unsqueeze(-2) @ per_head).squeeze(-2)

    # Eager under compile: a loop over query chunks whose count follows the row's length; no
    # gradient flows through it.
    @torch.compiler.disable
    @torch.no_grad()
    def forward(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        visible: VisibleKeys,
    ) -> TokenSelection:
        batch_size, seq_len, _ = x.shape
        q = self.wq_b(q_latent).view(batch_size, seq_len, self.num_heads, self.head_dim)
        k = self.k_norm(self.wk(x)).unsqueeze(2)
        q = torch.cat((apply_interleaved_rope(q[..., : self.rope_dim], *rope), q[..., self.rope_dim :]), dim=-1)
        k = torch.cat((apply_interleaved_rope(k[..., : self.rope_dim], *rope), k[..., self.rope_dim :]), dim=-1)
        q, k = q.float(), k.squeeze(2).float()
        weights = F.linear(x.float(), self.weights_proj.weight.float()) * self.num_heads**-0.5
        top_k = min(self.top_k, seq_len)
        chosen = torch.zeros_like(visible.allowed)
        positions = torch.empty(batch_size, seq_len, top_k, dtype=torch.int64, device=x.device)
        # Queries in chunks: the per-head scores of a chunk are [B, chunk, H, T] float32.
        chunk = max(1, _SCORES_PER_CHUNK // (batch_size * self.num_heads * seq_len))
        for start in range(0, seq_len, chunk):
            rows = slice(start, start + chunk)
            allowed = visible.allowed[:, rows]
            scores = self.scores(q[:, rows], k, weights[:, rows]).masked_fill(~allowed, float("-inf"))
            keys = scores.topk(top_k, dim=-1).indices
            valid = allowed.gather(-1, keys)
            chosen[:, rows].scatter_(-1, keys, valid)
            key_positions = visible.position_ids[:, None, :].expand(-1, keys.shape[1], -1).gather(-1, keys)
            positions[:, rows] = _ascending(key_positions, valid)
        return TokenSelection(chosen, positions)
