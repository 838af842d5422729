"""Multi-head latent attention (MLA, DeepSeek-V2/V3 and the families built on it): queries and
keys/values through low-rank latents.

- queries: x -> wq_a (dim -> q_lora_rank) -> RMSNorm `q_norm` -> wq_b -> per head a "nope" part
  (qk_nope_head_dim, no position) and a "rope" part (qk_rope_head_dim, rotated);
- keys and values: x -> wkv_a (dim -> kv_lora_rank + qk_rope_head_dim): the latent, RMSNorm'd by
  `kv_norm` and expanded by wkv_b into each head's key "nope" part and value (v_head_dim), plus
  one rotated key part shared by all heads;
- attention over [nope | rope] keys (scale (nope + rope)^-0.5), output projection wo.

RoPE is DeepSeek's interleaved form: dims are rotated in pairs (x0, x1), (x2, x3), ..., and the
result is laid out de-interleaved (all first members, then all second members), as transformers
computes it; queries and keys alike, so their products are those of the interleaved rotation.

The latent norms use eps 1e-6 whatever the model's rms_norm_eps (transformers' modules).
"""

from __future__ import annotations

import torch
from torch import nn

from primerl_trainer.models.common.attention import AttentionMask, attention
from primerl_trainer.models.common.norms import RMSNorm

LATENT_NORM_EPS = 1e-6


def apply_interleaved_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, T, H, D] rotated in interleaved pairs by cos/sin [B, T, D] (the rotate-half table:
    both halves alike, the first holds each pair's angle); the output is de-interleaved."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].unsqueeze(2), sin[..., :half].unsqueeze(2)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.cat((even * cos - odd * sin, odd * cos + even * sin), dim=-1)


class MultiHeadLatentAttention(nn.Module):
    """MLA without a KV cache (training). `project` gives the heads and the query latent (which
    DeepSeek's sparse-attention indexer reads); `forward` attends with the given mask."""

    def __init__(
        self,
        *,
        dim: int,
        num_heads: int,
        q_lora_rank: int,
        kv_lora_rank: int,
        qk_nope_head_dim: int,
        qk_rope_head_dim: int,
        v_head_dim: int,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.qk_nope_head_dim, self.qk_rope_head_dim, self.v_head_dim = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.wq_a = nn.Linear(dim, q_lora_rank, bias=False)
        self.q_norm = RMSNorm(q_lora_rank, eps=LATENT_NORM_EPS)
        self.wq_b = nn.Linear(q_lora_rank, num_heads * (qk_nope_head_dim + qk_rope_head_dim), bias=False)
        self.wkv_a = nn.Linear(dim, kv_lora_rank + qk_rope_head_dim, bias=False)
        self.kv_norm = RMSNorm(kv_lora_rank, eps=LATENT_NORM_EPS)
        self.wkv_b = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.wo = nn.Linear(num_heads * v_head_dim, dim, bias=False)

    def project(
        self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, dim] -> q, k [B, T, H, nope + rope], v [B, T, H, v_head_dim] and the normed
        query latent [B, T, q_lora_rank]."""
        batch_size, seq_len, _ = x.shape
        q_latent = self.q_norm(self.wq_a(x))
        q = self.wq_b(q_latent).view(batch_size, seq_len, self.num_heads, -1)
        q_nope, q_rope = q.split([self.qk_nope_head_dim, self.qk_rope_head_dim], dim=-1)
        kv_latent, k_rope = self.wkv_a(x).split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv = self.wkv_b(self.kv_norm(kv_latent)).view(batch_size, seq_len, self.num_heads, -1)
        k_nope, v = kv.split([self.qk_nope_head_dim, self.v_head_dim], dim=-1)
        q_rope = apply_interleaved_rope(q_rope, *rope)
        k_rope = apply_interleaved_rope(k_rope.unsqueeze(2), *rope).expand(-1, -1, self.num_heads, -1)
        return torch.cat((q_nope, q_rope), dim=-1), torch.cat((k_nope, k_rope), dim=-1), v, q_latent

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask) -> torch.Tensor:
        q, k, v, _ = self.project(x, rope)
        return self.wo(attention(q, k, v, mask).flatten(2))
