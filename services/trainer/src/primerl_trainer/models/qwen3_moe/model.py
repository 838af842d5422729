"""Qwen3-MoE: Qwen3's attention with mixture-of-experts feed-forward blocks (softmax top-k
routing, no shared experts). Layers listed in `mlp_only_layers`, or off the
`decoder_sparse_step` grid, keep a dense feed-forward block, as in transformers.

The forward takes optional replayed expert indices (R3) and returns the experts it used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from primerl_trainer.models.common.attention import AttentionMask
from primerl_trainer.models.common.norms import RMSNorm
from primerl_trainer.models.common.outputs import CausalLMOutput
from primerl_trainer.models.moe import ExpertsImpl, GroupedSigmoidRouting, MoE, check_routed_experts
from primerl_trainer.models.qwen3.model import (
    Attention,
    Qwen3Model,
    Qwen3ModelArgs,
    TransformerBlock,
    check_supported_hf_config,
    common_args_from_hf_config,
)

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout


@dataclass(frozen=True, kw_only=True)
class Qwen3MoeModelArgs(Qwen3ModelArgs):
    num_experts: int
    top_k: int
    moe_hidden_dim: int
    norm_topk_prob: bool
    moe_layers: tuple[int, ...]
    # How the experts run (moe.GroupedExperts); not part of the checkpoint's config.
    experts_impl: ExpertsImpl = "auto"

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        check_supported_hf_config(config)
        if config.get("num_experts", 0) <= 0:
            raise ValueError(f"a Qwen3-MoE config needs num_experts > 0, got {config.get('num_experts')}")
        mlp_only_layers = set(config.get("mlp_only_layers") or ())
        sparse_step = config.get("decoder_sparse_step", 1)
        moe_layers = tuple(
            i for i in range(config["num_hidden_layers"]) if i not in mlp_only_layers and (i + 1) % sparse_step == 0
        )
        if not moe_layers:
            raise ValueError("the config leaves no mixture-of-experts layer (mlp_only_layers, decoder_sparse_step)")
        return cls(
            **common_args_from_hf_config(config),
            num_experts=config["num_experts"],
            top_k=config["num_experts_per_tok"],
            moe_hidden_dim=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", False),
            moe_layers=moe_layers,
        )


class MoETransformerBlock(nn.Module):
    def __init__(self, args: Qwen3MoeModelArgs) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.attention = self.build_attention(args)
        self.ffn_norm = RMSNorm(args.dim, eps=args.norm_eps)
        self.moe = self.build_moe(args)
        self.shared_experts = self.build_shared_experts(args)

    def build_attention(self, args: Qwen3MoeModelArgs) -> nn.Module:
        return Attention(args)

    def routing(self, args: Qwen3MoeModelArgs) -> GroupedSigmoidRouting | None:
        """None: softmax top-k (Qwen3-MoE); families with grouped sigmoid routing give theirs."""
        return None

    def build_moe(self, args: Qwen3MoeModelArgs) -> MoE:
        return MoE(
            dim=args.dim,
            hidden_dim=args.moe_hidden_dim,
            num_experts=args.num_experts,
            top_k=args.top_k,
            norm_topk_prob=args.norm_topk_prob,
            experts_impl=args.experts_impl,
            grouped_sigmoid=self.routing(args),
        )

    def build_shared_experts(self, args: Qwen3MoeModelArgs) -> nn.Module | None:
        """None: no shared experts (Qwen3-MoE); families with them give the module whose output
        run_experts adds to the routed one."""
        return None

    def run_experts(
        self, h: torch.Tensor, replayed_experts_TK: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The normed hidden states through the experts (and the shared experts, if any): (output,
        expert ids [T, K], tokens per expert [E])."""
        routed, expert_ids_TK, tokens_per_expert_E = self.moe(h, replayed_experts_TK)
        if self.shared_experts is not None:
            routed = routed + self.shared_experts(h)
        return routed, expert_ids_TK, tokens_per_expert_E

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        mask: AttentionMask,
        replayed_experts_TK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """-> (hidden states, expert ids [T, K], tokens per expert [E])."""
        x = x + self.attention(self.attention_norm(x), rope, mask)
        moe_out, expert_ids_TK, tokens_per_expert_E = self.run_experts(self.ffn_norm(x), replayed_experts_TK)
        return x + moe_out, expert_ids_TK, tokens_per_expert_E


class Qwen3MoeModel(Qwen3Model):
    args: Qwen3MoeModelArgs
    # The blocks of MoE layers and of the others; families change them.
    moe_block_cls: type[nn.Module] = MoETransformerBlock
    dense_block_cls: type[nn.Module] = TransformerBlock

    def build_block(self, layer_id: int) -> nn.Module:
        block_cls = self.moe_block_cls if layer_id in self.args.moe_layers else self.dense_block_cls
        return block_cls(self.args)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        routed_experts: torch.Tensor | None = None,
        compute_logits: bool = True,
        row_layout: RowLayout | None = None,
    ) -> CausalLMOutput:
        """input_ids [B, T]; position_ids [B, T] or None; routed_experts
        [B*T, num_moe_layers, top_k] to replay inference's routing (R3);
        `compute_logits=False` returns the final-normed hidden states instead of the logits;
        `row_layout` as in Qwen3Model.forward (routed experts are then the local tokens')."""
        if routed_experts is not None:
            routed_experts = check_routed_experts(
                routed_experts,
                num_tokens=input_ids.numel(),
                num_moe_layers=len(self.args.moe_layers),
                top_k=self.args.top_k,
                num_experts=self.args.num_experts,
            )
        h, rope, mask = self.embed(input_ids, position_ids, row_layout)
        expert_ids, tokens_per_expert = [], []
        # Layers are told apart by number, not type: activation checkpointing and compile
        # wrap the blocks.
        for layer_id, block in self.layers.items():
            if int(layer_id) not in self.args.moe_layers:
                h = block(h, rope, mask)
                continue
            replayed = None if routed_experts is None else routed_experts[:, len(expert_ids)]
            h, expert_ids_TK, tokens_per_expert_E = block(h, rope, mask, replayed)
            expert_ids.append(expert_ids_TK)
            tokens_per_expert.append(tokens_per_expert_E)
        return self.output(
            h,
            compute_logits=compute_logits,
            routed_experts=torch.stack(expert_ids, dim=1),
            tokens_per_expert=torch.stack(tokens_per_expert),
        )
