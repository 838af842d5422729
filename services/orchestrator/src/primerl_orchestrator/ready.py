"""Rollouts of completed groups, waiting for a batch.

A completed group is counted finished (every episode got a reward) or incomplete; its
episodes that finished with a reward get their advantages (advantages.py); a group whose
advantages are all zero may be filtered out (counted). Groups wait here oldest first; rollouts
that have become too old for the step being cut are dropped (counted) before each cut, and a
batch takes whole groups (counted) until it holds batch_size rollouts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from primerl_orchestrator.advantages import group_advantages, is_zero_advantage
from primerl_orchestrator.config import AdvantageConfig
from primerl_orchestrator.episodes import EpisodeState, Group, Rollout
from primerl_orchestrator.metrics import RunCounters
from primerl_orchestrator.staleness import is_stale

__all__ = ["ReadyRollouts"]


@dataclass
class _ReadyGroup:
    environment: str
    rollouts: list[Rollout]


class ReadyRollouts:
    def __init__(
        self,
        *,
        advantage: AdvantageConfig,
        max_off_policy_steps: int,
        counters: RunCounters,
        on_change: Callable[[int], None],
    ) -> None:
        self._advantage = advantage
        self._max_off_policy_steps = max_off_policy_steps
        self._counters = counters
        # Told the number of rollouts waiting whenever it changes.
        self._on_change = on_change
        self._groups: list[_ReadyGroup] = []

    @property
    def num_rollouts(self) -> int:
        return sum(len(group.rollouts) for group in self._groups)

    def add(self, group: Group) -> None:
        """The rollouts of a completed group, with their advantages (unless filtered out)."""
        scored = [e for e in group.episodes if e.state == EpisodeState.FINISHED and e.reward is not None]
        finished = len(scored) == len(group.episodes)
        self._counters.count(group.environment, "groups_finished" if finished else "groups_incomplete")
        advantages = group_advantages([e.reward for e in scored], std_normalize=self._advantage.std_normalize)
        rollouts = [
            Rollout(e.episode_id, group.environment, group.group_id, e.reward, advantage, e.tokens.samples)
            for e, advantage in zip(scored, advantages, strict=True)
            if e.tokens.samples
        ]
        if not rollouts:
            return
        if self._advantage.filter_zero_advantage and is_zero_advantage(advantages):
            self._counters.count(group.environment, "groups_filtered_zero_advantage")
            return
        self._groups.append(_ReadyGroup(group.environment, rollouts))
        self._on_change(self.num_rollouts)

    def take(self, step: int, batch_size: int) -> list[Rollout] | None:
        """Whole groups, oldest first, holding at least batch_size rollouts recent enough for
        `step`; None while there are not enough."""
        self._drop_stale(step)
        if self.num_rollouts < batch_size:
            return None
        taken: list[Rollout] = []
        while len(taken) < batch_size:
            group = self._groups.pop(0)
            taken += group.rollouts
            self._counters.count(group.environment, "groups_batched")
        self._on_change(self.num_rollouts)
        return taken

    def _drop_stale(self, step: int) -> None:
        dropped = False
        for group in self._groups:
            fresh = [
                r
                for r in group.rollouts
                if not is_stale(step, r.oldest_version, max_off_policy_steps=self._max_off_policy_steps)
            ]
            if len(fresh) < len(group.rollouts):
                self._counters.count(group.environment, "dropped_off_policy", len(group.rollouts) - len(fresh))
                group.rollouts = fresh
                dropped = True
        if dropped:
            self._groups = [group for group in self._groups if group.rollouts]
            self._on_change(self.num_rollouts)
