"""A multimodal environment played against the primerl orchestrator: read the digit in a picture.

Each task is a small picture drawn here, from a seed, with nothing downloaded: a digit 0-9 in
seven-segment strokes of random size, place, colour and thickness over a noisy background
(`--task-kind digit`), or 1-9 circles and squares to count (`--task-kind count`). The user
message carries the question as a text part and the picture as a PNG image part; the reward
is 1.0 when the first digit of the answer is right, else 0.0 (`score`), with the metric
`correct`. One turn per episode; each task is started as a group of episodes (StartEpisode),
every episode of a group sees the same picture.

It depends on grpcio, the generated primerl stubs (primerl.orchestrator.v1), Pillow and numpy,
and needs a model that takes images (the launcher's tiny-vl, for one):

    python examples/vision_env/read_digit.py --orchestrator localhost:50051 \
        --environment read_digit --tasks 8
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import re
import sys
from typing import Any, Literal

import grpc
import numpy as np
from PIL import Image, ImageDraw

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc

TaskKind = Literal["digit", "count"]
QUESTIONS: dict[TaskKind, str] = {
    "digit": "Which digit is drawn? Answer with the digit only.",
    "count": "How many shapes are drawn? Answer with the number only.",
}
MIME_TYPE = "image/png"

# Seven-segment strokes on a 1 x 2 box (x right, y down): segment -> its two ends.
SEGMENTS = {
    "a": ((0, 0), (1, 0)),
    "b": ((1, 0), (1, 1)),
    "c": ((1, 1), (1, 2)),
    "d": ((0, 2), (1, 2)),
    "e": ((0, 1), (0, 2)),
    "f": ((0, 0), (0, 1)),
    "g": ((0, 1), (1, 1)),
}
DIGIT_SEGMENTS = ["abcdef", "bc", "abged", "abgcd", "fgbc", "afgcd", "afgcde", "abc", "abcdefg", "abcdfg"]


def _canvas(size: int, rng: random.Random) -> tuple[Image.Image, tuple[int, int, int]]:
    """A light background and a dark ink colour: any pair of them reads clearly."""
    background = (rng.randint(190, 255), rng.randint(190, 255), rng.randint(190, 255))
    ink = (rng.randint(0, 90), rng.randint(0, 90), rng.randint(0, 90))
    return Image.new("RGB", (size, size), background), ink


def _png(image: Image.Image, seed: int, noise: float) -> bytes:
    """The image with Gaussian pixel noise (std `noise`, seeded) as PNG bytes."""
    pixels = np.asarray(image, dtype=np.float32)
    pixels += np.random.default_rng(seed).normal(0.0, noise, pixels.shape)
    buffer = io.BytesIO()
    Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def draw_digit(digit: int, *, seed: int, size: int = 64, noise: float = 8.0) -> bytes:
    """A PNG of `size` x `size` pixels showing `digit` in seven-segment strokes; the same
    arguments always give the same bytes."""
    if not 0 <= digit <= 9:
        raise ValueError(f"digit must be 0-9, got {digit}")
    rng = random.Random(seed)
    image, ink = _canvas(size, rng)
    height = rng.uniform(0.45, 0.8) * size
    width = height * rng.uniform(0.4, 0.6)
    thickness = max(2, round(height * rng.uniform(0.08, 0.16)))
    margin = thickness / 2 + 1
    left = rng.uniform(margin, size - margin - width)
    top = rng.uniform(margin, size - margin - height)
    draw = ImageDraw.Draw(image)
    for segment in DIGIT_SEGMENTS[digit]:
        ends = [(left + x * width, top + y * height / 2) for x, y in SEGMENTS[segment]]
        draw.line(ends, fill=ink, width=thickness)
        for x, y in ends:  # round joints
            draw.ellipse((x - thickness / 2, y - thickness / 2, x + thickness / 2, y + thickness / 2), fill=ink)
    return _png(image, seed, noise)


def draw_shapes(count: int, *, seed: int, size: int = 64, noise: float = 8.0) -> bytes:
    """A PNG of `size` x `size` pixels with `count` (1-9) circles and squares, one in each
    of `count` cells of a 3 x 3 grid, so that none touch."""
    if not 1 <= count <= 9:
        raise ValueError(f"count must be 1-9, got {count}")
    rng = random.Random(seed)
    image, ink = _canvas(size, rng)
    draw = ImageDraw.Draw(image)
    cell = size / 3
    pad = 0.1 * cell  # a gap of two pads between neighbours
    for index in rng.sample(range(9), count):
        side = rng.uniform(0.3, 0.7) * cell
        left = (index % 3) * cell + pad + rng.uniform(0, cell - 2 * pad - side)
        top = (index // 3) * cell + pad + rng.uniform(0, cell - 2 * pad - side)
        box = (left, top, left + side, top + side)
        if rng.random() < 0.5:
            draw.ellipse(box, fill=ink)
        else:
            draw.rectangle(box, fill=ink)
    return _png(image, seed, noise)


def draw_task(kind: TaskKind, answer: int, *, seed: int, size: int = 64) -> bytes:
    return draw_digit(answer, seed=seed, size=size) if kind == "digit" else draw_shapes(answer, seed=seed, size=size)


def parse_answer(text: str) -> int | None:
    """The first digit in `text`, wherever it stands: "7", " 7." and "It is 7" read 7, "12"
    reads 1; words ("seven") and an empty answer read None."""
    match = re.search(r"\d", text)
    return int(match.group()) if match else None


def score(text: str, answer: int) -> float:
    return 1.0 if parse_answer(text) == answer else 0.0


def new_task(kind: TaskKind, rng: random.Random, task_id: str) -> orchestrator_pb2.Task:
    """A task whose data holds what the picture is drawn from: its kind, answer and seed."""
    task = orchestrator_pb2.Task(task_id=task_id)
    answer = rng.randint(0, 9) if kind == "digit" else rng.randint(1, 9)
    task.data.update({"kind": kind, "answer": answer, "image_seed": rng.getrandbits(31)})
    return task


def start_request(environment: str, task: orchestrator_pb2.Task) -> orchestrator_pb2.StartEpisodeRequest:
    return orchestrator_pb2.StartEpisodeRequest(environment=environment, task=task)


def question_message(kind: TaskKind, image: bytes) -> orchestrator_pb2.ChatMessage:
    """The user's turn: the question, then the picture (`content` stays empty with parts)."""
    return orchestrator_pb2.ChatMessage(
        role="user",
        parts=[
            orchestrator_pb2.ContentPart(text=QUESTIONS[kind]),
            orchestrator_pb2.ContentPart(image=orchestrator_pb2.ImagePart(data=image, mime_type=MIME_TYPE)),
        ],
    )


