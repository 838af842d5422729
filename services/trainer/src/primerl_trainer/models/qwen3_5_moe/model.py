"""Qwen3.5-MoE (transformers' `qwen3_5_moe`, text part `qwen3_5_moe_text`): a pre-norm decoder
whose layers mix tokens either with Gated DeltaNet (`linear_attention` in `layer_types`, three of
every four layers in the hub's models; common/gated_delta_net.py) or with gated attention
(`full_attention`), and all of which end in a mixture of experts: softmax top-k routing with the
k weights renormalised, plus one shared expert (a SwiGLU) scaled by sigmoid(shared_expert_gate x).

Gated attention: grouped-query attention whose q projection gives each head its queries and, after
them, as many gate values; the attention's output is scaled by sigmoid(gate) before the output
projection. Queries and keys get a per-head RMSNorm, then RoPE on the first
`partial_rotary_factor` of each head's dims.

Every RMSNorm but the DeltaNet's gated one is zero-centred: it scales by (1 + weight), in float32,
and casts after the scaling.

The hub's checkpoints are the multimodal model (`qwen3_5_moe`: a vision tower, the language model
under `model.language_model.`, `lm_head`, multi-token-prediction layers under `mtp.`); this model
is the language model. Text positions only: the multimodal rotary sections (`mrope_section`)
coincide with plain RoPE when the three position rows are equal, as they are for text.

Layers run, take replayed experts (R3) and report routing as in Qwen3MoeModel, whose forward
this model reuses. Packed rows restart the DeltaNet's convolution and recurrent state at every
sample. Context parallel: attention as every family's; the DeltaNet layers pass their state
between the ranks (gated_delta_net.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from primerl_trainer.models.common.attention import attention
from primerl_trainer.models.common.feed_forward import FeedForward
from primerl_trainer.models.common.gated_delta_net import GatedDeltaNet, GatedDeltaNetImpl, LayerMasks, layer_masks
from primerl_trainer.models.common.linear import fused_linear
from primerl_trainer.models.qwen3.model import Attention, check_supported_hf_config, common_args_from_hf_config
from primerl_trainer.models.qwen3_moe.model import MoETransformerBlock, Qwen3MoeModel, Qwen3MoeModelArgs

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout

LAYER_TYPES = ("linear_attention", "full_attention")
# transformers' defaults when a config does not name them.
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.25
DEFAULT_FULL_ATTENTION_INTERVAL = 4


@dataclass(frozen=True, kw_only=True)
class Qwen3_5MoeModelArgs(Qwen3MoeModelArgs):
    shared_expert_hidden_dim: int
    layer_types: tuple[str, ...]
    rotary_dim: int
    linear_num_k_heads: int
    linear_num_v_heads: int
    linear_head_k_dim: int
    linear_head_v_dim: int
    linear_conv_width: int
    # The checkpoint is the multimodal one: the language model's tensors under
    # `model.language_model.` (state_dict_adapter.py).
    multimodal: bool = False
    # How the DeltaNet layers run (gated_delta_net.GatedDeltaNet); not part of the checkpoint's config.
    gdn_impl: GatedDeltaNetImpl = "auto"

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        """From the multimodal config.json (its `text_config`) or the text model's."""
        multimodal = "text_config" in config
        text = config["text_config"] if multimodal else config
        if config.get("quantization_config") or text.get("quantization_config"):
            # The hub's FP8 variants: weight_scale_inv beside each weight.
            raise ValueError(
                "a quantized checkpoint (quantization_config) needs impl='hf'; the own model loads unquantized weights"
            )
        check_supported_qwen3_5_moe_config(text)
        num_layers = text["num_hidden_layers"]
        layer_types = tuple(text.get("layer_types") or _default_layer_types(text, num_layers))
        if len(layer_types) != num_layers or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must name {LAYER_TYPES[0]!r} or {LAYER_TYPES[1]!r} for each of the {num_layers} "
                f"layers, got {list(layer_types)}"
            )
        # There is no dense feed-forward: hidden_dim is the shared expert's width.
        common = common_args_from_hf_config({**text, "intermediate_size": text["shared_expert_intermediate_size"]})
        common["tie_word_embeddings"] = config.get("tie_word_embeddings", text.get("tie_word_embeddings", False))
        rope = text.get("rope_parameters") or {}
        factor = rope.get("partial_rotary_factor", text.get("partial_rotary_factor", DEFAULT_PARTIAL_ROTARY_FACTOR))
        rotary_dim = int(common["head_dim"] * factor)
        if rotary_dim <= 0 or rotary_dim % 2:
            raise ValueError(
                f"partial_rotary_factor {factor} of head_dim {common['head_dim']} must give a positive even "
                f"number of rotated dims, got {rotary_dim}"
            )
        return cls(
            **common,
            num_experts=text["num_experts"],
            top_k=text["num_experts_per_tok"],
            moe_hidden_dim=text["moe_intermediate_size"],
            norm_topk_prob=True,
            moe_layers=tuple(range(num_layers)),
            shared_expert_hidden_dim=text["shared_expert_intermediate_size"],
            layer_types=layer_types,
            rotary_dim=rotary_dim,
            linear_num_k_heads=text["linear_num_key_heads"],
            linear_num_v_heads=text["linear_num_value_heads"],
            linear_head_k_dim=text["linear_key_head_dim"],
            linear_head_v_dim=text["linear_value_head_dim"],
            linear_conv_width=text["linear_conv_kernel_dim"],
            multimodal=multimodal,
        )


