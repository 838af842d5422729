"""`KvStoreClient`: puts blocks through a storage node and gets them from whichever node
holds them (located and leased through the metadata role, read from the holders, leases
released). Where a holder runs the bulk side channel, `get(..., bulk=True)` and `put_bulk`
use it, in worker threads.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import Sequence

import grpc

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.kvpool.bulk import BulkClient
from primerl_common.kvpool.framing import FetchedBlock, iter_put_messages, read_block_stream
from primerl_common.kvpool.keys import BlockKey

__all__ = ["BlockItem", "KvStoreClient"]

_PUT = "/primerl.kvstore.v1.KvStoreService/PutBlocks"
_GET = "/primerl.kvstore.v1.KvStoreService/GetBlocks"

BlockItem = tuple[BlockKey | kvstore_pb2.BlockHeader, bytes | bytearray | memoryview]


def _headers(blocks: Sequence[BlockItem]) -> list[tuple[kvstore_pb2.BlockHeader, bytes | bytearray | memoryview]]:
    return [
        (kvstore_pb2.BlockHeader(key=key.to_proto()) if isinstance(key, BlockKey) else key, data)
        for key, data in blocks
    ]


class KvStoreClient:
    def __init__(
        self, metadata_address: str, *, chunk_bytes: int = 1024 * 1024, max_message_bytes: int = 64 * 1024 * 1024
    ) -> None:
        self.metadata_address = metadata_address
        self.chunk_bytes = chunk_bytes
        self._max_message_bytes = max_message_bytes
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._bulk_idle: defaultdict[str, list[BulkClient]] = defaultdict(list)

    def channel(self, address: str) -> grpc.aio.Channel:
        if address not in self._channels:
            self._channels[address] = make_channel(address, max_message_bytes=self._max_message_bytes)
        return self._channels[address]

    def stub(self, address: str | None = None) -> kvstore_pb2_grpc.KvStoreServiceStub:
        return kvstore_pb2_grpc.KvStoreServiceStub(self.channel(address or self.metadata_address))

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        for connections in self._bulk_idle.values():
            for connection in connections:
                connection.close()
        self._bulk_idle.clear()

    async def __aenter__(self) -> KvStoreClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    def _bulk_call(self, bulk_address: str, call):
        """Runs `call(connection)` on an idle bulk connection to `bulk_address` (blocking)."""
        idle = self._bulk_idle[bulk_address]
        connection = idle.pop() if idle else BulkClient(bulk_address)
        try:
            result = call(connection)
        except BaseException:
            connection.close()
            raise
        idle.append(connection)
        return result

    async def put_bulk(self, bulk_address: str, blocks: Sequence[BlockItem]) -> kvstore_pb2.PutBlocksResponse:
        headers = _headers(blocks)
        return await asyncio.to_thread(self._bulk_call, bulk_address, lambda c: c.put(headers))

    async def get_bulk(self, bulk_address: str, keys: Sequence[BlockKey]) -> list[FetchedBlock]:
        fetched = await asyncio.to_thread(self._bulk_call, bulk_address, lambda c: c.get(keys))
        return [FetchedBlock(header, data) for header, data in fetched]

    async def put(
        self, node_address: str, blocks: Sequence[BlockItem], *, timeout_s: float = 60.0
    ) -> kvstore_pb2.PutBlocksResponse:
        call = self.channel(node_address).stream_unary(
            _PUT, request_serializer=None, response_deserializer=kvstore_pb2.PutBlocksResponse.FromString
        )
        return await call(iter_put_messages(_headers(blocks), self.chunk_bytes), timeout=timeout_s)

    async def get_from(
        self, node_address: str, keys: Sequence[BlockKey], *, timeout_s: float = 60.0
    ) -> list[FetchedBlock]:
        call = self.channel(node_address).unary_stream(
            _GET, request_serializer=kvstore_pb2.GetBlocksRequest.SerializeToString, response_deserializer=None
        )
        request = kvstore_pb2.GetBlocksRequest(keys=[key.to_proto() for key in keys])
        return await read_block_stream(call(request, timeout=timeout_s))

    async def get(self, keys: Sequence[BlockKey], *, lease_ms: int = 10_000, bulk: bool = False) -> list[FetchedBlock]:
        """Each key's block from the node that holds it; found = false for misses. With
        `bulk`, holders that run the bulk side channel are read through it."""
        stub = self.stub()
        located = await stub.LocateBlocks(
            kvstore_pb2.LocateBlocksRequest(keys=[key.to_proto() for key in keys], lease_ms=lease_ms)
        )
        results: list[FetchedBlock | None] = [None] * len(keys)
        by_node: defaultdict[tuple[str, bool], list[int]] = defaultdict(list)
        for index, location in enumerate(located.locations):
            if location.found:
                use_bulk = bulk and bool(location.bulk_address)
                by_node[(location.bulk_address if use_bulk else location.address, use_bulk)].append(index)
            else:
                results[index] = FetchedBlock(kvstore_pb2.BlockHeader(key=keys[index].to_proto()), None)
        lease_ids = [location.lease_id for location in located.locations if location.lease_id]
        try:

            async def read(address: str, use_bulk: bool, indices: list[int]) -> None:
                wanted = [keys[i] for i in indices]
                fetched = await (self.get_bulk(address, wanted) if use_bulk else self.get_from(address, wanted))
                for index, block in zip(indices, fetched, strict=True):
                    results[index] = block

            await asyncio.gather(*(read(address, b, indices) for (address, b), indices in by_node.items()))
        finally:
            if lease_ids:
                await stub.ReleaseLeases(kvstore_pb2.ReleaseLeasesRequest(lease_ids=lease_ids))
        return [block for block in results if block is not None]
