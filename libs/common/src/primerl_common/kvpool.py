"""The client side of the KV-cache pool (kvstore.v1): block keys, the raw block framing,
the bulk side channel's client, and `KvStoreClient`, which puts blocks through a storage
node and gets them from whichever node holds them (located and leased through the
metadata role, read from the holders, leases released).

It lives here, not in the kvstore service, so that the services that read and write the
pool (inference's KV connector) need no dependency on the store itself; the store uses the
same keys, framing and protocol constants.

Framing: `PutBlocksRequest` and `GetBlocksResponse` share their wire layout (header = 1,
data = 2), so a put message that carries only data (`0x12 <varint len> <bytes>`) is exactly
the `GetBlocksResponse` that serves those bytes back; block streams are built and read as
raw bytes, with no protobuf copy of the data. Where a holder runs the bulk side channel
(protocol at the top of primerl_kvstore/bulk.py), `get(..., bulk=True)` and `put_bulk` use
it, in worker threads.
"""

from __future__ import annotations

import asyncio
import hashlib
import socket
import struct
from collections import defaultdict
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import dataclass

import grpc
from google.rpc import status_pb2

from primerl.kvstore.v1 import kvstore_pb2, kvstore_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.errors import InvalidArgument

__all__ = [
    "MAX_CONTENT_HASH_BYTES",
    "MAX_NAME_CHARS",
    "BlockKey",
    "BulkClient",
    "BulkError",
    "FetchedBlock",
    "KvStoreClient",
    "data_frame",
    "data_frames",
    "data_view",
    "iter_put_messages",
    "keys_from_proto",
    "parse_put_message",
    "read_block_stream",
]

MAX_NAME_CHARS = 512
MAX_CONTENT_HASH_BYTES = 64

_PUT = "/primerl.kvstore.v1.KvStoreService/PutBlocks"
_GET = "/primerl.kvstore.v1.KvStoreService/GetBlocks"

# ---------------------------------------------------------------------------- keys


@dataclass(frozen=True, slots=True)
class BlockKey:
    """(model, parallel rank, policy-version namespace, content hash)."""

    model: str
    parallel_rank: int
    namespace: str
    content_hash: bytes

    @property
    def namespace_id(self) -> tuple[str, str]:
        return self.model, self.namespace

    def to_proto(self) -> kvstore_pb2.BlockKey:
        return kvstore_pb2.BlockKey(
            model=self.model, parallel_rank=self.parallel_rank, namespace=self.namespace, content_hash=self.content_hash
        )

    def file_stem(self) -> str:
        """A file name unique to the key (the key itself is kept in the file's header)."""
        digest = hashlib.blake2b(digest_size=20)
        for part in (self.model.encode(), str(self.parallel_rank).encode(), self.namespace.encode()):
            digest.update(len(part).to_bytes(4, "little"))
            digest.update(part)
        digest.update(self.content_hash)
        return digest.hexdigest()

    def __str__(self) -> str:
        return f"{self.model}/rank{self.parallel_rank}/{self.namespace!r}/{self.content_hash.hex()[:16]}"

    @classmethod
    def from_proto(cls, key: kvstore_pb2.BlockKey, field: str = "key") -> BlockKey:
        """The key a request names; InvalidArgument naming `field` when it is malformed."""
        if not key.model:
            raise InvalidArgument("model must not be empty", field=f"{field}.model")
        if len(key.model) > MAX_NAME_CHARS:
            raise InvalidArgument(f"longer than {MAX_NAME_CHARS} characters", field=f"{field}.model")
        if len(key.namespace) > MAX_NAME_CHARS:
            raise InvalidArgument(f"longer than {MAX_NAME_CHARS} characters", field=f"{field}.namespace")
        if not key.content_hash:
            raise InvalidArgument("content_hash must not be empty", field=f"{field}.content_hash")
        if len(key.content_hash) > MAX_CONTENT_HASH_BYTES:
            raise InvalidArgument(
                f"{len(key.content_hash)} bytes; at most {MAX_CONTENT_HASH_BYTES}", field=f"{field}.content_hash"
            )
        return cls(key.model, key.parallel_rank, key.namespace, bytes(key.content_hash))


