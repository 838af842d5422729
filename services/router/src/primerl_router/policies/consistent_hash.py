"""consistent_hash: requests with the same session key (the episode id) go to
the same replica, so each turn of an episode finds the previous turns' KV in
that replica's prefix cache.

A hash ring with `virtual_nodes` points per replica, built over every
registered replica, eligible or not: a replica that fails a health check or
drains for a while does not reshuffle the other sessions. A key whose replica
cannot take the request falls through to the next candidate on the ring, and
comes back once its replica can. Requests without a key go to the least
loaded candidate.

Bounded loads (`balance_factor`, Mirrokni et al., "Consistent Hashing with
Bounded Loads"): a replica takes a key's request only while its outstanding
requests, this one counted, stay within `balance_factor` times the mean over
the candidates; past that the key falls through to the next replica on the
ring. A few sessions rarely split evenly (64 keys over two replicas: often
36/28), and without the bound the replica that holds more of them queues its
requests while the other has room; with it, keys of a replica that falls
behind spill over and come back once it catches up. Off by default (0): a
spilled turn of a multi-turn episode misses the prefix cache its replica holds,
so the bound suits many short sessions better than few long ones (see also
cache_aware, which weighs cached prefix against load per request).
"""

from __future__ import annotations

import bisect
import hashlib
import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

from pydantic import Field, field_validator

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
        balance_factor: float = Field(
            default=0.0,
            description="bounded loads: a replica takes a key's request while its outstanding requests stay within "
            "this factor of the candidates' mean, else the next on the ring does (e.g. 1.25); 0: strict stickiness",
        )

        @field_validator("balance_factor")
        @classmethod
        def _off_or_at_least_one(cls, value: float) -> float:
            if value != 0 and value < 1:
                raise ValueError("must be 0 (off) or >= 1")
            return value

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
        # The most a replica may have outstanding once it takes this request; the least loaded
        # candidate is always within it (factor >= 1), so the walk ends on the ring.
        bound = math.inf
        if self.options.balance_factor and len(candidates) > 1:
            total = sum(replica.outstanding for replica in candidates) + 1
            bound = math.ceil(self.options.balance_factor * total / len(candidates))
        for step in range(num_points):
            replica = by_id.get(self._owners[(start + step) % num_points])
            if replica is not None and replica.outstanding < bound:
                return replica
        return self._fallback.least_loaded(candidates)
