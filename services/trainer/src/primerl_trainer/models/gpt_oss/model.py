"""GPT-OSS (transformers' `gpt_oss`): a pre-norm decoder whose every layer has a mixture of
experts, with these particulars:

- Attention: grouped-query with bias on q, k, v and o (`attention_bias`), no q/k norm, a learned
  sink logit per head in the softmax's denominator, and per layer (`layer_types`) either full
  causal attention or a sliding window of `sliding_window` keys (common/attention.py).
- RoPE: default or YaRN as `rope_parameters` define it (common/rope.py).
- Router: a linear layer with bias; top-k of its logits, weights the softmax over those k
  (the same as the softmax over all experts renormalised at the k: moe.TokenChoiceTopKRouter
  with norm_topk_prob, whose replay gathers at the given experts).
- Experts: biases on both projections and the clamped SwiGLU: gate clamped above at `limit`,
  up clamped to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate).

Layers run, take replayed experts (R3) and report routing as in Qwen3MoeModel, whose forward
this model reuses.

On GPUs run it with attn_backend "flex": every layer has sinks, which SDPA's kernels lack, so
"sdpa" takes the explicit softmax that holds every score (right, for CPUs and tests).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.nn.functional as F
from torch import nn

from primerl_trainer.kernels.gather import accumulation_dtype
from primerl_trainer.models.common.attention import AttentionMask, attention
from primerl_trainer.models.common.rope import RopeParameters
from primerl_trainer.models.moe import GroupedExperts, MoE, _local
from primerl_trainer.models.qwen3.model import Attention, common_args_from_hf_config
from primerl_trainer.models.qwen3_moe.model import MoETransformerBlock, Qwen3MoeModel, Qwen3MoeModelArgs

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout

logger = logging.getLogger(__name__)

# transformers' GptOssConfig defaults, for fields a config.json leaves out.
DEFAULT_ROPE_THETA = 150_000.0
DEFAULT_SWIGLU_ALPHA = 1.702
DEFAULT_SWIGLU_LIMIT = 7.0
LAYER_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True, kw_only=True)
class GptOssModelArgs(Qwen3MoeModelArgs):
    # Per layer: its sliding window in keys, or None for full attention.
    layer_windows: tuple[int | None, ...]
    attention_bias: bool
    rope: RopeParameters
    swiglu_alpha: float
    swiglu_limit: float

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        check_supported_gpt_oss_config(config)
        common = common_args_from_hf_config(config)
        num_layers = config["num_hidden_layers"]
        layer_types = config.get("layer_types") or [LAYER_TYPES[i % 2] for i in range(num_layers)]
        if len(layer_types) != num_layers or set(layer_types) - set(LAYER_TYPES):
            raise ValueError(
                f"layer_types must name {num_layers} layers, each one of {LAYER_TYPES}, got {layer_types!r}"
            )
        window = config.get("sliding_window")
        if "sliding_attention" in layer_types and (not isinstance(window, int) or window < 1):
            raise ValueError(f"sliding_window must be a positive number of keys for sliding layers, got {window!r}")
        num_experts = config.get("num_local_experts", config.get("num_experts", 0))
        top_k = config["num_experts_per_tok"]
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok ({top_k}) must lie in [1, num_local_experts = {num_experts}]")
        limit = config.get("swiglu_limit", DEFAULT_SWIGLU_LIMIT)
        if not limit > 0:
            raise ValueError(f"swiglu_limit must be positive, got {limit!r}")
        if common["head_dim"] % 2:
            raise ValueError(f"head_dim ({common['head_dim']}) must be even for RoPE")
        rope = RopeParameters.from_hf_config(config, default_theta=DEFAULT_ROPE_THETA)
        return cls(
            **common | {"rope_theta": rope.theta},
            num_experts=num_experts,
            top_k=top_k,
            moe_hidden_dim=config["intermediate_size"],
            norm_topk_prob=True,
            moe_layers=tuple(range(num_layers)),
            layer_windows=tuple(window if kind == "sliding_attention" else None for kind in layer_types),
            attention_bias=config.get("attention_bias", True),
            rope=rope,
            swiglu_alpha=config.get("swiglu_alpha", DEFAULT_SWIGLU_ALPHA),
            swiglu_limit=limit,
        )

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return tuple(sorted({window for window in self.layer_windows if window is not None}))


def check_supported_gpt_oss_config(config: dict[str, Any]) -> None:
    num_experts = config.get("num_local_experts", config.get("num_experts", 0))
    # The hub's GPT-OSS keeps its experts in MXFP4 (`*_blocks`/`*_scales`): dequantized on load
    # (state_dict_adapter.py). Other quantizations are refused.
    quantization = (config.get("quantization_config") or {}).get("quant_method")
    unsupported = {
        f"num_local_experts {num_experts}": not num_experts or num_experts <= 0,
        f"quantization_config (quant_method {quantization!r})": bool(config.get("quantization_config"))
        and quantization != "mxfp4",
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own GPT-OSS implementation lacks: {names}; use impl='hf'")


class GptOssAttention(Attention):
    """Qwen3's without q/k norms, with biases (o included), a sink per head and this layer's window."""

    def __init__(self, args: GptOssModelArgs, *, sliding_window: int | None) -> None:
        super().__init__(args, bias=args.attention_bias, out_bias=args.attention_bias)
        self.sinks = nn.Parameter(torch.empty(args.num_heads))
        self.sliding_window = sliding_window

    def build_qk_norms(self, args: GptOssModelArgs) -> tuple[None, None]:
        return None, None

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.heads(q), self.heads(k)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        return attention(q, k, v, mask, sliding_window=self.sliding_window, sinks=self.sinks)


def clamped_swiglu(gate: torch.Tensor, up: torch.Tensor, *, alpha: float, limit: float) -> torch.Tensor:
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


class GptOssExperts(GroupedExperts):
    """GroupedExperts' stacked layout (w13 [E, 2F, D] gate rows then up rows, w2 [E, D, F]) plus
    biases w13_bias [E, 2F] and w2_bias [E, D], and the clamped SwiGLU. The checkpoint fuses gate
    and up, so LoRA adapts them as one projection (one A and B per expert)."""

    lora_fused_gate_up = True

    def __init__(
        self, *, dim: int, hidden_dim: int, num_experts: int, alpha: float, limit: float, experts_impl: str = "auto"
    ) -> None:
        super().__init__(dim=dim, hidden_dim=hidden_dim, num_experts=num_experts, experts_impl=experts_impl)
        self.alpha, self.limit = alpha, limit
        self.w13_bias = nn.Parameter(torch.empty(num_experts, 2 * hidden_dim))
        self.w2_bias = nn.Parameter(torch.empty(num_experts, dim))

    def takes_padded_rows(self, x: torch.Tensor) -> bool:
        """No: every row gets its expert's biases, whose gradients sum over all rows."""
        return False

    def forward(self, x_ND: torch.Tensor, offsets_E: torch.Tensor) -> torch.Tensor:
        w13, w2 = _local(self.w13), _local(self.w2)
        b13, b2 = _local(self.w13_bias), _local(self.w2_bias)
        if self._use_grouped_products(x_ND):
            # The expert of each row, for its biases (rows past the last offset do not occur).
            rows = torch.arange(x_ND.shape[0], device=x_ND.device, dtype=offsets_E.dtype)
            expert_N = torch.searchsorted(offsets_E, rows, right=True).clamp(max=w13.shape[0] - 1)
            # The biases are gathered in float32 (at least): the gather's backward sums each
            # expert's rows into its bias gradient by scatter-add, which in bf16 rounds at every
            # row (eager on the CPU; compiled, atomics on CUDA): several times the error of the
            # bias gradient F.linear sums in float32.
            dtype = accumulation_dtype(x_ND)
            gate_up = (self._grouped_product(x_ND, w13, offsets_E) + b13.to(dtype)[expert_N]).to(x_ND.dtype)
            gate, up = gate_up.chunk(2, dim=-1)
            hidden = clamped_swiglu(gate, up, alpha=self.alpha, limit=self.limit)
            return (self._grouped_product(hidden, w2, offsets_E) + b2.to(dtype)[expert_N]).to(x_ND.dtype)
        sizes = torch.diff(offsets_E, prepend=offsets_E.new_zeros(1)).tolist()
        outs = []
        for expert, x in enumerate(torch.split(x_ND, sizes)):
            gate, up = F.linear(x, w13[expert], b13[expert]).chunk(2, dim=-1)
            hidden = clamped_swiglu(gate, up, alpha=self.alpha, limit=self.limit)
            outs.append(F.linear(hidden, w2[expert], b2[expert]))
        return torch.cat(outs)


