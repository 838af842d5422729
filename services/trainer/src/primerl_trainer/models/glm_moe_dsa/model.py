"""GLM-5 (transformers' `glm_moe_dsa`): GLM-4.5's mixture of experts (grouped sigmoid routing
with the correction bias, shared experts, dense first layers from `mlp_layer_types`) under
multi-head latent attention (common/mla.py) with DeepSeek's sparse attention
(common/sparse_attention.py): every query attends to the `index_topk` keys of its sample that
an indexer picks. Layers marked "full" in `indexer_types` run their own indexer; "shared" ones
reuse the previous full layer's selection.

The forward takes replayed experts (R3) as Qwen3-MoE's does, and replayed token selections
(`selected_tokens`, the form inference records: positions within the sample) for the full
layers; it returns both (GlmMoeDsaOutput). The indexers' weights are frozen: their selection
has no gradient.

Context parallel is not supported (the indexer scores every key of the row): setting the
model's cp group (parallel.cp > 1) raises.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

import torch
import torch.distributed as dist
from torch import nn

from primerl_trainer.models.common.attention import attention
from primerl_trainer.models.common.mla import MultiHeadLatentAttention
from primerl_trainer.models.common.outputs import CausalLMOutput
from primerl_trainer.models.common.sparse_attention import LightningIndexer, TokenSelection, VisibleKeys
from primerl_trainer.models.glm4_moe.model import Glm4MoeBlock
from primerl_trainer.models.moe import GroupedSigmoidRouting, check_routed_experts
from primerl_trainer.models.qwen3.model import TransformerBlock, common_args_from_hf_config
from primerl_trainer.models.qwen3_moe.model import Qwen3MoeModel, Qwen3MoeModelArgs

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout


@dataclass(frozen=True, kw_only=True)
class GlmMoeDsaModelArgs(Qwen3MoeModelArgs):
    num_shared_experts: int
    routing: GroupedSigmoidRouting
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    index_topk: int
    index_head_dim: int
    index_num_heads: int
    # Layers with their own indexer ("full"); the others reuse the previous one's selection.
    indexer_layers: tuple[int, ...]

    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        check_supported_glm_moe_dsa_config(config)
        num_layers = config["num_hidden_layers"]
        mlp_types = config.get("mlp_layer_types") or [
            "dense" if i < config.get("first_k_dense_replace", 3) else "sparse" for i in range(num_layers)
        ]
        if len(mlp_types) != num_layers or set(mlp_types) - {"dense", "sparse"} or "sparse" not in mlp_types:
            raise ValueError(
                f"mlp_layer_types must name 'dense' or 'sparse' for each of the {num_layers} layers, at least one "
                f"sparse, got {mlp_types}"
            )
        indexer_types = _indexer_types(config)
        if len(indexer_types) != num_layers or set(indexer_types) - {"full", "shared"} or indexer_types[0] != "full":
            raise ValueError(
                f"indexer_types must name 'full' or 'shared' for each of the {num_layers} layers, the first "
                f"'full' (a shared layer reuses an earlier selection), got {indexer_types}"
            )
        common = common_args_from_hf_config(config)
        return cls(
            **(common | {"head_dim": config["qk_rope_head_dim"]}),
            num_experts=config["n_routed_experts"],
            top_k=config["num_experts_per_tok"],
            moe_hidden_dim=config["moe_intermediate_size"],
            norm_topk_prob=config.get("norm_topk_prob", True),
            moe_layers=tuple(i for i, kind in enumerate(mlp_types) if kind == "sparse"),
            num_shared_experts=config.get("n_shared_experts", 1),
            routing=GroupedSigmoidRouting(
                num_groups=config.get("n_group", 1),
                top_k_groups=config.get("topk_group", 1),
                scaling_factor=config.get("routed_scaling_factor", 1.0),
            ),
            q_lora_rank=config["q_lora_rank"],
            kv_lora_rank=config["kv_lora_rank"],
            qk_nope_head_dim=config["qk_nope_head_dim"],
            qk_rope_head_dim=config["qk_rope_head_dim"],
            v_head_dim=config["v_head_dim"],
            index_topk=config["index_topk"],
            index_head_dim=config["index_head_dim"],
            index_num_heads=config["index_n_heads"],
            indexer_layers=tuple(i for i, kind in enumerate(indexer_types) if kind == "full"),
        )


def _indexer_types(config: dict[str, Any]) -> list[str]:
    """`indexer_types`, or transformers' default from index_topk_pattern / index_topk_freq and
    index_skip_topk_offset."""
    if config.get("indexer_types") is not None:
        return list(config["indexer_types"])
    pattern = config.get("index_topk_pattern")
    if pattern is not None:
        return [{"F": "full", "S": "shared"}.get(c, c) for c in pattern] if isinstance(pattern, str) else list(pattern)
    freq, offset = max(config.get("index_topk_freq", 1), 1), config.get("index_skip_topk_offset", 2)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(config["num_hidden_layers"])]


# The layer kind's names: transformers 5.17 writes "deepseek_sparse_attention", 5.19
# "indexed_attention" (and reads the old name as the new one).
INDEXED_ATTENTION_LAYER_TYPES = frozenset({"indexed_attention", "deepseek_sparse_attention"})


def check_supported_glm_moe_dsa_config(config: dict[str, Any]) -> None:
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    num_heads = config["num_attention_heads"]
    unsupported = {
        f"rope_parameters: rope type {rope_type!r}": rope_type != "default",
        f"hidden_act {config.get('hidden_act')!r}": config.get("hidden_act", "silu") != "silu",
        "attention_bias": bool(config.get("attention_bias")),
        "q_lora_rank None (the indexer reads the query latent)": not config.get("q_lora_rank"),
        f"num_key_value_heads {config.get('num_key_value_heads')} != num_attention_heads {num_heads}": (
            config.get("num_key_value_heads") or num_heads
        )
        != num_heads,
        "n_routed_experts <= 0": config.get("n_routed_experts", 0) <= 0,
        "quantization_config (the hub's FP8 checkpoints)": bool(config.get("quantization_config")),
        f"layer_types other than 'indexed_attention': {config.get('layer_types')}": bool(
            set(config.get("layer_types") or ()) - INDEXED_ATTENTION_LAYER_TYPES
        ),
    }
    if any(unsupported.values()):
        names = [name for name, present in unsupported.items() if present]
        raise ValueError(f"config uses features the own GLM-5 implementation lacks: {names}; use impl='hf'")
    if config.get("index_topk", 0) < 1:
        raise ValueError(f"index_topk must be positive, got {config.get('index_topk')}")
    if not config["qk_rope_head_dim"] <= config.get("index_head_dim", 0):
        raise ValueError(
            f"index_head_dim ({config.get('index_head_dim')}) must hold the rotated qk_rope_head_dim "
            f"({config['qk_rope_head_dim']})"
        )


@dataclass(frozen=True)
class GlmMoeDsaOutput(CausalLMOutput):
    """CausalLMOutput plus selected_tokens: [B*T, num indexer layers, K] int64, the positions
    within its sample of the keys each token attended to in each full indexer layer (ascending,
    -1 after the last; the replayed ones when the forward was given them)."""

    selected_tokens: torch.Tensor | None = None


class GlmMoeDsaAttention(MultiHeadLatentAttention):
    """MLA whose keys are those the indexer picks (or the previous full layer picked)."""

    def __init__(self, args: GlmMoeDsaModelArgs, layer_id: int) -> None:
        super().__init__(
            dim=args.dim,
            num_heads=args.num_heads,
            q_lora_rank=args.q_lora_rank,
            kv_lora_rank=args.kv_lora_rank,
            qk_nope_head_dim=args.qk_nope_head_dim,
            qk_rope_head_dim=args.qk_rope_head_dim,
            v_head_dim=args.v_head_dim,
        )
        self.indexer = None
        if layer_id in args.indexer_layers:
            self.indexer = LightningIndexer(
                dim=args.dim,
                q_lora_rank=args.q_lora_rank,
                num_heads=args.index_num_heads,
                head_dim=args.index_head_dim,
                rope_dim=args.qk_rope_head_dim,
                top_k=args.index_topk,
            )
            self.indexer.requires_grad_(False)

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        visible: VisibleKeys,
        selection: TokenSelection | None = None,
        replayed_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, TokenSelection]:
        """-> (output, the selection used). Full layers select (or take `replayed_tokens` [B, T, K]);
        shared ones use `selection`."""
        q, k, v, q_latent = self.project(x, rope)
        if self.indexer is not None:
            if replayed_tokens is not None:
                selection = TokenSelection.replayed(replayed_tokens, visible)
            else:
                selection = self.indexer(x, q_latent, rope, visible)
        assert selection is not None, "a shared indexer layer needs an earlier full layer's selection"
        mask = selection.flex_attention_mask() if visible.backend == "flex" else selection.attention_mask()
        return self.wo(attention(q, k, v, mask).flatten(2)), selection


class _SparseMlaBlock:
    """A block whose attention is its layer's sparse MLA (mixed in before the block class)."""

    def __init__(self, args: GlmMoeDsaModelArgs, layer_id: int) -> None:
        self.layer_id = layer_id
        super().__init__(args)

    def build_attention(self, args: GlmMoeDsaModelArgs) -> nn.Module:
        return GlmMoeDsaAttention(args, self.layer_id)


