"""Nemotron-H (transformers' `nemotron_h`; Nemotron-3-Nano): a pre-norm decoder whose every layer
is one token or channel mixer with its own RMSNorm, x + mixer(norm(x)), of four kinds named by the
config's `layers_block_type` (or the hub's `hybrid_override_pattern`: M, *, E, -):

- `linear_attention` (M): Mamba-2 (common/mamba2.py);
- `full_attention` (*): grouped-query attention without positions (no RoPE, no q/k norm, no bias);
- `moe` (E): routed experts plus one shared expert, both non-gated MLPs down(relu(up x)^2);
  grouped sigmoid routing with the correction bias for the choice only (moe.GroupedSigmoidRouting:
  `n_group`/`topk_group`, `norm_topk_prob`, `routed_scaling_factor`);
- `mlp` (-): a dense non-gated relu^2 MLP.

The norms scale in float32 and cast after the scaling (transformers' NemotronHRMSNorm rounding).
Mamba-2's step sizes are clamped below at `time_step_min` (transformers' `time_step_limit` of the
mixer, which ignores the config's own `time_step_limit`).

Layers run, take replayed experts (R3) and report routing as in Qwen3MoeModel, whose forward this
model reuses. Packed rows restart Mamba-2's convolution and scan state at every sample. Context
parallel: attention as every family's; the Mamba-2 layers pass their state between the ranks
(mamba2.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.models.common.gated_delta_net import LayerMasks, layer_masks
from primerl_trainer.models.common.mamba2 import DEFAULT_CHUNK_SIZE, Mamba2, Mamba2Impl
from primerl_trainer.models.common.norms import RMSNorm
from primerl_trainer.models.moe import GroupedExperts, GroupedSigmoidRouting, MoE, _local
from primerl_trainer.models.qwen3.model import Attention
from primerl_trainer.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout

LAYER_TYPES = ("linear_attention", "full_attention", "moe", "mlp")
PATTERN = {"M": "linear_attention", "*": "full_attention", "E": "moe", "-": "mlp"}


def _get(config: dict[str, Any], *names: str, default: Any = None) -> Any:
    """The first of `names` the config has (transformers' field, then the hub's older alias)."""
    return next((config[name] for name in names if config.get(name) is not None), default)


@dataclass(frozen=True, kw_only=True)
class NemotronHModelArgs(Qwen3MoeModelArgs):
    layer_types: tuple[str, ...]
    shared_expert_hidden_dim: int
    routing: GroupedSigmoidRouting
    mamba_num_heads: int
    mamba_head_dim: int
    mamba_num_groups: int
    ssm_state_size: int
    conv_width: int
    conv_bias: bool
    chunk_size: int
    dt_limit: tuple[float, float]
    # How the Mamba-2 layers run (mamba2.Mamba2); not part of the checkpoint's config.
    mamba_impl: Mamba2Impl = "auto"

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        check_supported_nemotron_h_config(config)
        layer_types = _get(config, "layers_block_type", "layer_types")
        if layer_types is None and config.get("hybrid_override_pattern") is not None:
            pattern = config["hybrid_override_pattern"]
            if not set(pattern) <= set(PATTERN):
                raise ValueError(f"hybrid_override_pattern {pattern!r} may hold only {''.join(PATTERN)}")
            layer_types = [PATTERN[c] for c in pattern]
        if not layer_types or not set(layer_types) <= set(LAYER_TYPES):
            raise ValueError(f"layers_block_type must name one of {LAYER_TYPES} per layer, got {layer_types}")
        layer_types = tuple(layer_types)
        moe_layers = tuple(i for i, kind in enumerate(layer_types) if kind == "moe")
        if not moe_layers:
            raise ValueError("layers_block_type has no 'moe' layer: the own Nemotron-H needs one; use impl='hf'")
        num_heads = config["num_attention_heads"]
        return cls(
            vocab_size=config["vocab_size"],
            dim=config["hidden_size"],
            num_layers=len(layer_types),
            num_heads=num_heads,
            num_kv_heads=config.get("num_key_value_heads") or num_heads,
            head_dim=config.get("head_dim") or config["hidden_size"] // num_heads,
            hidden_dim=config["intermediate_size"],
            norm_eps=config.get("layer_norm_epsilon", 1e-5),
            rope_theta=0.0,
            tie_word_embeddings=config.get("tie_word_embeddings", False),
            num_experts=config["n_routed_experts"],
            top_k=config["num_experts_per_tok"],
            moe_hidden_dim=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", True),
            moe_layers=moe_layers,
            layer_types=layer_types,
            shared_expert_hidden_dim=config["moe_shared_expert_intermediate_size"],
            routing=GroupedSigmoidRouting(
                num_groups=config.get("n_group", 1),
                top_k_groups=config.get("topk_group", 1),
                scaling_factor=config.get("routed_scaling_factor", 1.0),
            ),
            mamba_num_heads=config["mamba_num_heads"],
            mamba_head_dim=config["mamba_head_dim"],
            mamba_num_groups=_get(config, "n_groups", "mamba_n_groups", default=8),
            ssm_state_size=config["ssm_state_size"],
            conv_width=_get(config, "conv_kernel", "mamba_d_conv", default=4),
            conv_bias=bool(_get(config, "use_conv_bias", "mamba_conv_bias", default=True)),
            chunk_size=_get(config, "chunk_size", "mamba_chunk_size", default=DEFAULT_CHUNK_SIZE),
            dt_limit=(float(_get(config, "time_step_min", "mamba_dt_min", default=0.001)), float("inf")),
        )


def check_supported_nemotron_h_config(config: dict[str, Any]) -> None:
    unsupported = {
        f"mlp_hidden_act {config.get('mlp_hidden_act')!r}": config.get("mlp_hidden_act", "relu2") != "relu2",
        f"mamba_hidden_act {config.get('mamba_hidden_act')!r}": config.get("mamba_hidden_act", "silu") != "silu",
        "moe_latent_size": config.get("moe_latent_size") is not None,
        "mlp_bias": bool(config.get("mlp_bias")),
        "use_bias": bool(config.get("use_bias")),
        "n_routed_experts <= 0": config.get("n_routed_experts", 0) <= 0,
        "quantization_config": bool(config.get("quantization_config")),
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own Nemotron-H implementation lacks: {names}; use impl='hf'")


class NemotronHRMSNorm(RMSNorm):
    """RMSNorm scaled in float32, cast after the scaling."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * x32).to(x.dtype)


