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
from torch import nn

from primerl_trainer.models.common.feed_forward import FeedForward
from primerl_trainer.models.moe import GroupedSigmoidRouting
from primerl_trainer.models.qwen3.model import Attention, TransformerBlock, common_args_from_hf_config
from primerl_trainer.models.qwen3_moe.model import MoETransformerBlock, Qwen3MoeModel, Qwen3MoeModelArgs

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


class Glm4MoeAttention(Attention):
    """Qwen3's, with optional q/k/v bias and q/k norm (partial rotary: Attention.rotate by the
    model's table of rotary_dim)."""

    def __init__(self, args: Glm4MoeModelArgs) -> None:
        super().__init__(args, bias=args.attention_bias)

    def build_qk_norms(self, args: Glm4MoeModelArgs) -> tuple[nn.Module | None, nn.Module | None]:
        return super().build_qk_norms(args) if args.qk_norm else (None, None)

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return super().qk_heads(q, k) if self.q_norm is not None else (self.heads(q), self.heads(k))


class Glm4MoeDenseBlock(TransformerBlock):
    """The first `first_k_dense_replace` layers: GLM's attention, a dense feed-forward."""

    def build_attention(self, args: Glm4MoeModelArgs) -> nn.Module:
        return Glm4MoeAttention(args)


class Glm4MoeBlock(MoETransformerBlock):
    """GLM's attention, then the routed experts (`moe`) plus the shared experts (`shared_experts`)."""

    def build_attention(self, args: Glm4MoeModelArgs) -> nn.Module:
        return Glm4MoeAttention(args)

    def routing(self, args: Glm4MoeModelArgs) -> GroupedSigmoidRouting:
        return args.routing

    def build_shared_experts(self, args: Glm4MoeModelArgs) -> nn.Module:
        return FeedForward(dim=args.dim, hidden_dim=args.moe_hidden_dim * args.num_shared_experts)


class Glm4MoeModel(Qwen3MoeModel):
    args: Glm4MoeModelArgs
    moe_block_cls = Glm4MoeBlock
    dense_block_cls = Glm4MoeDenseBlock

    @property
    def rotary_dim(self) -> int:
        return self.args.rotary_dim
