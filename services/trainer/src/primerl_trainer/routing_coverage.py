"""How many of the expert-parallel ranks a token needs, and when the dispatcher sends every token
to every rank (its dense grid): one rule for the dispatcher (distributed/expert_parallel.py) and
the capacity planner (planner/timing.py). Imports no torch: the planner's CLI runs without it."""

from __future__ import annotations

__all__ = ["DENSE_GRID_SHARE", "dense_grid_by_default", "rank_share"]

# The dense grid is the default where a token is expected to need at least this share of the ranks.
DENSE_GRID_SHARE = 0.9


def rank_share(num_experts: int, ep: int, top_k: int) -> float:
    """Expected share of the `ep` ranks (experts split evenly over them) that hold at least one of
    a token's `top_k` distinct experts, under uniform routing. 1.0 on one rank."""
    if ep <= 1:
        return 1.0
    others = num_experts - num_experts // ep
    miss = 1.0  # probability that none of the token's experts is on a given rank
    for i in range(top_k):
        miss *= max(others - i, 0) / (num_experts - i)
    return 1.0 - miss


def dense_grid_by_default(num_experts: int, ep: int, top_k: int) -> bool:
    """Whether a token is expected to need at least DENSE_GRID_SHARE of the ranks."""
    return rank_share(num_experts, ep, top_k) >= DENSE_GRID_SHARE
