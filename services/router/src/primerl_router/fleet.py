"""Replica membership: replicas from the config and those registering at run
time, drain and undrain, deregistration, prefix-cache resets. Owns each
replica's Upstream (channel and watch loops) and the weight-broadcaster
follower, and feeds the pool."""

from __future__ import annotations

import asyncio
import contextlib
import logging

from primerl.common.v1 import generation_pb2
from primerl_router.config import RouterConfig
from primerl_router.policies import make_policy
from primerl_router.pool import ReplicaPool
from primerl_router.replica import ROLE_BOTH, Replica
from primerl_router.upstream import Upstream
from primerl_router.versions import BroadcasterFollower

__all__ = ["Fleet"]

logger = logging.getLogger(__name__)

_ROLES = {
    "both": generation_pb2.REPLICA_ROLE_BOTH,
    "prefill": generation_pb2.REPLICA_ROLE_PREFILL,
    "decode": generation_pb2.REPLICA_ROLE_DECODE,
}


class Fleet:
    def __init__(self, config: RouterConfig) -> None:
        self._config = config
        policy = make_policy(config.policy.name, config.policy.options)
        self.pool = ReplicaPool(policy, avoid_updating=config.routing.avoid_updating)
        self._upstreams: dict[Replica, Upstream] = {}
        self._retiring: set[asyncio.Task[None]] = set()
        self.follower: BroadcasterFollower | None = None
        if config.versions.weight_broadcaster_address:
            self.follower = BroadcasterFollower(
                config.versions.weight_broadcaster_address, lambda: self.pool, on_change=self.pool.notify
            )
        self._follower_task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self.follower is not None:
            self._follower_task = asyncio.create_task(self.follower.run(), name="weight-broadcaster follower")
        await asyncio.gather(
            *(
                self.register(replica.replica_id, replica.address, role=_ROLES[replica.role], labels=replica.labels)
                for replica in self._config.replicas
            )
        )

    async def stop(self) -> None:
        if self._follower_task is not None:
            self._follower_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._follower_task
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*(upstream.close() for upstream in self._upstreams.values()), return_exceptions=True)
        self._upstreams.clear()

    def upstream(self, replica: Replica) -> Upstream:
        return self._upstreams[replica]

    async def register(
        self, replica_id: str, address: str, *, role: int = ROLE_BOTH, labels: dict[str, str] | None = None
    ) -> Replica:
        """Adds a replica, or updates the role and labels of a registered one;
        a new address replaces it (the old one finishes its requests first)."""
        if replica_id in self.pool:
            existing = self.pool.get(replica_id)
            if existing.address == address:
                existing.role, existing.labels = role, dict(labels or {})
                self.pool.notify()
                return existing
            self.deregister(replica_id)
        replica = Replica(
            replica_id,
            address,
            role=role,
            labels=labels,
            health=self._config.health,
            circuit=self._config.circuit_breaker,
        )
        upstream = Upstream(
            replica,
            health=self._config.health,
            load=self._config.load,
            max_message_bytes=self._config.server.max_message_bytes,
            on_change=self.pool.notify,
        )
        self._upstreams[replica] = upstream
        if self.follower is not None:
            self.follower.on_register(replica)
        await upstream.check_health()
        self.pool.add(replica)
        upstream.start()
        logger.info(
            "registered replica %s at %s (%s)",
            replica_id,
            address,
            replica.health.state.value,
            extra={"replica_id": replica_id, "address": address},
        )
        return replica

    def deregister(self, replica_id: str) -> Replica:
        """Removes a replica at once from routing; its running requests finish
        before its channel closes."""
        replica = self.pool.remove(replica_id)
        upstream = self._upstreams.pop(replica)
        task = asyncio.create_task(self._retire(replica, upstream), name=f"retire {replica_id}")
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)
        logger.info("deregistered replica %s", replica_id, extra={"replica_id": replica_id})
        return replica

    async def _retire(self, replica: Replica, upstream: Upstream) -> None:
        await replica.wait_idle()
        await upstream.close()
        if replica.replica_id not in self.pool:  # not re-registered under the same id meanwhile
            replica.metrics.remove()

    async def drain(self, replica_id: str, *, wait: bool) -> Replica:
        replica = self.pool.get(replica_id)
        if not replica.draining:
            replica.draining = True
            logger.info("draining replica %s (%d in flight)", replica_id, replica.num_in_flight)
        if wait:
            await replica.wait_idle()
        return replica

    def undrain(self, replica_id: str) -> Replica:
        replica = self.pool.get(replica_id)
        replica.draining = False
        self.pool.notify()
        logger.info("replica %s back in rotation", replica_id)
        return replica

    async def reset_prefix_cache(self, timeout_s: float) -> tuple[list[str], list[str]]:
        """Resets every replica's prefix cache; returns the ids that did and those that did not."""
        replicas = list(self.pool)
        results = await asyncio.gather(*(self._upstreams[r].reset_prefix_cache(timeout_s) for r in replicas))
        for replica, reset in zip(replicas, results, strict=True):
            if reset:
                self.pool.policy.on_prefix_cache_reset(replica)
        return (
            [r.replica_id for r, reset in zip(replicas, results, strict=True) if reset],
            [r.replica_id for r, reset in zip(replicas, results, strict=True) if not reset],
        )
