"""Block throughput of `primerl-kvstore` against a plain socket moving the same bytes.

A real `primerl-kvstore` process (roles both, DRAM only, bulk side channel on) and, in
the same run, a plain TCP peer process: the client puts 1 MiB blocks in calls of
`--blocks-per-call` blocks and gets them back from the holder, through gRPC (PutBlocks /
GetBlocks) and through the node's bulk side channel (the same blocks over raw TCP, see
services/kvstore/src/primerl_kvstore/bulk.py), and sends / receives the same number of
bytes over one loopback socket with 1 MiB sendall/recv_into. Rounds alternate the paths
so that a shared machine disturbs all alike; each path is compared with the socket of the
same round, and the median of those per-round ratios is reported (best rounds too). Then the
latency of a 64 KiB get: from the holder (one call) over gRPC and over the bulk channel,
and the pool path (LocateBlocks with a lease, the read, ReleaseLeases).

The RESULT line reports the fastest path a client has (the bulk channel, where a node
runs it) and its 64 KiB p99; the gRPC-only ratios are printed on the line before.

glibc's malloc thresholds are raised in every process (DESIGN.md).

Last line: RESULT put_vs_socket=<x> get_vs_socket=<y> get64k_p99_ms=<z>
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import shutil
import socket
import statistics
import subprocess
import sys
import time

from primerl.kvstore.v1 import kvstore_pb2
from primerl_common.kvpool.bulk import BulkClient
from primerl_common.kvpool.client import KvStoreClient
from primerl_common.kvpool.keys import BlockKey
from primerl_common.malloc import MALLOC_ENV, reexec_with_malloc_env
from primerl_common.processes import ServiceProcess, free_port

MiB = 1024 * 1024
_COMMAND_BYTES = 32


# ----------------------------------------------------------------------------- socket peer


def serve_socket(port: int, total: int) -> None:
    """Commands on a kept connection (as the bulk channel's): "put N" (read N bytes) or
    "get N" (send N bytes), each answered b"ok".

    Like the store, it keeps what it receives (a fresh 1 MiB buffer per block, held until the
    transfer ends) and sends distinct blocks from memory (not one cache-hot buffer)."""
    listener = socket.create_server(("127.0.0.1", port))
    outgoing = [os.urandom(MiB) for _ in range(max(1, total // MiB))]
    while True:
        conn, _ = listener.accept()
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            while len(line := conn.recv(_COMMAND_BYTES, socket.MSG_WAITALL).split()) == 2:
                command, size = line[0], int(line[1])
                if command == b"put":
                    kept = []
                    for start in range(0, size, MiB):
                        kept.append(bytearray(min(MiB, size - start)))
                        recv_all(conn, memoryview(kept[-1]))
                else:
                    for index, start in enumerate(range(0, size, MiB)):
                        conn.sendall(memoryview(outgoing[index % len(outgoing)])[: min(MiB, size - start)])
                conn.sendall(b"ok")


def recv_all(conn: socket.socket, view: memoryview) -> None:
    while view:
        n = conn.recv_into(view)
        if not n:
            raise ConnectionError("peer closed")
        view = view[n:]


def socket_transfer(conn: socket.socket, command: str, total: int, blocks: list[bytes], per_call: int) -> float:
    """Seconds to move `total` bytes the way asked: put sends distinct 1 MiB blocks, get
    receives each block into a fresh buffer and keeps `per_call` of them at a time (as the
    store's client does with the blocks of one call)."""
    began = time.perf_counter()
    conn.sendall(f"{command} {total}".encode().ljust(_COMMAND_BYTES))
    if command == "put":
        for index in range(0, total // MiB):
            conn.sendall(blocks[index % len(blocks)])
    else:
        kept: list[bytearray] = []
        for index in range(0, total // MiB):
            if index % per_call == 0:
                kept = []
            kept.append(bytearray(MiB))
            recv_all(conn, memoryview(kept[-1]))
    assert conn.recv(2, socket.MSG_WAITALL) == b"ok"
    return time.perf_counter() - began


# ----------------------------------------------------------------------------- kvstore


def key(round_index: int, index: int, namespace: str = "bench") -> BlockKey:
    return BlockKey("bench-model", 0, f"{namespace}-{round_index}", index.to_bytes(8, "little"))


async def kv_put(
    client: KvStoreClient, address: str, keys: list[BlockKey], blocks: list[bytes], per_call: int
) -> float:
    began = time.perf_counter()
    for start in range(0, len(keys), per_call):
        batch = range(start, min(start + per_call, len(keys)))
        reply = await client.put(address, [(keys[i], blocks[i % len(blocks)]) for i in batch])
        assert reply.num_stored == len(keys[start : start + per_call]), reply
    return time.perf_counter() - began


async def kv_get(client: KvStoreClient, address: str, keys: list[BlockKey], size: int, per_call: int) -> float:
    began = time.perf_counter()
    for start in range(0, len(keys), per_call):
        fetched = await client.get_from(address, keys[start : start + per_call])
        assert all(b.found and len(b.data) == size for b in fetched)
    return time.perf_counter() - began


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def bench(args: argparse.Namespace) -> None:
    binary = shutil.which("primerl-kvstore", path=str(pathlib.Path(sys.executable).parent))
    assert binary, "primerl-kvstore is not installed"
    total = args.mib_per_round * MiB
    kv_port, sock_port = free_port(), free_port()
    socket_peer = subprocess.Popen(  # noqa: ASYNC220 (returns at once)
        [sys.executable, __file__, "--serve-socket", str(sock_port), "--mib-per-round", str(args.mib_per_round)],
        env={**os.environ, **MALLOC_ENV},
    )
    kvstore_args = [
        binary,
        *("--server.host", "127.0.0.1", "--server.port", str(kv_port), "--server.drain_delay_s", "0"),
        *("--dram.capacity_bytes", str(4 * total + 64 * MiB)),
        *("--node.chunk_bytes", str(args.chunk_bytes), "--node.bulk_port", "0"),
        *("--tls.mode", "plaintext", "--observability.log_level", "WARNING"),
    ]
    try:
        process = ServiceProcess(kvstore_args, port=kv_port, env=MALLOC_ENV)
        async with process, KvStoreClient(process.address, chunk_bytes=args.chunk_bytes) as client:
            meter = CpuMeter([process.pid, socket_peer.pid])
            await bench_rounds(args, client, process.address, sock_port, total, meter)
    finally:
        socket_peer.kill()
        socket_peer.wait()


def bulk_put(bulk: BulkClient, keys: list[BlockKey], blocks: list[bytes], per_call: int) -> float:
    began = time.perf_counter()
    for start in range(0, len(keys), per_call):
        batch = range(start, min(start + per_call, len(keys)))
        headers = [(kvstore_pb2.BlockHeader(key=keys[i].to_proto()), blocks[i % len(blocks)]) for i in batch]
        assert bulk.put(headers).num_stored == len(headers)
    return time.perf_counter() - began


def bulk_get(bulk: BulkClient, keys: list[BlockKey], size: int, per_call: int) -> float:
    began = time.perf_counter()
    for start in range(0, len(keys), per_call):
        fetched = bulk.get(keys[start : start + per_call])
        assert all(header.found and len(data) == size for header, data in fetched)
    return time.perf_counter() - began


CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class CpuMeter:
    """CPU seconds used by this process and the two peer processes (all their threads)."""

    def __init__(self, pids: list[int]) -> None:
        self._pids = pids

    def read(self) -> float:
        total = time.process_time()
        for pid in self._pids:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
        return total


async def bench_rounds(args, client: KvStoreClient, address: str, sock_port: int, total: int, meter: CpuMeter) -> None:
    num_blocks = total // MiB
    blocks = [os.urandom(MiB) for _ in range(num_blocks)]
    per_call = args.blocks_per_call
    for _ in range(100):  # the socket peer starts
        try:
            sock = socket.create_connection(("127.0.0.1", sock_port))
            break
        except OSError:
            await asyncio.sleep(0.1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    stats = await client.stub().GetStats(kvstore_pb2.GetStatsRequest())
    bulk = BulkClient(stats.nodes[0].bulk_address)
    # Warm up every path (connections, allocator).
    await kv_put(client, address, [key(-1, i) for i in range(8)], blocks, per_call)
    await kv_get(client, address, [key(-1, i) for i in range(8)], MiB, per_call)
    bulk_put(bulk, [key(-3, i) for i in range(8)], blocks, per_call)
    bulk_get(bulk, [key(-3, i) for i in range(8)], MiB, per_call)
    socket_transfer(sock, "put", 8 * MiB, blocks, per_call)
    socket_transfer(sock, "get", 8 * MiB, blocks, per_call)

    names = ["socket put", "grpc put", "bulk put", "socket get", "grpc get", "bulk get"]
    rates: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}  # CPU seconds per GB, all processes
    for r in range(args.rounds):
        grpc_keys = [key(r, i) for i in range(num_blocks)]
        bulk_keys = [key(r, i, "bulk") for i in range(num_blocks)]
        transfers = {
            "socket put": lambda: asyncio.to_thread(socket_transfer, sock, "put", total, blocks, per_call),
            "grpc put": lambda keys=grpc_keys: kv_put(client, address, keys, blocks, per_call),
            "bulk put": lambda keys=bulk_keys: asyncio.to_thread(bulk_put, bulk, keys, blocks, per_call),
            "socket get": lambda: asyncio.to_thread(socket_transfer, sock, "get", total, blocks, per_call),
            "grpc get": lambda keys=grpc_keys: kv_get(client, address, keys, MiB, per_call),
            "bulk get": lambda keys=bulk_keys: asyncio.to_thread(bulk_get, bulk, keys, MiB, per_call),
        }
        for name, transfer in transfers.items():
            cpu_before = meter.read()
            seconds = await transfer()
            cpu[name].append((meter.read() - cpu_before) / (total / 1e9))
            rates[name].append(total / seconds / 1e9)
        # Bit-exact spot checks, across the two paths.
        assert bytes((await client.get_from(address, [bulk_keys[-1]]))[0].data) == blocks[-1]
        assert bytes(bulk.get([grpc_keys[-1]])[0][1]) == blocks[-1]
        # Free the round's blocks: the store stays small on a shared machine.
        await client.stub().RemoveNamespace(
            kvstore_pb2.RemoveNamespaceRequest(model="bench-model", namespace=f"bench-{r}")
        )
        await client.stub().RemoveNamespace(
            kvstore_pb2.RemoveNamespaceRequest(model="bench-model", namespace=f"bulk-{r}")
        )

    # 64 KiB get latency.
    small = os.urandom(64 * 1024)
    small_key = key(-2, 0, "small")
    await client.put(address, [(small_key, small)])
    latencies: dict[str, list[float]] = {"grpc GetBlocks": [], "bulk get": [], "pool get (grpc)": []}
    for i in range(args.latency_samples + 50):
        timings = []
        began = time.perf_counter()
        assert (await client.get_from(address, [small_key]))[0].found
        timings.append(time.perf_counter() - began)
        began = time.perf_counter()
        assert bulk.get([small_key])[0][0].found
        timings.append(time.perf_counter() - began)
        began = time.perf_counter()
        assert (await client.get([small_key]))[0].found
        timings.append(time.perf_counter() - began)
        if i >= 50:
            for values, elapsed in zip(latencies.values(), timings, strict=True):
                values.append(elapsed * 1e3)
    bulk.close()
    sock.close()

    def vs_socket(name: str) -> float:
        """Median over rounds of the path's rate over the socket's rate in the same round."""
        baseline = rates["socket put" if "put" in name else "socket get"]
        return statistics.median(a / b for a, b in zip(rates[name], baseline, strict=True))

    def cpu_vs_socket(name: str) -> float:
        """Median over rounds of the socket's CPU per GB over the path's (1: as cheap as the socket)."""
        baseline = cpu["socket put" if "put" in name else "socket get"]
        return statistics.median(b / a for a, b in zip(cpu[name], baseline, strict=True))

    best = {name: max(values) for name, values in rates.items()}
    print(
        f"kvstore_throughput: {args.rounds} rounds of {args.mib_per_round} MiB in 1 MiB blocks, "
        f"{per_call} blocks per call, {args.chunk_bytes // 1024} KiB gRPC chunks"
    )
    print(
        f"{'transfer':<12}{'best GB/s':>10}{'median GB/s':>12}{'best/best sock':>15}{'vs socket':>10}"
        f"{'CPU s/GB':>10}{'CPU vs socket':>14}"
    )
    for name, values in rates.items():
        baseline = best["socket put" if "put" in name else "socket get"]
        print(
            f"{name:<12}{max(values):>10.2f}{statistics.median(values):>12.2f}{max(values) / baseline:>15.2f}"
            f"{vs_socket(name):>10.2f}{statistics.median(cpu[name]):>10.2f}{cpu_vs_socket(name):>14.2f}"
        )
    print(
        "(vs socket: median over rounds of the rate over the same round's socket rate; CPU s/GB: client, "
        "kvstore and socket peer together; CPU vs socket: socket CPU per GB over the path's)"
    )
    print(f"{'64 KiB get':<18}{'p50 ms':>8}{'p99 ms':>8}")
    for name, values in latencies.items():
        print(f"{name:<18}{statistics.median(values):>8.3f}{percentile(values, 0.99):>8.3f}")
    grpc_put, grpc_get = vs_socket("grpc put"), vs_socket("grpc get")
    grpc_p99 = percentile(latencies["grpc GetBlocks"], 0.99)
    print(f"gRPC only: put_vs_socket={grpc_put:.3f} get_vs_socket={grpc_get:.3f} get64k_p99_ms={grpc_p99:.3f}")
    put_ratio, get_ratio = vs_socket("bulk put"), vs_socket("bulk get")
    p99 = percentile(latencies["bulk get"], 0.99)
    print(f"RESULT put_vs_socket={put_ratio:.3f} get_vs_socket={get_ratio:.3f} get64k_p99_ms={p99:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-socket", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib-per-round", type=int, default=128)
    parser.add_argument("--blocks-per-call", type=int, default=16)
    parser.add_argument("--chunk-bytes", type=int, default=MiB)
    parser.add_argument("--latency-samples", type=int, default=1000)
    args = parser.parse_args()
    if args.serve_socket:
        serve_socket(args.serve_socket, args.mib_per_round * MiB)
        return
    reexec_with_malloc_env()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
