"""Images in prompts: the capability that says a replica takes them, and the checks every
service that receives image bytes makes before anything holds them (the orchestrator on its
API, inference on Generate).

A replica of a release before images would drop the `images` field of a GenerationInput it
does not know and sample without them, with no error: clients and routers send images only to
replicas whose GetServiceInfo lists CAPABILITY_IMAGES.

Pillow (a dependency of vLLM and of transformers' image processors) is imported only by
`decode_image`, so the router, which only routes on the field's presence, does not need it.
"""

from __future__ import annotations

import io
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from primerl_common.errors import InvalidArgument

if TYPE_CHECKING:
    from PIL import Image

__all__ = [
    "CAPABILITY_IMAGES",
    "DEFAULT_MAX_IMAGE_PIXELS",
    "MIME_TYPES",
    "ROUTER_CAPABILITY_IMAGES",
    "decode_image",
    "is_vision_language",
    "vision_placeholder_token_ids",
]

CAPABILITY_IMAGES = "generate.images"
# A router that routes requests with images, to replicas that list CAPABILITY_IMAGES only; one of
# an older release would drop them, so clients send images only to routers that list this.
ROUTER_CAPABILITY_IMAGES = f"router.{CAPABILITY_IMAGES}"
# MIME type -> Pillow's name of the format.
MIME_TYPES = {
    "image/png": "PNG",
    "image/jpeg": "JPEG",
    "image/webp": "WEBP",
    "image/gif": "GIF",
    "image/bmp": "BMP",
}
# The config.json keys of a vision-language model's placeholder tokens (Qwen2-VL and later): an
# image's place, a video's, and the markers around either.
_PLACEHOLDER_KEYS = ("vision_start_token_id", "vision_end_token_id", "image_token_id", "video_token_id")

# 16 MP: above any vision encoder's input (Qwen3-VL resizes to at most ~16.7 MP by default),
# below what a decompression bomb needs.
DEFAULT_MAX_IMAGE_PIXELS = 4096 * 4096


def decode_image(data: bytes, mime_type: str, *, field: str, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Image.Image:
    """The RGB image `data` encodes. Raises InvalidArgument naming `field` (e.g.
    "input.images[2]") when the type is not one of MIME_TYPES, the bytes are not an image of
    that type, or it has more than `max_pixels` pixels: the size is read from the header,
    before the pixels are decoded."""
    from PIL import Image, UnidentifiedImageError

    expected = MIME_TYPES.get(mime_type)
    if expected is None:
        raise InvalidArgument(
            f"unknown image type {mime_type!r}; one of {', '.join(MIME_TYPES)}", field=f"{field}.mime_type"
        )
    if not data:
        raise InvalidArgument("no image bytes", field=f"{field}.data")
    try:
        image = Image.open(io.BytesIO(data), formats=[expected])
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise InvalidArgument(f"not a {mime_type} image ({exc})", field=f"{field}.data") from None
    width, height = image.size
    if width * height > max_pixels:
        raise InvalidArgument(
            f"{width}x{height} = {width * height} pixels, more than the {max_pixels} allowed", field=f"{field}.data"
        )
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise InvalidArgument(f"the {mime_type} image does not decode ({exc})", field=f"{field}.data") from None
    return image.convert("RGB")


def is_vision_language(config: Mapping[str, Any]) -> bool:
    """Whether a model's config.json is a vision-language model's: a vision tower and its image
    token (every service that reads the checkpoint decides it so)."""
    return "vision_config" in config and config.get("image_token_id") is not None


def vision_placeholder_token_ids(config: Mapping[str, Any]) -> tuple[int, ...]:
    """The placeholder tokens of a vision-language model's config.json (none for a text model).
    They are never sampled: one in a completion would go into the next turn's prompt as an
    image without pixels. Inference bans them (their logits -inf), so the logprobs it returns
    are over the vocabulary without them, and the trainer scores tokens the same way."""
    if not is_vision_language(config):
        return ()
    return tuple(int(config[key]) for key in _PLACEHOLDER_KEYS if config.get(key) is not None)
