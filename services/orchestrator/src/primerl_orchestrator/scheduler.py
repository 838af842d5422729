"""When a group may start, and whose it is.

Players (built-in environments' coroutines, and NextEpisode/StartEpisode calls of external
ones) wait here for an episode. A new group starts only while the run is open and

- its target step (staleness.target_step) is within max_steps and within max_async_level of
  the latest policy version,
- the episodes in flight leave room for the whole group (max_concurrent_episodes),
- its environment is the one furthest behind its share among the environments that have a
  player waiting (episodes started / weight; ties go to the environment listed first), so
  weights hold among the environments that are playing.

The episodes of a started group are handed to its environment's next callers first.
Everything runs on the event loop; a waiter re-checks whenever anything it depends on
changed.
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable, Sequence

from primerl_common.errors import ServiceError
from primerl_orchestrator.episodes import Episode, EpisodeState, Group, take_pending
from primerl_orchestrator.staleness import may_start, target_step

__all__ = ["Dispatcher"]

# Makes the group of one environment for a target step.
GroupFactory = Callable[[int], Group]


class Dispatcher:
    def __init__(
        self,
        *,
        weights: dict[str, float],
        batch_size: int,
        max_async_level: int,
        max_concurrent_episodes: int,
        max_steps: int,
    ) -> None:
        self._weights = dict(weights)
        self._order = list(weights)
        self._batch_size = batch_size
        self._max_async_level = max_async_level
        self._max_concurrent = max_concurrent_episodes
        self._max_steps = max_steps
        self.policy_version: int | None = None
        self.next_step = 1
        self.num_ready = 0
        self.num_in_flight = 0
        # Finished episodes of groups still playing: ready rollouts once their group completes.
        self.num_awaiting_group = 0
        self.open = False
        # Set when the run ended: every waiter gets it.
        self.closed_error: ServiceError | None = None
        self.num_started = dict.fromkeys(weights, 0)
        self._waiting: collections.Counter[str] = collections.Counter()
        self._pending: dict[str, collections.deque[Episode]] = {name: collections.deque() for name in weights}
        self._changed = asyncio.Event()

    # State changes (each wakes the waiters).

    def update(
        self,
        *,
        policy_version: int | None = None,
        next_step: int | None = None,
        num_ready: int | None = None,
        open: bool | None = None,
    ) -> None:
        if policy_version is not None:
            self.policy_version = policy_version
        if next_step is not None:
            self.next_step = next_step
        if num_ready is not None:
            self.num_ready = num_ready
        if open is not None:
            self.open = open
        self._wake()

    def close(self, error: ServiceError) -> None:
        self.closed_error = error
        self.open = False
        self._wake()

    def episode_ended(self, *, awaits_group: bool = False) -> None:
        """An episode ended. It no longer counts toward a step unless `awaits_group`: it finished
        and its rollout becomes ready with the rest of its group (`group_completed`)."""
        self.num_in_flight -= 1
        if awaits_group:
            self.num_awaiting_group += 1
        self._wake()

    def group_completed(self, num_awaited: int) -> None:
        """A group's last episode ended: its `num_awaited` episodes that waited for it are ready
        rollouts now (num_ready) or were filtered out."""
        self.num_awaiting_group -= num_awaited
        self._wake()

    # Waiting for episodes.

    async def next_episode(self, environment: str, group_size: int, make_group: GroupFactory) -> Episode:
        """The next episode of `environment`: a pending one of a started group, or the first
        of a group started for it."""
        self._waiting[environment] += 1
        try:
            while True:
                pending = self._pending[environment]
                if (episode := take_pending(pending)) is not None:
                    return episode
                self._raise_if_closed()
                if self._may_start(environment, group_size):
                    pending.extend(self._start(environment, make_group).episodes)
                    continue
                await self.wait_for_change()
        finally:
            self._decrement_waiting(environment)

    async def start_group(self, environment: str, group_size: int, make_group: GroupFactory) -> Group:
        """A group of `environment` started for its caller, all episodes running."""
        self._waiting[environment] += 1
        try:
            while True:
                self._raise_if_closed()
                if self._may_start(environment, group_size):
                    group = self._start(environment, make_group)
                    for episode in group.episodes:
                        episode.state = EpisodeState.RUNNING
                    return group
                await self.wait_for_change()
        finally:
            self._decrement_waiting(environment)

    def target_step(self) -> int:
        return target_step(
            self.next_step,
            num_committed=self.num_ready + self.num_in_flight + self.num_awaiting_group,
            batch_size=self._batch_size,
        )

    def blocked_reason(self, group_size: int) -> str | None:
        """Why a group of `group_size` may not start now (None: it may)."""
        if self.closed_error is not None:
            return self.closed_error.message
        if not self.open:
            return "dispatch is closed (starting or paused)"
        step = self.target_step()
        if step > self._max_steps:
            return f"the rollouts ready or in flight cover the last step ({self._max_steps})"
        if self.policy_version is None or not may_start(
            self.policy_version, step, max_async_level=self._max_async_level
        ):
            return (
                f"a group for step {step} needs policy version >= {step - self._max_async_level} "
                f"(max_async_level {self._max_async_level}); the latest is {self.policy_version}"
            )
        if self.num_in_flight + group_size > self._max_concurrent:
            return f"{self.num_in_flight} episodes in flight (max_concurrent_episodes {self._max_concurrent})"
        return None

    def _may_start(self, environment: str, group_size: int) -> bool:
        return (
            self.blocked_reason(group_size) is None and self._most_behind(self._waiting_environments()) == environment
        )

    def _waiting_environments(self) -> list[str]:
        return [name for name in self._order if self._waiting[name] > 0]

    def _most_behind(self, environments: Sequence[str]) -> str:
        return min(
            environments, key=lambda name: (self.num_started[name] / self._weights[name], self._order.index(name))
        )

    def _start(self, environment: str, make_group: GroupFactory) -> Group:
        group = make_group(self.target_step())
        self.num_started[environment] += len(group.episodes)
        self.num_in_flight += len(group.episodes)
        self._wake()
        return group

    def _raise_if_closed(self) -> None:
        if self.closed_error is not None:
            raise self.closed_error

    def _decrement_waiting(self, environment: str) -> None:
        self._waiting[environment] -= 1
        # Another environment may be the one most behind now.
        self._wake()

    async def wait_for_change(self) -> None:
        """Returns at the next state change (of any kind)."""
        await self._changed.wait()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()