def relu2(x: torch.Tensor) -> torch.Tensor:
    return F.relu(x).square()


class Relu2MLP(nn.Module):
    """w2(relu(w3 x)^2); w3/w2 are Hugging Face's up/down projections (the LoRA targets up, down)."""

    def __init__(self, *, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(relu2(self.w3(x)))


class Relu2Experts(GroupedExperts):
    """E non-gated relu^2 experts: w13 holds the up projections only [E, F, D] (`gated` False:
    LoRA's one projection there), w2 the down ones [E, D, F]."""

    gated = False

    def __init__(self, *, dim: int, hidden_dim: int, num_experts: int, experts_impl: str = "auto") -> None:
        super().__init__(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts, experts_impl=experts_impl)
        self.w13 = nn.Parameter(torch.empty(num_experts, hidden_dim, dim))

    def forward(self, x_ND: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        w1, w2 = _local(self.w13), _local(self.w2)
        if self._use_grouped_products(x_ND):
            return self._grouped_product(relu2(self._grouped_product(x_ND, w1, offsets_E)), w2, offsets_E)
        sizes = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
        return torch.cat([F.linear(relu2(F.linear(x, w1[e])), w2[e]) for e, x in enumerate(torch.split(x_ND, sizes))])


class NemotronHAttention(Attention):
    """Grouped-query attention of the heads as projected: no positions, no q/k norm."""

    def build_qk_norms(self, args: NemotronHModelArgs) -> tuple[None, None]:
        return None, None

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(q), self.heads(k)

    def rotate(self, x: torch.Tensor, *rope: torch.Tensor) -> torch.Tensor:
        return x


class MambaBlock(nn.Module):
    def __init__(self, args: NemotronHModelArgs) -> None:
        super().__init__()
        self.norm = NemotronHRMSNorm(args.dim, eps=args.norm_eps)
        # Named as the other families' token mixers (LoRA targets in_proj, out_proj).
        self.attention = Mamba2(
            dim=args.dim,
            num_heads=args.mamba_num_heads,
            head_dim=args.mamba_head_dim,
            num_groups=args.mamba_num_groups,
            state_size=args.ssm_state_size,
            conv_width=args.conv_width,
            norm_eps=args.norm_eps,
            dt_limit=args.dt_limit,
            chunk_size=args.chunk_size,
            conv_bias=args.conv_bias,
            impl=args.mamba_impl,
        )

    def forward(self, x: torch.Tensor, rope: tuple, masks: LayerMasks) -> torch.Tensor:
        return x + self.attention(self.norm(x), masks.segments, masks.cp)


class AttentionBlock(nn.Module):
    def __init__(self, args: NemotronHModelArgs) -> None:
        super().__init__()
        self.norm = NemotronHRMSNorm(args.dim, eps=args.norm_eps)
        self.attention = NemotronHAttention(args)

    def forward(self, x: torch.Tensor, rope: tuple, masks: LayerMasks) -> torch.Tensor:
        return x + self.attention(self.norm(x), rope, masks.attention)


class MLPBlock(nn.Module):
    def __init__(self, args: NemotronHModelArgs) -> None:
        super().__init__()
        self.norm = NemotronHRMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = Relu2MLP(dim=args.dim, hidden_dim=args.hidden_dim)

    def forward(self, x: torch.Tensor, rope: tuple, masks: LayerMasks) -> torch.Tensor:
        return x + self.feed_forward(self.norm(x))


class MoEBlock(nn.Module):
    """The routed experts (`moe`) plus the shared expert of the same normed input."""

    def __init__(self, args: NemotronHModelArgs) -> None:
        super().__init__()
        self.norm = NemotronHRMSNorm(args.dim, eps=args.norm_eps)
        self.moe = MoE(
            dim=args.dim,
            hidden_dim=args.moe_hidden_dim,
            num_experts=args.num_experts,
            top_k=args.top_k,
            norm_topk_prob=args.norm_topk_prob,
            experts_impl=args.experts_impl,
            grouped_sigmoid=args.routing,
        )
        self.moe.experts = Relu2Experts(
            dim=args.dim, hidden_dim=args.moe_hidden_dim, num_experts=args.num_experts, experts_impl=args.experts_impl
        )
        self.shared_experts = Relu2MLP(dim=args.dim, hidden_dim=args.shared_expert_hidden_dim)

    def forward(
        self, x: torch.Tensor, rope: tuple, masks: LayerMasks, replayed_experts_TK: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h = self.norm(x)
        routed, expert_ids_TK, tokens_per_expert_E = self.moe(h, replayed_experts_TK)
        return x + routed + self.shared_experts(h), expert_ids_TK, tokens_per_expert_E


BLOCKS: dict[str, type[nn.Module]] = {
    "linear_attention": MambaBlock,
    "full_attention": AttentionBlock,
    "mlp": MLPBlock,
    "moe": MoEBlock,
}


class NemotronHModel(Qwen3MoeModel):
    args: NemotronHModelArgs

    def __init__(self, args: NemotronHModelArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        self.norm = NemotronHRMSNorm(args.dim, eps=args.norm_eps)

    def build_block(self, layer_id: int) -> nn.Module:
        return BLOCKS[self.args.layer_types[layer_id]](self.args)

    def rope(self, position_ids: torch.Tensor, *, dtype: torch.dtype) -> tuple:
        """No positions: the attention layers take their heads as projected."""
        return ()

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
