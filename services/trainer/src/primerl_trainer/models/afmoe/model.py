"""Trinity / AFMoE (transformers' `afmoe`): a decoder whose first `num_dense_layers` layers have a
dense SwiGLU block and the rest a mixture of experts, with
- sandwich norms: each sub-block's output is RMS-normed again before the residual add
  (post_attention_norm, post_ffn_norm beside the usual attention_norm and ffn_norm);
- RMSNorm weights applied to the float32 normalised values before the cast back (the other
  families cast first, then scale: two roundings in bf16 where AFMoE has one);
- attention layers of two kinds (`layer_types`): "sliding_attention" layers attend to the last
  `sliding_window` tokens and rotate q/k with RoPE, "full_attention" layers attend causally to
  everything and use no positions at all (NoPE); every layer has per-head q/k RMSNorm,
  q/k/v/o bias with `attention_bias`, and an output gate: the heads times
  sigmoid(wg(x)), one gate per head dim, before the output projection;
- routing by sigmoid scores with the router's expert bias for the choice only (one group),
  always renormalised, times `route_scale` (moe.GroupedSigmoidRouting), plus
  `num_shared_experts` shared experts (one SwiGLU of n times the expert width);
- with `mup_enabled`, the embeddings times sqrt(hidden_size).

Layers run, take replayed experts (R3) and report routing as in Qwen3MoeModel, whose forward
this model reuses.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from primerl_trainer.models.common.attention import AttentionMask
from primerl_trainer.models.common.feed_forward import FeedForward
from primerl_trainer.models.common.norms import RMSNorm
from primerl_trainer.models.moe import GroupedSigmoidRouting
from primerl_trainer.models.qwen3.model import Attention, TransformerBlock, common_args_from_hf_config
from primerl_trainer.models.qwen3_moe.model import MoETransformerBlock, Qwen3MoeModel, Qwen3MoeModelArgs

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)


@dataclass(frozen=True, kw_only=True)
class AfmoeModelArgs(Qwen3MoeModelArgs):
    num_shared_experts: int
    routing: GroupedSigmoidRouting
    attention_bias: bool
    layer_types: tuple[str, ...]
    sliding_window: int | None
    mup: bool

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        check_supported_afmoe_config(config)
        common = common_args_from_hf_config(config)
        num_layers = config["num_hidden_layers"]
        num_dense = config.get("num_dense_layers", 1)
        if num_dense is None or not 0 <= num_dense < num_layers:
            raise ValueError(f"num_dense_layers ({num_dense}) must lie in [0, num_hidden_layers = {num_layers})")
        layer_types = tuple(config.get("layer_types") or _default_layer_types(config))
        if len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must name {num_layers} layers, each one of {LAYER_TYPES}, got {list(layer_types)}"
            )
        window = config.get("sliding_window", 1024)
        if SLIDING in layer_types and (window is None or window < 1):
            raise ValueError(f"sliding_window ({window}) must be a positive number of tokens")
        num_shared = config.get("num_shared_experts", 2)
        if num_shared is None or num_shared < 0:
            raise ValueError(f"num_shared_experts ({num_shared}) must be 0 or more")
        return cls(
            **common,
            num_experts=config["num_experts"],
            top_k=config["num_experts_per_tok"],
            moe_hidden_dim=config["moe_intermediate_size"],
            norm_topk_prob=True,
            moe_layers=tuple(range(num_dense, num_layers)),
            num_shared_experts=num_shared,
            routing=GroupedSigmoidRouting(scaling_factor=config.get("route_scale", 1.0)),
            attention_bias=bool(config.get("attention_bias", False)),
            layer_types=layer_types,
            sliding_window=window if SLIDING in layer_types else None,
            mup=bool(config.get("mup_enabled", False)),
        )


def _default_layer_types(config: dict[str, Any]) -> list[str]:
    """transformers' rule when a config names no layer_types: every n-th layer full, the rest sliding."""
    every = config.get("global_attn_every_n_layers", 4)
    if not every or every < 1:
        raise ValueError(f"global_attn_every_n_layers ({every}) must be positive")
    return [SLIDING if (i + 1) % every else FULL for i in range(config["num_hidden_layers"])]


