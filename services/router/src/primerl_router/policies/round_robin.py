"""round_robin: each request to the next candidate in turn."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from primerl_router.policies.base import RoutingPolicy

if TYPE_CHECKING:
    from primerl_router.replica import Replica
    from primerl_router.request import RouteRequest


class RoundRobin(RoutingPolicy):
    name = "round_robin"

    def __init__(self, options: RoutingPolicy.Options) -> None:
        super().__init__(options)
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        self._turn += 1
        return candidates[self._turn % len(candidates)]
