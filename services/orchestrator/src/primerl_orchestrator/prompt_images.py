"""Images in prompts of a vision-language model: read (bytes, a data: URI, or a file under the
configured roots), checked, and made into the model's inputs by its own image processor.

The chat template writes one image token per image (Qwen3-VL: `<|vision_start|><|image_pad|>
<|vision_end|>`); the model reads that token repeated once per merged patch group of the image,
as its processor expands it. Inference takes the prompt with one token per image and expands it
itself (vLLM), so a turn holds both forms: `engine_token_ids` for inference, `token_ids` (the
expanded form) for everything that counts tokens — the context, the training sample, the
routed experts' rows — and the check that inference expanded it the same way.
"""

from __future__ import annotations

import base64
import binascii
import collections
import hashlib
import json
import pathlib
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from primerl_common.errors import FailedPrecondition, InvalidArgument
from primerl_common.images import MIME_TYPES, decode_image, is_vision_language
from primerl_orchestrator.samples import PromptImage

__all__ = ["ImageInput", "ImageProcessor", "ImageUri", "expand_image_tokens", "read_image_uri"]

# Processed images kept by digest: an episode sends its whole conversation, images included, every turn.
_CACHE_SIZE = 256


@dataclass(frozen=True)
class ImageInput:
    """An image of a chat message as the environment sent it, not yet decoded."""

    data: bytes
    mime_type: str


@dataclass(frozen=True)
class ImageUri:
    """An image of a chat message named by a URI, read when the prompt is rendered."""

    uri: str
    mime_type: str = ""


def read_image_uri(uri: str, mime_type: str, *, roots: Sequence[pathlib.Path], field: str) -> ImageInput:
    """The image a URI names: `data:<mime>;base64,...`, or `file:///path` under one of `roots`
    (the folders model.image_uri_roots lets the orchestrator read; none: no file is read)."""
    parsed = urllib.parse.urlparse(uri)
    if parsed.scheme == "data":
        header, _, payload = parsed.path.partition(",")
        media_type, *params = header.split(";")
        if "base64" not in params:
            raise InvalidArgument("a data: URI of an image must be base64 (data:image/png;base64,...)", field=field)
        try:
            data = base64.b64decode(payload, validate=True)
        except binascii.Error as exc:
            raise InvalidArgument(f"the data: URI's base64 does not decode ({exc})", field=field) from None
        return ImageInput(data, mime_type or media_type)
    if parsed.scheme == "file":
        path = pathlib.Path(urllib.parse.unquote(parsed.path)).resolve()
        if not any(path.is_relative_to(root.resolve()) for root in roots):
            raise FailedPrecondition(
                f"{path} is outside the folders model.image_uri_roots lets the orchestrator read "
                f"({', '.join(str(root) for root in roots) or 'none'})",
                reason="IMAGE_URI_NOT_ALLOWED",
            )
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise InvalidArgument(f"cannot read {path}: {exc.strerror}", field=field) from None
        guessed = {f".{name.lower()}": mime for mime, name in MIME_TYPES.items()} | {".jpg": "image/jpeg"}
        return ImageInput(data, mime_type or guessed.get(path.suffix.lower(), ""))
    raise InvalidArgument(f"URI scheme {parsed.scheme!r} is not read; use data: or file:", field=field)


class ImageProcessor:
    """The model's image processor (transformers, from the model folder) and its image token."""

    def __init__(self, model_path: pathlib.Path) -> None:
        from transformers import AutoImageProcessor

        config = json.loads((model_path / "config.json").read_text())
        self.image_token_id: int = int(config["image_token_id"])
        self._processor = AutoImageProcessor.from_pretrained(str(model_path))
        self.merge_size: int = int(getattr(self._processor, "merge_size", 1))
        self._cache: collections.OrderedDict[str, PromptImage] = collections.OrderedDict()

    @staticmethod
    def is_multimodal(model_path: pathlib.Path) -> bool:
        try:
            config = json.loads((model_path / "config.json").read_text())
        except (OSError, ValueError):
            return False
        return is_vision_language(config)

    def process(self, image: ImageInput, *, field: str) -> PromptImage:
        digest = hashlib.sha256(image.data).hexdigest()
        cached = self._cache.get(digest)
        if cached is not None and cached.mime_type == image.mime_type:
            self._cache.move_to_end(digest)
            return cached
        decoded = decode_image(image.data, image.mime_type, field=field)
        outputs: Any = self._processor(images=[decoded], return_tensors="pt")
        grid = tuple(int(size) for size in outputs["image_grid_thw"][0].tolist())
        processed = PromptImage(
            data=image.data,
            mime_type=image.mime_type,
            digest=digest,
            pixel_values=outputs["pixel_values"].to(torch.float32),
            grid_thw=(grid[0], grid[1], grid[2]),
            num_tokens=grid[0] * grid[1] * grid[2] // self.merge_size**2,
        )
        self._cache[digest] = processed
        if len(self._cache) > _CACHE_SIZE:
            self._cache.popitem(last=False)
        return processed


def expand_image_tokens(
    token_ids: Sequence[int], images: Sequence[PromptImage], image_token_id: int
) -> tuple[list[int], list[int]]:
    """`token_ids` with each image's one token repeated to the image's size, and where each
    image's tokens start. Raises FailedPrecondition when the chat template placed another number
    of image tokens than there are images (one that drops images would send them unplaced)."""
    placed = sum(1 for token in token_ids if token == image_token_id)
    if placed != len(images):
        raise FailedPrecondition(
            f"the chat template placed {placed} image tokens for {len(images)} images; it must place one per image",
            reason="IMAGES_NOT_PLACED",
        )
    sizes = iter(image.num_tokens for image in images)
    expanded: list[int] = []
    starts: list[int] = []
    for token in token_ids:
        if token == image_token_id:
            starts.append(len(expanded))
            expanded += [token] * next(sizes)
        else:
            expanded.append(token)
    return expanded, starts
