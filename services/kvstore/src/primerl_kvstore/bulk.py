"""The bulk side channel: the same block puts and gets as PutBlocks / GetBlocks over plain TCP.

grpcio takes and returns only `bytes`, so every block crosses several copies in each
process (DESIGN.md: gRPC streams reach about half a raw socket). Here a storage node's
worker thread receives a block's bytes straight into the buffer it keeps (`recv_into`)
and sends stored blocks straight from the memory it serves them from (`sendall` of a
view), so a block costs about what the socket does (a block put here is turned into `bytes`,
one copy, only if it is later served over gRPC). Everything that decides (room,
eviction, leases, the metadata role) stays on the event loop; threads only move bytes.

Protocol, on a connection that carries any number of requests (integers little-endian):

    request   op u8 ('P' put, 'G' get)
      put     then num_blocks u32 | per block: header_len u32 | BlockHeader (key, num_bytes, ...)
              the node answers status 0 and one byte per block: 0 send it, 1 held already,
              2 no room; the client then sends the data of the blocks marked 0, in order
      get     then len u32 | GetBlocksRequest
    answer    status u8: 0 ok, 1 error
      ok put  len u32 | PutBlocksResponse
      ok get  per key: header_len u32 | BlockHeader (found, num_bytes) | data
      error   len u32 | google.rpc.Status (code, message naming the field); the
              server then closes the connection

A connection past node.bulk_max_connections gets an error answer (RESOURCE_EXHAUSTED) before
any request: under mTLS once the handshake is done, so the client reads it as it reads any answer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from google.rpc import status_pb2

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common import security
from primerl_common.admission import LimitExceeded, Overloaded, StreamDeadlineExceeded
from primerl_common.config import TlsConfig
from primerl_common.errors import InvalidArgument, ResourceExhausted, ServiceError
from primerl_common.kvpool.bulk import (
    EXISTING,
    OP_GET,
    OP_PUT,
    REJECTED,
    SEND,
    STATUS_ERROR,
    STATUS_OK,
    U32,
)
from primerl_common.kvpool.framing import DATA_TAG, data_view, varint
from primerl_common.kvpool.keys import BlockKey, keys_from_proto
from primerl_kvstore.metadata import StoredBlock
from primerl_kvstore.storage import Reservation, StorageNode
from primerl_kvstore.wire import Block, check_put_header

__all__ = ["BulkLimits", "BulkServer"]

logger = logging.getLogger(__name__)

_MAX_BLOCKS = 65_536
# Headers and requests on this channel are small; a larger length is a broken peer.
_MAX_HEADER_BYTES = 16 * 1024 * 1024
# Connections over node.bulk_max_connections being refused at once under mTLS (each a TLS
# handshake and an answer, in a thread of its own, for at most _REFUSAL_TIMEOUT_S each).
_MAX_REFUSALS = 8
_REFUSAL_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class BulkLimits:
    """Bounds of the bulk channel (the node.bulk_* config fields)."""

    max_connections: int = 256
    max_header_bytes: int = 256 * 1024 * 1024
    idle_timeout_s: float = 60.0
    request_timeout_s: float = 600.0


class _Peer:
    """One request's reads and writes on a connection, each bounded by the idle timeout and all
    of them by the request's deadline: a peer that trickles or stops reading cannot hold a
    worker thread and a reservation for ever."""

    def __init__(self, conn: socket.socket, limits: BulkLimits) -> None:
        self.conn = conn
        self._idle_s = limits.idle_timeout_s
        self._total_s = limits.request_timeout_s
        self._give_up_at = time.monotonic() + limits.request_timeout_s
        self._timeout_s: float | None = None

    def _arm(self) -> bool:
        """Sets the socket's timeout for the next operation; True when the request's deadline, not
        the idle timeout, bounds it."""
        remaining_s = self._give_up_at - time.monotonic()
        if remaining_s <= 0:
            raise self._expired(total=True)
        timeout_s = min(self._idle_s, remaining_s)
        if timeout_s != self._timeout_s:  # each change is a system call
            self.conn.settimeout(timeout_s)
            self._timeout_s = timeout_s
        return remaining_s <= self._idle_s

    def _expired(self, *, total: bool) -> StreamDeadlineExceeded:
        if total:
            return StreamDeadlineExceeded(
                f"the bulk request did not finish within {self._total_s:g} s (node.bulk_request_timeout_s)",
                reason="STREAM_TOO_LONG",
            )
        return StreamDeadlineExceeded(
            f"the peer sent or read nothing for {self._idle_s:g} s (node.bulk_idle_timeout_s)", reason="STREAM_IDLE"
        )

    def recv_into(self, view: memoryview) -> None:
        while view:
            total = self._arm()
            try:
                n = self.conn.recv_into(view)
            except TimeoutError:
                raise self._expired(total=total) from None
            if n == 0:
                raise ConnectionError("peer closed in the middle of a request")
            view = view[n:]

    def recv_exact(self, size: int) -> bytes:
        buffer = bytearray(size)
        self.recv_into(memoryview(buffer))
        return bytes(buffer)

    def sendall(self, data: bytes | bytearray | memoryview) -> None:
        total = self._arm()
        try:
            self.conn.sendall(data)
        except TimeoutError:
            raise self._expired(total=total) from None


def _send_error(conn: socket.socket, exc: ServiceError) -> None:
    status = status_pb2.Status(code=exc.code.value[0], message=exc.message).SerializeToString()
    with contextlib.suppress(OSError):
        conn.settimeout(1.0)
        conn.sendall(bytes((STATUS_ERROR,)) + U32.pack(len(status)) + status)


def _close(conn: socket.socket) -> None:
    with contextlib.suppress(OSError):
        conn.shutdown(socket.SHUT_RDWR)
    conn.close()


class _Handler(socketserver.BaseRequestHandler):
    server: _ThreadingServer

    def handle(self) -> None:
        conn: socket.socket = self.request
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        bulk = self.server.bulk
        if bulk.tls_context is not None:
            try:
                conn = bulk.admit(conn)
            except (ServiceError, OSError):  # refused (answered), or no TLS handshake
                return
        while True:
            # Between requests a pooled connection may stay quiet as long as it likes (bounded by
            # node.bulk_max_connections); once a request starts, its deadlines run.
            conn.settimeout(None)
            try:
                op = conn.recv(1)
            except OSError:
                return
            if not op:
                return
            peer = _Peer(conn, bulk.limits)
            try:
                if op == OP_PUT:
                    bulk.handle_put(peer)
                elif op == OP_GET:
                    bulk.handle_get(peer)
                else:
                    raise InvalidArgument(f"unknown operation {op!r}", field="op")
            except ServiceError as exc:
                _send_error(conn, exc)
                return
            except (ConnectionError, OSError):
                return

    def finish(self) -> None:
        self.server.bulk.connections.release()


class _ThreadingServer(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    bulk: BulkServer

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.bulk.connections.acquire(blocking=False):
            self.bulk.refuse_overloaded(request)
            return
        super().process_request(request, client_address)


class BulkServer:
    def __init__(
        self,
        node: StorageNode,
        host: str,
        port: int,
        *,
        limits: BulkLimits | None = None,
        tls: TlsConfig | None = None,
        allowed_roles: Collection[str] = (),
    ) -> None:
        """Under tls.mode mtls each connection is mutual TLS, and only a peer whose certificate
        names one of `allowed_roles` (those of PutBlocks / GetBlocks) may use it."""
        self.node = node
        self.limits = limits or BulkLimits()
        self.tls_context = security.ssl_server_context(tls) if tls is not None and tls.mode == "mtls" else None
        self._allowed_roles = frozenset(allowed_roles)
        # Held by each connection's worker thread, released when it ends.
        self.connections = threading.BoundedSemaphore(self.limits.max_connections)
        self._refusals = threading.BoundedSemaphore(_MAX_REFUSALS)
        self._host, self._port = host, port
        self._server: _ThreadingServer | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self.port = 0

    def admit(self, conn: socket.socket) -> socket.socket:
        """The TLS side of a new connection, once its peer's certificate names an allowed role;
        else the refusal is answered (UNAUTHENTICATED / PERMISSION_DENIED) and raised."""
        assert self.tls_context is not None
        conn.settimeout(self.limits.idle_timeout_s)  # the handshake, too, is bounded
        secure = self.tls_context.wrap_socket(conn, server_side=True)
        identity = security.certificate_identity(secure.getpeercert(binary_form=True) or b"")
        refusal: ServiceError | None = None
        if identity is None:
            refusal = security.Unauthenticated("the client certificate names no identity", reason="NO_IDENTITY")
        elif identity[1].isdisjoint(self._allowed_roles):
            needed = " or ".join(sorted(self._allowed_roles))
            refusal = security.PermissionDenied(
                f"the kvstore bulk channel needs role {needed}; {identity[0]} has {','.join(sorted(identity[1]))}",
                reason="MISSING_ROLE",
            )
        if refusal is not None:
            logger.warning("kvstore bulk channel refused %s: %s", secure.getpeername(), refusal.message)
            _send_error(secure, refusal)
            secure.close()
            raise refusal
        return secure

    def refuse_overloaded(self, conn: socket.socket) -> None:
        """A connection over node.bulk_max_connections, answered RESOURCE_EXHAUSTED with a retry
        hint: in plaintext at once; under mTLS after the handshake (the client reads nothing
        before it), in a thread of its own, at most _MAX_REFUSALS at a time; past those it is
        closed without a word (the client's handshake fails: it retries or uses gRPC)."""
        limit = self.limits.max_connections
        error = Overloaded(
            f"{limit} bulk connections are open, the most this node takes (node.bulk_max_connections = "
            f"{limit}); use the open ones or retry later",
            config_field="node.bulk_max_connections",
            limit=limit,
            retry_after_s=1.0,
        )
        if self.tls_context is None:
            _send_error(conn, error)
            _close(conn)
        elif self._refusals.acquire(blocking=False):
            threading.Thread(
                target=self._refuse_after_handshake, args=(conn, error), name="kvstore-bulk-refusal", daemon=True
            ).start()
        else:
            _close(conn)

    def _refuse_after_handshake(self, conn: socket.socket, error: ServiceError) -> None:
        assert self.tls_context is not None
        try:
            conn.settimeout(min(self.limits.idle_timeout_s, _REFUSAL_TIMEOUT_S))
            conn = self.tls_context.wrap_socket(conn, server_side=True)
            _send_error(conn, error)
            # Read what the client sends meanwhile (its first request) until it closes: closed
            # with unread bytes, the connection would be reset and the answer lost.
            conn.settimeout(_REFUSAL_TIMEOUT_S)
            with contextlib.suppress(OSError):
                while conn.recv(65536):
                    pass
        except OSError:
            pass
        finally:
            _close(conn)
            self._refusals.release()

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._server = _ThreadingServer((self._host, self._port), _Handler)
        self._server.bulk = self
        self.port = self._server.server_address[1]
        self._thread = threading.Thread(target=self._server.serve_forever, name="kvstore-bulk", daemon=True)
        self._thread.start()
        logger.info("bulk side channel on port %d", self.port)

    async def stop(self) -> None:
        if self._server is not None:
            await asyncio.to_thread(self._server.shutdown)
            self._server.server_close()

    def _on_loop(self, call: Callable[[], Any]) -> Any:
        """Runs `call` (a coroutine function or a plain one) on the event loop, from a worker thread."""
        assert self._loop is not None

        async def run() -> Any:
            result = call()
            return await result if asyncio.iscoroutine(result) else result

        return asyncio.run_coroutine_threadsafe(run(), self._loop).result()

    def handle_put(self, conn: _Peer) -> None:
        node = self.node
        (num_blocks,) = U32.unpack(conn.recv_exact(4))
        if num_blocks > _MAX_BLOCKS:
            raise InvalidArgument(f"{num_blocks} blocks; at most {_MAX_BLOCKS} per request", field="headers")
        headers, keys = [], []
        num_header_bytes = 0
        for index in range(num_blocks):
            (header_len,) = U32.unpack(conn.recv_exact(4))
            if header_len > _MAX_HEADER_BYTES:
                raise InvalidArgument(f"{header_len} bytes", field="header")
            num_header_bytes += header_len
            if num_header_bytes > self.limits.max_header_bytes:
                raise LimitExceeded(
                    f"block {index} brings the request's headers to {num_header_bytes} bytes, more than this node "
                    f"takes (node.bulk_max_header_bytes = {self.limits.max_header_bytes})",
                    field="header",
                    config_field="node.bulk_max_header_bytes",
                    limit=self.limits.max_header_bytes,
                )
            try:
                header = kvstore_pb2.BlockHeader.FromString(conn.recv_exact(header_len))
            except Exception:
                raise InvalidArgument("not a BlockHeader", field="header") from None
            keys.append(check_put_header(header, index, node.dram_capacity_bytes))
            headers.append(header)
        # One trip to the event loop for the room of all blocks, one for storing them.
        outcomes = self._on_loop(lambda: self._reserve_all(headers, keys))
        conn.sendall(
            bytes((STATUS_OK,))
            + bytes(SEND if isinstance(o, Reservation) else EXISTING if o is True else REJECTED for o in outcomes)
        )
        reservations = [o for o in outcomes if isinstance(o, Reservation)]
        try:
            for reservation in reservations:
                self._receive(conn, reservation)
        except BaseException:
            self._on_loop(lambda: [node.abort(r) for r in reservations])
            raise
        num_stored = self._on_loop(lambda: self._commit(reservations))
        num_existing = sum(o is True for o in outcomes)
        num_rejected = sum(o is False for o in outcomes)
        if num_rejected and not num_stored and not num_existing:
            raise ResourceExhausted(f"no room for {num_rejected} blocks: this node's DRAM is full of leased blocks")
        reply = kvstore_pb2.PutBlocksResponse(
            num_stored=num_stored, num_existing=num_existing, num_rejected=num_rejected
        ).SerializeToString()
        conn.sendall(bytes((STATUS_OK,)) + U32.pack(len(reply)) + reply)

    async def _reserve_all(self, headers: list[kvstore_pb2.BlockHeader], keys: list[BlockKey]) -> list[Any]:
        # A key twice in one request: reserve counts the second as held already.
        return [await self.node.reserve(header, key) for header, key in zip(headers, keys, strict=True)]

    def _receive(self, conn: _Peer, reservation: Reservation) -> None:
        """Receives a block's bytes straight into the data messages the node keeps."""
        num_bytes, chunk_bytes = reservation.block.num_bytes, self.node.chunk_bytes
        for start in range(0, num_bytes, chunk_bytes):
            size = min(chunk_bytes, num_bytes - start)
            prefix = bytes((DATA_TAG,)) + varint(size)
            frame = bytearray(len(prefix) + size)
            frame[: len(prefix)] = prefix
            conn.recv_into(memoryview(frame)[len(prefix) :])
            # Kept as it is: the gRPC path turns it into bytes when it serves it.
            reservation.block.frames.append(frame)
        reservation.num_received = num_bytes

    async def _commit(self, reservations: list[Reservation]) -> int:
        stored = []
        for reservation in reservations:
            self.node.commit(reservation)
            block = reservation.block
            stored.append(StoredBlock(block.key, block.num_bytes, kvstore_pb2.TIER_DRAM))
        await self.node.publish(stored=stored)
        return len(stored)

    def handle_get(self, conn: _Peer) -> None:
        (size,) = U32.unpack(conn.recv_exact(4))
        if size > _MAX_HEADER_BYTES:
            raise InvalidArgument(f"{size} bytes", field="request")
        try:
            request = kvstore_pb2.GetBlocksRequest.FromString(conn.recv_exact(size))
        except Exception:
            raise InvalidArgument("not a GetBlocksRequest", field="request") from None
        keys = keys_from_proto(request.keys)
        blocks = self._on_loop(lambda: self._get_all(keys))
        conn.sendall(bytes((STATUS_OK,)))
        for key, block in zip(keys, blocks, strict=True):
            if block is None:
                header = kvstore_pb2.BlockHeader(key=key.to_proto(), found=False).SerializeToString()
                conn.sendall(U32.pack(len(header)) + header)
                continue
            header = block.header.SerializeToString()
            conn.sendall(U32.pack(len(header)) + header)
            for frame in block.frames:
                conn.sendall(data_view(frame))

    async def _get_all(self, keys: list[BlockKey]) -> list[Block | None]:
        return [await self.node.get(key) for key in keys]
