"""MiniMax-M2 parameter names <-> Hugging Face's. The hub stores the mixture of experts under
Mixtral's names (`block_sparse_moe.gate`, `block_sparse_moe.experts.{e}.w1/w3/w2` = gate, up,
down) with the correction bias beside the gate (`block_sparse_moe.e_score_correction_bias`).
They are renamed to Qwen3-MoE's hub names and mapped by Qwen3-MoE's adapter (experts stacked as
`moe.experts.w13`/`w2`), and back on export.

Hub checkpoints may also hold multi-token-prediction layers after the last decoder layer
(`model.layers.{num_hidden_layers + i}.*`); transformers does not load them and neither does the
trainer. Values pass through untouched, so HF -> own -> HF is bit-exact for the rest."""

import re
from typing import ClassVar

import torch

from primerl_trainer.models.minimax_m2.model import MiniMaxM2ModelArgs
from primerl_trainer.models.qwen3.state_dict_adapter import _split_layer
from primerl_trainer.models.qwen3_moe.state_dict_adapter import Qwen3MoeStateDictAdapter

_PROJ_FROM_HUB = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_PROJ_TO_HUB = {qwen: hub for hub, qwen in _PROJ_FROM_HUB.items()}
_HUB_EXPERT = re.compile(r"(model\.layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight")
_QWEN_EXPERT = re.compile(r"(model\.layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_GATE = ("block_sparse_moe.gate.weight", "mlp.gate.weight")


class MiniMaxM2StateDictAdapter(Qwen3MoeStateDictAdapter):
    from_hf_map: ClassVar[dict[str, str | None]] = {
        **Qwen3MoeStateDictAdapter.from_hf_map,
        "model.layers.{}.block_sparse_moe.e_score_correction_bias": "layers.{}.moe.router.e_score_correction_bias",
    }
    args: MiniMaxM2ModelArgs

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return super().from_hf(
            {_from_hub_name(key): value for key, value in hf_state_dict.items() if not self._is_mtp_layer(key)}
        )

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        return {_to_hub_name(key): value for key, value in super().to_hf(state_dict).items()}

    def _is_mtp_layer(self, key: str) -> bool:
        _, layer = _split_layer(key)
        return key.startswith("model.layers.") and layer is not None and int(layer) >= self.args.num_layers


def _from_hub_name(key: str) -> str:
    match = _HUB_EXPERT.fullmatch(key)
    if match is not None:
        prefix, expert, proj = match.groups()
        return f"{prefix}.mlp.experts.{expert}.{_PROJ_FROM_HUB[proj]}.weight"
    hub, qwen = _GATE
    return key.removesuffix(hub) + qwen if key.endswith(hub) else key


def _to_hub_name(key: str) -> str:
    match = _QWEN_EXPERT.fullmatch(key)
    if match is not None:
        prefix, expert, proj = match.groups()
        return f"{prefix}.block_sparse_moe.experts.{expert}.{_PROJ_TO_HUB[proj]}.weight"
    hub, qwen = _GATE
    return key.removesuffix(qwen) + hub if key.endswith(qwen) else key
