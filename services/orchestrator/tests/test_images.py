"""Prompts with images on a vision-language model (the tiny Qwen3-VL): rendered through the
model's chat template and image processor, kept whole with the samples they make, packed with
their pixels for the trainer, and sent only where they will not be dropped.

The expected image sizes come from transformers' image processor of the checkpoint, called here
(one image token per 2 x 2 merged patches), not from the orchestrator's code.
"""

from __future__ import annotations

import base64
import io
import pathlib
from typing import Any

import grpc
import numpy as np
import pytest
import torch
from PIL import Image

from primerl.common.v1 import generation_pb2, service_info_pb2
from primerl.orchestrator.v1 import orchestrator_pb2
from primerl.router.v1 import router_pb2
from primerl.trainer.v1 import trainer_pb2, trainer_pb2_grpc
from primerl_common.errors import FailedPrecondition, InvalidArgument, field_violations
from primerl_common.images import ROUTER_CAPABILITY_IMAGES
from primerl_common.tensors import tensor_from_proto
from primerl_common.testing import eventually
from primerl_launcher.tiny_model import (
    IMAGE_TOKEN_ID,
    VISION_END_TOKEN_ID,
    VISION_START_TOKEN_ID,
    VOCAB_SIZE,
    make_tiny_model,
)
from primerl_orchestrator.packing import TrainingSample, pack
from primerl_orchestrator.prompt_images import ImageInput, ImageUri
from primerl_orchestrator.rendering import Message, PromptRenderer
from primerl_orchestrator.samples import EpisodeTokens, Turn

from .stand_ins import StandInRouter
from .test_service import orchestrator as served_orchestrator
from .test_service import refusal


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    return make_tiny_model(tmp_path_factory.mktemp("vl") / "model", family="qwen3-vl")


@pytest.fixture(scope="module")
def renderer(model_dir: pathlib.Path) -> PromptRenderer:
    return PromptRenderer(model_dir, image_uri_roots=[model_dir.parent])


