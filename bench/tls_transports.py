"""Why mutual TLS halves a weight push's bytes per second, transport by transport: 1 GiB in
4 MiB messages from one client process to one receiving process over K parallel TCP
connections, plaintext and mTLS, through

- `aio`: grpc.aio at both ends (the push paths' transport today, bench/tls_overhead.py's push);
- `sync`: gRPC's threaded API (K client threads, a thread-pool server);
- `ssl`: raw sockets with Python's `ssl` (OpenSSL) in one thread per connection at each end,
  length-prefixed messages read with recv_into (the kvstore bulk channel's way);
- `sync>aio` and `aio>sync`: the sending API > the receiving one, to tell which end bounds;
- `sealed`: grpc.aio at both ends over plaintext connections, each message sealed (mode mtls)
  with AES-256-GCM in a thread pool ahead of the sender and opened in one at the receiver
  (primerl_common.security.sealed; its session key, handed out over mTLS in the push paths, is
  made here). Its plaintext mode is `aio`'s.

If TLS's cost were the cipher's (AES-GCM runs at ~10 GB/s a core on the device host's Xeon,
`openssl speed`), K connections on K cores would hide it. The table shows where each transport
stops scaling instead. Both ends run on this machine; the receiver drains and drops the bytes.

Last line: RESULT best_mtls_gib_s=<x> transport=<t> k=<k> best_plaintext_gib_s=<y>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import socket
import ssl
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures

import grpc
import psutil

from primerl_common import security
from primerl_common.malloc import MALLOC_ENV, reexec_with_malloc_env
from primerl_common.processes import free_port
from primerl_common.security.sealed import StreamKey, open_frames, seal_frames
from primerl_common.server import channel_options, server_options

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from tls_push import (
    MODES,
    SINK_PUSH,
    add_port,
    busiest_thread_s,
    make_certs,
    serve_sink,
    striped_channel,
    thread_cpu,
    tls_for,
)

HERE = pathlib.Path(__file__).resolve()
MiB = 1 << 20
TRANSPORTS = ("aio", "sync", "ssl", "sync>aio", "aio>sync", "sealed")
_HEADER = 8  # little-endian message length; 0 ends a round and asks for a one-byte answer


def serve_sync(port: int, mode: str, certs: pathlib.Path) -> None:
    def push(request_iterator, context) -> bytes:
        for _ in request_iterator:
            pass
        return b""

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=16), options=server_options(64 * MiB))
    handler = grpc.method_handlers_generic_handler("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    server.add_generic_rpc_handlers((handler,))
    add_port(server, port, tls_for(mode, certs, "weight_broadcaster"))
    server.start()
    server.wait_for_termination()


# The sealed transport's one session key: the bench measures the stream, not the hand-out.
SEALED_KEY = StreamKey("bench", bytes(range(32)), SINK_PUSH)


async def serve_sealed(port: int, mode: str, certs: pathlib.Path) -> None:
    if mode != "mtls":
        return await serve_sink(port, tls_for(mode, certs, "weight_broadcaster"))

    async def push(request_iterator, context: grpc.aio.ServicerContext) -> bytes:
        async for _ in open_frames(SEALED_KEY, request_iterator):
            pass
        return b""

    server = grpc.aio.server(options=server_options(64 * MiB))
    server.add_registered_method_handlers("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def serve_ssl(port: int, mode: str, certs: pathlib.Path) -> None:
    listener = socket.create_server(("127.0.0.1", port))
    tls = tls_for(mode, certs, "weight_broadcaster")
    context = security.ssl_server_context(tls) if mode == "mtls" else None

    def drain(conn: socket.socket) -> None:
        if context is not None:
            try:
                conn = context.wrap_socket(conn, server_side=True)
            except (ssl.SSLError, OSError):  # wait_listening's probe: connects, sends nothing
                return
        view = memoryview(bytearray(16 * MiB))
        while header := conn.recv(_HEADER):
            size = int.from_bytes(header, "little")
            if size == 0:
                conn.sendall(b"k")
            got = 0
            while got < size:
                received = conn.recv_into(view[got:size])
                if not received:
                    return
                got += received

    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        threading.Thread(target=drain, args=(conn,), daemon=True).start()


def gib_s(num_bytes: int, seconds: float) -> float:
    return num_bytes / (1 << 30) / seconds


async def rounds_aio(
    port: int, mode: str, certs: pathlib.Path, k: int, payload: bytes, n: int, rounds: int, sealed: bool = False
):
    channel_mode = "plaintext" if sealed else mode
    channels = [striped_channel(f"127.0.0.1:{port}", channel_mode, certs, stripe) for stripe in range(k)]
    for channel in channels:
        await asyncio.wait_for(channel.channel_ready(), 60)

    async def plain(stripe: int):
        for _ in range(stripe, n, k):
            yield payload

    def messages(stripe: int):
        return seal_frames(SEALED_KEY, plain(stripe)) if sealed else plain(stripe)

    rates = []
    for _ in range(rounds):
        began = time.perf_counter()
        calls = (c.stream_unary(SINK_PUSH, _registered_method=True)(messages(s)) for s, c in enumerate(channels))
        await asyncio.gather(*calls)
        rates.append(gib_s(n * len(payload), time.perf_counter() - began))
    for channel in channels:
        await channel.close()
    return rates


def rounds_sync(port: int, mode: str, certs: pathlib.Path, k: int, payload: bytes, n: int, rounds: int):
    tls = tls_for(mode, certs, "trainer")
    options = [*channel_options(64 * MiB), ("grpc.use_local_subchannel_pool", 1)]
    channels = [
        security.secure_channel(f"127.0.0.1:{port}", options=[*options, ("primerl.stripe", s)], tls=tls)
        for s in range(k)
    ]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=60)
    calls = [channel.stream_unary(SINK_PUSH, _registered_method=True) for channel in channels]
    rates = []
    with futures.ThreadPoolExecutor(k) as pool:
        for _ in range(rounds):
            began = time.perf_counter()
            list(pool.map(lambda s: calls[s](payload for _ in range(s, n, k)), range(k)))
            rates.append(gib_s(n * len(payload), time.perf_counter() - began))
    for channel in channels:
        channel.close()
    return rates


def rounds_ssl(port: int, mode: str, certs: pathlib.Path, k: int, payload: bytes, n: int, rounds: int):
    context = security.ssl_client_context(tls_for(mode, certs, "trainer")) if mode == "mtls" else None
    connections = []
    for _ in range(k):
        conn = socket.create_connection(("127.0.0.1", port))
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        connections.append(context.wrap_socket(conn, server_hostname="127.0.0.1") if context else conn)
    header = len(payload).to_bytes(_HEADER, "little")

    def send(stripe: int) -> None:
        conn = connections[stripe]
        for _ in range(stripe, n, k):
            conn.sendall(header)
            conn.sendall(payload)
        conn.sendall(bytes(_HEADER))
        if conn.recv(1) != b"k":
            raise ConnectionError("the receiver did not answer")

    rates = []
    with futures.ThreadPoolExecutor(k) as pool:
        for _ in range(rounds):
            began = time.perf_counter()
            list(pool.map(send, range(k)))
            rates.append(gib_s(n * len(payload), time.perf_counter() - began))
    for conn in connections:
        conn.close()
    return rates


def ends(transport: str) -> tuple[str, str]:
    """(sending API, receiving API) of a transport."""
    sender, _, receiver = transport.partition(">")
    return sender, receiver or sender


def measure(transport: str, port: int, mode: str, certs: pathlib.Path, k: int, args: argparse.Namespace):
    payload, n = os.urandom(args.message_mib * MiB), args.push_mib // args.message_mib
    transport = ends(transport)[0]
    if transport in ("aio", "sealed"):
        sealed = transport == "sealed" and mode == "mtls"
        return asyncio.run(rounds_aio(port, mode, certs, k, payload, n, args.rounds, sealed))
    run = rounds_sync if transport == "sync" else rounds_ssl
    return run(port, mode, certs, k, payload, n, args.rounds)


def wait_listening(port: int, process: subprocess.Popen, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and process.poll() is None:
        with socket.socket() as probe:
            if probe.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"the receiver on port {port} did not start")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve", nargs=4, metavar=("TRANSPORT", "PORT", "MODE", "CERTS"), help=argparse.SUPPRESS)
    parser.add_argument(
        "--transports", default=",".join(TRANSPORTS), help="comma-separated, of " + ", ".join(TRANSPORTS)
    )
    parser.add_argument("--streams", default="1,2,4,8", help="numbers K of parallel connections, comma-separated")
    parser.add_argument("--push-mib", type=int, default=1024, help="MiB per round")
    parser.add_argument("--message-mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="rounds per transport, mode and K (median printed)")
    args = parser.parse_args()
    if args.serve:
        transport, port, mode, certs = args.serve
        serve = {"sync": serve_sync, "ssl": serve_ssl}.get(transport)
        if transport == "sealed":
            asyncio.run(serve_sealed(int(port), mode, pathlib.Path(certs)))
        elif serve is None:
            asyncio.run(serve_sink(int(port), tls_for(mode, pathlib.Path(certs), "weight_broadcaster")))
        else:
            serve(int(port), mode, pathlib.Path(certs))
        return
    transports, streams = args.transports.split(","), [int(k) for k in args.streams.split(",")]
    if not set(transports) <= set(TRANSPORTS) or min(streams) < 1 or args.push_mib < args.message_mib:
        parser.error(f"--transports from {TRANSPORTS}, --streams at least 1, --push-mib at least --message-mib")
    reexec_with_malloc_env()
    print(f"cores {os.cpu_count()}  load average {os.getloadavg()[0]:.2f}  grpcio {grpc.__version__}")
    print(f"Python's ssl: {ssl.OPENSSL_VERSION}")
    print(f"{args.rounds} rounds of {args.push_mib} MiB in {args.message_mib} MiB messages per transport, mode and K")
    print("busiest thread: CPU s/GiB of the sender's and the receiver's busiest thread (a ceiling of 1/that GiB/s")
    print("  on a machine with cores to spare, whatever the other threads do)")
    print(f"{'transport':>9} {'mode':>9} {'K':>2} {'GiB/s (median)':>15}   busiest thread   rounds")
    best: dict[str, tuple[float, str, int]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        certs = pathlib.Path(tmp) / "certs"
        make_certs(certs)
        for transport in transports:
            for mode in MODES:
                port = free_port()
                command = [sys.executable, str(HERE), "--serve", ends(transport)[1], str(port), mode, str(certs)]
                receiver = subprocess.Popen(command, env={**os.environ, **MALLOC_ENV})
                try:
                    wait_listening(port, receiver)
                    for k in streams:
                        ends_now = [psutil.Process(), psutil.Process(receiver.pid)]
                        before = [thread_cpu(end) for end in ends_now]
                        rates = measure(transport, port, mode, certs, k, args)
                        gib = args.rounds * args.push_mib / 1024
                        busiest = [
                            busiest_thread_s(b, thread_cpu(end)) / gib for b, end in zip(before, ends_now, strict=True)
                        ]
                        median = statistics.median(rates)
                        each = " ".join(f"{rate:.2f}" for rate in rates)
                        threads = f"{busiest[0]:6.2f} {busiest[1]:6.2f}"
                        print(f"{transport:>9} {mode:>9} {k:>2} {median:>15.2f}   {threads}   {each}")
                        best[mode] = max(best.get(mode, (0.0, "", 0)), (median, transport, k))
                finally:
                    receiver.kill()
                    receiver.wait()
    (mtls, transport, k), plaintext = best["mtls"], best["plaintext"][0]
    print(f"RESULT best_mtls_gib_s={mtls:.2f} transport={transport} k={k} best_plaintext_gib_s={plaintext:.2f}")


if __name__ == "__main__":
    main()
