"""Qwen3 (dense): a pre-norm decoder with grouped-query attention, RMSNorm on each head's
queries and keys, rotary positions and SwiGLU feed-forward blocks.

Own parameter names (torchtitan's); state_dict_adapter.py maps them to and from Hugging
Face's. Inputs are [B, T] token ids, batched or packed ([1, T] with position ids restarting
at each sample); see common/attention.py for how packed samples are kept apart.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from primerl_trainer.models.common.attention import AttentionBackend, AttentionMask, attention, build_attention_mask
from primerl_trainer.models.common.feed_forward import FeedForward
from primerl_trainer.models.common.linear import fused_linear
from primerl_trainer.models.common.norms import RMSNorm
from primerl_trainer.models.common.outputs import CausalLMOutput
from primerl_trainer.models.common.rope import apply_partial_rope, rope_cos_sin

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout


@dataclass(frozen=True, kw_only=True)
class Qwen3ModelArgs:
    vocab_size: int
    dim: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_theta: float
    tie_word_embeddings: bool

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        """From a Hugging Face config.json; features this implementation lacks are refused
        rather than silently ignored."""
        check_supported_hf_config(config)
        return cls(**common_args_from_hf_config(config))


class Attention(nn.Module):
    """Grouped-query attention with q/k RMSNorm and RoPE. Other families change its particulars
    through the hooks: `bias` on q/k/v, `out_bias` on the output projection, build_qk_norms,
    qk_heads, rotate, attend and gate_heads; `sliding_window` (None: full causal attention) for a layer
    that attends to its last that many keys only (the model's `sliding_windows` must name it)."""

    sliding_window: int | None = None

    def __init__(self, args: Qwen3ModelArgs, *, bias: bool = False, out_bias: bool = False) -> None:
        super().__init__()
        if args.num_heads % args.num_kv_heads:
            raise ValueError(f"num_heads ({args.num_heads}) must be a multiple of num_kv_heads ({args.num_kv_heads})")
        self.head_dim = args.head_dim
        self.wq = nn.Linear(args.dim, args.num_heads * args.head_dim, bias=bias)
        self.wk = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=bias)
        self.wv = nn.Linear(args.dim, args.num_kv_heads * args.head_dim, bias=bias)
        self.wo = nn.Linear(args.num_heads * args.head_dim, args.dim, bias=out_bias)
        self.q_norm, self.k_norm = self.build_qk_norms(args)

    def build_qk_norms(self, args: Qwen3ModelArgs) -> tuple[nn.Module | None, nn.Module | None]:
        """Qwen3: one weight per head dim, shared by all heads."""
        return RMSNorm(args.head_dim, eps=args.norm_eps), RMSNorm(args.head_dim, eps=args.norm_eps)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """[B, T, H * head_dim] -> [B, T, H, head_dim]."""
        return x.view(*x.shape[:-1], -1, self.head_dim)

    def qk_heads(self, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected queries and keys [B, T, H * head_dim] -> normed, [B, T, H, head_dim]."""
        return self.q_norm(self.heads(q)), self.k_norm(self.heads(k))

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """RoPE on the leading cos.shape[-1] dims of each head (all of them but with partial rotary)."""
        return apply_partial_rope(x, cos, sin)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: AttentionMask) -> torch.Tensor:
        """The attention of the rotated heads (families with sinks pass them here)."""
        return attention(q, k, v, mask, sliding_window=self.sliding_window)

    def gate_heads(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """The attention's output heads [B, T, H, head_dim] before the output projection, given
        the block's normed input x (families with output gates scale them here)."""
        return out

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask) -> torch.Tensor:
        batch_size, seq_len, _ = x.shape
        # One matrix product for q, k and v (the weights stay three parameters).
        projections = (self.wq, self.wk, self.wv)
        qkv = fused_linear(x, projections)
        q, k, v = qkv.split([p.out_features for p in projections], dim=-1)
        q, k = self.qk_heads(q, k)
        q, k = self.rotate(q, *rope), self.rotate(k, *rope)
        out = self.gate_heads(x, self.attend(q, k, self.heads(v), mask))
        return self.wo(out.reshape(batch_size, seq_len, -1))


class TransformerBlock(nn.Module):
    def __init__(self, args: Qwen3ModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = self.build_attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.feed_forward = FeedForward(dim=args.dim, hidden_dim=args.hidden_dim)

    def build_attention(self, args: Qwen3ModelArgs) -> nn.Module:
        return Attention(args)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask: AttentionMask) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), rope, mask)
        return x + self.feed_forward(self.ffn_norm(x))


