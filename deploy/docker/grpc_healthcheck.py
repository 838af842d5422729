#!/usr/bin/env python3
"""Container health probe: asks the service's grpc.health.v1 Check (overall
status, service "") on 127.0.0.1 and exits 0 only when it answers SERVING.

Installed in every image as `primerl-healthcheck`; the Dockerfiles' HEALTHCHECK
runs `primerl-healthcheck <default port>`. The port comes from, in order:
PRIMERL_HEALTHCHECK_PORT, the service's PRIMERL_<SERVICE>_SERVER__PORT, the argument.
Under mutual TLS (PRIMERL_TLS_MODE=mtls) it shows the certificate PRIMERL_TLS_CERT and
PRIMERL_TLS_KEY name and trusts PRIMERL_TLS_CA (any identity of the CA may ask for health).

It speaks just enough HTTP/2 for one unary call, with the standard library
only: a probe that imports grpcio costs a few tenths of a second of CPU, many
seconds on a loaded machine, and Docker runs one per container every interval.
The request's headers are HPACK literals (no table, no Huffman); the answer's
headers are not decoded: the call succeeded when a response message arrives,
and the message (HealthCheckResponse, field 1 = status) says SERVING or not.
"""

from __future__ import annotations

import os
import socket
import ssl
import struct
import sys

TIMEOUT_S = 5.0
PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, RST_STREAM, SETTINGS, PING, GOAWAY = 0x0, 0x1, 0x3, 0x4, 0x6, 0x7
END_STREAM, ACK, END_HEADERS, PADDED = 0x1, 0x1, 0x4, 0x8
STATUS_NAMES = {0: "UNKNOWN", 1: "SERVING", 2: "NOT_SERVING", 3: "SERVICE_UNKNOWN"}
STREAM = 1


def port(default: str) -> str:
    if "PRIMERL_HEALTHCHECK_PORT" in os.environ:
        return os.environ["PRIMERL_HEALTHCHECK_PORT"]
    for key, value in os.environ.items():
        if key.startswith("PRIMERL_") and key.endswith("_SERVER__PORT"):
            return value
    return default


def frame(kind: int, flags: int, stream: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes([kind, flags]) + struct.pack(">I", stream) + payload


def literal(name: str, value: str) -> bytes:
    """An HPACK literal header field without indexing, new name, no Huffman."""
    fields = b"\x00"
    for text in (name.encode(), value.encode()):
        assert len(text) < 127
        fields += bytes([len(text)]) + text
    return fields


def read_exactly(sock: socket.socket, size: int) -> bytes:
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise ConnectionError("connection closed")
        data += chunk
    return data


def tls_context() -> ssl.SSLContext | None:
    """The client side of mutual TLS from PRIMERL_TLS_*, or None for plaintext."""
    if os.environ.get("PRIMERL_TLS_MODE", "plaintext") != "mtls":
        return None
    context = ssl.create_default_context(cafile=os.environ["PRIMERL_TLS_CA"])
    context.load_cert_chain(os.environ["PRIMERL_TLS_CERT"], os.environ["PRIMERL_TLS_KEY"])
    context.set_alpn_protocols(["h2"])
    return context


def check(address: str, host: str) -> int:
    """The health status the server answers (an int of HealthCheckResponse.ServingStatus)."""
    context = tls_context()
    headers = b"".join(
        literal(name, value)
        for name, value in (
            (":method", "POST"),
            (":scheme", "http" if context is None else "https"),
            (":path", "/grpc.health.v1.Health/Check"),
            (":authority", address),
            ("content-type", "application/grpc"),
            ("te", "trailers"),
        )
    )
    request = b"\x00" + struct.pack(">I", 0)  # an empty HealthCheckRequest: service ""
    with socket.create_connection((host, int(address.rpartition(":")[2])), timeout=TIMEOUT_S) as plain:
        sock = plain if context is None else context.wrap_socket(plain, server_hostname=host)
        sock.sendall(
            PREFACE
            + frame(SETTINGS, 0, 0)
            + frame(HEADERS, END_HEADERS, STREAM, headers)
            + frame(DATA, END_STREAM, STREAM, request)
        )
        message = b""
        while True:
            length, kind, flags, stream = struct.unpack(">IBBI", b"\x00" + read_exactly(sock, 9))
            payload = read_exactly(sock, length)
            if kind == SETTINGS and not flags & ACK:
                sock.sendall(frame(SETTINGS, ACK, 0))
            elif kind == PING and not flags & ACK:
                sock.sendall(frame(PING, ACK, 0, payload))
            elif kind == GOAWAY:
                raise ConnectionError("the server sent GOAWAY")
            elif stream & 0x7FFFFFFF != STREAM:
                continue
            elif kind == RST_STREAM:
                raise ConnectionError("the server reset the call")
            elif kind == DATA:
                if flags & PADDED:
                    payload = payload[1 : len(payload) - payload[0]]
                message += payload
            if stream == STREAM and kind in (DATA, HEADERS) and flags & END_STREAM:
                break
    if len(message) < 5:
        raise ConnectionError("the call failed (no response message)")
    return parse_status(message[5 : 5 + struct.unpack(">I", message[1:5])[0]])


def parse_status(body: bytes) -> int:
    """Field 1 (varint) of a HealthCheckResponse; 0 when absent (proto3 default)."""
    status, index = 0, 0
    while index < len(body):
        key, index = varint(body, index)
        field, wire_type = key >> 3, key & 7
        if wire_type == 0:
            value, index = varint(body, index)
            if field == 1:
                status = value
        elif wire_type == 2:
            size, index = varint(body, index)
            index += size
        elif wire_type == 5:
            index += 4
        elif wire_type == 1:
            index += 8
        else:
            raise ValueError(f"unexpected protobuf wire type {wire_type}")
    return status


def varint(data: bytes, index: int) -> tuple[int, int]:
    value, shift = 0, 0
    while True:
        byte = data[index]
        index += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, index
        shift += 7


def main() -> int:
    address = f"127.0.0.1:{port(sys.argv[1] if len(sys.argv) > 1 else '50051')}"
    try:
        status = check(address, "127.0.0.1")
    except (OSError, KeyError, ValueError, IndexError, struct.error) as exc:
        print(f"{address}: {exc}", file=sys.stderr)
        return 1
    print(f"{address}: {STATUS_NAMES.get(status, status)}")
    return 0 if status == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