class GlmMoeDsaDenseBlock(_SparseMlaBlock, TransformerBlock):
    """The dense first layers: sparse MLA, a dense feed-forward."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        visible: VisibleKeys,
        selection: TokenSelection | None = None,
        replayed_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, TokenSelection]:
        out, selection = self.attention(self.attention_norm(x), rope, visible, selection, replayed_tokens)
        x = x + out
        return x + self.feed_forward(self.ffn_norm(x)), selection


class GlmMoeDsaBlock(_SparseMlaBlock, Glm4MoeBlock):
    """Sparse MLA, then GLM-4.5's routed and shared experts."""

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        visible: VisibleKeys,
        replayed_experts_TK: torch.Tensor | None = None,
        selection: TokenSelection | None = None,
        replayed_tokens: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, TokenSelection]:
        out, selection = self.attention(self.attention_norm(x), rope, visible, selection, replayed_tokens)
        x = x + out
        moe_out, expert_ids_TK, tokens_per_expert_E = self.run_experts(self.ffn_norm(x), replayed_experts_TK)
        return x + moe_out, expert_ids_TK, tokens_per_expert_E, selection


class GlmMoeDsaModel(Qwen3MoeModel):
    args: GlmMoeDsaModelArgs
    moe_block_cls = GlmMoeDsaBlock
    dense_block_cls = GlmMoeDsaDenseBlock

    def build_block(self, layer_id: int) -> nn.Module:
        block_cls = self.moe_block_cls if layer_id in self.args.moe_layers else self.dense_block_cls
        return block_cls(self.args, layer_id)

    @property
    def cp_group(self) -> dist.ProcessGroup | None:
        return None

    @cp_group.setter
    def cp_group(self, group: dist.ProcessGroup | None) -> None:
        if group is not None:
            raise ValueError(
                "parallel.cp > 1 is not supported for glm_moe_dsa: the sparse-attention indexer scores every key "
                "of the row; use parallel.cp = 1"
            )

    @property
    def rotary_dim(self) -> int:
        return self.args.qk_rope_head_dim

    def attention_mask(
        self,
        position_ids: torch.Tensor | None,
        *,
        batch_size: int,
        seq_len: int,
        device: torch.device,
        row_layout: RowLayout | None,
    ) -> VisibleKeys:
        if row_layout is not None and row_layout.cp_size > 1:
            raise ValueError("parallel.cp > 1 is not supported for glm_moe_dsa (row layout of cp_size > 1)")
        if position_ids is None:
            position_ids = torch.arange(seq_len, device=device).expand(batch_size, seq_len)
        return VisibleKeys.of(position_ids.to(device), backend=self.attn_backend)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        routed_experts: torch.Tensor | None = None,
        selected_tokens: torch.Tensor | None = None,
        compute_logits: bool = True,
        row_layout: RowLayout | None = None,
    ) -> GlmMoeDsaOutput:
        """As Qwen3MoeModel's, plus `selected_tokens` [B*T, num indexer layers, K] (K <= index_topk)
        to replay inference's token selection: positions within each token's sample, -1 for none."""
        batch_size, seq_len = input_ids.shape
        if routed_experts is not None:
            routed_experts = check_routed_experts(
                routed_experts,
                num_tokens=input_ids.numel(),
                num_moe_layers=len(self.args.moe_layers),
                top_k=self.args.top_k,
                num_experts=self.args.num_experts,
            )
        if selected_tokens is not None:
            selected_tokens = check_selected_tokens(
                selected_tokens,
                num_tokens=input_ids.numel(),
                num_indexer_layers=len(self.args.indexer_layers),
                index_topk=self.args.index_topk,
            ).view(batch_size, seq_len, len(self.args.indexer_layers), -1)
        h, rope, visible = self.embed(input_ids, position_ids, row_layout)
        expert_ids, tokens_per_expert, selections = [], [], []
        selection = None
        for layer_id, block in self.layers.items():
            replayed_tokens = None
            if int(layer_id) in self.args.indexer_layers and selected_tokens is not None:
                replayed_tokens = selected_tokens[:, :, len(selections)]
            if int(layer_id) not in self.args.moe_layers:
                h, new_selection = block(h, rope, visible, selection=selection, replayed_tokens=replayed_tokens)
            else:
                replayed = None if routed_experts is None else routed_experts[:, len(expert_ids)]
                h, expert_ids_TK, tokens_per_expert_E, new_selection = block(
                    h, rope, visible, replayed, selection=selection, replayed_tokens=replayed_tokens
                )
                expert_ids.append(expert_ids_TK)
                tokens_per_expert.append(tokens_per_expert_E)
            if new_selection is not selection:
                selections.append(new_selection.positions.flatten(0, 1))
            selection = new_selection
        out = self.output(
            h,
            compute_logits=compute_logits,
            routed_experts=torch.stack(expert_ids, dim=1),
            tokens_per_expert=torch.stack(tokens_per_expert),
        )
        return GlmMoeDsaOutput(
            **{f.name: getattr(out, f.name) for f in fields(out)}, selected_tokens=torch.stack(selections, dim=1)
        )


