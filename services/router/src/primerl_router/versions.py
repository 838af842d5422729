"""Follows the weight broadcaster's WatchReplicas stream: which policy version
each replica serves and whether a push to it is under way, usually before the
replica's own load report says so.

Broadcaster and router name replicas independently; an update applies to the
router's replica of the same id, else of the same address. The latest state of
every replica the broadcaster knows is kept, so one that registers with the
router later starts with it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

import grpc

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as wb_pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc as wb_pb2_grpc
from primerl_common import security
from primerl_common.server import channel_options
from primerl_router.replica import UNKNOWN_VERSION, Replica

__all__ = ["BroadcasterFollower"]

logger = logging.getLogger(__name__)

_MAX_RECONNECT_S = 5.0


class BroadcasterFollower:
    def __init__(
        self, address: str, replicas: Callable[[], Iterable[Replica]], *, on_change: Callable[[], None]
    ) -> None:
        self.address = address
        self._replicas = replicas
        self._on_change = on_change
        self._statuses: dict[str, wb_pb2.ReplicaStatus] = {}  # by broadcaster replica id
        self.connected = False
        self.latest_policy_version = UNKNOWN_VERSION

    async def run(self) -> None:
        """Follows the stream until cancelled, reconnecting with backoff."""
        backoff = 0.1
        num_failures = 0
        async with security.secure_aio_channel(self.address, options=channel_options(4 * 1024 * 1024)) as channel:
            stub = wb_pb2_grpc.WeightBroadcasterServiceStub(channel)
            while True:
                try:
                    async for update in stub.WatchReplicas(wb_pb2.WatchReplicasRequest()):
                        if not self.connected:
                            logger.info("following the weight broadcaster at %s", self.address)
                            self.connected, backoff, num_failures = True, 0.1, 0
                        self.apply(update)
                except grpc.aio.AioRpcError as exc:
                    # Said once per outage (a restarting broadcaster fails every reconnect until it is back).
                    num_failures += 1
                    log = logger.warning if num_failures == 1 else logger.debug
                    log("weight broadcaster at %s: %s", self.address, exc.code().name)
                self._disconnected()
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, _MAX_RECONNECT_S)

    def apply(self, update: wb_pb2.WatchReplicasResponse) -> None:
        self.latest_policy_version = update.latest_policy_version
        status = update.replica
        if update.removed:
            self._statuses.pop(status.replica_id, None)
        else:
            self._statuses[status.replica_id] = status
        replica = self._match(status)
        if replica is not None:
            _apply_status(replica, status, removed=update.removed)
            self._on_change()

    def on_register(self, replica: Replica) -> None:
        """Gives a replica that just joined the router what the broadcaster said of it."""
        for status in self._statuses.values():
            if status.replica_id == replica.replica_id or status.address == replica.address:
                _apply_status(replica, status, removed=False)
                return

    def _match(self, status: wb_pb2.ReplicaStatus) -> Replica | None:
        by_address = None
        for replica in self._replicas():
            if replica.replica_id == status.replica_id:
                return replica
            if replica.address == status.address:
                by_address = replica
        return by_address

    def _disconnected(self) -> None:
        # Without the stream an "updating" flag could stay set forever; the replicas'
        # own load reports still say when they update.
        self.connected = False
        self._statuses.clear()
        for replica in self._replicas():
            if replica.broadcaster_updating:
                replica.apply_broadcaster_state(policy_version=replica.policy_version, updating=False)
        self._on_change()


def _apply_status(replica: Replica, status: wb_pb2.ReplicaStatus, *, removed: bool) -> None:
    version_known = not removed and status.policy_version != UNKNOWN_VERSION
    version = status.policy_version if version_known else replica.policy_version
    updating = not removed and status.state == wb_pb2.REPLICA_STATE_UPDATING
    adapter_versions = {} if removed else dict(status.adapter_versions)
    adapter_owners = {} if removed else dict(status.adapter_owners)
    replica.apply_broadcaster_state(
        policy_version=version, updating=updating, adapter_versions=adapter_versions, adapter_owners=adapter_owners
    )