class Qwen3Model(nn.Module):
    # Context parallel's group (distributed.context_parallel.apply_context_parallel): rows given
    # with a RowLayout of cp_size > 1 gather their keys and values over it.
    cp_group: dist.ProcessGroup | None = None

    def __init__(self, args: Qwen3ModelArgs, *, attn_backend: AttentionBackend = "sdpa") -> None:
        super().__init__()
        self.args = args
        self.attn_backend = attn_backend
        # No padding_idx: transformers freezes the pad token's embedding row with it, and
        # Qwen's pad token (<|endoftext|>) is one the policy samples and must learn.
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        # A ModuleDict keyed by layer number keeps parameter names stable when a pipeline
        # stage drops layers (torchtitan's convention).
        self.layers = nn.ModuleDict({str(i): self.build_block(i) for i in range(args.num_layers)})
        self.norm = RMSNorm(args.dim, eps=args.norm_eps)
        # A tied head reads the embedding's weight rather than sharing the Parameter: a
        # shared Parameter is split in two by meta-device loading (to_empty, assign=True),
        # and the state dict then has the single copy that Hugging Face saves.
        self.lm_head = None if args.tie_word_embeddings else nn.Linear(args.dim, args.vocab_size, bias=False)

    def build_block(self, layer_id: int) -> nn.Module:
        return TransformerBlock(self.args)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        routed_experts: torch.Tensor | None = None,
        compute_logits: bool = True,
        row_layout: RowLayout | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T]; position_ids [B, T] or None for 0..T-1 in every row.
        `compute_logits=False` returns the final-normed hidden states instead of the logits
        (see CausalLMOutput). `row_layout`: the tokens are one row, or this rank's share of one
        under context parallel (distributed/context_parallel.py); B must be 1."""
        if routed_experts is not None:
            raise ValueError("routed_experts is only accepted by mixture-of-experts models")
        h, rope, mask = self.embed(input_ids, position_ids, row_layout)
        for block in self.layers.values():
            h = block(h, rope, mask)
        return self.output(h, compute_logits=compute_logits)

    @property
    def rotary_dim(self) -> int:
        """How many leading dims of each head RoPE rotates (all of them here; fewer with partial
        rotary, as in GLM-4.5)."""
        return self.args.head_dim

    @property
    def output_weight(self) -> torch.Tensor:
        """The vocabulary projection's weight [vocab, dim] (the embedding's when tied)."""
        return self.tok_embeddings.weight if self.lm_head is None else self.lm_head.weight

    def output(self, h: torch.Tensor, *, compute_logits: bool = True, **aux: torch.Tensor) -> CausalLMOutput:
        """Final norm, then the vocabulary projection (or, without `compute_logits`, the normed
        hidden states); `aux` goes into the output as is."""
        h = self.norm(h)
        if not compute_logits:
            return CausalLMOutput(logits=None, hidden_states=h, **aux)
        logits = F.linear(h, self.tok_embeddings.weight) if self.lm_head is None else self.lm_head(h)
        return CausalLMOutput(logits=logits, **aux)

    def embed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, row_layout: RowLayout | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], AttentionMask]:
        """Token embeddings plus what every layer shares: RoPE's cos/sin and the mask."""
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be [batch, seq_len], got shape {list(input_ids.shape)}")
        if position_ids is not None and position_ids.shape != input_ids.shape:
            raise ValueError(
                f"position_ids must have the shape of input_ids {list(input_ids.shape)}, got {list(position_ids.shape)}"
            )
        batch_size, seq_len = input_ids.shape
        if row_layout is not None and (batch_size, seq_len) != (1, row_layout.num_local_tokens):
            raise ValueError(
                f"a row layout of {row_layout.num_local_tokens} local tokens needs input_ids of shape "
                f"[1, {row_layout.num_local_tokens}], got {list(input_ids.shape)}"
            )
        h = self.tok_embeddings(input_ids)
        mask = self.attention_mask(
            position_ids, batch_size=batch_size, seq_len=seq_len, device=h.device, row_layout=row_layout
        )
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=h.device).expand(batch_size, seq_len)
        return h, self.rope(position_ids, dtype=h.dtype), mask

    def attention_mask(
        self,
        position_ids: torch.Tensor | None,
        *,
        batch_size: int,
        seq_len: int,
        device: torch.device,
        row_layout: RowLayout | None,
    ) -> Any:
        """What every layer's attention gets as its mask (with the variants of `sliding_windows`)."""
        return build_attention_mask(
            position_ids,
            backend=self.attn_backend,
            batch_size=batch_size,
            seq_len=seq_len,
            device=device,
            layout=row_layout,
            cp_group=self.cp_group,
            sliding_windows=self.sliding_windows,
        )

    @property
    def sliding_windows(self) -> tuple[int, ...]:
        """The sliding windows the layers' attentions use (none here)."""
        return ()

    def rope(self, position_ids: torch.Tensor, *, dtype: torch.dtype) -> Any:
        """What every layer's attention gets to rotate with: RoPE's cos/sin [B, T, rotary_dim]
        (families whose layers rotate differently give one per kind of layer)."""
        return rope_cos_sin(position_ids, head_dim=self.rotary_dim, theta=self.args.rope_theta, dtype=dtype)


def common_args_from_hf_config(config: dict[str, Any]) -> dict[str, Any]:
    num_heads = config["num_attention_heads"]
    return {
        "vocab_size": config["vocab_size"],
        "dim": config["hidden_size"],
        "num_layers": config["num_hidden_layers"],
        "num_heads": num_heads,
        "num_kv_heads": config.get("num_key_value_heads") or num_heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // num_heads,
        "hidden_dim": config["intermediate_size"],
        "norm_eps": config["rms_norm_eps"],
        # transformers 5 writes rope_parameters, the hub's files rope_theta.
        "rope_theta": (config.get("rope_parameters") or {}).get("rope_theta", config.get("rope_theta", 10_000.0)),
        "tie_word_embeddings": config.get("tie_word_embeddings", False),
    }


def check_supported_hf_config(config: dict[str, Any]) -> None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    unsupported = {
        "attention_bias": bool(config.get("attention_bias")),
        "use_sliding_window": bool(config.get("use_sliding_window")),
        f"rope type {rope_type!r}": rope_type != "default",
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own Qwen3 implementation lacks: {names}; use impl='hf'")