def generate_request(episode_id: str, kind: TaskKind, image: bytes) -> orchestrator_pb2.GenerateRequest:
    messages = orchestrator_pb2.ChatMessages(messages=[question_message(kind, image)])
    return orchestrator_pb2.GenerateRequest(episode_id=episode_id, messages=messages)


def finish_request(episode_id: str, text: str, answer: int) -> orchestrator_pb2.FinishEpisodeRequest:
    reward = score(text, answer)
    return orchestrator_pb2.FinishEpisodeRequest(episode_id=episode_id, reward=reward, metrics={"correct": reward})


async def play_episode(
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub, episode: orchestrator_pb2.Episode, *, image_size: int
) -> dict[str, Any]:
    data = episode.task.data
    kind, answer, seed = data["kind"], int(data["answer"]), int(data["image_seed"])
    image = draw_task(kind, answer, seed=seed, size=image_size)
    reply = await stub.Generate(generate_request(episode.episode_id, kind, image))
    finish = finish_request(episode.episode_id, reply.text, answer)
    finished = await stub.FinishEpisode(finish)
    return {
        "episode_id": episode.episode_id,
        "group_id": episode.group_id,
        "task_id": episode.task.task_id,
        "answer": answer,
        "text": reply.text,
        "token_ids": list(reply.token_ids),
        "num_prompt_tokens": reply.num_prompt_tokens,
        "reward": finish.reward,
        "num_samples": finished.num_samples,
    }


async def play(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    transcript: list[dict[str, Any]] = []
    async with grpc.aio.insecure_channel(args.orchestrator) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        for index in range(args.tasks):
            task = new_task(args.task_kind, rng, f"{args.task_kind}-{args.seed}-{index}")
            try:
                # Waits while the orchestrator holds dispatch back (staleness, concurrency).
                started = await stub.StartEpisode(start_request(args.environment, task))
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION and "run is finished" in (error.details() or ""):
                    print("the run is finished", flush=True)
                    break
                raise
            played = await asyncio.gather(
                *(play_episode(stub, episode, image_size=args.image_size) for episode in started.episodes)
            )
            transcript += played
            print(f"task {task.task_id}: rewards {[entry['reward'] for entry in played]}", flush=True)
    return transcript


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orchestrator", default="localhost:50051", help="host:port of the orchestrator")
    parser.add_argument("--environment", default="read_digit", help="name of the external environment in its config")
    parser.add_argument("--tasks", type=int, default=4, help="tasks to play (each as a group of episodes)")
    parser.add_argument("--task-kind", choices=sorted(QUESTIONS), default="digit", help="read a digit or count shapes")
    parser.add_argument("--image-size", type=int, default=64, help="side of the square pictures, in pixels")
    parser.add_argument("--seed", type=int, default=0, help="seed of the tasks and their pictures")
    parser.add_argument("--transcript", help="write what each episode saw (JSONL, without the pictures) to this file")
    args = parser.parse_args(argv)
    transcript = asyncio.run(play(args))
    if args.transcript:
        with open(args.transcript, "w") as file:
            for entry in transcript:
                file.write(json.dumps(entry) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
