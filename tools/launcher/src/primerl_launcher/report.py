"""What a run leaves behind: the reward / mismatch_kl plot and a short summary."""

from __future__ import annotations

import math
import pathlib
from collections.abc import Sequence
from typing import Any

__all__ = ["format_summary", "summary", "write_plot"]


def _series(records: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), int | float) and math.isfinite(r[key])]
    return [step for step, _ in points], [value for _, value in points]


def _mean(values: Sequence[float]) -> float | None:
    return math.fsum(values) / len(values) if values else None


def write_plot(records: Sequence[dict[str, Any]], path: pathlib.Path, *, title: str = "primerl run") -> pathlib.Path:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display needed
    from matplotlib import pyplot as plt
    from matplotlib.ticker import MaxNLocator

    figure, (reward_axes, kl_axes) = plt.subplots(2, 1, figsize=(8, 6), sharex=True)
    steps, rewards = _series(records, "reward_mean")
    reward_axes.plot(steps, rewards, marker="o", markersize=3)
    reward_axes.set_ylabel("reward (batch mean)")
    reward_axes.grid(alpha=0.3)
    steps, kls = _series(records, "mismatch_kl")
    kl_axes.plot(steps, kls, marker="o", markersize=3, color="tab:orange")
    kl_axes.set_ylabel("mismatch_kl")
    kl_axes.set_xlabel("trainer step")
    kl_axes.xaxis.set_major_locator(MaxNLocator(integer=True))
    kl_axes.grid(alpha=0.3)
    figure.suptitle(title)
    figure.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


GROUP_COUNTS = ("finished", "filtered_equal_rewards", "incomplete", "episodes_timed_out", "batched")


def summary(
    records: Sequence[dict[str, Any]], *, wall_time_s: float, groups: Any = None, window: int = 5
) -> dict[str, Any]:
    """`groups`: the orchestrator's GroupCounts at the end (GetRunStatus.groups), if known."""
    _, rewards = _series(records, "reward_mean")
    _, kls = _series(records, "mismatch_kl")
    return {
        "wall_time_s": wall_time_s,
        "num_steps": len(records),
        "reward_mean_first": _mean(rewards[:window]),
        "reward_mean_last": _mean(rewards[-window:]),
        "mismatch_kl_mean": _mean(kls),
        "groups": {name: getattr(groups, name) for name in GROUP_COUNTS} if groups is not None else None,
    }


def format_summary(values: dict[str, Any], *, window: int = 5) -> str:
    def number(value: float | None, spec: str) -> str:
        return "n/a" if value is None else format(value, spec)

    return "\n".join(
        [
            f"wall time {values['wall_time_s']:.1f}s, {values['num_steps']} steps",
            f"reward mean: first {window} steps {number(values['reward_mean_first'], '.3f')}, "
            f"last {window} steps {number(values['reward_mean_last'], '.3f')}",
            f"mismatch_kl mean: {number(values['mismatch_kl_mean'], '.3e')}",
            *_groups_line(values.get("groups")),
        ]
    )


def _groups_line(groups: dict[str, int] | None) -> list[str]:
    if not groups:
        return []
    return [
        f"groups: {groups['finished']} finished, {groups['filtered_equal_rewards']} filtered for equal rewards, "
        f"{groups['incomplete']} incomplete ({groups['episodes_timed_out']} episodes timed out), "
        f"{groups['batched']} batched"
    ]
