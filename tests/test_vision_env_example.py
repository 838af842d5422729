"""examples/vision_env: the pictures, the scoring, the requests it sends, its launch file,
and one play against a stand-in orchestrator (no model: the vision model's run is the
README's)."""

from __future__ import annotations

import asyncio
import functools
import importlib.util
import io
import json
import pathlib
import random
import sys
import tomllib

import numpy as np
import pytest
from PIL import Image

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_common.testing import bare_server
from primerl_launcher.spec import TINY_MODELS, parse_launch_file

EXAMPLE = pathlib.Path(__file__).resolve().parents[1] / "examples" / "vision_env"


def _load_example():
    spec = importlib.util.spec_from_file_location("read_digit", EXAMPLE / "read_digit.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


read_digit = _load_example()


def pixels(png: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(png)))


@pytest.mark.parametrize("kind", ["digit", "count"])
@pytest.mark.parametrize("size", [32, 64, 100])
def test_pictures_are_pngs_of_the_size_asked_and_the_same_per_seed(kind, size):
    answer = 7
    png = read_digit.draw_task(kind, answer, seed=3, size=size)
    image = Image.open(io.BytesIO(png))
    assert image.format == "PNG" and image.size == (size, size) and image.mode == "RGB"
    assert png == read_digit.draw_task(kind, answer, seed=3, size=size)
    assert png != read_digit.draw_task(kind, answer, seed=4, size=size)


def test_every_digit_draws_differently_and_ink_stands_out():
    images = [pixels(read_digit.draw_digit(digit, seed=5, noise=0.0)) for digit in range(10)]
    assert len({image.tobytes() for image in images}) == 10
    # Same seed: same place and colours, so 8 is exactly 0 plus the middle stroke.
    ink = [np.any(image != images[8][0, 0], axis=-1) for image in images]  # the corner is background
    assert ink[0].sum() < ink[8].sum() and not (ink[0] & ~ink[8]).any()
    with pytest.raises(ValueError, match="digit must be 0-9"):
        read_digit.draw_digit(10, seed=0)


def test_shapes_are_as_many_as_asked_one_per_cell():
    for count in range(1, 10):
        image = pixels(read_digit.draw_shapes(count, seed=count, size=63, noise=0.0))
        ink = np.any(image != image[0, 0], axis=-1)  # the corner is background
        cells = ink.reshape(3, 21, 3, 21).any(axis=(1, 3))
        assert cells.sum() == count
        # None reaches its cell's border: they never touch.
        assert not ink[[0, 20, 21, 41, 42, 62]].any() and not ink[:, [0, 20, 21, 41, 42, 62]].any()
    with pytest.raises(ValueError, match="count must be 1-9"):
        read_digit.draw_shapes(0, seed=0)


@pytest.mark.parametrize(
    ("text", "parsed"),
    [("7", 7), (" 7.", 7), ("It is 7", 7), ("7\n", 7), ("12", 1), ("seven", None), ("", None)],
)
def test_the_first_digit_is_the_answer(text, parsed):
    assert read_digit.parse_answer(text) == parsed
    assert read_digit.score(text, 7) == (1.0 if parsed == 7 else 0.0)


def test_requests_carry_the_question_and_the_picture_as_parts():
    task = read_digit.new_task("digit", random.Random(0), "digit-0-0")
    answer, seed = int(task.data["answer"]), int(task.data["image_seed"])
    assert task.data["kind"] == "digit" and 0 <= answer <= 9
    start = read_digit.start_request("read_digit", task)
    assert start.environment == "read_digit" and start.task.task_id == "digit-0-0" and start.num_episodes == 0

    png = read_digit.draw_task("digit", answer, seed=seed)
    [message] = read_digit.generate_request("e-1", "digit", png).messages.messages
    assert message.role == "user" and message.content == ""
    text, image = message.parts
    assert text.WhichOneof("part") == "text" and text.text == "Which digit is drawn? Answer with the digit only."
    assert image.WhichOneof("part") == "image" and image.image.WhichOneof("source") == "data"
    assert image.image.data == png and image.image.mime_type == "image/png"

    right = read_digit.finish_request("e-1", f" {answer}.", answer)
    wrong = read_digit.finish_request("e-1", "", answer)
    assert (right.episode_id, right.reward, dict(right.metrics)) == ("e-1", 1.0, {"correct": 1.0})
    assert (wrong.reward, dict(wrong.metrics)) == (0.0, {"correct": 0.0})


class FakeOrchestrator(orchestrator_pb2_grpc.OrchestratorServiceServicer):
    """Starts groups of two and answers every turn with "7"."""

    def __init__(self) -> None:
        self.generated: list[orchestrator_pb2.GenerateRequest] = []
        self.finished: list[orchestrator_pb2.FinishEpisodeRequest] = []
        self.tasks: dict[str, orchestrator_pb2.Task] = {}

    async def StartEpisode(self, request, context):
        episodes = []
        for index in range(2):
            episode_id = f"{request.task.task_id}/{index}"
            self.tasks[episode_id] = request.task
            episodes.append(
                orchestrator_pb2.Episode(
                    episode_id=episode_id, group_id=request.task.task_id, task=request.task, index_in_group=index
                )
            )
        return orchestrator_pb2.StartEpisodeResponse(episodes=episodes)

    async def Generate(self, request, context):
        self.generated.append(request)
        return orchestrator_pb2.GenerateResponse(text="7", token_ids=[55], num_prompt_tokens=30)

    async def FinishEpisode(self, request, context):
        self.finished.append(request)
        return orchestrator_pb2.FinishEpisodeResponse(num_samples=1)


@pytest.mark.parametrize("kind", ["digit", "count"])
async def test_it_plays_each_task_as_a_group_and_rewards_the_right_answers(tmp_path, kind):
    fake = FakeOrchestrator()
    transcript = tmp_path / "transcript.jsonl"
    add = functools.partial(orchestrator_pb2_grpc.add_OrchestratorServiceServicer_to_server, fake)
    async with bare_server(add) as address:
        argv = ["--orchestrator", address, "--tasks", "5", "--task-kind", kind, "--transcript", str(transcript)]
        # main() runs its own event loop: in a thread, while this one serves.
        assert await asyncio.to_thread(read_digit.main, argv) == 0
    assert len(fake.generated) == len(fake.finished) == 10
    for request in fake.generated:
        task = fake.tasks[request.episode_id]
        image = request.messages.messages[0].parts[1].image
        assert image.data == read_digit.draw_task(kind, int(task.data["answer"]), seed=int(task.data["image_seed"]))
    rewards = {r.episode_id: r.reward for r in fake.finished}
    assert rewards == {e: float(int(t.data["answer"]) == 7) for e, t in fake.tasks.items()}
    entries = [json.loads(line) for line in transcript.read_text().splitlines()]
    assert sorted(e["episode_id"] for e in entries) == sorted(rewards)
    assert all(e["text"] == "7" and e["reward"] == rewards[e["episode_id"]] for e in entries)


def test_the_launch_file_runs_read_digit_on_the_tiny_vision_model():
    launch = parse_launch_file(tomllib.loads((EXAMPLE / "vision.toml").read_text()))
    assert launch.launcher.model == "tiny-vl" and TINY_MODELS["tiny-vl"] == "qwen3-vl"
    orchestrator = launch.services["orchestrator"].table
    [environment] = orchestrator["environments"]
    assert (environment["name"], environment["kind"]) == ("read_digit", "external")
    assert orchestrator["server"]["port"] == 50051  # the port the README's command names
    assert [name for name in launch.services if name.startswith("inference")] == ["inference-0"]
