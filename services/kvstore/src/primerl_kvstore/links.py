"""How the two roles reach each other: directly in one process, over kvstore.v1 across processes;
and the storage node's membership loop (register, report every block, heartbeat)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import grpc

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.kvpool.keys import BlockKey
from primerl_kvstore.metadata import Metadata, NodeRecord, StorageLink, StoredBlock
from primerl_kvstore.storage import NodeNotRegisteredError, StorageNode

__all__ = ["LocalMetadataLink", "Membership", "RemoteMetadataLink", "RemoteStorageLinks"]

logger = logging.getLogger(__name__)

_CALL_TIMEOUT_S = 10.0
# Blocks per UpdateBlocks call when a node reports all it holds.
_REPORT_BATCH = 8192


def _stored_to_proto(block: StoredBlock) -> kvstore_pb2.StoredBlock:
    return kvstore_pb2.StoredBlock(key=block.key.to_proto(), num_bytes=block.num_bytes, tier=block.tier)


class LocalMetadataLink:
    """The metadata role of this process (role both)."""

    def __init__(self, metadata: Metadata) -> None:
        self._metadata = metadata

    async def register(self, info: kvstore_pb2.NodeInfo) -> None:
        self._metadata.register(info)

    async def heartbeat(self, info: kvstore_pb2.NodeInfo) -> None:
        self._metadata.heartbeat(info)

    async def update_blocks(self, node_id: str, stored: Sequence[StoredBlock], removed: Sequence[BlockKey]) -> None:
        self._metadata.update_blocks(node_id, stored, removed)

    async def claim_eviction(self, node_id: str, keys: Sequence[BlockKey]) -> list[bool]:
        return self._metadata.claim_eviction(node_id, keys)


class RemoteMetadataLink:
    """The metadata role of another process."""

    def __init__(self, address: str, *, max_message_bytes: int) -> None:
        self.address = address
        self._channel = make_channel(address, max_message_bytes=max_message_bytes)
        self._stub = kvstore_pb2_grpc.KvStoreServiceStub(self._channel)

    async def close(self) -> None:
        await self._channel.close()

    async def _call(self, method: str, request: object) -> object:
        try:
            return await getattr(self._stub, method)(request, timeout=_CALL_TIMEOUT_S)
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.NOT_FOUND:
                raise NodeNotRegisteredError(exc.details()) from None
            raise

    async def register(self, info: kvstore_pb2.NodeInfo) -> None:
        await self._call("RegisterNode", kvstore_pb2.RegisterNodeRequest(node=info))

    async def heartbeat(self, info: kvstore_pb2.NodeInfo) -> None:
        await self._call("Heartbeat", kvstore_pb2.HeartbeatRequest(node=info))

    async def update_blocks(self, node_id: str, stored: Sequence[StoredBlock], removed: Sequence[BlockKey]) -> None:
        request = kvstore_pb2.UpdateBlocksRequest(
            node_id=node_id, stored=[_stored_to_proto(b) for b in stored], removed=[k.to_proto() for k in removed]
        )
        await self._call("UpdateBlocks", request)

    async def claim_eviction(self, node_id: str, keys: Sequence[BlockKey]) -> list[bool]:
        request = kvstore_pb2.ClaimEvictionRequest(node_id=node_id, keys=[key.to_proto() for key in keys])
        reply = await self._call("ClaimEviction", request)
        return list(reply.granted)  # type: ignore[attr-defined]


class _RemoteStorageLink:
    def __init__(self, stub: kvstore_pb2_grpc.KvStoreServiceStub) -> None:
        self._stub = stub

    async def remove_blocks(self, keys: Sequence[BlockKey]) -> tuple[int, int]:
        request = kvstore_pb2.RemoveBlocksRequest(keys=[key.to_proto() for key in keys])
        reply = await self._stub.RemoveBlocks(request, timeout=_CALL_TIMEOUT_S)
        return reply.num_removed, 0

    async def remove_namespace(self, model: str, namespace: str) -> tuple[int, int]:
        request = kvstore_pb2.RemoveNamespaceRequest(model=model, namespace=namespace)
        reply = await self._stub.RemoveNamespace(request, timeout=_CALL_TIMEOUT_S)
        return reply.num_blocks, reply.num_bytes


class RemoteStorageLinks:
    """Storage links of the metadata role: this process's node directly, others over gRPC
    (one channel per address, kept)."""

    def __init__(self, *, local: StorageNode | None, max_message_bytes: int) -> None:
        self.local = local
        self._max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}

    def __call__(self, record: NodeRecord) -> StorageLink:
        if self.local is not None and record.info.node_id == self.local.node_id:
            return self.local
        address = record.info.address
        if address not in self._channels:
            self._channels[address] = make_channel(address, max_message_bytes=self._max_message_bytes)
        return _RemoteStorageLink(kvstore_pb2_grpc.KvStoreServiceStub(self._channels[address]))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()


class Membership:
    """Keeps a storage node registered: registers (then reports every block it holds),
    heartbeats, and registers again whenever the metadata role has forgotten it."""

    def __init__(self, node: StorageNode, *, interval_s: float) -> None:
        self._node = node
        self._link = node.metadata
        self._interval_s = interval_s
        self._task: asyncio.Task[None] | None = None
        self._registered = False

    async def start(self) -> None:
        # One attempt before serving, so that a node that can reach the metadata
        # role is locatable as soon as it reports SERVING.
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._step(), timeout=2.0)
        self._task = asyncio.create_task(self._run(), name="kvstore-membership")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self._interval_s)
            try:
                await self._step()
                failures = 0
            except Exception as exc:
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("metadata role unreachable (%d tries): %s", failures, exc)

    async def _step(self) -> None:
        node = self._node
        if self._registered and not node.needs_resync:
            try:
                await self._link.heartbeat(node.info())
                return
            except NodeNotRegisteredError:
                logger.info("metadata role forgot node %s; registering again", node.node_id)
                self._registered = False
        await self._link.register(node.info())
        self._registered = True
        node.needs_resync = False
        inventory = node.inventory()
        try:
            for start in range(0, len(inventory), _REPORT_BATCH):
                await self._link.update_blocks(node.node_id, inventory[start : start + _REPORT_BATCH], ())
        except BaseException:
            node.needs_resync = True
            raise
        logger.info("node %s registered; reported %d blocks", node.node_id, len(inventory))
