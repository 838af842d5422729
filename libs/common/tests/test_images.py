"""decode_image: the checks every service makes of image bytes before it holds them."""

import io

import pytest
from PIL import Image

from primerl_common.errors import InvalidArgument
from primerl_common.images import decode_image


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
