"""AFMoE parameter names <-> Hugging Face's: Qwen3-MoE's mapping (attention, dense layers,
experts stacked as `moe.experts.w13`/`w2`) with AFMoE's own names: the router under
`mlp.router.gate`, its `mlp.expert_bias` (the own router's `e_score_correction_bias`), the
shared experts, the attention's output gate (`self_attn.gate_proj`), the o_proj bias, and the
four norms of a layer (`post_attention_layernorm` is the attention output's norm here, not the
feed-forward's input norm as in Qwen3: that one is `pre_mlp_layernorm`).

Values pass through untouched, so HF -> own -> HF is bit-exact."""

from typing import ClassVar

from primerl_trainer.models.afmoe.model import AfmoeModelArgs
from primerl_trainer.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter

_RENAMED = {"model.layers.{}.mlp.gate.weight", "model.layers.{}.post_attention_layernorm.weight"}


class AfmoeStateDictAdapter(Qwen3MoeStateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **{hf: own for hf, own in Qwen3MoeStateDictAdapter.from_hf_map.items() if hf not in _RENAMED},
        "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
        "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
        "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
        "model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
        "model.layers.{}.self_attn.gate_proj.weight": "layers.{}.attention.wg.weight",
        "model.layers.{}.post_attention_layernorm.weight": "layers.{}.post_attention_norm.weight",
        "model.layers.{}.pre_mlp_layernorm.weight": "layers.{}.ffn_norm.weight",
        "model.layers.{}.post_mlp_layernorm.weight": "layers.{}.post_ffn_norm.weight",
        "model.layers.{}.mlp.router.gate.weight": "layers.{}.moe.router.gate.weight",
        "model.layers.{}.mlp.expert_bias": "layers.{}.moe.router.e_score_correction_bias",
        "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.shared_experts.w1.weight",
        "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.shared_experts.w3.weight",
        "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.shared_experts.w2.weight",
    }
    args: AfmoeModelArgs
