"""GLM-4.5 / INTELLECT-3 (transformers' `glm4_moe`): a pre-norm decoder whose first
`first_k_dense_replace` layers have a dense SwiGLU block and the rest a mixture of experts with
grouped sigmoid routing (moe.GroupedSigmoidRouting: correction bias for the choice only,
`n_group`/`topk_group`, `norm_topk_prob`, `routed_scaling_factor`) plus `n_shared_experts`
shared experts (one SwiGLU of n times the expert width) added to the routed output.

Attention: grouped-query, optional bias on q/k/v (`attention_bias`), optional RMSNorm of each
head's queries and keys (`use_qk_norm`), RoPE on the first `partial_rotary_factor` of each head's
dims only (the rest pass through).

Layers run, take replayed experts (R3) and report routing as in Qwen3MoeModel, whose forward
this model reuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.models.common.attention import AttentionMask, attention
from primerl_trainer.models.common.feed_forward import FeedForward
from primerl_trainer.models.common.norms import RMSNorm
from primerl_trainer.models.common.rope import apply_rope
from primerl_trainer.models.moe import GroupedSigmoidRouting, MoE
from primerl_trainer.models.qwen3.model import common_args_from_hf_config
from primerl_trainer.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs

# transformers' default when a config does not name it (Glm4MoeConfig keeps it for old files).
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5


@dataclass(frozen=True, kw_only=True)
class Glm4MoeModelArgs(Qwen3MoeModelArgs):
    num_shared_experts: int
    routing: GroupedSigmoidRouting
    attention_bias: bool
    qk_norm: bool
    rotary_dim: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        check_supported_glm4_moe_config(config)
        common = common_args_from_hf_config(config)
        rope = config.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
        rotary_dim = int(common["head_dim"] * factor)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {factor} of head_dim {common['head_dim']} must give a positive even "
                f"number of rotated dims, got {rotary_dim}"
            )
        num_layers = config["num_hidden_layers"]
        first_dense = config.get("first_k_dense_replace", 1)
        if not 0 <= first_dense < num_layers:
            raise ValueError(f"first_k_dense_replace ({first_dense}) leaves no mixture-of-experts layer")
        return cls(
            **common,
            num_experts=config["n_routed_experts"],
            top_k=config["num_experts_per_tok"],
            moe_hidden_dim=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", True),
            moe_layers=tuple(range(first_dense, num_layers)),
            num_shared_experts=config.get("n_shared_experts", 1),
            routing=GroupedSigmoidRouting(
                num_groups=config.get("n_group", 1),
                top_k_groups=config.get("topk_group", 1),
                scaling_factor=config.get("routed_scaling_factor", 1.0),
            ),
            attention_bias=bool(config.get("attention_bias", False)),
            qk_norm=bool(config.get("use_qk_norm", False)),
            rotary_dim=rotary_dim,
        )


def check_supported_glm4_moe_config(config: dict[str, Any]) -> None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        f"rope type {rope_type!r}": rope_type != "default",
        f"hidden_act {config.get('hidden_act')!r}": config.get("hidden_act", "silu") != "silu",
        "n_routed_experts <= 0": config.get("n_routed_experts", 0) <= 0,
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own GLM-4.5 implementation lacks: {names}; use impl='hf'")


class Glm4MoeAttention(nn.Module):
    def __init__(self, args: Glm4MoeModelArgs) -> None:
        super().__init__()
        if args.num_heads % args.num_kv_heads:
            raise ValueError(f"num_heads ({args.num_heads}) must be a multiple of num_kv_heads ({args.num_kv_heads})")
        self.head_dim = args.head_dim
        bias = args.attention_bias
        self.wq = nn.Linear(args.dim, args.num_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.num_heads * args.head_dim, args.dim, bias=False)
        self.q_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, eps=args.norm_eps) if args.qk_norm else None

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask) -> torch.Tensor:
        batch_size, seq_len, _ = x.shape
        # q, k and v in one product, as Qwen3's attention does (three parameters, one matmul).
        projections = (self.wq, self.wk, self.wv)
        bias = torch.cat([p.bias for p in projections]) if self.wq.bias is not None else None
        qkv = F.linear(x, torch.cat([p.weight for p in projections]), bias)
        q, k, v = qkv.split([p.out_features for p in projections], dim=-1)
        q = q.view(batch_size, seq_len, -1, self.head_dim)
        k = k.view(batch_size, seq_len, -1, self.head_dim)
        v = v.view(batch_size, seq_len, -1, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_partial_rope(q, *rope), apply_partial_rope(k, *rope)
        return self.wo(attention(q, k, v, mask).reshape(batch_size, seq_len, -1))


def apply_partial_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on the first cos.shape[-1] dims of each head of x [B, T, H, D]; the rest unchanged."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return apply_rope(x, cos, sin)
    return torch.cat((apply_rope(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)


class Glm4MoeBlock(nn.Module):
    """Attention, then a dense feed-forward (`feed_forward`) or the routed experts (`moe`) plus
    the shared experts (`shared_experts`)."""

    def __init__(self, args: Glm4MoeModelArgs, *, moe: bool) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = Glm4MoeAttention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.is_moe = moe
        if moe:
            self.moe = MoE(
                dim=args.dim,
                hidden_dim=args.moe_hidden_dim,
                num_experts=args.num_experts,
                top_k=args.top_k,
                norm_topk_prob=args.norm_topk_prob,
                experts_impl=args.experts_impl,
                grouped_sigmoid=args.routing,
            )
            self.shared_experts = FeedForward(dim=args.dim, hidden_dim=args.moe_hidden_dim * args.num_shared_experts)
        else:
            self.feed_forward = FeedForward(dim=args.dim, hidden_dim=args.hidden_dim)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
        replayed_experts_TK: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Dense: hidden states. MoE: (hidden states, expert ids [T, K], tokens per expert [E])."""
        x = x + self.attention(self.attention_norm(x), rope, mask)
        h = self.ffn_norm(x)
        if not self.is_moe:
            return x + self.feed_forward(h)
        routed, expert_ids_TK, tokens_per_expert_E = self.moe(h, replayed_experts_TK)
        return x + (routed + self.shared_experts(h)), expert_ids_TK, tokens_per_expert_E


class Glm4MoeModel(Qwen3MoeModel):
    args: Glm4MoeModelArgs

    def build_block(self, layer_id: int) -> nn.Module:
        return Glm4MoeBlock(self.args, moe=layer_id in self.args.moe_layers)

    @property
    def rotary_dim(self) -> int:
        return self.args.rotary_dim
