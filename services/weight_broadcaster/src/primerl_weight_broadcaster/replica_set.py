"""Every registered inference replica (`ReplicaSet`): registration, the task keeping each
one current (pusher.py), the waits on the versions they serve, and the listeners of their
changes."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl_weight_broadcaster import metrics
from primerl_weight_broadcaster.adapters import AdapterStore
from primerl_weight_broadcaster.collective import CollectiveHost, replica_update
from primerl_weight_broadcaster.pusher import ReplicaPusher
from primerl_weight_broadcaster.replicas import PushSettings, Replica
from primerl_weight_broadcaster.shared_fs import SharedFolders
from primerl_weight_broadcaster.shm import SharedMemory, ShmReceiver
from primerl_weight_broadcaster.store import WeightStore
from primerl_weight_broadcaster.wire import SharedSerializer

__all__ = ["ReplicaSet"]


class ReplicaSet:
    """Every registered replica, and the listeners of their changes."""

    def __init__(
        self,
        store: WeightStore,
        settings: PushSettings,
        shared: SharedFolders | None = None,
        collective: CollectiveHost | None = None,
        shm: SharedMemory | None = None,
        adapters: AdapterStore | None = None,
    ) -> None:
        self.store = store
        self.adapters = adapters or AdapterStore()
        self.settings = settings
        self.shared = shared
        self.collective = collective
        self.shm = shm
        self.serializer = SharedSerializer()
        self._workers: dict[str, ReplicaPusher] = {}
        # Set and replaced on every publish and replica change (WaitForVersion waits on it).
        self._changed = asyncio.Event()
        self._listeners: set[Callable[[pb2.WatchReplicasResponse], None]] = set()

    @property
    def shared_fs_enabled(self) -> bool:
        return self.shared is not None

    def replicas(self) -> list[Replica]:
        return [worker.replica for worker in self._workers.values()]

    def shm_receiver(self, begin: pb2.PublishBegin) -> ShmReceiver | None:
        """Where a publish stream is received: shared memory while some replica takes it (and
        the version fits there), else None (RAM)."""
        if self.shm is None or not any(worker.route()[0] == pb2.TRANSPORT_SHM for worker in self._workers.values()):
            return None
        return self.shm.receiver(begin.num_bytes)

    @property
    def latest_policy_version(self) -> int:
        """The latest version published, with its data or over a collective group; -1: none."""
        announced = -1 if self.collective is None else self.collective.announced_policy_version
        return max(self.store.latest_policy_version, announced)

    def publish_collective(self, request: pb2.PublishCollectiveRequest) -> pb2.PublishCollectiveResponse:
        """Announces a version broadcast by the trainer: the group it is broadcast in, each
        member's task told to join, and whether the broadcaster needs the data too."""
        host = self.collective
        assert host is not None  # the servicer checks it
        members = [
            worker
            for worker in self._workers.values()
            if worker.route()[0] == pb2.TRANSPORT_NCCL
            and worker.replica.reachable
            and host.capability in worker.replica.capabilities
        ]
        name, world_size = host.group([worker.replica.replica_id for worker in members], new=request.new_group)
        for rank, worker in enumerate(members, start=1):
            worker.collective = replica_update(request, host.member_group(name, rank, world_size))
            worker.wake.set()
        host.announce(request.begin.policy_version)
        self._notify()
        return pb2.PublishCollectiveResponse(
            group=host.member_group(name, 0, world_size),
            replica_ids=[worker.replica.replica_id for worker in members],
            send_data=host.settings.keep_data or len(members) < len(self._workers),
        )

    def collective_failed(self, policy_version: int) -> None:
        if self.collective is not None:
            self.collective.member_failed(policy_version)

    def num_at_version(self, policy_version: int) -> int:
        return sum(1 for r in self.replicas() if r.policy_version >= policy_version)

    def num_holding(self, adapter_name: str, policy_version: int) -> int:
        return sum(1 for r in self.replicas() if r.adapter_versions.get(adapter_name, -1) >= policy_version)

    async def register(self, replica: Replica) -> Replica:
        """Adds a replica (replacing one registered under the same id) and starts its task."""
        old = self._workers.pop(replica.replica_id, None)
        if old is not None:
            await old.close()
        self._workers[replica.replica_id] = ReplicaPusher(replica, self)
        self.changed(replica)
        return replica

    async def deregister(self, replica_id: str) -> bool:
        worker = self._workers.pop(replica_id, None)
        if worker is None:
            return False
        await worker.close()
        metrics.forget_replica(replica_id)
        self._emit(pb2.WatchReplicasResponse(replica=worker.replica.to_proto(), removed=True))
        self._notify()
        return True

    def published(self) -> None:
        """A new version (or adapter version) is stored, or an adapter removed: wake every
        replica's task."""
        for worker in self._workers.values():
            worker.wake.set()
        self._notify()

    def changed(self, replica: Replica) -> None:
        self._emit(pb2.WatchReplicasResponse(replica=replica.to_proto()))
        self._notify()

    def listen(self, listener: Callable[[pb2.WatchReplicasResponse], None]) -> Callable[[], None]:
        """Calls `listener` with every change; returns the function that stops it."""
        self._listeners.add(listener)
        return lambda: self._listeners.discard(listener)

    def _emit(self, event: pb2.WatchReplicasResponse) -> None:
        event.latest_policy_version = self.latest_policy_version
        for listener in list(self._listeners):
            listener(event)

    def wake_waiters(self) -> None:
        """Makes every `wait_until` check its predicate again."""
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def wait_until(self, predicate: Callable[[], bool], timeout_s: float | None) -> bool:
        """Waits until `predicate()` holds after some change; False if `timeout_s` passed first."""
        try:
            async with asyncio.timeout(timeout_s):
                while not predicate():
                    await self._changed.wait()
        except TimeoutError:
            return predicate()
        return True

    async def close(self) -> None:
        for worker in list(self._workers.values()):
            await worker.close()
        self._workers.clear()
