"""Plays a verifiers environment's episodes through the orchestrator's API, a group at a time:
NextEpisode for the group's episodes (a group's episodes are handed out one after the other,
so one caller takes them all), the environment's own rollout of each (its model turns are
Generate calls: client.py), its rubric over the group (group reward functions see the whole
group, as verifiers scores one), FinishEpisode with each rollout's reward and metrics.

Evaluation episodes (Episode.evaluation set) are played the same way, a group being one task's
samples; the orchestrator scores the evaluation and never trains on them.

A rollout the orchestrator could not serve (a turn refused, the episode dropped) or that
generated no turn ends discarded; one the model answered badly is scored like any other.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import verifiers as vf
from verifiers.clients import OpenAIChatCompletionsClient

from primerl.orchestrator.v1 import orchestrator_pb2, orchestrator_pb2_grpc
from primerl_orchestrator.environments.verifiers_process.client import EpisodeChatClient, TurnFailed

__all__ = ["DatasetRows", "EpisodePlayer", "TaskRows"]

logger = logging.getLogger(__name__)

# verifiers passes a model name to its client; the orchestrator serves one policy, whatever the name.
MODEL_NAME = "primerl-policy"
# NextEpisode waits while dispatch is held; asked again after this long.
_NEXT_EPISODE_DEADLINE_S = 30.0
_UNAVAILABLE_PAUSE_S = 1.0
_FINISH_ATTEMPTS = 5


class TaskRows:
    """Task `index` -> a row of the dataset: every row once per pass, in an order shuffled
    by the seed anew each pass (or in order)."""

    def __init__(self, rows: Sequence[dict[str, Any]], *, seed: int, shuffle: bool) -> None:
        if not rows:
            raise ValueError("the environment's dataset is empty")
        self._rows = rows
        self._seed = seed
        self._shuffle = shuffle
        self._order: tuple[int, list[int]] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def row(self, index: int) -> dict[str, Any]:
        passes, position = divmod(index, len(self._rows))
        if not self._shuffle:
            return self._rows[position]
        if self._order is None or self._order[0] != passes:
            order = list(range(len(self._rows)))
            random.Random(f"{self._seed}:{passes}").shuffle(order)
            self._order = (passes, order)
        return self._rows[self._order[1][position]]


class DatasetRows:
    """A task's row: its data names the split, the seed and the order of the stream (a training
    task and an evaluation's alike; unnamed: the process's own), each dataset read once."""

    def __init__(self, environment: vf.Environment, *, split: str, seed: int, shuffle: bool) -> None:
        self._environment = environment
        self._defaults = (split, seed, shuffle)
        self._datasets: dict[str, list[dict[str, Any]]] = {}
        self._streams: dict[tuple[str, int, bool], TaskRows] = {}

    def stream(self, split: str | None = None, seed: int | None = None, shuffle: bool | None = None) -> TaskRows:
        default_split, default_seed, default_shuffle = self._defaults
        key = (
            split or default_split,
            default_seed if seed is None else int(seed),
            default_shuffle if shuffle is None else bool(shuffle),
        )
        if key not in self._streams:
            if key[0] not in self._datasets:
                env = self._environment
                dataset = env.get_dataset() if key[0] == "train" else env.get_eval_dataset()
                self._datasets[key[0]] = dataset.to_list()
            self._streams[key] = TaskRows(self._datasets[key[0]], seed=key[1], shuffle=key[2])
        return self._streams[key]

    def row(self, data: dict[str, Any]) -> dict[str, Any]:
        stream = self.stream(data.get("split"), data.get("seed"), data.get("shuffle"))
        return stream.row(int(data["index"]))


@dataclass
class _Rollout:
    episode: orchestrator_pb2.Episode
    client: EpisodeChatClient
    state: vf.State | None = None
    # Why it yields no reward (None: it is scored).
    discard_reason: str | None = None


class EpisodePlayer:
    def __init__(
        self,
        environment: vf.Environment,
        rows: DatasetRows,
        stub: orchestrator_pb2_grpc.OrchestratorServiceStub,
        *,
        name: str,
        max_concurrent_groups: int,
        turn_timeout_s: float,
    ) -> None:
        self._env = environment
        self._rows = rows
        self._stub = stub
        self._name = name
        self._max_concurrent_groups = max_concurrent_groups
        self._turn_timeout_s = turn_timeout_s
        self._taking = asyncio.Lock()
        # An episode taken while collecting a group that turned out to start the next one.
        self._carried: orchestrator_pb2.Episode | None = None

    async def run(self) -> None:
        """Plays until the run is over (NextEpisode: FAILED_PRECONDITION)."""
        await asyncio.gather(*(self._play_groups() for _ in range(self._max_concurrent_groups)))

    async def _play_groups(self) -> None:
        while (episodes := await self._next_group()) is not None:
            await self.play_group(episodes)

    async def _next_group(self) -> list[orchestrator_pb2.Episode] | None:
        """The episodes of the next group (those left of it after a restart of this process: the
        earlier ones went to the process that died), or None once the run is over."""
        async with self._taking:
            first, self._carried = self._carried, None
            if first is None and (first := await self._next_episode()) is None:
                return None
            episodes = [first]
            while episodes[-1].index_in_group + 1 < first.group_size:
                episode = await self._next_episode()
                if episode is None:
                    break
                if episode.group_id != first.group_id:  # the rest of the group was dropped meanwhile
                    self._carried = episode
                    break
                episodes.append(episode)
            return episodes

    async def _next_episode(self) -> orchestrator_pb2.Episode | None:
        request = orchestrator_pb2.NextEpisodeRequest(environment=self._name)
        while True:
            try:
                return (await self._stub.NextEpisode(request, timeout=_NEXT_EPISODE_DEADLINE_S)).episode
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    logger.info("no more episodes: %s", error.details())
                    return None
                if error.code() not in (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE):
                    raise
                if error.code() == grpc.StatusCode.UNAVAILABLE:
                    await asyncio.sleep(_UNAVAILABLE_PAUSE_S)

    async def play_group(self, episodes: Sequence[orchestrator_pb2.Episode]) -> None:
        rollouts = [
            _Rollout(episode, EpisodeChatClient(self._stub, episode.episode_id, timeout_s=self._turn_timeout_s))
            for episode in episodes
        ]
        await asyncio.gather(*(self._roll_out(rollout) for rollout in rollouts))
        scored = [r for r in rollouts if r.discard_reason is None]
        if scored:
            states = [r.state for r in scored]
            try:
                if self._env.score_rollouts:
                    await self._env.rubric.score_group(states)
                else:
                    await self._env.rubric.dummy_score_group(states)
                for state in states:
                    await self._env.rubric.cleanup(state)
            except Exception as exc:
                logger.exception("the rubric failed on group %s", episodes[0].group_id)
                for rollout in scored:
                    rollout.discard_reason = f"the rubric failed: {exc!r}"
        await asyncio.gather(*(self._finish(rollout) for rollout in rollouts))

    async def _roll_out(self, rollout: _Rollout) -> None:
        row = self._rows.row(dict(rollout.episode.task.data))
        client = OpenAIChatCompletionsClient(rollout.client)
        try:
            rollout.state = await self._env.rollout(
                copy.deepcopy(row), client, MODEL_NAME, copy.deepcopy(self._env.sampling_args)
            )
        except Exception as exc:
            logger.exception("the rollout of episode %s failed", rollout.episode.episode_id)
            rollout.discard_reason = f"the rollout failed: {exc!r}"
            return
        refused = _turn_failure(rollout.state.get("error"))
        if refused is not None:
            rollout.discard_reason = str(refused)
        elif rollout.client.num_turns == 0:
            rollout.discard_reason = "it generated no turn"

    async def _finish(self, rollout: _Rollout) -> None:
        episode_id = rollout.episode.episode_id
        if rollout.discard_reason is not None:
            logger.info("episode %s discarded: %s", episode_id, rollout.discard_reason)
            request = orchestrator_pb2.FinishEpisodeRequest(episode_id=episode_id, discard=True)
        else:
            assert rollout.state is not None
            metrics = {
                key: float(value)
                for key, value in (rollout.state.get("metrics") or {}).items()
                if isinstance(value, int | float) and math.isfinite(value)
            }
            reward = float(rollout.state.get("reward") or 0.0)
            request = orchestrator_pb2.FinishEpisodeRequest(
                episode_id=episode_id, reward=reward if math.isfinite(reward) else 0.0, metrics=metrics
            )
        for attempt in range(_FINISH_ATTEMPTS):
            try:
                await self._stub.FinishEpisode(request, timeout=30)
                return
            except grpc.aio.AioRpcError as error:
                if error.code() == grpc.StatusCode.FAILED_PRECONDITION:
                    # Dropped by the orchestrator meanwhile (too far off-policy, timed out): nothing to end.
                    logger.info("episode %s ended without us: %s", episode_id, error.details())
                    return
                if error.code() != grpc.StatusCode.UNAVAILABLE or attempt + 1 == _FINISH_ATTEMPTS:
                    raise
                await asyncio.sleep(_UNAVAILABLE_PAUSE_S)


def _turn_failure(error: BaseException | None) -> TurnFailed | None:
    """The refused turn behind a rollout's error, if that is what stopped it."""
    while error is not None:
        if isinstance(error, TurnFailed):
            return error
        error = error.__cause__ or error.__context__
    return None
