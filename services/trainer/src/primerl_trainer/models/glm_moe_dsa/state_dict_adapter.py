"""GLM-5 parameter names <-> Hugging Face's: GLM-4.5's mapping (experts stacked, router with its
correction bias, shared experts, multi-token-prediction layers dropped) with multi-head latent
attention and the indexer in place of q/k/v. Values pass through untouched (bit-exact)."""

from typing import ClassVar

from primerl_trainer.models.glm4_moe.state_dict_adapter import Glm4MoeStateDictAdapter

_ATTENTION = {
    "q_a_proj.weight": "wq_a.weight",
    "q_a_layernorm.weight": "q_norm.weight",
    "q_b_proj.weight": "wq_b.weight",
    "kv_a_proj_with_mqa.weight": "wkv_a.weight",
    "kv_a_layernorm.weight": "kv_norm.weight",
    "kv_b_proj.weight": "wkv_b.weight",
    "o_proj.weight": "wo.weight",
    "indexer.wq_b.weight": "indexer.wq_b.weight",
    "indexer.wk.weight": "indexer.wk.weight",
    "indexer.k_norm.weight": "indexer.k_norm.weight",
    "indexer.k_norm.bias": "indexer.k_norm.bias",
    "indexer.weights_proj.weight": "indexer.weights_proj.weight",
}


class GlmMoeDsaStateDictAdapter(Glm4MoeStateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **{
            hf: own
            for hf, own in Glm4MoeStateDictAdapter.from_hf_map.items()
            if not hf.startswith("model.layers.{}.self_attn.")
        },
        **{f"model.layers.{{}}.self_attn.{hf}": f"layers.{{}}.attention.{own}" for hf, own in _ATTENTION.items()},
    }