def keys_from_proto(
    keys: Sequence[kvstore_pb2.BlockKey], *, field: str = "keys", max_keys: int | None = None
) -> list[BlockKey]:
    if max_keys is not None and len(keys) > max_keys:
        raise InvalidArgument(f"{len(keys)} keys; at most {max_keys} per request", field=field)
    return [BlockKey.from_proto(key, f"{field}[{index}]") for index, key in enumerate(keys)]


# ---------------------------------------------------------------------------- framing

DATA_TAG = 0x12  # field 2 (data), length-delimited


def varint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(buf: bytes | bytearray, pos: int) -> tuple[int, int]:
    """(value, position after it); (-1, pos) when the buffer ends inside it."""
    value = shift = 0
    while pos < len(buf) and shift < 64:
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    return -1, pos


def data_frame(data: bytes | memoryview) -> bytes:
    """A message that carries only `data` (a PutBlocksRequest or a GetBlocksResponse)."""
    return b"".join((bytes((DATA_TAG,)), varint(len(data)), data))


def data_frames(data: bytes | memoryview, chunk_bytes: int) -> Iterator[bytes]:
    view = memoryview(data)
    for start in range(0, len(view), chunk_bytes):
        yield data_frame(view[start : start + chunk_bytes])


def _data_offset(frame: bytes | bytearray) -> int:
    """Where the data of a data-only message starts; -1 if `frame` is not one."""
    if not frame or frame[0] != DATA_TAG:
        return -1
    length, pos = _read_varint(frame, 1)
    return pos if length >= 0 and pos + length == len(frame) else -1


def data_view(frame: bytes | bytearray) -> memoryview:
    """The data bytes of a data-only message (no copy)."""
    offset = _data_offset(frame)
    assert offset >= 0, "not a data-only message"
    return memoryview(frame)[offset:]


def parse_put_message(message: bytes) -> tuple[kvstore_pb2.BlockHeader | None, bytes | None]:
    """(header or None, data frame or None) of one raw PutBlocksRequest."""
    if _data_offset(message) >= 0:
        return None, message
    try:
        request = kvstore_pb2.PutBlocksRequest.FromString(message)
    except Exception:  # protobuf's DecodeError and friends
        raise InvalidArgument("not a PutBlocksRequest message", field="request") from None
    header = request.header if request.HasField("header") else None
    return header, data_frame(request.data) if request.data else None


def _stamped(header: kvstore_pb2.BlockHeader, num_bytes: int) -> kvstore_pb2.BlockHeader:
    stamped = kvstore_pb2.BlockHeader()
    stamped.CopyFrom(header)
    stamped.num_bytes = num_bytes
    return stamped


def iter_put_messages(
    blocks: Sequence[tuple[kvstore_pb2.BlockHeader, bytes | bytearray | memoryview]], chunk_bytes: int
) -> Iterator[bytes]:
    """Raw PutBlocksRequest messages: each block's header alone, then its data in chunks."""
    for header, data in blocks:
        yield kvstore_pb2.PutBlocksRequest(header=_stamped(header, len(data))).SerializeToString()
        yield from data_frames(data, chunk_bytes)


@dataclass
class FetchedBlock:
    header: kvstore_pb2.BlockHeader
    data: bytearray | None  # None when not found

    @property
    def found(self) -> bool:
        return self.header.found


