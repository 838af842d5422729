"""Images in prompts, for a vision-language model: what its config says about them, the checks
a request passes before anything reaches vLLM, and the vision placeholder tokens never sampled.

A prompt holds the model's image token once per image, in the order of `images`; vLLM expands
each to the image's size itself (ids expanded already would be expanded again, and a count
that does not match the images makes it assert deep in its input processing).
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import TYPE_CHECKING, Any

from primerl_common.errors import InvalidArgument
from primerl_common.images import CAPABILITY_IMAGES, decode_image, is_vision_language, vision_placeholder_token_ids
from primerl_inference.capabilities import missing_capability
from primerl_inference.generation import GenerateRequest

if TYPE_CHECKING:
    from PIL import Image

__all__ = ["VisionModel", "is_multimodal"]


def is_multimodal(model: pathlib.Path) -> bool:
    """Whether the checkpoint is a vision-language model's (primerl_common.images.is_vision_language)."""
    return is_vision_language(json.loads((model / "config.json").read_text()))


@dataclasses.dataclass(frozen=True)
class VisionModel:
    image_token_id: int
    # The placeholder tokens as SamplingParams.bad_words: vLLM bans each (logit -inf) at every step.
    placeholder_words: tuple[str, ...]
    max_images_per_prompt: int  # 0: images off

    @classmethod
    def of(cls, hf_config: Any, tokenizer: Any, *, max_images_per_prompt: int) -> VisionModel:
        """From the model's config (vLLM's hf_config: the checkpoint's config.json) and tokenizer."""
        config = hf_config.to_dict()
        placeholders = vision_placeholder_token_ids(config)
        words = tuple(tokenizer.decode([token]) for token in placeholders)
        for token, word in zip(placeholders, words, strict=True):
            # vLLM bans a bad word's tokens as the tokenizer encodes it.
            if tokenizer.encode(word, add_special_tokens=False) != [token]:
                raise ValueError(f"placeholder token {token} ({word!r}) does not encode back to itself")
        return cls(config["image_token_id"], words, max_images_per_prompt)

    def images_of(self, request: GenerateRequest) -> list[Image.Image]:
        """The request's images, decoded, after the checks that keep vLLM from asserting;
        InvalidArgument naming the field at fault."""
        images = request.images
        if images and not self.max_images_per_prompt:
            raise missing_capability(CAPABILITY_IMAGES, "images in the prompt (engine.max_images_per_prompt is 0)")
        if len(images) > self.max_images_per_prompt:
            raise InvalidArgument(
                f"{len(images)} images, more than the {self.max_images_per_prompt} a prompt may hold here",
                field="input.images",
            )
        num_places = request.prompt_token_ids.count(self.image_token_id)
        if num_places != len(images):
            raise InvalidArgument(
                f"{len(images)} images for {num_places} image tokens (id {self.image_token_id}) in "
                "input.prompt_token_ids: one token per image, not expanded",
                field="input.images",
            )
        return [decode_image(data, mime, field=f"input.images[{i}]") for i, (data, mime) in enumerate(images)]
