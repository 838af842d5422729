"""Prompts with images, end to end: the tiny Qwen3-VL (float32) behind a real gRPC server.

The service expands nothing itself: a prompt holds one image token per image and vLLM expands
each to the image's size; the final output carries the prompt as the engine ran it, and its
prompt logprobs are one per token of that prompt. Vision placeholder tokens are never sampled
(SamplingParams.bad_words), so the logprobs returned are the model's renormalized over the
vocabulary without them (the trainer's full-vocabulary ones differ by -log(1 - p(placeholders))).
"""

from __future__ import annotations

import io
import pathlib

import grpc
import numpy as np
import pytest
import pytest_asyncio
import torch
from google.rpc import error_details_pb2
from PIL import Image

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2
from primerl_common.errors import error_details, field_violations
from primerl_common.images import CAPABILITY_IMAGES
from primerl_common.tensors import tensor_from_proto
from primerl_launcher.tiny_model import (
    IMAGE_TOKEN_ID,
    VIDEO_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    make_tiny_model,
)

from .serving import Served, checkpoint, final_output, generate, running_service, update_weights

pytestmark = pytest.mark.asyncio(loop_scope="session")

PLACEHOLDERS = [VISION_START_TOKEN_ID, VISION_END_TOKEN_ID, IMAGE_TOKEN_ID, VIDEO_TOKEN_ID]
MAX_IMAGES = 2
# (height, width): 2 image tokens, then 2 + 10 after resizing (16-pixel patches, merged 2 x 2).
IMAGE_SIZES = {"one-image": [(40, 56)], "two-images": [(40, 56), (200, 90)]}


@pytest.fixture(scope="module")
def vl_model(model_root: pathlib.Path) -> pathlib.Path:
    return make_tiny_model(model_root / "qwen3-vl-float32", family="qwen3-vl")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served_vl(vl_model: pathlib.Path):
    async with running_service(model=vl_model, max_images_per_prompt=MAX_IMAGES) as served:
        yield served


def random_images(sizes: list[tuple[int, int]], seed: int = 0) -> list[Image.Image]:
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)) for h, w in sizes]


def png(image: Image.Image) -> generation_pb2.ImageData:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return generation_pb2.ImageData(data=buffer.getvalue(), mime_type="image/png")


def prompt_with(num_images: int, num_text: int = 12) -> list[int]:
    """Text, then each image's place (one token per image) followed by more text."""
    ids = list(range(40, 40 + num_text))
    for index in range(num_images):
        ids += [VISION_START_TOKEN_ID, IMAGE_TOKEN_ID, VISION_END_TOKEN_ID, 100 + index, 101]
    return ids


def image_input(
    images: list[generation_pb2.ImageData], prompt: list[int] | None = None, **sampling: object
) -> generation_pb2.GenerationInput:
    return generation_pb2.GenerationInput(
        prompt_token_ids=prompt_with(len(images)) if prompt is None else prompt,
        images=images,
        sampling=generation_pb2.SamplingParams(**{"max_tokens": 24, "seed": 1, "ignore_eos": True, **sampling}),
        stream=generation_pb2.StreamOptions(final_only=True),
        return_prompt_logprobs=True,
    )


def pixels_of(checkpoint: pathlib.Path, images: list[Image.Image]) -> dict[str, torch.Tensor]:
    from transformers import AutoImageProcessor

    processed = AutoImageProcessor.from_pretrained(checkpoint)(images=images, return_tensors="pt")
    return {"pixel_values": processed["pixel_values"], "image_grid_thw": processed["image_grid_thw"]}


