"""Qwen3-VL (`qwen3_vl`, dense) and Qwen3-VL-MoE (`qwen3_vl_moe`): the vision tower of vision.py
in front of Qwen3's or Qwen3-MoE's decoder, whose blocks (attention, MLP or experts, norms) are
reused as they are.

With images, each image token's embedding is replaced by the vision tower's feature for it (the
images' tokens in order), and the first layers add the deepstack features at the same tokens to
their outputs. Positions are 3-D (t, h, w; positions.py) and rotate by the interleaved MRoPE
(common/rope.py): text alone, whose three rows are equal, rotates as plain RoPE.

The forward is Qwen3Model's / Qwen3MoeModel's (checks, router replay, outputs), plus
`pixel_values` and `image_grid_thw`; `position_ids` may be [B, T] (packed rows restart them at
each sample; with images the 3-D ones are derived per sample) or [3, B, T] (given 3-D ones; each
row is then one sample). The vision tower is frozen unless `train_vision`.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, Any, Self

import torch
from torch import nn

from primerl_trainer.models.common.attention import AttentionMask
from primerl_trainer.models.common.outputs import CausalLMOutput
from primerl_trainer.models.common.rope import RopeParameters
from primerl_trainer.models.qwen3.model import Qwen3Model, Qwen3ModelArgs, TransformerBlock
from primerl_trainer.models.qwen3_moe.model import MoETransformerBlock, Qwen3MoeModel, Qwen3MoeModelArgs
from primerl_trainer.models.qwen3_vl.positions import mrope_position_ids
from primerl_trainer.models.qwen3_vl.vision import VisionArgs, VisionModel

if TYPE_CHECKING:
    from primerl_trainer.distributed.context_parallel import RowLayout

# transformers' default when the config does not name the sections.
DEFAULT_MROPE_SECTION = (24, 20, 20)


@dataclass(frozen=True, kw_only=True)
class VisionLanguageArgs:
    """What the multimodal models add to their language model's args."""

    vision: VisionArgs
    mrope_section: tuple[int, int, int]
    image_token_id: int
    # Train the vision tower too (its parameters require grad); not part of the checkpoint's config.
    train_vision: bool = False


@dataclass(frozen=True, kw_only=True)
class Qwen3VLModelArgs(VisionLanguageArgs, Qwen3ModelArgs):
    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        return cls(**_language_model_fields(Qwen3ModelArgs, config), **_vision_language_fields(config))


@dataclass(frozen=True, kw_only=True)
class Qwen3VLMoeModelArgs(VisionLanguageArgs, Qwen3MoeModelArgs):
    @classmethod
    def from_hf_config(cls, config: dict[str, Any]) -> Self:
        return cls(**_language_model_fields(Qwen3MoeModelArgs, config), **_vision_language_fields(config))


def _language_model_fields(args_cls: type[Qwen3ModelArgs], config: dict[str, Any]) -> dict[str, Any]:
    """The language model's args from config.json's `text_config` (the head's tying is the top
    level's; Qwen3-VL-MoE's router always renormalises its top-k weights)."""
    text = config["text_config"]
    text = text | {
        "tie_word_embeddings": config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)),
        "norm_topk_prob": True,
    }
    args = args_cls.from_hf_config(text)
    return {field.name: getattr(args, field.name) for field in fields(args)}


def _vision_language_fields(config: dict[str, Any]) -> dict[str, Any]:
    text = config["text_config"]
    rope = text.get("rope_parameters") or text.get("rope_scaling") or {}
    if not rope.get("mrope_interleaved", True):
        raise ValueError("text_config: non-interleaved mrope (Qwen2.5-VL's layout) is not supported; use impl='hf'")
    return {
        "vision": VisionArgs.from_hf_config(config.get("vision_config") or {}),
        "mrope_section": tuple(rope.get("mrope_section", DEFAULT_MROPE_SECTION)),
        "image_token_id": config.get("image_token_id", 151655),
    }


@dataclass(frozen=True)
class LayerInputs:
    """What every decoder layer gets besides its hidden states and RoPE: the attention mask and,
    with images, the (row, column) indices of the image tokens, row-major, and the deepstack
    features [num_image_tokens, dim] that the first len(deepstack) layers add there."""

    attention: AttentionMask
    image_tokens: tuple[torch.Tensor, torch.Tensor] | None = None
    deepstack: tuple[torch.Tensor, ...] = ()

    def add_deepstack(self, h: torch.Tensor, layer_id: int) -> torch.Tensor:
        if layer_id >= len(self.deepstack):
            return h
        # Out of place and not a view: a block's output (FSDP's backward hook sits on it).
        return h.index_put(self.image_tokens, self.deepstack[layer_id].to(h.dtype), accumulate=True)


class DeepstackBlock(TransformerBlock):
    """Qwen3's block, then its layer's deepstack features."""

    def __init__(self, args: Qwen3ModelArgs, layer_id: int) -> None:
        super().__init__(args)
        self.layer_id = layer_id

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], inputs: LayerInputs) -> torch.Tensor:
        return inputs.add_deepstack(super().forward(x, rope, inputs.attention), self.layer_id)


