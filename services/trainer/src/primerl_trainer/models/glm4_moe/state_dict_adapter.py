"""GLM-4.5 parameter names <-> Hugging Face's: Qwen3-MoE's mapping (attention, dense layers,
router gate, experts stacked as `moe.experts.w13`/`w2`) plus attention biases, the router's
`e_score_correction_bias` and the shared experts.

Hub checkpoints of GLM-4.5 also hold the multi-token-prediction layer(s) after the last
decoder layer (`model.layers.{num_hidden_layers + i}.*`, for speculative decoding). The trainer
does not train them: they are dropped on load, as transformers drops them, and absent from
exports. Values pass through untouched, so HF -> own -> HF is bit-exact for the rest."""

from typing import ClassVar

import torch

from primerl_trainer.models.glm4_moe.model import Glm4MoeModelArgs
from primerl_trainer.models.qwen3.state_dict_adapter import _split_layer
from primerl_trainer.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter


class Glm4MoeStateDictAdapter(Qwen3MoeStateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **Qwen3MoeStateDictAdapter.from_hf_map,
        "model.layers.{}.self_attn.q_proj.bias": "layers.{}.attention.wq.bias",
        "model.layers.{}.self_attn.k_proj.bias": "layers.{}.attention.wk.bias",
        "model.layers.{}.self_attn.v_proj.bias": "layers.{}.attention.wv.bias",
        "model.layers.{}.mlp.gate.e_score_correction_bias": "layers.{}.moe.router.e_score_correction_bias",
        "model.layers.{}.mlp.shared_experts.gate_proj.weight": "layers.{}.shared_experts.w1.weight",
        "model.layers.{}.mlp.shared_experts.up_proj.weight": "layers.{}.shared_experts.w3.weight",
        "model.layers.{}.mlp.shared_experts.down_proj.weight": "layers.{}.shared_experts.w2.weight",
    }
    args: Glm4MoeModelArgs

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().from_hf({key: value for key, value in hf_state_dict.items() if not self._is_mtp_layer(key)})

    def _is_mtp_layer(self, key: str) -> bool:
        _, layer = _split_layer(key)
        return key.startswith("model.layers.") and layer is not None and int(layer) >= self.args.num_layers
