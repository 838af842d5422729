"""primerl.kvstore.v1.KvStoreService: proto <-> domain translation only.

PutBlocks and GetBlocks are registered with raw bytes for the block stream (see
server.py and wire.py). Which role answers what: a storage node serves PutBlocks and
GetBlocks; the metadata role serves the node and location RPCs. BatchExists,
RemoveBlocks, RemoveNamespace and GetStats answer for the whole pool where the metadata
role runs, for the node alone on a storage-only process.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl_common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from primerl_common.kvpool.framing import data_view, parse_put_message
from primerl_common.kvpool.keys import BlockKey, keys_from_proto
from primerl_common.server import ServiceDefinition
from primerl_kvstore.metadata import Metadata, StoredBlock
from primerl_kvstore.storage import Reservation, StorageNode
from primerl_kvstore.wire import check_put_header, header_frame

__all__ = ["KvstoreServicer"]

_TIERS = (kvstore_pb2.TIER_DRAM, kvstore_pb2.TIER_DISK)


@dataclass(eq=False)
class _Incoming:
    """The block a PutBlocks stream is sending (reservation None: existing or rejected, bytes dropped)."""

    index: int
    key: BlockKey
    num_bytes: int
    reservation: Reservation | None
    num_received: int = 0


class KvstoreServicer(kvstore_pb2_grpc.KvStoreServiceServicer):
    def __init__(
        self,
        definition: ServiceDefinition,
        *,
        metadata: Metadata | None,
        storage: StorageNode | None,
        max_keys: int,
    ) -> None:
        self._definition = definition
        self._metadata = metadata
        self._storage = storage
        self._max_keys = max_keys

    def _need_storage(self) -> StorageNode:
        if self._storage is None:
            raise FailedPrecondition(
                "this kvstore process has only the metadata role: put and get blocks through a storage node "
                "(LocateBlocks says which)",
                subject="role",
                reason="NO_STORAGE_ROLE",
            )
        return self._storage

    def _need_metadata(self) -> Metadata:
        if self._metadata is None:
            raise FailedPrecondition(
                "this kvstore process is a storage node only: ask the metadata role",
                subject="role",
                reason="NO_METADATA_ROLE",
            )
        return self._metadata

    def _keys(self, keys, field: str = "keys") -> list[BlockKey]:
        return keys_from_proto(keys, field=field, max_keys=self._max_keys)

    async def GetServiceInfo(
        self, request: kvstore_pb2.GetServiceInfoRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.GetServiceInfoResponse:
        return kvstore_pb2.GetServiceInfoResponse(info=self._definition.info())

    # ------------------------------------------------------------------ blocks (storage role)

    async def PutBlocks(self, request_iterator: AsyncIterator[bytes], context: grpc.aio.ServicerContext) -> bytes:
        node = self._need_storage()
        incoming: _Incoming | None = None
        stored: list[StoredBlock] = []
        num_existing = num_rejected = 0
        try:
            async for message in request_iterator:
                header, frame = parse_put_message(message)
                if header is not None:
                    if incoming is not None and incoming.num_received < incoming.num_bytes:
                        raise InvalidArgument(
                            f"block {incoming.index} ({incoming.key}) got {incoming.num_received} of its "
                            f"{incoming.num_bytes} bytes before the next header",
                            field="data",
                        )
                    index = incoming.index + 1 if incoming is not None else 0
                    key = check_put_header(header, index, node.dram_capacity_bytes)
                    outcome = await node.reserve(header, key)
                    if outcome is True:
                        num_existing += 1
                    elif outcome is False:
                        num_rejected += 1
                    reservation = outcome if isinstance(outcome, Reservation) else None
                    incoming = _Incoming(index, key, header.num_bytes, reservation)
                if frame is None:
                    continue
                if incoming is None:
                    raise InvalidArgument("the first message of a block must carry its header", field="header")
                size = len(data_view(frame))
                if incoming.num_received + size > incoming.num_bytes:
                    raise InvalidArgument(
                        f"block {incoming.index} ({incoming.key}): more than header.num_bytes = {incoming.num_bytes}",
                        field="data",
                    )
                incoming.num_received += size
                if incoming.reservation is not None:
                    incoming.reservation.block.frames.append(frame)
                    incoming.reservation.num_received = incoming.num_received
                    if incoming.num_received == incoming.num_bytes:
                        node.commit(incoming.reservation)
                        stored.append(StoredBlock(incoming.key, incoming.num_bytes, kvstore_pb2.TIER_DRAM))
            if incoming is not None and incoming.num_received < incoming.num_bytes:
                raise InvalidArgument(
                    f"the stream ended after {incoming.num_received} of the {incoming.num_bytes} bytes of block "
                    f"{incoming.index} ({incoming.key})",
                    field="data",
                )
        finally:
            if incoming is not None and incoming.reservation is not None:
                node.abort(incoming.reservation)
            await node.publish(stored=stored)
        if num_rejected and not stored and not num_existing:
            raise ResourceExhausted(
                f"no room for {num_rejected} blocks: this node's DRAM is full of leased blocks",
                reason="STORE_FULL",
                retry_after_s=1.0,
            )
        return kvstore_pb2.PutBlocksResponse(
            num_stored=len(stored), num_existing=num_existing, num_rejected=num_rejected
        ).SerializeToString()

    async def GetBlocks(
        self, request: kvstore_pb2.GetBlocksRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[bytes]:
        node = self._need_storage()
        for key in self._keys(request.keys):
            block = await node.get(key)
            if block is None:
                yield header_frame(kvstore_pb2.BlockHeader(key=key.to_proto(), found=False))
                continue
            yield block.header_frame()
            for frame in block.frames:
                # grpcio sends only bytes; blocks put through the bulk channel are bytearrays.
                yield frame if isinstance(frame, bytes) else bytes(frame)

    async def BatchExists(
        self, request: kvstore_pb2.BatchExistsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.BatchExistsResponse:
        keys = self._keys(request.keys)
        if self._metadata is not None:
            return kvstore_pb2.BatchExistsResponse(exists=self._metadata.exists(keys))
        node = self._need_storage()
        return kvstore_pb2.BatchExistsResponse(exists=[node.contains(key) for key in keys])

    async def RemoveBlocks(
        self, request: kvstore_pb2.RemoveBlocksRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.RemoveBlocksResponse:
        keys = self._keys(request.keys)
        if self._metadata is not None:
            return kvstore_pb2.RemoveBlocksResponse(num_removed=await self._metadata.remove_blocks(keys))
        num_removed, _ = await self._need_storage().remove_blocks(keys)
        return kvstore_pb2.RemoveBlocksResponse(num_removed=num_removed)

    async def RemoveNamespace(
        self, request: kvstore_pb2.RemoveNamespaceRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.RemoveNamespaceResponse:
        if not request.model:
            raise InvalidArgument("must not be empty", field="model")
        model, namespace = request.model, request.namespace
        if self._metadata is not None:
            num_blocks, num_bytes = await self._metadata.remove_namespace(model, namespace)
        else:
            num_blocks, num_bytes = await self._need_storage().remove_namespace(model, namespace)
        return kvstore_pb2.RemoveNamespaceResponse(num_blocks=num_blocks, num_bytes=num_bytes)

    # ------------------------------------------------------------------ nodes and locations (metadata role)

    async def RegisterNode(
        self, request: kvstore_pb2.RegisterNodeRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.RegisterNodeResponse:
        return kvstore_pb2.RegisterNodeResponse(node=self._need_metadata().register(request.node))

    async def Heartbeat(
        self, request: kvstore_pb2.HeartbeatRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.HeartbeatResponse:
        self._need_metadata().heartbeat(request.node)
        return kvstore_pb2.HeartbeatResponse()

    async def UpdateBlocks(
        self, request: kvstore_pb2.UpdateBlocksRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.UpdateBlocksResponse:
        metadata = self._need_metadata()
        stored = []
        for index, block in enumerate(request.stored):
            if block.tier not in _TIERS:
                raise InvalidArgument("must be TIER_DRAM or TIER_DISK", field=f"stored[{index}].tier")
            key = BlockKey.from_proto(block.key, f"stored[{index}].key")
            stored.append(StoredBlock(key, block.num_bytes, block.tier))
        removed = keys_from_proto(request.removed, field="removed")
        metadata.update_blocks(request.node_id, stored, removed)
        return kvstore_pb2.UpdateBlocksResponse()

    async def ClaimEviction(
        self, request: kvstore_pb2.ClaimEvictionRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.ClaimEvictionResponse:
        metadata = self._need_metadata()
        granted = metadata.claim_eviction(request.node_id, self._keys(request.keys))
        return kvstore_pb2.ClaimEvictionResponse(granted=granted)

    async def LocateBlocks(
        self, request: kvstore_pb2.LocateBlocksRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.LocateBlocksResponse:
        metadata = self._need_metadata()
        locations = metadata.locate(self._keys(request.keys), request.lease_ms)
        return kvstore_pb2.LocateBlocksResponse(locations=locations)

    async def ReleaseLeases(
        self, request: kvstore_pb2.ReleaseLeasesRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.ReleaseLeasesResponse:
        return kvstore_pb2.ReleaseLeasesResponse(num_released=self._need_metadata().release(request.lease_ids))

    async def GetStats(
        self, request: kvstore_pb2.GetStatsRequest, context: grpc.aio.ServicerContext
    ) -> kvstore_pb2.GetStatsResponse:
        node = self._storage
        if self._metadata is not None:
            if node is not None and node.node_id in self._metadata.nodes:
                self._metadata.heartbeat(node.info())  # this process's own node, current
            return self._metadata.stats()
        node = self._need_storage()
        info = node.info()
        return kvstore_pb2.GetStatsResponse(
            num_blocks=info.num_blocks,
            dram_used_bytes=info.dram_used_bytes,
            dram_capacity_bytes=info.dram_capacity_bytes,
            disk_used_bytes=info.disk_used_bytes,
            disk_capacity_bytes=info.disk_capacity_bytes,
            num_hits_total=node.num_hits_total,
            num_misses_total=node.num_misses_total,
            num_evicted_total=node.num_evicted_total,
            num_spilled_total=node.num_spilled_total,
            namespaces=node.namespace_stats(),
            nodes=[info],
        )
