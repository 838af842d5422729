"""Evaluation episodes handed out through the orchestrator's API, for the environments that a
process of their own plays (verifiers ones): the process takes them with NextEpisode like
training episodes (marked with the evaluation's name), plays them with Generate and ends them
with FinishEpisode; the reward scores the evaluation, nothing is trained on.

An evaluation queues one group per task (its `num_samples` episodes, so that the environment's
group scoring sees them together). A queued group is handed out only while its admission says
so (during training: while training cannot start a group) and the evaluation has room under
its `max_concurrent`; the started group's episodes go to the environment's next callers first.
An episode its process dropped (it died) or discarded after inference failed it is played again
under a new id, up to `MAX_ATTEMPTS` plays; after that, or discarded for another reason, or not
finished within the episode timeout, it counts as a failed sample.
"""

from __future__ import annotations

import asyncio
import collections
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from primerl.common.v1 import generation_pb2
from primerl_common.errors import FailedPrecondition
from primerl_orchestrator.config import SamplingDefaults
from primerl_orchestrator.environments import Task
from primerl_orchestrator.episodes import EpisodeState, TurnChecks, take_pending
from primerl_orchestrator.scheduler import Dispatcher

__all__ = ["MAX_ATTEMPTS", "EvalEpisode", "EvalEpisodes", "EvalPlay", "SampleRecord"]

MAX_ATTEMPTS = 3
# Ended episodes remembered, so that a late call on one is told what became of it.
_MAX_RETIRED = 10_000


@dataclass
class SampleRecord:
    """One played eval sample, as the samples table shows it."""

    task_id: str
    prompt: str
    completion: str
    reward: float
    policy_version: int
    error: str = ""


@dataclass(frozen=True)
class EvalPlay:
    """One evaluation's run at a policy version, as its episodes need it."""

    evaluation: str
    environment: str
    policy_version: int
    sampling: SamplingDefaults
    # The eval's own sampling settings: they win over a turn's overrides.
    forced_sampling: generation_pb2.SamplingParams
    max_concurrent: int
    # Admission: True while an eval group may start.
    may_start: Callable[[], bool]


@dataclass(eq=False)
class EvalEpisode(TurnChecks):
    episode_id: str
    group_id: str
    play: EvalPlay
    task: Task
    index_in_group: int
    group_size: int
    created_at: float
    result: asyncio.Future[SampleRecord]
    attempt: int = 1
    state: EpisodeState = EpisodeState.PENDING
    turn_in_progress: bool = False
    num_turns: int = 0
    prompts: list[str] = field(default_factory=list)
    completions: list[str] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    # The last turn's failure in inference (a discard after it plays the sample again).
    turn_failed: str = ""

    @property
    def environment(self) -> str:
        return self.play.environment

    @property
    def start_version(self) -> int:
        return self.play.policy_version

    def check_not_ended(self) -> None:
        if self.state.ended:
            raise FailedPrecondition(
                f"evaluation episode {self.episode_id} is over", reason="EPISODE_FINISHED", subject=self.episode_id
            )


