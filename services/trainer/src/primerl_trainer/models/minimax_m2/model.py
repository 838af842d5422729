"""MiniMax-M2 (transformers' `minimax_m2`): a pre-norm decoder whose every layer has a mixture of
experts (no dense layers, no shared experts). Routing is sigmoid scoring with the correction
bias for the choice only and one group of experts (moe.GroupedSigmoidRouting with its defaults);
the k weights are always renormalised, never scaled.

Attention: grouped-query, no bias, RMSNorm of the queries and of the keys over all heads of a
token together (one weight of num_heads * head_dim, resp. num_kv_heads * head_dim, not one per
head dim as Qwen3's), then RoPE on the first `rotary_dim` dims of each head only.

Layers run, take replayed experts (R3) and report routing as in Qwen3MoeModel, whose forward
this model reuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Self

import torch
from torch import nn

from primerl_trainer.models.common.norms import RMSNorm
from primerl_trainer.models.moe import GroupedSigmoidRouting
from primerl_trainer.models.qwen3.model import Attention, common_args_from_hf_config
from primerl_trainer.models.qwen3_moe.model import MoETransformerBlock, Qwen3MoeModel, Qwen3MoeModelArgs


@dataclass(frozen=True, kw_only=True)
class MiniMaxM2ModelArgs(Qwen3MoeModelArgs):
    routing: GroupedSigmoidRouting
    rotary_dim: int

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        check_supported_minimax_m2_config(config)
        common = common_args_from_hf_config(config)
        rotary_dim = _rotary_dim(config, common["head_dim"])
        if not 0 < rotary_dim <= common["head_dim"] or rotary_dim % 2:
            raise ValueError(
                f"rotary_dim ({rotary_dim}) must be a positive even number of dims, at most head_dim "
                f"({common['head_dim']})"
            )
        return cls(
            **common,
            # Hub files name the experts num_local_experts; transformers also accepts num_experts.
            num_experts=config.get("num_local_experts", config.get("num_experts")),
            top_k=config["num_experts_per_tok"],
            # The experts' width is intermediate_size (there is no dense feed-forward).
            moe_hidden_dim=config["intermediate_size"],
            norm_topk_prob=True,
            moe_layers=tuple(range(config["num_hidden_layers"])),
            routing=GroupedSigmoidRouting(),
            rotary_dim=rotary_dim,
        )


def _rotary_dim(config: dict[str, Any], head_dim: int) -> int:
    """The hub's files give `rotary_dim`; transformers 5 writes `partial_rotary_factor` into
    rope_parameters and, as it does, a factor given wins over `rotary_dim`. Neither: the whole head."""
    rope = config.get("rope_parameters") or {}
    factor = rope.get("partial_rotary_factor", config.get("partial_rotary_factor"))
    if factor is not None:
        return int(head_dim * factor)
    return int(config.get("rotary_dim") or head_dim)


def check_supported_minimax_m2_config(config: dict[str, Any]) -> None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    num_experts = config.get("num_local_experts", config.get("num_experts", 0))
    # Fields of the hub's config.json that transformers ignores: refused unless they describe
    # the model transformers runs.
    attn_types = config.get("attn_type_list") or []
    # The hub's MiniMax-M2 is stored in block FP8 (weight_scale_inv beside each weight); the own
    # model loads unquantized weights only.
    quantization = (config.get("quantization_config") or {}).get("quant_method")
    unsupported = {
        f"rope type {rope_type!r}": rope_type != "default",
        f"hidden_act {config.get('hidden_act')!r}": config.get("hidden_act", "silu") != "silu",
        f"num_local_experts {num_experts}": not num_experts or num_experts <= 0,
        f"router_jitter_noise {config.get('router_jitter_noise')}": bool(config.get("router_jitter_noise")),
        f"scoring_func {config.get('scoring_func')!r}": config.get("scoring_func", "sigmoid") != "sigmoid",
        f"use_qk_norm {config.get('use_qk_norm')!r}": config.get("use_qk_norm", True) is not True,
        f"qk_norm_type {config.get('qk_norm_type')!r}": config.get("qk_norm_type", "per_layer") != "per_layer",
        f"shared_intermediate_size {config.get('shared_intermediate_size')}": bool(
            config.get("shared_intermediate_size")
        ),
        "attn_type_list with linear attention (0)": any(kind != 1 for kind in attn_types),
        f"quantization_config (quant_method {quantization!r})": bool(config.get("quantization_config")),
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own MiniMax-M2 implementation lacks: {names}; use impl='hf'")


class MiniMaxM2Attention(Attention):
    """Qwen3's, with q/k norms over all of a token's heads and partial rotary."""

    def build_qk_norms(self, args: MiniMaxM2ModelArgs) -> tuple[nn.Module | None, nn.Module | None]:
        return (
            RMSNorm(args.num_heads * args.head_dim, eps=args.norm_eps),
            RMSNorm(args.num_kv_heads * args.head_dim, eps=args.norm_eps),
        )

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Normalised before the split into heads: one RMS over all of a token's heads.
        return self.heads(self.q_norm(q)), self.heads(self.k_norm(k))


class MiniMaxM2Block(MoETransformerBlock):
    def build_attention(self, args: MiniMaxM2ModelArgs) -> nn.Module:
        return MiniMaxM2Attention(args)

    def routing(self, args: MiniMaxM2ModelArgs) -> GroupedSigmoidRouting:
        return args.routing


class MiniMaxM2Model(Qwen3MoeModel):
    args: MiniMaxM2ModelArgs
    moe_block_cls = MiniMaxM2Block

    @property
    def rotary_dim(self) -> int:
        return self.args.rotary_dim
