"""The bulk side channel's wire format (protocol at the top of primerl_kvstore/bulk.py):
the constants and socket reads both ends use, and `BulkClient`, the client end."""

from __future__ import annotations

import socket
import ssl
import struct
from collections.abc import Sequence

import grpc
from google.rpc import status_pb2

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common import security
from primerl_common.config import TlsConfig
from primerl_common.kvpool.framing import stamped_header
from primerl_common.kvpool.keys import BlockKey

__all__ = [
    "EXISTING",
    "OP_GET",
    "OP_PUT",
    "REJECTED",
    "SEND",
    "STATUS_ERROR",
    "STATUS_OK",
    "U32",
    "BulkClient",
    "BulkError",
    "recv_exact",
    "recv_into",
]

U32 = struct.Struct("<I")
OP_PUT, OP_GET = b"P", b"G"
STATUS_OK, STATUS_ERROR = 0, 1
SEND, EXISTING, REJECTED = 0, 1, 2  # a node's decision per block of a bulk put


def recv_exact(conn: socket.socket, size: int) -> bytes:
    if isinstance(conn, ssl.SSLSocket):  # no recv flags under TLS
        buffer = bytearray(size)
        recv_into(conn, memoryview(buffer))
        return bytes(buffer)
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
    run it in a worker thread from async code). Mutual TLS with `tls` (default: the process's
    identity, see primerl_common.security) unless that is plaintext."""

    def __init__(self, address: str, *, timeout_s: float = 60.0, tls: TlsConfig | None = None) -> None:
        host, port = address.rsplit(":", 1)
        conn = socket.create_connection((host, int(port)), timeout=timeout_s)
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        context = security.ssl_client_context(tls)
        if context is None:
            self._conn = conn
            return
        try:
            self._conn = context.wrap_socket(conn, server_hostname=host)
        except (ssl.SSLError, ConnectionError) as exc:
            conn.close()
            # A node past node.bulk_max_connections answers RESOURCE_EXHAUSTED after the
            # handshake; one flooded with refusals, or refusing this certificate, ends it.
            raise BulkError(
                grpc.StatusCode.UNAVAILABLE, f"{address}: the bulk channel's TLS handshake failed ({exc})"
            ) from exc

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
            raw = stamped_header(header, len(data)).SerializeToString()
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
