"""Model shapes for the planner: the dimensions that decide memory and FLOPs, read from a Hugging
Face config.json (Qwen3, Qwen3-MoE, GLM-4.5 MoE, DeepSeek-V3 / Kimi-K2 and GLM-5 MLA layouts) or
named built-ins.

Multi-head latent attention (MLA: DeepSeek-V3, Kimi-K2, GLM-5) is counted exactly for parameters
(its low-rank q and kv projections). For FLOPs and activations it is taken as the attention the
training form computes (the trainer's models/common/mla.py expands the latent per head):
`num_heads` heads of query/key dim qk_nope + qk_rope and value dim v_head_dim, K and V per head;
context parallel is taken to gather the compressed latent (kv_lora_rank + qk_rope_head_dim per
token), though the trainer's GLM-5 refuses context parallel today.
GLM-5's DeepSeek sparse attention (DSA) indexer is counted in the parameters; its sparsity is not
modelled (attention is costed as dense causal, an over-estimate at long context).
"""

from __future__ import annotations

import json
import pathlib
from dataclasses import dataclass
from typing import Any

__all__ = ["BUILTIN_SHAPES", "ModelShape", "builtin_shape", "shape_from_hf_config", "shape_from_model_path"]


@dataclass(frozen=True)
class ModelShape:
    name: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    # The dense SwiGLU MLP of the first `num_dense_layers` layers (all of them when num_experts is 0).
    intermediate_size: int
    num_dense_layers: int
    num_experts: int = 0
    top_k: int = 0
    moe_intermediate_size: int = 0
    num_shared_experts: int = 0
    tie_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    # MLA: low-rank query (0: a full q projection) and key/value ranks; the rope part of the keys.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    # DSA indexer (GLM-5): heads and head dim of its scoring projections.
    index_heads: int = 0
    index_head_dim: int = 0
    note: str = ""

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.num_dense_layers if self.is_moe else 0

    @property
    def attention_params(self) -> int:
        """Parameters of one layer's attention (projections, their biases and norms)."""
        dim, heads = self.hidden_size, self.num_heads
        if self.is_mla:
            nope = self.qk_head_dim - self.qk_rope_head_dim
            if self.q_lora_rank:
                q = dim * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * heads * self.qk_head_dim
            else:
                q = dim * heads * self.qk_head_dim
            kv = dim * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
            kv += self.kv_lora_rank * heads * (nope + self.v_head_dim)
            out = heads * self.v_head_dim * dim
            indexer = 0
            if self.index_heads:
                indexer = (self.q_lora_rank or dim) * self.index_heads * self.index_head_dim
                indexer += dim * self.index_head_dim + dim * self.index_heads + 2 * self.index_head_dim
            return q + kv + out + indexer
        q_out = heads * self.qk_head_dim
        kv_out = self.num_kv_heads * (self.qk_head_dim + self.v_head_dim)
        params = dim * (q_out + kv_out) + heads * self.v_head_dim * dim
        if self.attention_bias:
            params += q_out + kv_out
        if self.qk_norm:
            params += 2 * self.qk_head_dim
        return params

    @property
    def kv_elements_per_token(self) -> int:
        """What context parallel gathers per token and layer: K and V of every KV head, or MLA's
        compressed latent and rope key (each rank expands them into heads itself)."""
        if self.is_mla:
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.num_kv_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def dense_mlp_params(self) -> int:
        return 3 * self.hidden_size * self.intermediate_size

    @property
    def expert_params(self) -> int:
        """One routed (or shared) expert's SwiGLU."""
        return 3 * self.hidden_size * self.moe_intermediate_size

    @property
    def router_params(self) -> int:
        return self.hidden_size * self.num_experts

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def head_params(self) -> int:
        return 0 if self.tie_embeddings else self.vocab_size * self.hidden_size

    @property
    def routed_expert_params(self) -> int:
        """All routed experts of all MoE layers: what expert parallel splits."""
        return self.num_moe_layers * self.num_experts * self.expert_params

    @property
    def total_params(self) -> int:
        norms = self.num_layers * 2 * self.hidden_size + self.hidden_size
        layers = self.num_layers * self.attention_params + self.num_dense_layers * self.dense_mlp_params
        moe = self.num_moe_layers * ((self.num_experts + self.num_shared_experts) * self.expert_params)
        moe += self.num_moe_layers * self.router_params
        return layers + moe + norms + self.embedding_params + self.head_params

    @property
    def active_params(self) -> int:
        """Parameters one token passes through (all embedding and head weights counted, as the
        model cards count them)."""
        inactive = self.num_moe_layers * (self.num_experts - self.top_k) * self.expert_params
        return self.total_params - inactive

    @property
    def matmul_params_per_token(self) -> int:
        """Matrix parameters a token multiplies with (no embedding lookup, no norms): 2x this is
        the forward FLOPs of the linear layers per token, outside the attention core."""
        head = self.vocab_size * self.hidden_size
        per_layer = self.num_layers * self.attention_params + self.num_dense_layers * self.dense_mlp_params
        moe = self.num_moe_layers * ((self.top_k + self.num_shared_experts) * self.expert_params + self.router_params)
        return per_layer + moe + head


