"""Qwen3 parameter names <-> Hugging Face's.

Tensors pass through untouched (same objects, no copy, no cast), so HF -> own -> HF gives
back the very tensors that were read. Feed `to_hf` a full state dict: FSDP-sharded
parameters are gathered first (torch.distributed.checkpoint.state_dict.get_model_state_dict
with full_state_dict=True)."""

import re
from typing import ClassVar

import torch

from primerl_trainer.models.qwen3.model import Qwen3ModelArgs

# The layer number in a parameter name, e.g. "3" in "model.layers.3.mlp.up_proj.weight".
_LAYER_NUMBER = re.compile(r"(?<=layers\.)\d+(?=\.)")


class Qwen3StateDictAdapter:
    # Hugging Face name -> own name, with {} for the layer number; None: dropped on load
    # (older checkpoints saved the rotary table).
    from_hf_map: ClassVar[dict[str, str | None]] = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.layers.{}.input_layernorm.weight": "layers.{}.attention_norm.weight",
        "model.layers.{}.self_attn.q_proj.weight": "layers.{}.attention.wq.weight",
        "model.layers.{}.self_attn.k_proj.weight": "layers.{}.attention.wk.weight",
        "model.layers.{}.self_attn.v_proj.weight": "layers.{}.attention.wv.weight",
        "model.layers.{}.self_attn.o_proj.weight": "layers.{}.attention.wo.weight",
        "model.layers.{}.self_attn.q_norm.weight": "layers.{}.attention.q_norm.weight",
        "model.layers.{}.self_attn.k_norm.weight": "layers.{}.attention.k_norm.weight",
        "model.layers.{}.self_attn.rotary_emb.inv_freq": None,
        "model.layers.{}.post_attention_layernorm.weight": "layers.{}.ffn_norm.weight",
        "model.layers.{}.mlp.gate_proj.weight": "layers.{}.feed_forward.w1.weight",
        "model.layers.{}.mlp.up_proj.weight": "layers.{}.feed_forward.w3.weight",
        "model.layers.{}.mlp.down_proj.weight": "layers.{}.feed_forward.w2.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "lm_head.weight",
    }

    def __init__(self, args: Qwen3ModelArgs) -> None:
        self.args = args
        self.to_hf_map = {own: hf for hf, own in self.from_hf_map.items() if own is not None}

    def from_hf(self, hf_state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state_dict = {}
        for key, value in hf_state_dict.items():
            template, layer = _split_layer(key)
            if template not in self.from_hf_map:
                raise ValueError(f"unexpected tensor {key!r} in a {type(self.args).__name__} checkpoint")
            own = self.from_hf_map[template]
            # A tied model has no head of its own; a tied checkpoint that still carries
            # lm_head carries the embedding again.
            if own is not None and not (own == "lm_head.weight" and self.args.tie_word_embeddings):
                state_dict[own.format(layer)] = value
        return state_dict

    def to_hf(self, state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        hf_state_dict = {}
        for key, value in state_dict.items():
            template, layer = _split_layer(key)
            if template not in self.to_hf_map:
                raise ValueError(f"no Hugging Face name for parameter {key!r}")
            hf_state_dict[self.to_hf_map[template].format(layer)] = value
        return hf_state_dict


def _split_layer(key: str) -> tuple[str, str | None]:
    """("model.layers.{}.mlp.up_proj.weight", "3") for "model.layers.3.mlp.up_proj.weight"."""
    match = _LAYER_NUMBER.search(key)
    if match is None:
        return key, None
    return key[: match.start()] + "{}" + key[match.end() :], match.group()