class EvalEpisodes:
    """The evaluation episodes of process-played environments, by id and by environment."""

    def __init__(self, dispatcher: Dispatcher, *, clock: Callable[[], float]) -> None:
        # Its state changes wake the episode waiters; its close ends them.
        self._dispatcher = dispatcher
        self._clock = clock
        self._queued: dict[str, collections.deque[list[EvalEpisode]]] = collections.defaultdict(collections.deque)
        self._pending: dict[str, collections.deque[EvalEpisode]] = collections.defaultdict(collections.deque)
        self._live: dict[str, EvalEpisode] = {}
        self._in_flight: collections.Counter[str] = collections.Counter()
        self._retired: collections.OrderedDict[str, EpisodeState] = collections.OrderedDict()

    def get(self, episode_id: str) -> EvalEpisode | None:
        """The live evaluation episode `episode_id`; None when it is none (a training one);
        FAILED_PRECONDITION for one that ended (its evaluation was scored or given up)."""
        episode = self._live.get(episode_id)
        if episode is None and (state := self._retired.get(episode_id)) is not None:
            reason = "EPISODE_DROPPED" if state == EpisodeState.DROPPED else "EPISODE_FINISHED"
            raise FailedPrecondition(
                f"evaluation episode {episode_id} is over ({state.value})", reason=reason, subject=episode_id
            )
        return episode

    def has_queued(self, environment: str) -> bool:
        return bool(self._pending[environment] or self._queued[environment])

    async def play(self, play: EvalPlay, tasks: Sequence[Task], num_samples: int) -> list[SampleRecord]:
        """Queues the evaluation's episodes for its environment's process; their records, task by
        task, once every one has ended."""
        loop = asyncio.get_running_loop()
        groups = []
        for task in tasks:
            group_id = uuid.uuid4().hex
            groups.append(
                [
                    self._new_episode(play, task, group_id, index, num_samples, loop.create_future())
                    for index in range(num_samples)
                ]
            )
        self._queued[play.environment].extend(groups)
        self._dispatcher.update()
        episodes = [episode for group in groups for episode in group]
        try:
            return list(await asyncio.gather(*(episode.result for episode in episodes)))
        finally:
            queued = self._queued[play.environment]
            for group in groups:
                if group in queued:
                    queued.remove(group)
            for episode in list(self._live.values()):
                if episode.play is play:
                    self._end(episode)

    async def next_episode(self, environment: str) -> EvalEpisode:
        """The next evaluation episode of `environment` (waits for one its admission lets start;
        raises the dispatcher's error once the run is over)."""
        while True:
            pending = self._pending[environment]
            if (episode := take_pending(pending)) is not None:
                episode.created_at = self._clock()
                return episode
            if self._dispatcher.closed_error is not None:
                raise self._dispatcher.closed_error
            queued = self._queued[environment]
            if queued and self._may_start(queued[0]):
                group = queued.popleft()
                self._in_flight[group[0].play.evaluation] += len(group)
                pending.extend(group)
                continue
            await self._dispatcher.wait_for_change()

    def unget(self, episode: EvalEpisode) -> None:
        """Puts back an episode taken by a caller that did not get it (its call ended first)."""
        episode.state = EpisodeState.PENDING
        self._pending[episode.environment].appendleft(episode)
        self._dispatcher.update()

    def _may_start(self, group: list[EvalEpisode]) -> bool:
        play = group[0].play
        in_flight = self._in_flight[play.evaluation]
        return play.may_start() and (in_flight == 0 or in_flight + len(group) <= play.max_concurrent)

    def finish(self, episode: EvalEpisode, *, reward: float, discard: bool) -> None:
        episode.check_can_finish(discard=discard)
        if discard and episode.turn_failed:
            self._again(episode, f"inference failed its turn ({episode.turn_failed})")
        elif discard:
            self._resolve(episode, 0.0, "discarded by its environment")
        else:
            self._resolve(episode, reward, "")

    def abandon(self, environment: str, reason: str) -> int:
        """The episodes of `environment` its process was playing (it died) are played again."""
        running = [e for e in self._live.values() if e.environment == environment and e.state == EpisodeState.RUNNING]
        for episode in running:
            self._again(episode, reason)
        return len(running)

    def sweep(self, *, timeout_s: float) -> None:
        now = self._clock()
        for episode in list(self._live.values()):
            if episode.state == EpisodeState.RUNNING and now - episode.created_at > timeout_s:
                self._resolve(episode, 0.0, f"not finished within {timeout_s:.0f}s")

    def _again(self, episode: EvalEpisode, reason: str) -> None:
        if episode.attempt >= MAX_ATTEMPTS:
            self._resolve(episode, 0.0, f"{reason}, {episode.attempt} times")
            return
        self._end(episode, state=EpisodeState.DROPPED)
        again = self._new_episode(episode.play, episode.task, uuid.uuid4().hex, 0, 1, episode.result)
        again.attempt = episode.attempt + 1
        self._queued[again.environment].appendleft([again])
        self._dispatcher.update()

    def _resolve(self, episode: EvalEpisode, reward: float, error: str) -> None:
        self._end(episode, state=EpisodeState.DISCARDED if error else EpisodeState.FINISHED)
        if not episode.result.done():
            episode.result.set_result(
                SampleRecord(
                    task_id=episode.task.task_id,
                    prompt="\n".join(episode.prompts),
                    completion="\n".join(episode.completions),
                    reward=reward,
                    policy_version=min(episode.versions, default=episode.play.policy_version),
                    error=error,
                )
            )

    def _end(self, episode: EvalEpisode, *, state: EpisodeState = EpisodeState.DROPPED) -> None:
        if self._live.pop(episode.episode_id, None) is None:
            return
        self._retired[episode.episode_id] = state
        while len(self._retired) > _MAX_RETIRED:
            self._retired.popitem(last=False)
        if episode.state == EpisodeState.RUNNING:
            self._in_flight[episode.play.evaluation] -= 1
        elif episode.state == EpisodeState.PENDING and episode in self._pending[episode.environment]:
            # A pending episode of a started group counts as in flight too.
            self._pending[episode.environment].remove(episode)
            self._in_flight[episode.play.evaluation] -= 1
        episode.state = state
        self._dispatcher.update()

    def _new_episode(
        self,
        play: EvalPlay,
        task: Task,
        group_id: str,
        index: int,
        group_size: int,
        result: asyncio.Future[SampleRecord],
    ) -> EvalEpisode:
        episode = EvalEpisode(
            episode_id=f"eval-{uuid.uuid4().hex}",
            group_id=group_id,
            play=play,
            task=task,
            index_in_group=index,
            group_size=group_size,
            created_at=self._clock(),
            result=result,
        )
        self._live[episode.episode_id] = episode
        return episode