async def read_block_stream(stream: AsyncIterator[bytes]) -> list[FetchedBlock]:
    """Reassembles a raw GetBlocks answer."""
    blocks: list[FetchedBlock] = []
    offset = 0
    async for message in stream:
        header, frame = parse_put_message(message)  # same layout as a put message
        if header is not None:
            data = bytearray(header.num_bytes) if header.found else None
            blocks.append(FetchedBlock(header, data))
            offset = 0
        if frame is not None:
            piece = data_view(frame)
            target = blocks[-1].data
            if target is None or offset + len(piece) > len(target):
                raise ValueError("GetBlocks answer has more data than its header announced")
            target[offset : offset + len(piece)] = piece
            offset += len(piece)
    return blocks


# ---------------------------------------------------------------------------- bulk channel

U32 = struct.Struct("<I")
OP_PUT, OP_GET = b"P", b"G"
STATUS_OK, STATUS_ERROR = 0, 1
SEND, EXISTING, REJECTED = 0, 1, 2  # a node's decision per block of a bulk put


def recv_exact(conn: socket.socket, size: int) -> bytes:
    data = conn.recv(size, socket.MSG_WAITALL) if size else b""
    if len(data) != size:
        raise ConnectionError(f"peer closed after {len(data)} of {size} bytes")
    return data


def recv_into(conn: socket.socket, view: memoryview) -> None:
    while view:
        n = conn.recv_into(view)
        if n == 0:
            raise ConnectionError("peer closed in the middle of a block")
        view = view[n:]


class BulkError(Exception):
    """An error answer of the bulk channel (code: a grpc.StatusCode)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message


class BulkClient:
    """Blocking client of one node's bulk channel (one connection, one request at a time;
    run it in a worker thread from async code)."""

    def __init__(self, address: str, *, timeout_s: float = 60.0) -> None:
        host, port = address.rsplit(":", 1)
        self._conn = socket.create_connection((host, int(port)), timeout=timeout_s)
        self._conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def close(self) -> None:
        self._conn.close()

    def _answer(self) -> None:
        status = recv_exact(self._conn, 1)[0]
        if status == STATUS_ERROR:
            (size,) = U32.unpack(recv_exact(self._conn, 4))
            error = status_pb2.Status.FromString(recv_exact(self._conn, size))
            code = next((c for c in grpc.StatusCode if c.value[0] == error.code), grpc.StatusCode.UNKNOWN)
            raise BulkError(code, error.message)

    def put(
        self, blocks: Sequence[tuple[kvstore_pb2.BlockHeader, bytes | bytearray | memoryview]]
    ) -> kvstore_pb2.PutBlocksResponse:
        conn = self._conn
        plan = [OP_PUT, U32.pack(len(blocks))]
        for header, data in blocks:
            raw = _stamped(header, len(data)).SerializeToString()
            plan += [U32.pack(len(raw)), raw]
        conn.sendall(b"".join(plan))
        self._answer()
        decisions = recv_exact(conn, len(blocks))
        for decision, (_, data) in zip(decisions, blocks, strict=True):
            if decision == SEND:  # the node holds the others already, or has no room for them
                conn.sendall(data)
        self._answer()
        (size,) = U32.unpack(recv_exact(conn, 4))
        return kvstore_pb2.PutBlocksResponse.FromString(recv_exact(conn, size))

    def get(self, keys: Sequence[BlockKey]) -> list[tuple[kvstore_pb2.BlockHeader, bytearray | None]]:
        conn = self._conn
        request = kvstore_pb2.GetBlocksRequest(keys=[key.to_proto() for key in keys]).SerializeToString()
        conn.sendall(OP_GET + U32.pack(len(request)) + request)
        self._answer()
        blocks = []
        for _ in keys:
            (size,) = U32.unpack(recv_exact(conn, 4))
            header = kvstore_pb2.BlockHeader.FromString(recv_exact(conn, size))
            data = None
            if header.found:
                data = bytearray(header.num_bytes)
                recv_into(conn, memoryview(data))
            blocks.append((header, data))
        return blocks


# ---------------------------------------------------------------------------- pool client

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
