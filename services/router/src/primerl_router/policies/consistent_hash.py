"""consistent_hash: requests with the same session key (the episode id) go to
the same replica, so each turn of an episode finds the previous turns' KV in
that replica's prefix cache.

A hash ring with `virtual_nodes` points per replica, built over every
registered replica, eligible or not: a replica that fails a health check or
drains for a while does not reshuffle the other sessions. A key whose replica
cannot take the request falls through to the next candidate on the ring, and
comes back once its replica can. Requests without a key go to the least
loaded candidate.
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field

from primerl_router.policies.base import RoutingPolicy
from primerl_router.policies.least_loaded import LeastLoaded

if TYPE_CHECKING:
    from primerl_router.replica import Replica
    from primerl_router.request import RouteRequest


def ring_hash(key: bytes) -> int:
    # Stable across processes and restarts (Python's hash() is salted per process).
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")


class ConsistentHash(RoutingPolicy):
    name = "consistent_hash"

    class Options(RoutingPolicy.Options):
        virtual_nodes: int = Field(default=160, ge=1, description="ring points per replica (evenness of the split)")

    def __init__(self, options: Options) -> None:
        super().__init__(options)
        self._points: list[int] = []
        self._owners: list[str] = []
        self._fallback = LeastLoaded(RoutingPolicy.Options())

    def on_membership_change(self, replicas: Sequence[Replica]) -> None:
        ring = sorted(
            (ring_hash(f"{replica.replica_id}#{index}".encode()), replica.replica_id)
            for replica in replicas
            for index in range(self.options.virtual_nodes)
        )
        self._points = [point for point, _ in ring]
        self._owners = [owner for _, owner in ring]

    def choose(self, request: RouteRequest, candidates: Sequence[Replica]) -> Replica:
        if not request.session_key or not self._points:
            return self._fallback.least_loaded(candidates)
        by_id = {replica.replica_id: replica for replica in candidates}
        start = bisect.bisect(self._points, ring_hash(request.session_key))
        num_points = len(self._points)
        for step in range(num_points):
            replica = by_id.get(self._owners[(start + step) % num_points])
            if replica is not None:
                return replica
        return self._fallback.least_loaded(candidates)