def check_selected_tokens(
    selected_tokens: torch.Tensor, *, num_tokens: int, num_indexer_layers: int, index_topk: int
) -> torch.Tensor:
    """Validates replayed token selections [num_tokens, num_indexer_layers, K] (1 <= K <=
    index_topk; integer positions within the sample, -1 for none) and returns them as int64.
    Positions past the query's own are refused by TokenSelection.replayed's masking (dropped)."""
    shape = tuple(selected_tokens.shape)
    if len(shape) != 3 or shape[:2] != (num_tokens, num_indexer_layers) or not 1 <= shape[2] <= index_topk:
        raise ValueError(
            f"selected_tokens must have shape [num_tokens, num_indexer_layers, K <= index_topk] = "
            f"[{num_tokens}, {num_indexer_layers}, <= {index_topk}], got {list(shape)}"
        )
    if (
        selected_tokens.dtype.is_floating_point
        or selected_tokens.dtype.is_complex
        or selected_tokens.dtype == torch.bool
    ):
        raise ValueError(f"selected_tokens must hold integer token positions, got dtype {selected_tokens.dtype}")
    selected_tokens = selected_tokens.to(torch.int64)
    if selected_tokens.numel() and selected_tokens.min() < -1:
        raise ValueError(f"selected_tokens holds positions below -1: min {selected_tokens.min().item()}")
    return selected_tokens
