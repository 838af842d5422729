"""Laguna (transformers' `laguna`, Poolside): a pre-norm decoder whose layers are dense or sparse as
`mlp_layer_types` says, with
- attention layers of two kinds (`layer_types`): "sliding_attention" layers attend to the last
  `sliding_window` tokens, "full_attention" layers to everything; each kind has its own RoPE
  (`rope_parameters` keyed by layer type: theta, rotated fraction of each head, default or
  YaRN), applied to the leading dims of each head;
- per-layer query head counts (`num_attention_heads_per_layer`, one KV head count for all);
  per-head q/k RMSNorm, q/k/v/o bias with `attention_bias`, and an output gate: the heads times
  softplus(wg(x)) (taken in float32), one gate per head (`gating` True or "per-head") or per
  head dim ("per-element");
- routing by sigmoid scores of the optionally soft-capped router logits
  (`moe_router_logit_softcapping`), with the correction bias for the choice only (one group),
  always renormalised; the routed output times `moe_routed_scaling_factor` (applied to the
  weights, moe.GroupedSigmoidRouting) plus one shared expert of
  `shared_expert_intermediate_size`.

Layers run, take replayed experts (R3) and report routing as in Qwen3MoeModel, whose forward
this model reuses; each attention picks its kind's RoPE table from the model's per-kind ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.models.common.attention import AttentionMask
from primerl_trainer.models.common.feed_forward import FeedForward
from primerl_trainer.models.common.rope import RopeParameters
from primerl_trainer.models.moe import GroupedSigmoidRouting
from primerl_trainer.models.qwen3.model import Attention, TransformerBlock, common_args_from_hf_config
from primerl_trainer.models.qwen3_moe.model import MoETransformerBlock, Qwen3MoeModel, Qwen3MoeModelArgs

FULL, SLIDING = "full_attention", "sliding_attention"
LAYER_TYPES = (FULL, SLIDING)
GATINGS = (True, "per-head", "per-element")


@dataclass(frozen=True)
class LayerRope:
    """One kind of layer's RoPE: its parameters and how many leading dims of each head it rotates."""

    parameters: RopeParameters
    rotary_dim: int


@dataclass(frozen=True, kw_only=True)
class LagunaModelArgs(Qwen3MoeModelArgs):
    shared_hidden_dim: int
    routing: GroupedSigmoidRouting
    attention_bias: bool
    gate_per_head: bool
    heads_per_layer: tuple[int, ...]
    layer_types: tuple[str, ...]
    sliding_window: int | None
    # (layer type, its RoPE) per kind of layer present; a tuple keeps the args hashable.
    ropes: tuple[tuple[str, LayerRope], ...]

    def rope_of(self, layer_type: str) -> LayerRope:
        return dict(self.ropes)[layer_type]

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        check_supported_laguna_config(config)
        common = common_args_from_hf_config(config)
        num_layers = config["num_hidden_layers"]
        layer_types = tuple(config.get("layer_types") or [FULL] * num_layers)
        if len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must name {num_layers} layers, each one of {LAYER_TYPES}, got {list(layer_types)}"
            )
        mlp_types = tuple(config.get("mlp_layer_types") or ["dense"] + ["sparse"] * (num_layers - 1))
        if len(mlp_types) != num_layers or not set(mlp_types) <= {"dense", "sparse"}:
            raise ValueError(
                f"mlp_layer_types must name {num_layers} layers, each 'dense' or 'sparse', got {list(mlp_types)}"
            )
        moe_layers = tuple(i for i, kind in enumerate(mlp_types) if kind == "sparse")
        if not moe_layers:
            raise ValueError("mlp_layer_types leaves no mixture-of-experts ('sparse') layer")
        heads = tuple(config.get("num_attention_heads_per_layer") or [common["num_heads"]] * num_layers)
        if len(heads) != num_layers or any(h <= 0 or h % common["num_kv_heads"] for h in heads):
            raise ValueError(
                f"num_attention_heads_per_layer must give {num_layers} positive multiples of num_key_value_heads "
                f"({common['num_kv_heads']}), got {list(heads)}"
            )
        window = config.get("sliding_window")
        if SLIDING in layer_types and (window is None or window < 1):
            raise ValueError(f"sliding_window ({window}) must be a positive number of tokens")
        shared = config.get("shared_expert_intermediate_size", 512)
        if shared is None or shared < 0:
            raise ValueError(f"shared_expert_intermediate_size ({shared}) must be 0 or more")
        softcap = config.get("moe_router_logit_softcapping") or 0.0
        if softcap < 0:
            raise ValueError(f"moe_router_logit_softcapping ({softcap}) must be 0 (none) or positive")
        return cls(
            **common,
            num_experts=config["num_experts"],
            top_k=config["num_experts_per_tok"],
            moe_hidden_dim=config["moe_intermediate_size"],
            norm_topk_prob=True,
            moe_layers=moe_layers,
            shared_hidden_dim=shared,
            routing=GroupedSigmoidRouting(
                scaling_factor=config.get("moe_routed_scaling_factor", 1.0), logit_softcap=softcap
            ),
            attention_bias=bool(config.get("attention_bias", False)),
            gate_per_head=config.get("gating", True) in (True, "per-head"),
            heads_per_layer=heads,
            layer_types=layer_types,
            sliding_window=window if SLIDING in layer_types else None,
            ropes=tuple((kind, _layer_rope(config, kind, common["head_dim"])) for kind in sorted(set(layer_types))),
        )


