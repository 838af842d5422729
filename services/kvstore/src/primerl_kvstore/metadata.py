"""The metadata role: which storage node holds which block, leases, eviction claims, node liveness.

Storage nodes register, heartbeat and report the blocks they hold (`update_blocks`). Before
dropping blocks to make room, a node claims them (`claim_eviction`): a block a live lease
holds on that node is refused, a granted one stops being located there at once, so a lease
handed out by `locate` always points at a block that is still there when it is read.
Explicit removal (`remove_blocks`, `remove_namespace`) does not wait for leases: a reader
then gets found = false, as for any miss. A node silent for `node_timeout_s` is dead: its
blocks are not located any more and it is forgotten; when it comes back it registers again
and reports its blocks anew.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from google.protobuf import timestamp_pb2

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.errors import InvalidArgument, NotFound
from primerl_common.kvpool.keys import BlockKey

__all__ = ["Metadata", "NodeRecord", "StorageLink", "StoredBlock"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StoredBlock:
    key: BlockKey
    num_bytes: int
    tier: int  # kvstore_pb2.Tier


class StorageLink(Protocol):
    """How the metadata role reaches a storage node to remove blocks."""

    async def remove_blocks(self, keys: Sequence[BlockKey]) -> tuple[int, int]: ...

    async def remove_namespace(self, model: str, namespace: str) -> tuple[int, int]: ...


@dataclass(eq=False)
class NodeRecord:
    info: kvstore_pb2.NodeInfo
    last_seen: float
    keys: set[BlockKey] = field(default_factory=set)


@dataclass(eq=False, slots=True)
class _Lease:
    lease_id: str
    node_id: str
    key: BlockKey
    expires_at: float


class Metadata:
    def __init__(
        self,
        *,
        node_timeout_s: float,
        max_lease_ms: int,
        storage_link: Callable[[NodeRecord], StorageLink],
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.node_timeout_s = node_timeout_s
        self.max_lease_ms = max_lease_ms
        self._storage_link = storage_link
        self._clock = clock
        self.nodes: dict[str, NodeRecord] = {}
        # key -> node_id -> (tier, num_bytes)
        self._holders: dict[BlockKey, dict[str, tuple[int, int]]] = {}
        self._namespaces: defaultdict[tuple[str, str], set[BlockKey]] = defaultdict(set)
        self._leases: dict[str, _Lease] = {}
        self._leases_by_block: defaultdict[tuple[str, BlockKey], set[str]] = defaultdict(set)
        self.num_hits_total = 0
        self.num_misses_total = 0
        self._sweeper: asyncio.Task[None] | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        self._sweeper = asyncio.create_task(self._sweep_forever(), name="kvstore-metadata-sweeper")

    async def stop(self) -> None:
        if self._sweeper is not None:
            self._sweeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._sweeper

    async def _sweep_forever(self) -> None:
        while True:
            await asyncio.sleep(min(self.node_timeout_s / 2, 1.0))
            self.sweep()

    def sweep(self) -> None:
        """Forgets dead nodes and expired leases."""
        now = self._clock()
        for node_id in [n for n, record in self.nodes.items() if not self._alive(record, now)]:
            logger.warning("storage node %s missed its heartbeats; its blocks are no longer located", node_id)
            self._forget_node(node_id)
        for lease_id in [i for i, lease in self._leases.items() if lease.expires_at <= now]:
            self._drop_lease(lease_id)

    # ------------------------------------------------------------------ nodes

    def register(self, info: kvstore_pb2.NodeInfo) -> kvstore_pb2.NodeInfo:
        if not info.node_id:
            raise InvalidArgument("must not be empty", field="node.node_id")
        if not info.address:
            raise InvalidArgument("must be the host:port of the node's kvstore.v1 server", field="node.address")
        if info.node_id in self.nodes:
            # A restarted node reports its blocks again after registering.
            self._forget_node(info.node_id)
        record = NodeRecord(info=kvstore_pb2.NodeInfo(), last_seen=self._clock())
        self.nodes[info.node_id] = record
        self._refresh(record, info)
        logger.info("storage node %s registered at %s", info.node_id, info.address)
        return record.info

    def heartbeat(self, info: kvstore_pb2.NodeInfo) -> None:
        record = self._node(info.node_id, "node.node_id")
        record.last_seen = self._clock()
        self._refresh(record, info)

    def _refresh(self, record: NodeRecord, info: kvstore_pb2.NodeInfo) -> None:
        record.info.CopyFrom(info)
        record.info.last_heartbeat.CopyFrom(_now())

    def _node(self, node_id: str, field_name: str) -> NodeRecord:
        if not node_id:
            raise InvalidArgument("must not be empty", field=field_name)
        record = self.nodes.get(node_id)
        if record is None or not self._alive(record, self._clock()):
            if record is not None:
                self._forget_node(node_id)
            raise NotFound(f"storage node {node_id!r} is not registered", reason="NODE_NOT_REGISTERED")
        return record

    def _alive(self, record: NodeRecord, now: float) -> bool:
        return now - record.last_seen <= self.node_timeout_s

    def _forget_node(self, node_id: str) -> None:
        record = self.nodes.pop(node_id, None)
        if record is None:
            return
        for key in record.keys:
            self._unlink(key, node_id)
        for (holder, _key), lease_ids in list(self._leases_by_block.items()):
            if holder == node_id:
                for lease_id in list(lease_ids):
                    self._drop_lease(lease_id)

    # ------------------------------------------------------------------ block locations

    def update_blocks(self, node_id: str, stored: Sequence[StoredBlock], removed: Sequence[BlockKey]) -> None:
        record = self._node(node_id, "node_id")
        for key in removed:
            if key in record.keys:
                record.keys.discard(key)
                self._unlink(key, node_id)
        for block in stored:
            record.keys.add(block.key)
            self._holders.setdefault(block.key, {})[node_id] = (block.tier, block.num_bytes)
            self._namespaces[block.key.namespace_id].add(block.key)

    def _unlink(self, key: BlockKey, node_id: str) -> None:
        holders = self._holders.get(key)
        if holders is None:
            return
        holders.pop(node_id, None)
        if not holders:
            del self._holders[key]
            keys = self._namespaces.get(key.namespace_id)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._namespaces[key.namespace_id]

    def _live_holder(self, key: BlockKey, now: float) -> tuple[NodeRecord, int] | None:
        """A live node holding `key`, DRAM before disk."""
        best = None
        for node_id, (tier, _) in self._holders.get(key, {}).items():
            record = self.nodes.get(node_id)
            if record is None or not self._alive(record, now):
                continue
            if tier == kvstore_pb2.TIER_DRAM:
                return record, tier
            best = best or (record, tier)
        return best

    def locate(self, keys: Sequence[BlockKey], lease_ms: int) -> list[kvstore_pb2.BlockLocation]:
        if lease_ms > self.max_lease_ms:
            raise InvalidArgument(f"{lease_ms} ms; at most {self.max_lease_ms}", field="lease_ms")
        now = self._clock()
        locations = []
        for key in keys:
            location = kvstore_pb2.BlockLocation(key=key.to_proto())
            holder = self._live_holder(key, now)
            if holder is None:
                self.num_misses_total += 1
            else:
                self.num_hits_total += 1
                record, tier = holder
                location.found = True
                location.node_id = record.info.node_id
                location.address = record.info.address
                location.bulk_address = record.info.bulk_address
                location.tier = tier
                if lease_ms > 0:
                    location.lease_id = self._grant_lease(record.info.node_id, key, now + lease_ms / 1000)
            locations.append(location)
        return locations

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        now = self._clock()
        return [self._live_holder(key, now) is not None for key in keys]

    # ------------------------------------------------------------------ leases and eviction

    def _grant_lease(self, node_id: str, key: BlockKey, expires_at: float) -> str:
        lease_id = uuid.uuid4().hex
        self._leases[lease_id] = _Lease(lease_id, node_id, key, expires_at)
        self._leases_by_block[(node_id, key)].add(lease_id)
        return lease_id

    def _drop_lease(self, lease_id: str) -> bool:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            return False
        ids = self._leases_by_block.get((lease.node_id, lease.key))
        if ids is not None:
            ids.discard(lease_id)
            if not ids:
                del self._leases_by_block[(lease.node_id, lease.key)]
        return True

    def release(self, lease_ids: Sequence[str]) -> int:
        return sum(self._drop_lease(lease_id) for lease_id in lease_ids)

    def _is_leased(self, node_id: str, key: BlockKey, now: float) -> bool:
        ids = self._leases_by_block.get((node_id, key))
        if not ids:
            return False
        for lease_id in list(ids):
            if self._leases[lease_id].expires_at <= now:
                self._drop_lease(lease_id)
        return (node_id, key) in self._leases_by_block

    def num_leased_blocks(self) -> int:
        now = self._clock()
        return sum(1 for node_id, key in list(self._leases_by_block) if self._is_leased(node_id, key, now))

    def claim_eviction(self, node_id: str, keys: Sequence[BlockKey]) -> list[bool]:
        record = self._node(node_id, "node_id")
        now = self._clock()
        granted = []
        for key in keys:
            ok = not self._is_leased(node_id, key, now)
            if ok and key in record.keys:
                record.keys.discard(key)
                self._unlink(key, node_id)
            granted.append(ok)
        return granted

    # ------------------------------------------------------------------ removal (fanned out to the holders)

    async def remove_blocks(self, keys: Sequence[BlockKey]) -> int:
        by_node: defaultdict[str, list[BlockKey]] = defaultdict(list)
        for key in keys:
            for node_id in list(self._holders.get(key, {})):
                by_node[node_id].append(key)
                self.nodes[node_id].keys.discard(key)
                self._unlink(key, node_id)
        results = await self._fan_out({n: (lambda link, ks=ks: link.remove_blocks(ks)) for n, ks in by_node.items()})
        return sum(num_blocks for num_blocks, _ in results)

    async def remove_namespace(self, model: str, namespace: str) -> tuple[int, int]:
        keys = self._namespaces.pop((model, namespace), set())
        for key in keys:
            for node_id in self._holders.pop(key, {}):
                self.nodes[node_id].keys.discard(key)
        # Every live node, not only the known holders: one that has not reported a block yet holds it too.
        results = await self._fan_out({n: (lambda link: link.remove_namespace(model, namespace)) for n in self.nodes})
        return sum(n for n, _ in results), sum(b for _, b in results)

    async def _fan_out(self, calls: dict[str, Callable[[StorageLink], object]]) -> list[tuple[int, int]]:
        async def one(node_id: str, call: Callable[[StorageLink], object]) -> tuple[int, int]:
            record = self.nodes.get(node_id)
            if record is None:
                return 0, 0
            try:
                return await call(self._storage_link(record))  # type: ignore[misc]
            except Exception as exc:
                # Its locations are gone already; the blocks age out of that node by LRU.
                logger.warning("removal on storage node %s failed: %s", node_id, exc)
                return 0, 0

        return list(await asyncio.gather(*(one(node_id, call) for node_id, call in calls.items())))

    # ------------------------------------------------------------------ stats

    def stats(self) -> kvstore_pb2.GetStatsResponse:
        now = self._clock()
        reply = kvstore_pb2.GetStatsResponse(
            num_hits_total=self.num_hits_total,
            num_misses_total=self.num_misses_total,
            num_leased_blocks=self.num_leased_blocks(),
        )
        for record in self.nodes.values():
            if not self._alive(record, now):
                continue
            info = record.info
            reply.nodes.append(info)
            reply.num_blocks += info.num_blocks
            reply.dram_used_bytes += info.dram_used_bytes
            reply.dram_capacity_bytes += info.dram_capacity_bytes
            reply.disk_used_bytes += info.disk_used_bytes
            reply.disk_capacity_bytes += info.disk_capacity_bytes
            reply.num_evicted_total += info.num_evicted_total
            reply.num_spilled_total += info.num_spilled_total
        for (model, namespace), keys in sorted(self._namespaces.items()):
            num_bytes = sum(size for key in keys for _, size in self._holders.get(key, {}).values())
            reply.namespaces.append(
                kvstore_pb2.NamespaceStats(model=model, namespace=namespace, num_blocks=len(keys), num_bytes=num_bytes)
            )
        return reply


def _now() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.GetCurrentTime()
    return stamp