def expanded(ids: list[int], image_grid_thw: torch.Tensor) -> list[int]:
    """Each image token repeated once per merged 2 x 2 patches of its image."""
    counts = iter((image_grid_thw.prod(-1) // 4).tolist())
    return [t for token in ids for t in ([token] * next(counts) if token == IMAGE_TOKEN_ID else [token])]


async def assert_serves_an_image(served: Served) -> None:
    final = await final_output(served.stub, image_input([png(random_images([(32, 32)])[0])], max_tokens=2))
    assert len(final.token_ids) == 2


@pytest.mark.parametrize("case", list(IMAGE_SIZES))
async def test_prompts_with_images_are_served_as_the_model_computes(
    served_vl: Served, vl_model: pathlib.Path, case: str
) -> None:
    from transformers import AutoModelForImageTextToText

    images = random_images(IMAGE_SIZES[case], seed=len(case))
    prompt = prompt_with(len(images))
    final = await final_output(served_vl.stub, image_input([png(i) for i in images], prompt, temperature=1.0))

    pixels = pixels_of(vl_model, images)
    engine_prompt = expanded(prompt, pixels["image_grid_thw"])
    assert list(final.prompt_token_ids) == engine_prompt
    assert len(final.prompt_logprobs) == len(engine_prompt) == final.stats.num_prompt_tokens
    tokens = list(final.token_ids)
    assert len(tokens) == 24 and not set(tokens) & set(PLACEHOLDERS)

    # The model as transformers computes it (the trainer's own equals it: tests/test_vl_serving_parity.py).
    model = AutoModelForImageTextToText.from_pretrained(vl_model, dtype=torch.float32, attn_implementation="sdpa")
    ids = torch.tensor([engine_prompt + tokens])
    with torch.no_grad():
        logits = model.eval()(ids, **pixels, mm_token_type_ids=(ids == IMAGE_TOKEN_ID).int()).logits[0, :-1].float()
    targets = torch.tensor(engine_prompt[1:] + tokens)[:, None]
    full = logits.log_softmax(-1).gather(1, targets)[:, 0]
    banned = logits.index_fill(1, torch.tensor(PLACEHOLDERS), float("-inf")).log_softmax(-1).gather(1, targets)[:, 0]
    served_prompt = torch.tensor(list(final.prompt_logprobs)[1:])
    served_completion = torch.tensor(list(final.logprobs))
    num_prompt = len(engine_prompt) - 1
    # Prompt logprobs are vLLM's raw ones: the full vocabulary's.
    assert (served_prompt - full[:num_prompt]).abs().max() <= 1e-4
    # Sampled ones: over the vocabulary without the placeholders, which were never candidates.
    assert (served_completion - banned[num_prompt:]).abs().max() <= 1e-4
    differences = {
        "prompt vs full vocabulary": (served_prompt - full[:num_prompt]).abs().max().item(),
        "completion vs without placeholders": (served_completion - banned[num_prompt:]).abs().max().item(),
        "completion vs full vocabulary": (served_completion - full[num_prompt:]).abs().max().item(),
    }
    print(f"{case}: max differences {differences}")


def too_many_pixels() -> generation_pb2.ImageData:
    return png(Image.new("L", (5000, 4000)))


def bad_requests() -> dict[str, tuple[generation_pb2.GenerationInput, str]]:
    one = png(random_images([(40, 56)])[0])
    return {
        "not-an-image": (
            image_input([generation_pb2.ImageData(data=b"\x89PNG...", mime_type="image/png")]),
            "input.images[0].data",
        ),
        "unknown-type": (
            image_input([generation_pb2.ImageData(data=one.data, mime_type="image/tiff")]),
            "input.images[0].mime_type",
        ),
        "too-many-pixels": (image_input([one, too_many_pixels()]), "input.images[1].data"),
        "more-images-than-tokens": (image_input([one, one], prompt_with(1)), "input.images"),
        "fewer-images-than-tokens": (image_input([one], prompt_with(2)), "input.images"),
        "image-tokens-without-images": (image_input([], prompt_with(1)), "input.images"),
        "more-than-the-limit": (image_input([one] * 3), "input.images"),
        "aspect-ratio-past-200": (image_input([png(random_images([(2, 500)])[0])]), "input.images"),
        # Within max_model_len (512) as sent, past it once the image is expanded (10 tokens).
        "expanded-past-max-model-len": (
            image_input([png(random_images([(200, 90)])[0])], [7] * 500 + prompt_with(1, num_text=0)[:3]),
            "input.prompt_token_ids",
        ),
    }


@pytest.mark.parametrize("case", list(bad_requests()))
async def test_bad_images_are_refused_and_the_replica_keeps_serving(served_vl: Served, case: str) -> None:
    request_input, field = bad_requests()[case]
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await generate(served_vl.stub, request_input)

    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, error.value.details()
    assert field in field_violations(error.value)
    await assert_serves_an_image(served_vl)


async def test_service_info_lists_images(served_vl: Served) -> None:
    info = (await served_vl.stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest())).info
    assert CAPABILITY_IMAGES in info.capabilities


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def served_vl_moe(model_root: pathlib.Path):
    model = make_tiny_model(model_root / "qwen3-vl-moe-float32", family="qwen3-vl-moe")
    async with running_service(model=model) as served:
        yield served


async def test_routed_experts_cover_the_expanded_prompt(served_vl_moe: Served) -> None:
    images = random_images(IMAGE_SIZES["two-images"])
    request = image_input([png(i) for i in images], max_tokens=6, temperature=0.0)
    request.return_routed_experts = True
    final = await final_output(served_vl_moe.stub, request)

    num_expanded = len(final.prompt_token_ids)
    assert num_expanded == len(prompt_with(2)) - 2 + (2 + 10)
    routed = tensor_from_proto(final.routed_experts)
    assert final.routed_experts_start == 0
    assert routed.shape[0] == num_expanded + len(final.token_ids)


async def test_images_off_are_refused_and_not_listed(vl_model: pathlib.Path) -> None:
    async with running_service(model=vl_model, max_images_per_prompt=0) as served:
        info = (await served.stub.GetServiceInfo(inference_pb2.GetServiceInfoRequest())).info
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await generate(served.stub, image_input([png(random_images([(32, 32)])[0])]))
        text_only = await final_output(served.stub, image_input([], list(range(40, 60)), max_tokens=2))

    assert CAPABILITY_IMAGES not in info.capabilities
    assert error.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    reasons = [d.reason for d in error_details(error.value) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert reasons == ["CAPABILITY_MISSING"]
    assert len(text_only.token_ids) == 2
    assert not text_only.prompt_token_ids  # only a prompt with images comes back


async def test_an_image_seen_before_a_weight_update_is_served_after_it(
    served_vl: Served, vl_model: pathlib.Path
) -> None:
    """vLLM caches an image's processed inputs and its encoder output by the image's hash; an
    update must neither reuse them (a trained vision tower changes the output) nor leave the
    engine's two halves disagreeing on what is cached ("Encoder cache miss" killed the engine)."""
    request = image_input([png(random_images([(40, 56)], seed=11)[0])], max_tokens=2)
    before = await final_output(served_vl.stub, request)
    await update_weights(served_vl.stub, checkpoint(vl_model))
    for _ in range(2):
        after = await final_output(served_vl.stub, request)
        assert list(after.prompt_token_ids) == list(before.prompt_token_ids)
        assert after.policy_versions[0] == before.policy_versions[0] + 1
    await assert_serves_an_image(served_vl)
