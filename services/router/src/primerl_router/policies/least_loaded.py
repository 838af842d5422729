"""least_loaded: the candidate with the fewest requests queued or running,
from its live load reports corrected by what this router sent since (see
Replica.outstanding); ties go round robin so equal replicas share the load."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from primerl_router.policies.base import RoutingPolicy

if TYPE_CHECKING:
    from primerl_router.replica import Replica
    from primerl_router.request import RouteRequest


class LeastLoaded(RoutingPolicy):
    name = "least_loaded"

    def __init__(self, options: RoutingPolicy.Options) -> None:
        super().__init__(options)
        self._turn = 0

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        return self.least_loaded(candidates)

    def least_loaded(self, candidates: Sequence[Replica]) -> Replica:
        if len(candidates) == 1:
            return candidates[0]
        lowest = min(replica.outstanding for replica in candidates)
        tied = [replica for replica in candidates if replica.outstanding == lowest]
        self._turn += 1
        return tied[self._turn % len(tied)]
