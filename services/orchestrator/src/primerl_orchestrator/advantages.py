"""Group-relative advantages ("grpo"): each rollout's reward minus its group's mean reward,
optionally divided by the group's standard deviation."""

from __future__ import annotations

import math
from collections.abc import Sequence

__all__ = ["STD_EPSILON", "group_advantages", "is_zero_advantage"]

# Keeps a group with a tiny spread from blowing its advantages up.
STD_EPSILON = 1e-6


def group_advantages(rewards: Sequence[float], *, std_normalize: bool) -> list[float]:
    if not rewards:
        return []
    # Equal rewards give exactly zero (a float mean of equal values can be off by an ulp).
    if max(rewards) == min(rewards):
        return [0.0] * len(rewards)
    mean = math.fsum(rewards) / len(rewards)
    advantages = [reward - mean for reward in rewards]
    if std_normalize:
        std = math.sqrt(math.fsum(a * a for a in advantages) / len(advantages))
        advantages = [a / (std + STD_EPSILON) for a in advantages]
    return advantages


def is_zero_advantage(advantages: Sequence[float]) -> bool:
    """No rollout of the group moves the policy: nothing to learn from it."""
    return all(a == 0.0 for a in advantages)