class GptOssMoE(MoE):
    """MoE with a biased router gate and GPT-OSS's experts."""

    def __init__(self, args: GptOssModelArgs) -> None:
        super().__init__(
            dim=args.dim,
            hidden_dim=args.moe_hidden_dim,
            num_experts=args.num_experts,
            top_k=args.top_k,
            norm_topk_prob=True,
            experts_impl=args.experts_impl,
        )
        self.router.gate = nn.Linear(args.dim, args.num_experts, bias=True)
        self.experts = GptOssExperts(
            dim=args.dim,
            hidden_dim=args.moe_hidden_dim,
            num_experts=args.num_experts,
            alpha=args.swiglu_alpha,
            limit=args.swiglu_limit,
            experts_impl=args.experts_impl,
        )


class GptOssBlock(MoETransformerBlock):
    def __init__(self, args: GptOssModelArgs, layer_id: int) -> None:
        self.layer_id = layer_id
        super().__init__(args)

    def build_attention(self, args: GptOssModelArgs) -> nn.Module:
        return GptOssAttention(args, sliding_window=args.layer_windows[self.layer_id])

    def build_moe(self, args: GptOssModelArgs) -> MoE:
        return GptOssMoE(args)


class GptOssModel(Qwen3MoeModel):
    args: GptOssModelArgs
    moe_block_cls = GptOssBlock
    _warned_sdpa = False

    def build_block(self, layer_id: int) -> nn.Module:
        return GptOssBlock(self.args, layer_id)

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        return self.args.sliding_windows

    def attention_mask(
        self,
        position_ids: torch.Tensor | None,
        *,
        batch_size: int,
        seq_len: int,
        device: torch.device,
        row_layout: RowLayout | None,
    ) -> AttentionMask:
        if torch.device(device).type == "cuda" and self.attn_backend == "sdpa" and not self._warned_sdpa:
            self._warned_sdpa = True
            logger.warning("GPT-OSS on CUDA with attn_backend 'sdpa' holds every attention score; use 'flex'")
        return super().attention_mask(
            position_ids, batch_size=batch_size, seq_len=seq_len, device=device, row_layout=row_layout
        )

    def rope(self, position_ids: torch.Tensor, *, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.args.rope.cos_sin(position_ids, head_dim=self.args.head_dim, dtype=dtype)
