"""Removal of the KV pool's namespaces of policy versions nobody computes with any more.

Replicas salt each request with the policy version they serve it at, and the pool keeps a
version's blocks in that version's namespace (kvpool.keys; the inference service's engine and
KV connector). A namespace of version v is removed once every replica the router reports a
version of is on a newer one and every turn in flight was sent after the router said so: a turn
sent before may still run on a replica the router no longer lists (draining, deregistered) at v.
Removal never makes a block wrong, only missing: a namespace holds one version's KV. This
orchestrator is the one owner of removal: it knows its turns in flight, and it asks the router
(ListReplicas) for the versions replicas serve. Versions never go back, so a removed
namespace is not asked for again; if a replica restarted on an old version did fill it again,
the next sweep removes it again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator

import grpc

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl.router.v1 import router_pb2, router_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.kvpool.keys import policy_version_of_namespace

__all__ = ["KvNamespaceSweeper", "TurnsInFlight"]

logger = logging.getLogger(__name__)

_TIMEOUT_S = 10.0


class TurnsInFlight:
    """Numbers the model turns sent through the router and knows which are still running."""

    def __init__(self) -> None:
        self.num_started = 0
        self._running: set[int] = set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        number = self.num_started
        self.num_started += 1
        self._running.add(number)
        try:
            yield
        finally:
            self._running.discard(number)

    @property
    def oldest_running(self) -> int:
        """The number of the oldest turn still running; `num_started` when none is."""
        return min(self._running, default=self.num_started)


class KvNamespaceSweeper:
    """`model`: the model name replicas give the pool ("" for every model in it)."""

    def __init__(
        self, turns: TurnsInFlight, *, router: str, kvstore: str, model: str = "", interval_s: float = 5.0
    ) -> None:
        self._turns = turns
        self._model = model
        self._interval_s = interval_s
        self._router_channel = make_channel(router)
        self._router = router_pb2_grpc.RouterServiceStub(self._router_channel)
        self._kvstore_channel = make_channel(kvstore)
        self._kvstore = kvstore_pb2_grpc.KvStoreServiceStub(self._kvstore_channel)
        # (turns started by then, oldest version a replica served then), oldest first.
        self._observations: list[tuple[int, int]] = []

    async def close(self) -> None:
        await self._router_channel.close()
        await self._kvstore_channel.close()

    async def run(self) -> None:
        """Sweeps every `interval_s` until cancelled."""
        while True:
            try:
                await self.sweep()
            except grpc.aio.AioRpcError as exc:
                logger.warning(
                    "KV namespace sweep: %s (%s); next in %.0fs", exc.code().name, exc.details(), self._interval_s
                )
            await asyncio.sleep(self._interval_s)

    async def sweep(self) -> list[tuple[str, str]]:
        """Removes the namespaces no one uses any more; their (model, namespace)."""
        oldest_served = await self._oldest_served_version()
        if oldest_served is not None:
            self._observations.append((self._turns.num_started, oldest_served))
        floor = self._removable_below()
        if floor is None:
            return []
        stats = await self._kvstore.GetStats(kvstore_pb2.GetStatsRequest(), timeout=_TIMEOUT_S)
        removed = []
        for namespace in stats.namespaces:
            version = policy_version_of_namespace(namespace.namespace)
            if version is None or version >= floor or (self._model and namespace.model != self._model):
                continue
            request = kvstore_pb2.RemoveNamespaceRequest(model=namespace.model, namespace=namespace.namespace)
            reply = await self._kvstore.RemoveNamespace(request, timeout=_TIMEOUT_S)
            removed.append((namespace.model, namespace.namespace))
            logger.info(
                "KV pool namespace %s/%s removed (%d blocks, %.1f MiB): no replica serves version %d, no turn "
                "in flight may",
                namespace.model,
                namespace.namespace,
                reply.num_blocks,
                reply.num_bytes / 2**20,
                version,
                extra={"policy_version": version},
            )
        return removed

    async def _oldest_served_version(self) -> int | None:
        """The oldest version a listed replica reports; None while none reports one. A replica
        whose version the router does not know (not reported yet, its stream lost, dead) is
        left out: a namespace holds one version's KV whoever fills it, so removing one that
        such a replica still uses costs it misses, never a wrong block, and it is removed again
        once that replica is past it."""
        reply = await self._router.ListReplicas(router_pb2.ListReplicasRequest(), timeout=_TIMEOUT_S)
        versions = [r.load.policy_version for r in reply.replicas if r.HasField("load") and r.load.policy_version >= 0]
        return min(versions, default=None)

    def _removable_below(self) -> int | None:
        """Versions below this are used by no replica and no turn in flight: the oldest
        served version of the latest observation that every running turn was sent after."""
        oldest_running = self._turns.oldest_running
        valid = [index for index, (num_started, _) in enumerate(self._observations) if num_started <= oldest_running]
        if not valid:
            return None
        # Older observations are superseded by the latest valid one.
        del self._observations[: valid[-1]]
        return self._observations[0][1]