def check_supported_afmoe_config(config: dict[str, Any]) -> None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    # The hub's config.json names routing fields transformers does not read (it always routes by
    # sigmoid, renormalised, in one group): refused unless they describe that routing.
    num_groups, top_k_groups = config.get("n_group") or 1, config.get("topk_group") or 1
    unsupported = {
        f"rope type {rope_type!r}": rope_type != "default",
        f"hidden_act {config.get('hidden_act')!r}": config.get("hidden_act", "silu") != "silu",
        f"num_experts {config.get('num_experts')}": not config.get("num_experts") or config["num_experts"] <= 0,
        f"score_func {config.get('score_func')!r}": config.get("score_func", "sigmoid") != "sigmoid",
        f"route_norm {config.get('route_norm')!r}": config.get("route_norm", True) is not True,
        f"n_group {num_groups} with topk_group {top_k_groups}": top_k_groups < num_groups,
        f"attention_dropout {config.get('attention_dropout')}": bool(config.get("attention_dropout")),
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own AFMoE implementation lacks: {names}; use impl='hf'")


class AfmoeRMSNorm(RMSNorm):
    """RMSNorm scaled in float32, then cast once (transformers' AfmoeRMSNorm)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


class AfmoeAttention(Attention):
    """Qwen3's (per-head q/k norms), with q/k/v/o bias, RoPE on sliding layers only and a sigmoid
    output gate per head dim."""

    def __init__(self, args: AfmoeModelArgs, layer_type: str) -> None:
        super().__init__(args, bias=args.attention_bias, out_bias=args.attention_bias)
        self.layer_type = layer_type
        self.sliding_window = args.sliding_window if layer_type == SLIDING else None
        self.wg = nn.Linear(args.dim, args.num_heads * args.head_dim, bias=False)

    def build_qk_norms(self, args: AfmoeModelArgs) -> tuple[nn.Module, nn.Module]:
        return AfmoeRMSNorm(args.head_dim, eps=args.norm_eps), AfmoeRMSNorm(args.head_dim, eps=args.norm_eps)

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return super().rotate(x, cos, sin) if self.layer_type == SLIDING else x

    def gate_heads(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        return out * torch.sigmoid(self.heads(self.wg(x)))


class SandwichNorms:
    """Mixin of AFMoE's blocks: the norms of each sub-block's output (post_attention_norm,
    post_ffn_norm), AFMoE's norm everywhere, and the attention of the block's kind of layer."""

    layer_type: str

    def add_sandwich_norms(self, args: AfmoeModelArgs) -> None:
        self.attention_norm = AfmoeRMSNorm(args.dim, eps=args.norm_eps)
        self.post_attention_norm = AfmoeRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = AfmoeRMSNorm(args.dim, eps=args.norm_eps)
        self.post_ffn_norm = AfmoeRMSNorm(args.dim, eps=args.norm_eps)

    def build_attention(self, args: AfmoeModelArgs) -> nn.Module:
        return AfmoeAttention(args, self.layer_type)

    def attend(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask) -> torch.Tensor:
        return x + self.post_attention_norm(self.attention(self.attention_norm(x), rope, mask))


class AfmoeDenseBlock(SandwichNorms, TransformerBlock):
    """The first `num_dense_layers` layers: a dense feed-forward of intermediate_size."""

    def __init__(self, args: AfmoeModelArgs, layer_type: str) -> None:
        self.layer_type = layer_type
        super().__init__(args)
        self.add_sandwich_norms(args)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask) -> torch.Tensor:
        x = self.attend(x, rope, mask)
        return x + self.post_ffn_norm(self.feed_forward(self.ffn_norm(x)))


class AfmoeMoEBlock(SandwichNorms, MoETransformerBlock):
    """The routed experts (`moe`) plus the shared experts (`shared_experts`)."""

    def __init__(self, args: AfmoeModelArgs, layer_type: str) -> None:
        self.layer_type = layer_type
        super().__init__(args)
        self.add_sandwich_norms(args)

    def routing(self, args: AfmoeModelArgs) -> GroupedSigmoidRouting:
        return args.routing

    def build_shared_experts(self, args: AfmoeModelArgs) -> nn.Module:
        return FeedForward(dim=args.dim, hidden_dim=args.moe_hidden_dim * args.num_shared_experts)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
        replayed_experts_TK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.attend(x, rope, mask)
        out, expert_ids_TK, tokens_per_expert_E = self.run_experts(self.ffn_norm(x), replayed_experts_TK)
        return x + self.post_ffn_norm(out), expert_ids_TK, tokens_per_expert_E


class AfmoeModel(Qwen3MoeModel):
    args: AfmoeModelArgs

    def __init__(self, args: AfmoeModelArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        self.norm = AfmoeRMSNorm(args.dim, eps=args.norm_eps)

    def build_block(self, layer_id: int) -> nn.Module:
        block_cls = AfmoeMoEBlock if layer_id in self.args.moe_layers else AfmoeDenseBlock
        return block_cls(self.args, self.args.layer_types[layer_id])

    def embed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, row_layout: RowLayout | None = None
    ) -> tuple[torch.Tensor, Any, Any]:
        h, rope, mask = super().embed(input_ids, position_ids, row_layout)
        if self.args.mup:
            h = h * self.args.dim**0.5
        return h, rope, mask

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return () if self.args.sliding_window is None else (self.args.sliding_window,)
