"""Episodes and their groups: states, the checks every API call makes on them, and the book
that finds them by id.

An episode is created with its group (all episodes of one task), PENDING until a player
takes it, RUNNING while it plays, and ends FINISHED (with a reward), DISCARDED (by its
environment) or DROPPED (by the orchestrator: off-policy or timed out). A group completes
when every episode has ended; only then are its advantages computed.
"""

from __future__ import annotations

import collections
import enum
import uuid
from dataclasses import dataclass, field
from typing import TypeVar

from primerl_common.errors import FailedPrecondition, NotFound
from primerl_orchestrator.environments import Task
from primerl_orchestrator.samples import EpisodeTokens, Sample

__all__ = ["Episode", "EpisodeBook", "EpisodeState", "Group", "Rollout", "TurnChecks", "take_pending"]


class EpisodeState(enum.Enum):
    PENDING = "pending"
    RUNNING = "running"
    FINISHED = "finished"
    DISCARDED = "discarded"
    DROPPED = "dropped"

    @property
    def ended(self) -> bool:
        return self in (EpisodeState.FINISHED, EpisodeState.DISCARDED, EpisodeState.DROPPED)


class TurnChecks:
    """The checks an API call makes before a turn or the end of an episode, training or
    evaluation; the episode says when it has ended (check_not_ended)."""

    episode_id: str
    state: EpisodeState
    turn_in_progress: bool
    num_turns: int

    def check_not_ended(self) -> None:
        raise NotImplementedError

    def check_can_play(self) -> None:
        """Raises unless a model turn may run now."""
        self.check_not_ended()
        if self.turn_in_progress:
            raise FailedPrecondition(
                f"episode {self.episode_id} has a turn running; turns of one episode run one at a time",
                reason="TURN_IN_PROGRESS",
                subject=self.episode_id,
            )

    def check_can_finish(self, *, discard: bool) -> None:
        """Raises unless the episode may end now: with a reward once it has generated a turn
        (a reward with no token scores nothing), discarded at any time."""
        self.check_not_ended()
        if self.turn_in_progress:
            raise FailedPrecondition(
                f"episode {self.episode_id} has a turn running; finish it after the turn returns",
                reason="TURN_IN_PROGRESS",
                subject=self.episode_id,
            )
        if not discard and self.num_turns == 0:
            raise FailedPrecondition(
                f"episode {self.episode_id} has generated no turn, so a reward would score nothing: "
                "call Generate first, or FinishEpisode with discard to abandon it",
                reason="NO_TURN_GENERATED",
                subject=self.episode_id,
            )


_E = TypeVar("_E", bound=TurnChecks)


def take_pending(pending: collections.deque[_E]) -> _E | None:
    """The first episode of `pending` still PENDING, now RUNNING; those that ended while they
    waited leave the queue with it. None once `pending` is empty."""
    while pending:
        episode = pending.popleft()
        if episode.state == EpisodeState.PENDING:
            episode.state = EpisodeState.RUNNING
            return episode
    return None


@dataclass(eq=False)
class Episode(TurnChecks):
    episode_id: str
    group: Group
    index_in_group: int
    # Latest policy version when the group started (replicas salt each turn with the version
    # they serve it at, not this one).
    start_version: int
    created_at: float
    state: EpisodeState = EpisodeState.PENDING
    tokens: EpisodeTokens = field(default_factory=EpisodeTokens)
    num_turns: int = 0
    turn_in_progress: bool = False
    reward: float | None = None
    drop_reason: str = ""

    @property
    def environment(self) -> str:
        return self.group.environment

    def check_not_ended(self) -> None:
        if self.state == EpisodeState.DROPPED:
            raise FailedPrecondition(
                f"episode {self.episode_id} was dropped by the orchestrator: {self.drop_reason}",
                reason="EPISODE_DROPPED",
                subject=self.episode_id,
            )
        if self.state.ended:
            raise FailedPrecondition(
                f"episode {self.episode_id} is finished", reason="EPISODE_FINISHED", subject=self.episode_id
            )

    @property
    def oldest_version(self) -> int:
        """Version of its oldest sampled token; before the first turn, the version it started at."""
        oldest = self.tokens.oldest_version
        return self.start_version if oldest is None else oldest


@dataclass(eq=False)
class Group:
    group_id: str
    environment: str
    task: Task
    # The step the group was started for (staleness.target_step).
    target_step: int
    episodes: list[Episode] = field(default_factory=list)

    @property
    def complete(self) -> bool:
        return all(episode.state.ended for episode in self.episodes)


@dataclass(eq=False)
class Rollout:
    """A finished episode's samples, with its advantage: what a batch is cut from."""

    episode_id: str
    environment: str
    group_id: str
    reward: float
    advantage: float
    samples: list[Sample]

    @property
    def oldest_version(self) -> int:
        return min(sample.oldest_version for sample in self.samples)


class EpisodeBook:
    """Episodes by id. Ended episodes of completed groups are retired to their final state
    alone (kept for the last `max_retired`), so that a late call on one is told what
    happened to it rather than that it never existed."""

    def __init__(self, *, max_retired: int = 100_000) -> None:
        self._live: dict[str, Episode] = {}
        self._retired: collections.OrderedDict[str, EpisodeState] = collections.OrderedDict()
        self._max_retired = max_retired

    def new_group(
        self, environment: str, task: Task, *, size: int, policy_version: int, target_step: int, now: float
    ) -> Group:
        group = Group(group_id=uuid.uuid4().hex, environment=environment, task=task, target_step=target_step)
        for index in range(size):
            episode = Episode(
                episode_id=uuid.uuid4().hex,
                group=group,
                index_in_group=index,
                start_version=policy_version,
                created_at=now,
            )
            group.episodes.append(episode)
            self._live[episode.episode_id] = episode
        return group

    def get(self, episode_id: str) -> Episode:
        episode = self._live.get(episode_id)
        if episode is not None:
            return episode
        state = self._retired.get(episode_id)
        if state == EpisodeState.DROPPED:
            raise FailedPrecondition(
                f"episode {episode_id} was dropped by the orchestrator", reason="EPISODE_DROPPED", subject=episode_id
            )
        if state is not None:
            raise FailedPrecondition(f"episode {episode_id} is finished", reason="EPISODE_FINISHED", subject=episode_id)
        raise NotFound(f"no episode {episode_id!r} (never started here, or started before a restart)")

    def live(self) -> list[Episode]:
        return list(self._live.values())

    def retire(self, group: Group) -> None:
        for episode in group.episodes:
            del self._live[episode.episode_id]
            self._retired[episode.episode_id] = episode.state
        while len(self._retired) > self._max_retired:
            self._retired.popitem(last=False)
