"""A custom environment played against the primerl orchestrator: a number-guessing game.

The environment thinks of a number, the model guesses, the environment answers "higher" or
"lower", for up to --max-turns turns. Each task is started as a group of episodes
(StartEpisode: the environment brings its tasks); every episode is one multi-turn
conversation, sent whole with each Generate call. The reward is 1 for a correct guess, else
less the further the last guess was. The orchestrator records the tokens, logprobs and
policy versions; this program sees text only.

It depends on nothing but grpcio and the generated primerl stubs (primerl.orchestrator.v1),
so it is the template for an environment in its own process, repository or container:

    python examples/custom_env/guessing_game.py --orchestrator localhost:50051 \
        --environment guess --tasks 4
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
from typing import Any

import grpc

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc

SYSTEM_PROMPT = (
    "I am thinking of a whole number from {low} to {high}. Guess it: answer with the number only. "
    "After each guess I tell you whether my number is higher or lower."
)


def feedback(guess: int | None, secret: int) -> str:
    if guess is None:
        return "That is not a number. Guess again."
    return f"My number is {'higher' if secret > guess else 'lower'}. Guess again."


def parse_guess(text: str) -> int | None:
    match = re.search(r"-?\d+", text)
    return int(match.group()) if match else None


def reward_of(guess: int | None, secret: int, span: int) -> float:
    if guess is None:
        return 0.0
    if guess == secret:
        return 1.0
    return max(0.0, 0.5 * (1.0 - abs(guess - secret) / span))


async def play_episode(
    stub: orchestrator_pb2_grpc.OrchestratorServiceStub,
    episode: orchestrator_pb2.Episode,
    *,
    max_turns: int,
    transcript: list[dict[str, Any]],
) -> None:
    data = episode.task.data
    secret, low, high = int(data["secret"]), int(data["low"]), int(data["high"])
    messages = [
        orchestrator_pb2.ChatMessage(role="system", content=SYSTEM_PROMPT.format(low=low, high=high)),
        orchestrator_pb2.ChatMessage(role="user", content="Your first guess?"),
    ]
    turns: list[dict[str, Any]] = []
    guess = None
    for _ in range(max_turns):
        reply = await stub.Generate(
            orchestrator_pb2.GenerateRequest(
                episode_id=episode.episode_id, messages=orchestrator_pb2.ChatMessages(messages=messages)
            )
        )
        turns.append(
            {"text": reply.text, "token_ids": list(reply.token_ids), "num_prompt_tokens": reply.num_prompt_tokens}
        )
        guess = parse_guess(reply.text)
        messages.append(orchestrator_pb2.ChatMessage(role="assistant", content=reply.text))
        if guess == secret:
            break
        messages.append(orchestrator_pb2.ChatMessage(role="user", content=feedback(guess, secret)))
    reward = reward_of(guess, secret, high - low)
    finished = await stub.FinishEpisode(
        orchestrator_pb2.FinishEpisodeRequest(
            episode_id=episode.episode_id,
            reward=reward,
            metrics={"turns": float(len(turns)), "solved": float(guess == secret)},
        )
    )
    transcript.append(
        {
            "episode_id": episode.episode_id,
            "group_id": episode.group_id,
            "reward": reward,
            "num_samples": finished.num_samples,
            "turns": turns,
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--orchestrator", default="localhost:50051", help="host:port of the orchestrator")
    parser.add_argument("--environment", default="guess", help="name of the external environment in its config")
    parser.add_argument("--tasks", type=int, default=4, help="tasks to play (each as a group of episodes)")
    parser.add_argument("--max-turns", type=int, default=4)
    parser.add_argument("--low", type=int, default=1)
    parser.add_argument("--high", type=int, default=9)
    parser.add_argument("--seed", type=int, default=0, help="seed of the secret numbers")
    parser.add_argument("--transcript", help="write what each episode saw (JSONL) to this file")
    args = parser.parse_args(argv)
    transcript = asyncio.run(play(args))
    if args.transcript:
        with open(args.transcript, "w") as file:
            for entry in transcript:
                file.write(json.dumps(entry) + "\n")
    return 0


async def play(args: argparse.Namespace) -> list[dict[str, Any]]:
    rng = random.Random(args.seed)
    transcript: list[dict[str, Any]] = []
    async with grpc.aio.insecure_channel(args.orchestrator) as channel:
        stub = orchestrator_pb2_grpc.OrchestratorServiceStub(channel)
        for index in range(args.tasks):
            task = orchestrator_pb2.Task(task_id=f"guess-{args.seed}-{index}")
            task.data.update({"secret": rng.randint(args.low, args.high), "low": args.low, "high": args.high})
            # Waits while the orchestrator holds dispatch back (staleness, concurrency).
            started = await stub.StartEpisode(
                orchestrator_pb2.StartEpisodeRequest(environment=args.environment, task=task)
            )
            await asyncio.gather(
                *(play_episode(stub, e, max_turns=args.max_turns, transcript=transcript) for e in started.episodes)
            )
            rewards = [entry["reward"] for entry in transcript[-len(started.episodes) :]]
            print(f"task {task.task_id}: rewards {rewards}", flush=True)
    return transcript


if __name__ == "__main__":
    sys.exit(main())
