"""Laguna parameter names <-> Hugging Face's: Qwen3-MoE's mapping (attention, dense layers,
router gate, experts stacked as `moe.experts.w13`/`w2`) plus the attention biases (o_proj's
included), the output gate (`self_attn.g_proj`), the router's correction bias (stored beside the
experts, `mlp.experts.e_score_correction_bias`) and the shared expert (`mlp.shared_expert`,
singular in the hub's files; `shared_experts` in the own model, as GLM-4.5's).

Values pass through untouched, so HF -> own -> HF is bit-exact."""

from typing import ClassVar

from primerl_trainer.models.laguna.model import LagunaModelArgs
from primerl_trainer.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter


class LagunaStateDictAdapter(Qwen3MoeStateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **Qwen3MoeStateDictAdapter.from_hf_map,
        "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
        "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
        "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
        "model.layers.{}.self_attn.o_proj.bias": "layers.{}.attention.wo.bias",
        "model.layers.{}.self_attn.g_proj.weight": "layers.{}.attention.wg.weight",
        "model.layers.{}.mlp.experts.e_score_correction_bias": "layers.{}.moe.router.e_score_correction_bias",
        "model.layers.{}.mlp.shared_expert.gate_proj.weight": "layers.{}.shared_experts.w1.weight",
        "model.layers.{}.mlp.shared_expert.up_proj.weight": "layers.{}.shared_experts.w3.weight",
        "model.layers.{}.mlp.shared_expert.down_proj.weight": "layers.{}.shared_experts.w2.weight",
    }
    args: LagunaModelArgs