def shape_from_hf_config(config: dict[str, Any], name: str = "model") -> ModelShape:
    """The shape of a Hugging Face config.json (dict). ValueError names what is missing."""

    def need(key: str) -> Any:
        if key not in config or config[key] is None:
            raise ValueError(f"config.json of {name} has no {key!r}")
        return config[key]

    dim = need("hidden_size")
    heads = need("num_attention_heads")
    layers = need("num_hidden_layers")
    num_experts = config.get("num_experts") or config.get("n_routed_experts") or 0
    if "first_k_dense_replace" in config:
        dense_layers = config["first_k_dense_replace"] if num_experts else layers
    elif num_experts:
        sparse_step = config.get("decoder_sparse_step", 1)
        mlp_only = set(config.get("mlp_only_layers") or [])
        dense_layers = sum(1 for i in range(layers) if i in mlp_only or (i + 1) % sparse_step != 0)
    else:
        dense_layers = layers
    common = {
        "name": name,
        "vocab_size": need("vocab_size"),
        "hidden_size": dim,
        "num_layers": layers,
        "num_heads": heads,
        "intermediate_size": config.get("intermediate_size") or 0,
        "num_dense_layers": dense_layers,
        "num_experts": num_experts,
        "top_k": config.get("num_experts_per_tok", 0) if num_experts else 0,
        "moe_intermediate_size": config.get("moe_intermediate_size", 0) if num_experts else 0,
        "num_shared_experts": config.get("n_shared_experts") or 0,
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
        "attention_bias": bool(config.get("attention_bias", False)),
    }
    if config.get("kv_lora_rank"):
        rope = need("qk_rope_head_dim")
        return ModelShape(
            **common,
            num_kv_heads=heads,
            qk_head_dim=need("qk_nope_head_dim") + rope,
            v_head_dim=need("v_head_dim"),
            q_lora_rank=config.get("q_lora_rank") or 0,
            kv_lora_rank=config["kv_lora_rank"],
            qk_rope_head_dim=rope,
            index_heads=config.get("index_n_heads", 0),
            index_head_dim=config.get("index_head_dim", 0),
            note="MLA costed as the per-head attention its training form computes",
        )
    head_dim = config.get("head_dim") or dim // heads
    model_type = config.get("model_type", "")
    return ModelShape(
        **common,
        num_kv_heads=config.get("num_key_value_heads") or heads,
        qk_head_dim=head_dim,
        v_head_dim=head_dim,
        qk_norm=model_type.startswith("qwen3") or bool(config.get("use_qk_norm", False)),
    )


def shape_from_model_path(path: str | pathlib.Path) -> ModelShape:
    config_path = pathlib.Path(path) / "config.json"
    if not config_path.is_file():
        raise ValueError(f"model.path {path} has no config.json")
    return shape_from_hf_config(json.loads(config_path.read_text()), name=pathlib.Path(path).name)


# Excerpts of the models' config.json (the fields the planner reads), as published on the
# Hugging Face hub under the repository named in `source`.
BUILTIN_SHAPES: dict[str, dict[str, Any]] = {
    "Qwen3-30B-A3B": {
        "source": "Qwen/Qwen3-30B-A3B config.json",
        "model_type": "qwen3_moe",
        "vocab_size": 151936,
        "hidden_size": 2048,
        "num_hidden_layers": 48,
        "num_attention_heads": 32,
        "num_key_value_heads": 4,
        "head_dim": 128,
        "intermediate_size": 6144,
        "num_experts": 128,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "tie_word_embeddings": False,
    },
    "GLM-4.5-Air": {
        "source": "zai-org/GLM-4.5-Air config.json (glm4_moe)",
        "model_type": "glm4_moe",
        "vocab_size": 151552,
        "hidden_size": 4096,
        "num_hidden_layers": 46,
        "num_attention_heads": 96,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "attention_bias": True,
        "intermediate_size": 10944,
        "first_k_dense_replace": 1,
        "n_routed_experts": 128,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 1408,
        "tie_word_embeddings": False,
    },
    "GLM-5": {
        "source": "zai-org/GLM-5-FP8 config.json (glm_moe_dsa: MLA + DSA indexer; MTP layer left out)",
        "model_type": "glm_moe_dsa",
        "vocab_size": 154880,
        "hidden_size": 6144,
        "num_hidden_layers": 78,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 2048,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 192,
        "qk_rope_head_dim": 64,
        "v_head_dim": 256,
        "index_n_heads": 32,
        "index_head_dim": 128,
        "intermediate_size": 12288,
        "first_k_dense_replace": 3,
        "n_routed_experts": 256,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "tie_word_embeddings": False,
    },
    "Kimi-K2": {
        "source": "moonshotai/Kimi-K2-Instruct config.json (DeepSeek-V3 layout: MLA, 384 experts; MTP left out)",
        "model_type": "kimi_k2",
        "vocab_size": 163840,
        "hidden_size": 7168,
        "num_hidden_layers": 61,
        "num_attention_heads": 64,
        "num_key_value_heads": 64,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "intermediate_size": 18432,
        "first_k_dense_replace": 1,
        "n_routed_experts": 384,
        "n_shared_experts": 1,
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 2048,
        "tie_word_embeddings": False,
    },
}


def builtin_shape(name: str) -> ModelShape:
    by_lower = {key.lower(): key for key in BUILTIN_SHAPES}
    key = by_lower.get(name.lower())
    if key is None:
        raise ValueError(f"unknown shape {name!r}; built-in shapes: {sorted(BUILTIN_SHAPES)}")
    return shape_from_hf_config(BUILTIN_SHAPES[key], name=key)