def _default_layer_types(text: dict[str, Any], num_layers: int) -> list[str]:
    """transformers' rule for configs without layer_types: every `full_attention_interval`-th
    layer is full attention."""
    interval = text.get("full_attention_interval", DEFAULT_FULL_ATTENTION_INTERVAL)
    return [LAYER_TYPES[(i + 1) % interval == 0] for i in range(num_layers)]


def check_supported_qwen3_5_moe_config(text: dict[str, Any]) -> None:
    check_supported_hf_config(text)
    unsupported = {
        f"hidden_act {text.get('hidden_act')!r}": text.get("hidden_act", "silu") != "silu",
        f"num_experts {text.get('num_experts')}": not text.get("num_experts") or text["num_experts"] <= 0,
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own Qwen3.5-MoE implementation lacks: {names}; use impl='hf'")


class ZeroCenteredRMSNorm(nn.Module):
    """RMSNorm scaling by (1 + weight), in float32, cast after the scaling (transformers'
    Qwen3.5 rounding); the weight starts at zero."""

    def __init__(self, dim: int, *, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * (1.0 + self.weight.float())).to(x.dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class GatedAttention(Attention):
    """Qwen3's attention with a per-head output gate, zero-centred q/k norms and partial rotary."""

    def __init__(self, args: Qwen3_5MoeModelArgs) -> None:
        super().__init__(args)
        # Per head: head_dim queries, then head_dim gate values.
        self.wq = nn.Linear(args.dim, 2 * args.num_heads * args.head_dim, bias=False)

    def build_qk_norms(self, args: Qwen3_5MoeModelArgs) -> tuple[nn.Module, nn.Module]:
        return tuple(ZeroCenteredRMSNorm(args.head_dim, eps=args.norm_eps) for _ in range(2))

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], masks: LayerMasks) -> torch.Tensor:
        batch_size, seq_len, _ = x.shape
        projections = (self.wq, self.wk, self.wv)
        qkv = fused_linear(x, projections)
        q_and_gate, k, v = qkv.split([p.out_features for p in projections], dim=-1)
        q, gate = q_and_gate.view(batch_size, seq_len, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q, k = self.q_norm(q), self.k_norm(self.heads(k))
        q, k = self.rotate(q, *rope), self.rotate(k, *rope)
        out = attention(q, k, self.heads(v), masks.attention) * torch.sigmoid(gate)
        return self.wo(out.reshape(batch_size, seq_len, -1))


class LinearAttention(GatedDeltaNet):
    """The DeltaNet as a block's token mixer (the attention's call signature)."""

    def __init__(self, args: Qwen3_5MoeModelArgs) -> None:
        super().__init__(
            dim=args.dim,
            num_k_heads=args.linear_num_k_heads,
            num_v_heads=args.linear_num_v_heads,
            head_k_dim=args.linear_head_k_dim,
            head_v_dim=args.linear_head_v_dim,
            conv_width=args.linear_conv_width,
            norm_eps=args.norm_eps,
            impl=args.gdn_impl,
        )

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], masks: LayerMasks) -> torch.Tensor:
        return super().forward(x, masks.segments, masks.cp)


class Qwen3_5MoeBlock(MoETransformerBlock):
    """Gated attention, then the routed experts (`moe`) plus the gated shared expert."""

    def __init__(self, args: Qwen3_5MoeModelArgs) -> None:
        super().__init__(args)
        self.attention_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.ffn_norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)
        self.shared_experts = FeedForward(dim=args.dim, hidden_dim=args.shared_expert_hidden_dim)
        self.shared_experts_gate = nn.Linear(args.dim, 1, bias=False)

    def build_attention(self, args: Qwen3_5MoeModelArgs) -> nn.Module:
        return GatedAttention(args)

    def run_experts(
        self, h: torch.Tensor, replayed_experts_TK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        routed, expert_ids_TK, tokens_per_expert_E = self.moe(h, replayed_experts_TK)
        shared = torch.sigmoid(self.shared_experts_gate(h)) * self.shared_experts(h)
        return routed + shared, expert_ids_TK, tokens_per_expert_E


class Qwen3_5MoeLinearBlock(Qwen3_5MoeBlock):
    """Gated DeltaNet, then the experts."""

    def build_attention(self, args: Qwen3_5MoeModelArgs) -> nn.Module:
        return LinearAttention(args)


class Qwen3_5MoeModel(Qwen3MoeModel):
    args: Qwen3_5MoeModelArgs

    def __init__(self, args: Qwen3_5MoeModelArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        self.norm = ZeroCenteredRMSNorm(args.dim, eps=args.norm_eps)

    def build_block(self, layer_id: int) -> nn.Module:
        if self.args.layer_types[layer_id] == "linear_attention":
            return Qwen3_5MoeLinearBlock(self.args)
        return Qwen3_5MoeBlock(self.args)

    @property
    def rotary_dim(self) -> int:
        return self.args.rotary_dim

    def attention_mask(
        self,
        position_ids: torch.Tensor | None,
        *,
        batch_size: int,
        seq_len: int,
        device: torch.device,
        row_layout: RowLayout | None,
    ) -> LayerMasks:
        mask = super().attention_mask(
            position_ids, batch_size=batch_size, seq_len=seq_len, device=device, row_layout=row_layout
        )
        return layer_masks(mask, position_ids, device=device, row_layout=row_layout, cp_group=self.cp_group)