# transformers' LagunaConfig when a config names no rope_parameters.
DEFAULT_ROPE_PARAMETERS = {
    FULL: {"rope_type": "default", "rope_theta": 500000.0, "partial_rotary_factor": 0.5},
    SLIDING: {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 1.0},
}


def _layer_rope(config: dict[str, Any], kind: str, head_dim: int) -> LayerRope:
    """`rope_parameters[kind]`: YaRN or default RoPE over int(head_dim * partial_rotary_factor) dims."""
    ropes = config.get("rope_parameters") or DEFAULT_ROPE_PARAMETERS
    rope = ropes.get(kind)
    if not isinstance(rope, dict):
        raise ValueError(
            f"rope_parameters must hold one dict per layer type ({sorted(set(config.get('layer_types') or [FULL]))}), "
            f"got {ropes!r} with none for {kind!r}"
        )
    factor = rope.get("partial_rotary_factor", 1.0)
    rotary_dim = int(head_dim * factor)
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"rope_parameters[{kind!r}]: partial_rotary_factor {factor} of head_dim {head_dim} must give a "
            f"positive even number of rotated dims, got {rotary_dim}"
        )
    if rope.get("truncate", True) is not True:
        # transformers' Laguna reads `truncate` from the outer, per-kind dict and so always
        # truncates YaRN's ramp; vLLM honours the layer's value. Neither can be matched to both.
        raise ValueError(
            f"rope_parameters[{kind!r}]: truncate {rope['truncate']!r} is read by vLLM but not by transformers' "
            "Laguna (which always truncates); use impl='hf'"
        )
    flat = {key: value for key, value in rope.items() if key != "partial_rotary_factor"}
    parameters = RopeParameters.from_hf_config(
        {"rope_parameters": flat, "max_position_embeddings": config.get("max_position_embeddings", 131072)},
        default_theta=10000.0,
    )
    return LayerRope(parameters, rotary_dim)


def check_supported_laguna_config(config: dict[str, Any]) -> None:
    unsupported = {
        f"hidden_act {config.get('hidden_act')!r}": config.get("hidden_act", "silu") != "silu",
        f"num_experts {config.get('num_experts')}": not config.get("num_experts") or config["num_experts"] <= 0,
        f"gating {config.get('gating')!r}": config.get("gating", True) not in GATINGS,
        "moe_apply_router_weight_on_input": bool(config.get("moe_apply_router_weight_on_input")),
        f"attention_dropout {config.get('attention_dropout')}": bool(config.get("attention_dropout")),
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own Laguna implementation lacks: {names}; use impl='hf'")


class LagunaAttention(Attention):
    """Qwen3's (per-head q/k norms) with this layer's head count, q/k/v/o bias, its kind's RoPE on
    the leading dims of each head and window, and a softplus output gate."""

    def __init__(self, args: LagunaModelArgs, layer_id: int) -> None:
        num_heads = args.heads_per_layer[layer_id]
        super().__init__(
            dataclasses.replace(args, num_heads=num_heads), bias=args.attention_bias, out_bias=args.attention_bias
        )
        self.layer_type = args.layer_types[layer_id]
        self.sliding_window = args.sliding_window if self.layer_type == SLIDING else None
        self.gate_per_head = args.gate_per_head
        self.wg = nn.Linear(args.dim, num_heads if args.gate_per_head else num_heads * args.head_dim, bias=False)

    def gate_heads(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        gate = F.softplus(self.wg(x).float()).to(out.dtype)
        return out * (gate[..., None] if self.gate_per_head else self.heads(gate))

    def forward(
        self, x: torch.Tensor, rope: dict[str, tuple[torch.Tensor, torch.Tensor]], mask: AttentionMask
    ) -> torch.Tensor:
        return super().forward(x, rope[self.layer_type], mask)


class LagunaDenseBlock(TransformerBlock):
    """A "dense" layer: Laguna's attention, a dense feed-forward of intermediate_size."""

    def __init__(self, args: LagunaModelArgs, layer_id: int) -> None:
        self.layer_id = layer_id
        super().__init__(args)

    def build_attention(self, args: LagunaModelArgs) -> nn.Module:
        return LagunaAttention(args, self.layer_id)


class LagunaMoEBlock(MoETransformerBlock):
    """A "sparse" layer: the routed experts (`moe`) plus the shared expert (`shared_experts`)."""

    def __init__(self, args: LagunaModelArgs, layer_id: int) -> None:
        self.layer_id = layer_id
        super().__init__(args)

    def build_attention(self, args: LagunaModelArgs) -> nn.Module:
        return LagunaAttention(args, self.layer_id)

    def routing(self, args: LagunaModelArgs) -> GroupedSigmoidRouting:
        return args.routing

    def build_shared_experts(self, args: LagunaModelArgs) -> nn.Module:
        return FeedForward(dim=args.dim, hidden_dim=args.shared_hidden_dim)


class LagunaModel(Qwen3MoeModel):
    args: LagunaModelArgs

    def build_block(self, layer_id: int) -> nn.Module:
        block_cls = LagunaMoEBlock if layer_id in self.args.moe_layers else LagunaDenseBlock
        return block_cls(self.args, layer_id)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return () if self.args.sliding_window is None else (self.args.sliding_window,)

    def rope(self, position_ids: torch.Tensor, *, dtype: torch.dtype) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """One cos/sin table per kind of layer, [B, T, that kind's rotary_dim]."""
        return {
            kind: rope.parameters.cos_sin(position_ids, head_dim=rope.rotary_dim, dtype=dtype)
            for kind, rope in self.args.ropes
        }
