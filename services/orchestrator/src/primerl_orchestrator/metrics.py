"""What the run counts, per environment: totals (kept in the checkpoint, so that a resumed
run counts on without counting anything twice), the same as Prometheus counters, and per
step the differences since the previous step, written as one JSON line."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import pathlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import Counter, Gauge

__all__ = ["EnvironmentCounters", "MetricsLog", "RunCounters", "mean_std"]

_ENV = ("environment",)


@dataclass
class EnvironmentCounters:
    episodes_started: int = 0
    episodes_finished: int = 0
    episodes_discarded: int = 0
    # Rollouts dropped because they were too far off-policy (before a turn or a batch).
    dropped_off_policy: int = 0
    # Episodes dropped because they were not finished within run.episode_timeout_s.
    timed_out: int = 0
    # Failed model turns and failed built-in episodes.
    errors: int = 0
    # Groups whose episodes all ended: all with a reward (finished) or not (incomplete), then
    # those dropped for equal rewards, and those cut into a batch (GroupCounts in the proto).
    groups_finished: int = 0
    groups_incomplete: int = 0
    groups_filtered_zero_advantage: int = 0
    groups_batched: int = 0
    turns: int = 0
    # Turns that ended at max_tokens or the context length, and those cut by the context.
    turns_length_limited: int = 0
    turns_truncated_by_context: int = 0
    # Turns whose prompt did not extend the sample before and so started a new sample.
    new_samples_after_first: int = 0
    completion_tokens: int = 0


_FIELDS = [field.name for field in dataclasses.fields(EnvironmentCounters)]
_COUNTERS = {
    name: Counter(f"primerl_orchestrator_{name}", f"{name.replace('_', ' ')} (see metrics.py)", _ENV)
    for name in _FIELDS
}
_step = Gauge("primerl_orchestrator_step", "Last step whose batch went to the trainer.")
_policy_version = Gauge("primerl_orchestrator_policy_version", "Latest policy version known.")
_episodes_running = Gauge("primerl_orchestrator_episodes_running", "Episodes started and not ended.", _ENV)
_reward_mean = Gauge("primerl_orchestrator_reward_mean", "Mean reward of the last step's episodes.", _ENV)
_off_policy_max = Gauge("primerl_orchestrator_off_policy_steps_max", "Largest off-policy distance in the last batch.")
_samples_pushed = Counter("primerl_orchestrator_samples_pushed", "Samples sent to the trainer.")
_tokens_pushed = Counter("primerl_orchestrator_tokens_pushed", "Tokens sent to the trainer.")


class RunCounters:
    def __init__(self, environments: Iterable[str]) -> None:
        self.totals = {name: EnvironmentCounters() for name in environments}
        self._at_last_step = {name: EnvironmentCounters() for name in self.totals}
        # Rewards of the episodes finished since the last step.
        self.rewards: dict[str, list[float]] = {name: [] for name in self.totals}
        self.last_rewards: dict[str, tuple[float, float]] = dict.fromkeys(self.totals, (0.0, 0.0))
        # The metrics environments reported with FinishEpisode since the last step.
        self.episode_metrics: dict[str, dict[str, list[float]]] = {name: {} for name in self.totals}

    def count(self, environment: str, name: str, amount: int = 1) -> None:
        counters = self.totals[environment]
        setattr(counters, name, getattr(counters, name) + amount)
        _COUNTERS[name].labels(environment).inc(amount)

    def finished(self, environment: str, reward: float, metrics: dict[str, float]) -> None:
        self.rewards[environment].append(reward)
        for key, value in metrics.items():
            self.episode_metrics[environment].setdefault(key, []).append(value)

    def set_running(self, environment: str, num_running: int) -> None:
        _episodes_running.labels(environment).set(num_running)

    def close_step(self, *, policy_version: int) -> dict[str, dict[str, Any]]:
        """Per environment: what changed since the previous step, and the reward statistics;
        starts the next step."""
        per_env: dict[str, dict[str, Any]] = {}
        for name, totals in self.totals.items():
            before = self._at_last_step[name]
            delta = {field: getattr(totals, field) - getattr(before, field) for field in _FIELDS}
            reward_mean, reward_std = mean_std(self.rewards[name])
            if self.rewards[name]:
                self.last_rewards[name] = (reward_mean, reward_std)
                _reward_mean.labels(name).set(reward_mean)
            per_env[name] = {
                **delta,
                "num_rewards": len(self.rewards[name]),
                "reward_mean": reward_mean,
                "reward_std": reward_std,
                "episode_metrics": {key: mean_std(values)[0] for key, values in self.episode_metrics[name].items()},
            }
            self._at_last_step[name] = dataclasses.replace(totals)
            self.rewards[name] = []
            self.episode_metrics[name] = {}
        _policy_version.set(policy_version)
        return per_env

    def pushed(self, *, step: int, off_policy_max: int, num_samples: int, num_tokens: int) -> None:
        """A batch reached the trainer."""
        _step.set(step)
        _off_policy_max.set(off_policy_max)
        _samples_pushed.inc(num_samples)
        _tokens_pushed.inc(num_tokens)

    def state(self) -> dict[str, dict[str, int]]:
        return {name: dataclasses.asdict(totals) for name, totals in self.totals.items()}

    def restore(self, state: dict[str, dict[str, int]]) -> None:
        for name, values in state.items():
            if name in self.totals:
                self.totals[name] = EnvironmentCounters(**{k: v for k, v in values.items() if k in _FIELDS})
                self._at_last_step[name] = dataclasses.replace(self.totals[name])


def mean_std(values: Sequence[float]) -> tuple[float, float]:
    if not values:
        return 0.0, 0.0
    mean = math.fsum(values) / len(values)
    return mean, math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))


class MetricsLog:
    """One JSON object per line, appended (a resumed run continues the same file). Each step's
    line is written before its batch is pushed, and the lines of steps the trainer turns out not
    to hold (a crash before the push got through, a trainer that lost queued batches) are
    removed by `rewind` before those steps are collected again: each step has one line."""

    def __init__(self, path: pathlib.Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path

    def write(self, record: dict[str, Any]) -> None:
        with self.path.open("a") as file:
            file.write(json.dumps(record, sort_keys=True) + "\n")

    def rewind(self, step: int) -> int:
        """Removes the lines of `step` and later steps (atomically); returns how many."""
        try:
            lines = self.path.read_text().splitlines(keepends=True)
        except FileNotFoundError:
            return 0
        kept = [line for line in lines if not line.strip() or json.loads(line)["step"] < step]
        if len(kept) == len(lines):
            return 0
        partial = self.path.with_name(f".{self.path.name}.partial")
        partial.write_text("".join(kept))
        os.replace(partial, self.path)
        return len(lines) - len(kept)