def png(height: int, width: int, seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def image_tokens(model_dir: pathlib.Path, data: bytes) -> int:
    """The image tokens transformers' processor gives the image: its patches / 4."""
    from transformers import AutoImageProcessor

    grid = AutoImageProcessor.from_pretrained(model_dir)(images=[Image.open(io.BytesIO(data))])["image_grid_thw"]
    return int(grid.prod()) // 4


def user(*parts: str | ImageInput | ImageUri) -> Message:
    return Message("user", "", parts=parts)


# --- rendering -----------------------------------------------------------------------


def test_images_are_rendered_in_place_each_token_repeated_to_its_image_size(model_dir, renderer):
    first, second = png(40, 56), png(200, 90, seed=1)
    prompt = renderer.render(
        [
            Message("system", "Be brief."),
            user("Compare ", ImageInput(first, "image/png"), " and ", ImageInput(second, "image/png")),
        ]
    )
    sizes = [image_tokens(model_dir, first), image_tokens(model_dir, second)]
    assert sizes == [2, 10]
    # Inference takes one image token per image and expands it itself.
    assert prompt.engine_token_ids.count(IMAGE_TOKEN_ID) == 2
    assert prompt.token_ids.count(IMAGE_TOKEN_ID) == sum(sizes)
    assert len(prompt.token_ids) == len(prompt.engine_token_ids) + sum(sizes) - 2
    for start, size in zip(prompt.image_starts, sizes, strict=True):
        assert prompt.token_ids[start : start + size] == [IMAGE_TOKEN_ID] * size
        assert prompt.token_ids[start + size] != IMAGE_TOKEN_ID
    assert [image.num_tokens for image in prompt.images] == sizes
    assert [image.data for image in prompt.images] == [first, second]
    assert sum(len(image.pixel_values) for image in prompt.images) == 4 * sum(sizes)
    # Around the images (each between vision start and end) the text is as without them.
    vision = (VISION_START_TOKEN_ID, IMAGE_TOKEN_ID, VISION_END_TOKEN_ID)
    text_only = renderer.render([Message("system", "Be brief."), Message("user", "Compare  and ")])
    assert [t for t in prompt.engine_token_ids if t not in vision] == text_only.token_ids


def test_an_image_may_come_as_a_data_uri_or_a_file_under_the_allowed_roots(model_dir, renderer, tmp_path):
    data = png(40, 56)
    as_bytes = renderer.render([user("What is it? ", ImageInput(data, "image/png"))])
    data_uri = f"data:image/png;base64,{base64.b64encode(data).decode()}"
    assert renderer.render([user("What is it? ", ImageUri(data_uri))]).token_ids == as_bytes.token_ids
    inside = model_dir.parent / "picture.png"
    inside.write_bytes(data)
    assert renderer.render([user("What is it? ", ImageUri(inside.as_uri()))]).token_ids == as_bytes.token_ids

    outside = tmp_path / "secret.png"
    outside.write_bytes(data)
    with pytest.raises(FailedPrecondition, match="image_uri_roots"):
        renderer.render([user(ImageUri(outside.as_uri()))])
    with pytest.raises(InvalidArgument) as error:
        renderer.render([user(ImageUri("https://example.com/a.png"))])
    assert error.value.field == "messages[0].parts[0].image.uri"


def test_image_tokens_never_come_without_their_images(renderer):
    # Written as text, the image token would reach the trainer with no pixels.
    with pytest.raises(FailedPrecondition, match="placed 1 image tokens for 0 images"):
        renderer.render([Message("user", "look: <|image_pad|>")])
    with pytest.raises(InvalidArgument, match="image token"):
        renderer.check_tokens([1, 2, IMAGE_TOKEN_ID], vocab_size=VOCAB_SIZE)


# --- samples and packing -------------------------------------------------------------


def turn_of(prompt, completion: list[int]) -> Turn:
    n = len(completion)
    return Turn(
        prompt.token_ids, completion, [-0.5] * n, [0] * n, 1.0, images=prompt.images, image_starts=prompt.image_starts
    )


def test_a_turn_continues_a_sample_only_with_the_same_images(renderer):
    a, b = png(40, 56), png(40, 56, seed=2)  # same size: the same tokens
    first = renderer.render([user("What is it? ", ImageInput(a, "image/png"))])
    tokens = EpisodeTokens()
    tokens.add_turn(turn_of(first, [70, 71]))
    history = [user("What is it? ", ImageInput(a, "image/png")), Message("assistant", "FG"), Message("user", "Sure?")]
    assert tokens.add_turn(turn_of(renderer.render(history), [72]))
    swapped = [user("What is it? ", ImageInput(b, "image/png")), *history[1:]]
    assert renderer.render(swapped).token_ids == renderer.render(history).token_ids
    assert not tokens.add_turn(turn_of(renderer.render(swapped), [73]))
    assert [image.data for image in tokens.samples[-1].images] == [b]


def test_packing_never_cuts_an_image_and_sends_the_pixels_of_the_images_kept(renderer):
    small, large = png(40, 56), png(200, 90, seed=1)
    prompt = renderer.render([user("A ", ImageInput(small, "image/png"), " B ", ImageInput(large, "image/png"), " C")])
    tokens = EpisodeTokens()
    tokens.add_turn(turn_of(prompt, [70, 71, 72]))
    sample = tokens.samples[0]
    start_large = prompt.image_starts[1]
    whole = pack([TrainingSample(sample, 1.0)], seq_len=len(sample), with_routed_experts=False)
    (batch,) = whole.micro_batches
    assert batch.image_grid_thw.tolist() == [list(image.grid_thw) for image in prompt.images]
    assert torch.equal(batch.pixel_values, torch.cat([image.pixel_values for image in prompt.images]))

    # A cut inside the large image moves back to its first token; the small image goes alone.
    cut = pack([TrainingSample(sample, 1.0)], seq_len=start_large + 3, with_routed_experts=False)
    # That leaves no loss token: the sample is dropped, counted, never sent half.
    assert (cut.num_truncated, cut.num_truncated_before_image, cut.num_dropped_empty, cut.num_samples) == (1, 1, 1, 0)

    # With loss tokens before the image (a second turn's prompt adds it), the cut keeps them.
    history = [user("A ", ImageInput(small, "image/png")), Message("assistant", "xyz")]
    more = renderer.render([*history, user(" B ", ImageInput(large, "image/png"), " C")])
    first = renderer.render(history[:1])
    tokens.samples.clear()
    # The model's answer: the tokens the next prompt renders after the first one.
    tokens.add_turn(turn_of(first, more.token_ids[len(first.token_ids) : len(first.token_ids) + 3]))
    assert tokens.add_turn(turn_of(more, [72]))
    sample = tokens.samples[-1]
    start_large = more.image_starts[1]
    packed = pack([TrainingSample(sample, 1.0)], seq_len=start_large + 3, with_routed_experts=False)
    (batch,) = packed.micro_batches
    assert packed.num_truncated_before_image == 1
    assert len(batch.input_ids) == start_large
    assert batch.image_grid_thw.tolist() == [list(more.images[0].grid_thw)]
    assert int((batch.input_ids == IMAGE_TOKEN_ID).sum()) * 4 == len(batch.pixel_values)


# --- the service ---------------------------------------------------------------------


class VisionTrainer(trainer_pb2_grpc.TrainerServiceServicer):
    """A trainer whose model takes images (image token IMAGE_TOKEN_ID); keeps the micro-batches pushed."""

    def __init__(self) -> None:
        self.micro_batches: list[trainer_pb2.MicroBatch] = []

    async def GetBatchSpec(self, request, context):
        return trainer_pb2.GetBatchSpecResponse(
            seq_len=512,
            vocab_size=VOCAB_SIZE,
            next_step=1,
            mode=trainer_pb2.TRAINING_MODE_RL,
            image_token_id=IMAGE_TOKEN_ID,
            patches_per_image_token=4,
        )

    async def GetStatus(self, request, context):
        return trainer_pb2.GetStatusResponse(mode=trainer_pb2.TRAINING_MODE_RL, step=0, published_policy_version=0)

    async def PushBatch(self, request_iterator, context):
        async for request in request_iterator:
            if request.HasField("micro_batch"):
                self.micro_batches.append(request.micro_batch)
        return trainer_pb2.PushBatchResponse(step=1)


class VisionRouter(StandInRouter):
    """Answers every turn with two tokens and the prompt as an engine expands it (each image's
    token repeated to the size transformers' processor gives the image); lists the images
    capability or not."""

    def __init__(self, model_dir: pathlib.Path, *, takes_images: bool) -> None:
        self._model_dir = model_dir
        self._capabilities = [ROUTER_CAPABILITY_IMAGES] if takes_images else []
        self.requests: list[generation_pb2.GenerationInput] = []

    async def GetServiceInfo(self, request, context):
        info = service_info_pb2.ServiceInfo(
            service_name="router", package_version="0.9.0", capabilities=self._capabilities
        )
        return router_pb2.GetServiceInfoResponse(info=info)

    def output(self, request: router_pb2.GenerateRequest) -> generation_pb2.GenerationOutput:
        self.requests.append(request.input)
        output = super().output(request)
        if request.input.images:
            sizes = iter(image_tokens(self._model_dir, image.data) for image in request.input.images)
            for token in request.input.prompt_token_ids:
                output.prompt_token_ids.extend([token] * next(sizes) if token == IMAGE_TOKEN_ID else [token])
        return output


def orchestrator(model_dir: pathlib.Path, trainer: Any, router: VisionRouter):
    return served_orchestrator(model_dir, trainer, router=router, max_model_len=512, max_steps=1)


def image_turn(episode_id: str, data: bytes, mime_type: str = "image/png") -> orchestrator_pb2.GenerateRequest:
    parts = [
        orchestrator_pb2.ContentPart(text="Which digit? "),
        orchestrator_pb2.ContentPart(image=orchestrator_pb2.ImagePart(data=data, mime_type=mime_type)),
    ]
    message = orchestrator_pb2.ChatMessage(role="user", parts=parts)
    return orchestrator_pb2.GenerateRequest(
        episode_id=episode_id, messages=orchestrator_pb2.ChatMessages(messages=[message])
    )


async def start_group(stub) -> list[str]:
    request = orchestrator_pb2.StartEpisodeRequest(environment="guess", task=orchestrator_pb2.Task(task_id="t"))
    return [episode.episode_id for episode in (await stub.StartEpisode(request, timeout=10)).episodes]


async def test_images_go_to_the_trainer_with_their_samples_and_bad_ones_are_named(model_dir):
    trainer, router = VisionTrainer(), VisionRouter(model_dir, takes_images=True)
    data = [png(40, 56), png(200, 90, seed=1)]
    async with orchestrator(model_dir, trainer, router) as stub:
        episodes = await start_group(stub)
        bad = {
            "messages.messages[0].parts[1].image.data": image_turn(episodes[0], b"\x89PNG cut"),
            "messages.messages[0].parts[1].image.mime_type": image_turn(episodes[0], data[0], "image/tiff"),
        }
        for field, request in bad.items():
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await stub.Generate(request, timeout=10)
            assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT, field
            assert field in field_violations(error.value), (field, error.value.details())
        # The episodes go on: each plays a turn with its image and is rewarded.
        for episode_id, image, reward in zip(episodes, data, [1.0, 0.0], strict=True):
            response = await stub.Generate(image_turn(episode_id, image), timeout=30)
            assert response.num_prompt_tokens == len(router.requests[-1].prompt_token_ids) - 1 + image_tokens(
                model_dir, image
            )
            await stub.FinishEpisode(
                orchestrator_pb2.FinishEpisodeRequest(episode_id=episode_id, reward=reward), timeout=10
            )
        assert [list(request.images) for request in router.requests] == [
            [generation_pb2.ImageData(data=image, mime_type="image/png")] for image in data
        ]
        await eventually(lambda: bool(trainer.micro_batches), timeout_s=30, what="a batch at the trainer")
    (micro_batch,) = trainer.micro_batches
    input_ids = tensor_from_proto(micro_batch.input_ids)
    grid = tensor_from_proto(micro_batch.image_grid_thw)
    pixel_values = tensor_from_proto(micro_batch.pixel_values)
    # Longest sample first (first fit decreasing): the larger image's.
    assert sorted(grid.prod(-1).tolist()) == sorted(4 * image_tokens(model_dir, image) for image in data)
    assert int((input_ids == IMAGE_TOKEN_ID).sum()) * 4 == len(pixel_values) == int(grid.prod(-1).sum())


async def test_images_are_refused_where_a_router_or_the_trainer_would_drop_them(model_dir):
    async with orchestrator(model_dir, VisionTrainer(), VisionRouter(model_dir, takes_images=False)) as stub:
        episode_id, _ = await start_group(stub)
        assert await refusal(stub.Generate(image_turn(episode_id, png(40, 56)), timeout=10)) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "CAPABILITY_MISSING",
        )

    class TextTrainer(VisionTrainer):
        async def GetBatchSpec(self, request, context):
            spec = await super().GetBatchSpec(request, context)
            spec.ClearField("image_token_id")
            return spec

    async with orchestrator(model_dir, TextTrainer(), VisionRouter(model_dir, takes_images=True)) as stub:
        episode_id, _ = await start_group(stub)
        assert await refusal(stub.Generate(image_turn(episode_id, png(40, 56)), timeout=10)) == (
            grpc.StatusCode.FAILED_PRECONDITION,
            "TRAINER_TAKES_NO_IMAGES",
        )
