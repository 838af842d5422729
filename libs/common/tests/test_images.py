"""decode_image: the checks every service makes of image bytes before it holds them."""

import io

import pytest
from PIL import Image

from primerl_common.errors import InvalidArgument
from primerl_common.images import decode_image, is_vision_language, vision_placeholder_token_ids


def encoded(image_format: str, size: tuple[int, int] = (20, 10), mode: str = "RGB") -> bytes:
    out = io.BytesIO()
    Image.new(mode, size, 90).save(out, format=image_format)
    return out.getvalue()


@pytest.mark.parametrize(
    ("mime_type", "image_format"), [("image/png", "PNG"), ("image/jpeg", "JPEG"), ("image/webp", "WEBP")]
)
def test_images_decode_to_rgb_of_their_size(mime_type, image_format):
    image = decode_image(encoded(image_format, mode="L"), mime_type, field="input.images[0]")
    assert (image.mode, image.size) == ("RGB", (20, 10))


@pytest.mark.parametrize(
    ("data", "mime_type", "field", "words"),
    [
        (encoded("PNG"), "image/tiff", "input.images[3].mime_type", "unknown image type"),
        (encoded("JPEG"), "image/png", "input.images[3].data", "not a image/png image"),
        (b"", "image/png", "input.images[3].data", "no image bytes"),
        # A whole header, pixels cut off: found when the pixels are decoded.
        (encoded("PNG", (64, 64))[:60], "image/png", "input.images[3].data", "does not decode"),
        (encoded("PNG", (300, 200)), "image/png", "input.images[3].data", "60000 pixels, more than the 50000"),
    ],
)
def test_bad_images_are_refused_naming_the_field(data, mime_type, field, words):
    with pytest.raises(InvalidArgument) as error:
        decode_image(data, mime_type, field="input.images[3]", max_pixels=50_000)
    assert error.value.field == field
    assert words in str(error.value)


def test_a_vision_language_config_names_its_placeholders_and_a_text_one_none() -> None:
    vl = {
        "vision_config": {"depth": 2},
        "image_token_id": 7,
        "video_token_id": 8,
        "vision_start_token_id": 5,
        "vision_end_token_id": 6,
    }
    assert is_vision_language(vl) and vision_placeholder_token_ids(vl) == (5, 6, 7, 8)
    # A vision tower with no image token (or no tower) takes no images: nothing to keep out.
    for text in ({"vision_config": {}}, {"image_token_id": 7}, {}):
        assert not is_vision_language(text) and vision_placeholder_token_ids(text) == ()