class DeepstackMoEBlock(MoETransformerBlock):
    """Qwen3-MoE's block, then its layer's deepstack features."""

    def __init__(self, args: Qwen3MoeModelArgs, layer_id: int) -> None:
        super().__init__(args)
        self.layer_id = layer_id

    def forward(
        self,
        x: torch.Tensor,
        rope: tuple[torch.Tensor, torch.Tensor],
        inputs: LayerInputs,
        replayed_experts_TK: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        h, expert_ids_TK, tokens_per_expert_E = super().forward(x, rope, inputs.attention, replayed_experts_TK)
        return inputs.add_deepstack(h, self.layer_id), expert_ids_TK, tokens_per_expert_E


@dataclass(frozen=True)
class _Images:
    pixel_values: torch.Tensor
    grid_thw: torch.Tensor


class VisionLanguageModel(nn.Module):
    """The multimodal part of both models, mixed in before their language model's class, whose
    forward runs unchanged: the images reach `embed` through `_images`, set for one call."""

    args: Qwen3VLModelArgs | Qwen3VLMoeModelArgs

    def __init__(self, args: Qwen3VLModelArgs | Qwen3VLMoeModelArgs, **kwargs: Any) -> None:
        super().__init__(args, **kwargs)
        if args.vision.out_dim != args.dim:
            raise ValueError(f"vision out_hidden_size ({args.vision.out_dim}) must be the hidden_size ({args.dim})")
        if sum(args.mrope_section) != args.head_dim // 2:
            raise ValueError(
                f"mrope_section {list(args.mrope_section)} must sum to head_dim / 2 = {args.head_dim // 2}"
            )
        if len(args.vision.deepstack_layers) > args.num_layers:
            raise ValueError(f"{len(args.vision.deepstack_layers)} deepstack features for {args.num_layers} layers")
        self.visual = VisionModel(args.vision)
        self.visual.requires_grad_(args.train_vision)
        self._images: _Images | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        *,
        pixel_values: torch.Tensor | None = None,
        image_grid_thw: torch.Tensor | None = None,
        **kwargs: Any,
    ) -> CausalLMOutput:
        """input_ids [B, T]; position_ids [B, T], [3, B, T] or None; pixel_values [num_patches,
        patch_dim] and image_grid_thw [num_images, 3] (the processor's), both or neither; the
        other arguments are the language model's (routed_experts, compute_logits, row_layout)."""
        if (pixel_values is None) != (image_grid_thw is None):
            raise ValueError("pixel_values and image_grid_thw go together: give both or neither")
        self._images = None if pixel_values is None else _Images(pixel_values, image_grid_thw)
        try:
            return super().forward(input_ids, position_ids, **kwargs)
        finally:
            self._images = None

    def embed(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor | None, row_layout: RowLayout | None = None
    ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor], LayerInputs]:
        """The language model's embed, then the image features at the image tokens, and RoPE of
        the 3-D positions."""
        mrope_positions = None
        if position_ids is not None and position_ids.ndim == 3:
            if position_ids.shape != (3, *input_ids.shape):
                raise ValueError(
                    f"3-D position_ids must be [3, *input_ids.shape] = {[3, *input_ids.shape]}, "
                    f"got {list(position_ids.shape)}"
                )
            mrope_positions, position_ids = position_ids, None
        h, rope, mask = super().embed(input_ids, position_ids, row_layout)
        # A host sync (off the CPU), cheap next to the forward: it catches prompts whose images
        # went missing, and indexes the image tokens.
        image_tokens = (input_ids == self.args.image_token_id).nonzero(as_tuple=True)
        num_image_tokens = image_tokens[0].numel()
        if self._images is None:
            if num_image_tokens:
                raise ValueError(f"input_ids holds {num_image_tokens} image tokens but no pixel_values were given")
            if mrope_positions is not None:
                rope = self.rope(mrope_positions, dtype=h.dtype)
            return h, rope, LayerInputs(mask)

        if row_layout is not None and row_layout.cp_size > 1:
            raise ValueError("images under context parallel (a row split over cp ranks) are not supported")
        images = self.visual(self._images.pixel_values, self._images.grid_thw)
        if num_image_tokens != images.embeds.shape[0]:
            raise ValueError(
                f"input_ids holds {num_image_tokens} image tokens (id {self.args.image_token_id}) but the "
                f"images give {images.embeds.shape[0]} features (image_grid_thw {self._images.grid_thw.tolist()})"
            )
        h = h.index_put(image_tokens, images.embeds.to(h.dtype))
        if mrope_positions is None:
            mrope_positions = mrope_position_ids(
                input_ids,
                position_ids,
                self._images.grid_thw,
                image_token_id=self.args.image_token_id,
                spatial_merge_size=self.args.vision.spatial_merge_size,
            )
        return h, self.rope(mrope_positions, dtype=h.dtype), LayerInputs(mask, image_tokens, images.deepstack)

    def rope(self, position_ids: torch.Tensor, *, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """MRoPE's cos/sin [B, T, head_dim] for position ids [3, B, T] or [B, T]."""
        rope = RopeParameters(theta=self.args.rope_theta, mrope_section=self.args.mrope_section)
        return rope.cos_sin(position_ids, head_dim=self.rotary_dim, dtype=dtype)


class Qwen3VLModel(VisionLanguageModel, Qwen3Model):
    args: Qwen3VLModelArgs

    def build_block(self, layer_id: int) -> nn.Module:
        return DeepstackBlock(self.args, layer_id)


class Qwen3VLMoeModel(VisionLanguageModel, Qwen3MoeModel):
    args: Qwen3VLMoeModelArgs

    def build_block(self, layer_id: int) -> nn.Module:
        block_cls = DeepstackMoEBlock if layer_id in self.args.moe_layers else DeepstackBlock
        return block_cls(self.args, layer_id)
