"""A storage node: a DRAM segment and optionally a disk tier, each in least-recently-used order.

Room is made before a block's bytes arrive (its header says its size): when a tier's use
would pass `high_watermark` of its capacity, least recently used blocks leave until it is
at `low_watermark`. DRAM blocks spill to the disk tier first (they stay on this node, so
a lease on them still holds); a block leaves the node only after the metadata role granted
its eviction claim, which it refuses for leased blocks. When nothing can leave and the
block does not fit, it is rejected.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.kvpool.framing import data_frames
from primerl_common.kvpool.keys import BlockKey
from primerl_kvstore.disk import CorruptBlockError, DiskEntry, DiskTier
from primerl_kvstore.metadata import StoredBlock
from primerl_kvstore.wire import Block

__all__ = ["MetadataLink", "NodeNotRegisteredError", "Reservation", "StorageNode"]

logger = logging.getLogger(__name__)

TIER_DRAM = kvstore_pb2.TIER_DRAM
TIER_DISK = kvstore_pb2.TIER_DISK


class NodeNotRegisteredError(Exception):
    """The metadata role does not know this node (it restarted, or thought the node dead)."""


class MetadataLink(Protocol):
    """How a storage node reaches the metadata role (in this process or over gRPC)."""

    async def register(self, info: kvstore_pb2.NodeInfo) -> None: ...

    async def heartbeat(self, info: kvstore_pb2.NodeInfo) -> None: ...

    async def update_blocks(self, node_id: str, stored: Sequence[StoredBlock], removed: Sequence[BlockKey]) -> None: ...

    async def claim_eviction(self, node_id: str, keys: Sequence[BlockKey]) -> list[bool]: ...


@dataclass(eq=False)
class Reservation:
    """DRAM set aside for a block whose bytes are arriving."""

    block: Block
    num_received: int = 0
    done: bool = False


class StorageNode:
    def __init__(
        self,
        *,
        node_id: str,
        address: str,
        dram_capacity_bytes: int,
        disk: DiskTier | None,
        high_watermark: float,
        low_watermark: float,
        chunk_bytes: int,
        metadata: MetadataLink,
    ) -> None:
        self.node_id = node_id
        self.address = address
        self.bulk_address = ""  # set once the bulk side channel listens
        self.dram_capacity_bytes = dram_capacity_bytes
        self.disk = disk
        self.high_watermark = high_watermark
        self.low_watermark = low_watermark
        self.chunk_bytes = chunk_bytes
        self.metadata = metadata
        # Least recently used first.
        self.dram: OrderedDict[BlockKey, Block] = OrderedDict()
        self.dram_used_bytes = 0
        self._reserved_bytes = 0
        self._pending: dict[BlockKey, Reservation] = {}
        self._evict_lock = asyncio.Lock()
        self.num_evicted_total = 0
        self.num_spilled_total = 0
        self.num_hits_total = 0
        self.num_misses_total = 0
        # Set when the metadata role missed an update: the next registration reports every block.
        self.needs_resync = True

    # ------------------------------------------------------------------ state

    def load(self) -> None:
        if self.disk is not None:
            num_blocks = self.disk.load()
            logger.info("disk tier %s: %d blocks, %d bytes", self.disk.root, num_blocks, self.disk.used_bytes)

    @property
    def num_blocks(self) -> int:
        return len(self.dram) + (len(self.disk.entries) if self.disk else 0)

    def contains(self, key: BlockKey) -> bool:
        return key in self.dram or (self.disk is not None and key in self.disk.entries)

    def info(self) -> kvstore_pb2.NodeInfo:
        return kvstore_pb2.NodeInfo(
            node_id=self.node_id,
            address=self.address,
            bulk_address=self.bulk_address,
            dram_capacity_bytes=self.dram_capacity_bytes,
            disk_capacity_bytes=self.disk.capacity_bytes if self.disk else 0,
            dram_used_bytes=self.dram_used_bytes,
            disk_used_bytes=self.disk.used_bytes if self.disk else 0,
            num_blocks=self.num_blocks,
            num_evicted_total=self.num_evicted_total,
            num_spilled_total=self.num_spilled_total,
        )

    def inventory(self) -> list[StoredBlock]:
        blocks = [StoredBlock(key, block.num_bytes, TIER_DRAM) for key, block in self.dram.items()]
        if self.disk is not None:
            blocks += [StoredBlock(key, e.num_bytes, TIER_DISK) for key, e in self.disk.entries.items()]
        return blocks

    def namespace_stats(self) -> list[kvstore_pb2.NamespaceStats]:
        totals: dict[tuple[str, str], list[int]] = {}
        for block in self.inventory():
            entry = totals.setdefault(block.key.namespace_id, [0, 0])
            entry[0] += 1
            entry[1] += block.num_bytes
        return [
            kvstore_pb2.NamespaceStats(model=model, namespace=namespace, num_blocks=n, num_bytes=b)
            for (model, namespace), (n, b) in sorted(totals.items())
        ]

    # ------------------------------------------------------------------ metadata updates

    async def publish(self, stored: Sequence[StoredBlock] = (), removed: Sequence[BlockKey] = ()) -> None:
        """Tells the metadata role; on failure the next registration reports everything."""
        if not stored and not removed:
            return
        try:
            await self.metadata.update_blocks(self.node_id, stored, removed)
        except NodeNotRegisteredError:
            self.needs_resync = True
        except Exception as exc:
            logger.warning("cannot report %d stored, %d removed blocks: %s", len(stored), len(removed), exc)
            self.needs_resync = True

    # ------------------------------------------------------------------ put

    async def reserve(self, header: kvstore_pb2.BlockHeader, key: BlockKey) -> Reservation | bool:
        """A reservation to fill, True when the block is stored already, False when it does not fit."""
        if self.contains(key) or key in self._pending:
            return True
        if not await self._make_dram_room(header.num_bytes):
            return False
        if self.contains(key) or key in self._pending:  # stored while room was made
            return True
        stored_header = kvstore_pb2.BlockHeader()
        stored_header.CopyFrom(header)
        stored_header.found = True
        reservation = Reservation(Block(key, stored_header))
        self._pending[key] = reservation
        self._reserved_bytes += header.num_bytes
        return reservation

    def commit(self, reservation: Reservation) -> None:
        assert not reservation.done and reservation.num_received == reservation.block.num_bytes
        reservation.done = True
        block = reservation.block
        del self._pending[block.key]
        self._reserved_bytes -= block.num_bytes
        self.dram[block.key] = block
        self.dram_used_bytes += block.num_bytes

    def abort(self, reservation: Reservation) -> None:
        if not reservation.done:
            reservation.done = True
            self._pending.pop(reservation.block.key, None)
            self._reserved_bytes -= reservation.block.num_bytes

    # ------------------------------------------------------------------ get

    async def get(self, key: BlockKey) -> Block | None:
        block = self.dram.get(key)
        if block is not None:
            self.dram.move_to_end(key)
            self.num_hits_total += 1
            return block
        entry = self.disk.entries.get(key) if self.disk is not None else None
        if entry is None:
            self.num_misses_total += 1
            return None
        block = await self._read_disk(entry)
        if block is None:
            self.num_misses_total += 1
        else:
            self.num_hits_total += 1
        return block

    async def _read_disk(self, entry: DiskEntry) -> Block | None:
        assert self.disk is not None
        self.disk.touch(entry.key)
        try:
            header, data = await asyncio.to_thread(self.disk.read, entry)
        except FileNotFoundError:
            return None
        except CorruptBlockError as exc:
            logger.error("dropping corrupt block %s: %s", entry.key, exc)
            if self.disk.entries.get(entry.key) is entry:
                self.disk.discard(entry.key)
            await self.publish(removed=[entry.key])
            return None
        header.found = True
        return Block(entry.key, header, list(data_frames(data, self.chunk_bytes)))

    # ------------------------------------------------------------------ removal

    def _discard(self, key: BlockKey) -> int:
        """Drops a block from every tier; the bytes freed (0 if absent)."""
        block = self.dram.pop(key, None)
        freed = 0
        if block is not None:
            self.dram_used_bytes -= block.num_bytes
            freed += block.num_bytes
        if self.disk is not None and (entry := self.disk.discard(key)) is not None:
            freed += entry.num_bytes
        return freed

    async def remove_blocks(self, keys: Iterable[BlockKey]) -> tuple[int, int]:
        removed, num_bytes = [], 0
        for key in keys:
            if self.contains(key):
                num_bytes += self._discard(key)
                removed.append(key)
        await self.publish(removed=removed)
        return len(removed), num_bytes

    async def remove_namespace(self, model: str, namespace: str) -> tuple[int, int]:
        keys = [block.key for block in self.inventory() if block.key.namespace_id == (model, namespace)]
        return await self.remove_blocks(keys)

    # ------------------------------------------------------------------ eviction

    def _dram_load(self) -> int:
        return self.dram_used_bytes + self._reserved_bytes

    async def _make_dram_room(self, num_bytes: int) -> bool:
        capacity = self.dram_capacity_bytes
        if num_bytes > capacity:
            return False
        if self._dram_load() + num_bytes <= self.high_watermark * capacity:
            return True
        async with self._evict_lock:
            excess = self._dram_load() + num_bytes - int(self.low_watermark * capacity)
            if self._dram_load() + num_bytes > self.high_watermark * capacity and excess > 0:
                freed = await self._spill(excess) if self.disk is not None else 0
                if freed < excess:
                    await self._drop_dram(excess - freed)
            return self._dram_load() + num_bytes <= capacity

    def _lru(self, entries: OrderedDict[BlockKey, Block] | OrderedDict[BlockKey, DiskEntry], num_bytes: int):
        """Least recently used keys covering `num_bytes`."""
        picked, total = [], 0
        for key, entry in entries.items():
            if total >= num_bytes:
                break
            picked.append(key)
            total += entry.num_bytes
        return picked

    async def _spill(self, num_bytes: int) -> int:
        """Moves least recently used DRAM blocks to disk; the DRAM bytes freed."""
        assert self.disk is not None
        disk = self.disk
        blocks = [self.dram[key] for key in self._lru(self.dram, num_bytes)]
        total = sum(block.num_bytes for block in blocks)
        room = await self._make_disk_room(total)
        while blocks and total > room:
            total -= blocks.pop().num_bytes
        if not blocks:
            return 0

        def write_all() -> list[DiskEntry]:
            return [disk.write(block.key, block.header, block.data_views()) for block in blocks]

        entries = await asyncio.to_thread(write_all)
        freed, moved = 0, []
        for block, entry in zip(blocks, entries, strict=True):
            if self.dram.get(block.key) is not block:  # removed while it was written
                entry.path.unlink(missing_ok=True)
                continue
            del self.dram[block.key]
            self.dram_used_bytes -= block.num_bytes
            disk.add(entry)
            freed += block.num_bytes
            moved.append(StoredBlock(block.key, block.num_bytes, TIER_DISK))
        self.num_spilled_total += len(moved)
        await self.publish(stored=moved)
        return freed

    async def _make_disk_room(self, num_bytes: int) -> int:
        """Evicts from the disk tier past its high watermark; the bytes it can take now."""
        assert self.disk is not None
        capacity = self.disk.capacity_bytes
        if self.disk.used_bytes + num_bytes > self.high_watermark * capacity:
            excess = self.disk.used_bytes + num_bytes - int(self.low_watermark * capacity)
            await self._drop(self.disk.entries, excess, self.disk.discard)
        return max(0, capacity - self.disk.used_bytes)

    async def _drop_dram(self, num_bytes: int) -> int:
        def discard(key: BlockKey) -> None:
            block = self.dram.pop(key)
            self.dram_used_bytes -= block.num_bytes

        return await self._drop(self.dram, num_bytes, discard)

    async def _drop(self, entries, num_bytes: int, discard) -> int:
        """Drops least recently used blocks the metadata role lets go of; the bytes freed."""
        freed = 0
        refused: set[BlockKey] = set()
        while freed < num_bytes:
            candidates, total = [], 0
            for key, entry in entries.items():
                if total >= num_bytes - freed:
                    break
                if key not in refused:
                    candidates.append(key)
                    total += entry.num_bytes
            if not candidates:
                break
            try:
                granted = await self.metadata.claim_eviction(self.node_id, candidates)
            except Exception as exc:
                # Without the metadata role no lease can be checked: nothing leaves.
                logger.warning("eviction claim failed: %s", exc)
                if isinstance(exc, NodeNotRegisteredError):
                    self.needs_resync = True
                break
            for key, ok in zip(candidates, granted, strict=True):
                if not ok:
                    refused.add(key)
                elif key in entries:
                    freed += entries[key].num_bytes
                    discard(key)
                    self.num_evicted_total += 1
        return freed
