"""What the router adds to a Generate call: latency and throughput straight to
the replicas versus through `primerl-router`, at several concurrencies in one
run, and tokens/s of long streams both ways.

The replicas answer instantly: real gRPC servers (grpc.aio, health included),
one process each as real replicas are, that stream pre-encoded
GenerateResponse bytes, honouring the request's max_tokens and
StreamOptions.every_n_tokens, so the router is what is measured. (Two servers
in one event loop would each accept one call per turn of the loop: the replica
a policy sends more calls would queue them however idle the other, a stall
that is the stand-ins' and not the router's.)
The direct path alternates between the replicas, and the router runs round_robin, which
does the same: what differs is the router alone. (consistent_hash splits the 64 session
keys unevenly, e.g. 36/28, and the replica holding more of them queues while the other
idles: a policy's choice, shown with --policy consistent_hash, not the router's cost.)
The router runs pinned to one core, the load generator and the replicas to the
other (needs 2 cores). glibc's malloc thresholds are raised in every process
(DESIGN.md). CPU time per call is read from /proc for the router and for the
other core's processes: at high concurrency the router keeps up with direct
calls only while its CPU per call stays below the other core's.

Through the router the other core also spends more CPU per call (5-8% at
concurrency 64, up to 13% per message of the long streams) and, being
saturated, sets the routed throughput. That is the cost of crossing cores, not
of what the router sends: per call the same TCP segments go each way as on the
direct path (1 request; 3 response segments: two messages and the trailers),
but each now wakes a thread on the other core, about 3 rescheduling interrupts
per call each way (/proc/interrupts, RES) against none when everything is on
one core. With no router at all, moving the load generator to the other core
costs the replicas 5-7% more CPU per call, as the router does.

Last line: RESULT added_p50_ms_c1=<a> added_p99_ms_c64=<b> throughput_ratio_c64=<c> stream_tokens_ratio=<d>
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import pathlib
import shutil
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from primerl.common.v1 import generation_pb2
from primerl.inference.v1 import inference_pb2
from primerl.router.v1 import router_pb2
from primerl_common.malloc import MALLOC_ENV, reexec_with_malloc_env
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.server import channel_options, server_options

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from cpu_burner import cpu_burner

INFERENCE_SERVICE = "primerl.inference.v1.InferenceService"
INFERENCE_GENERATE = f"/{INFERENCE_SERVICE}/Generate"
ROUTER_GENERATE = "/primerl.router.v1.RouterService/Generate"
ROUTER_CORE, LOAD_CORE = 0, 1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
HERE = pathlib.Path(__file__).resolve()


# ----------------------------------------------------------------------------- instant replicas


class InstantReplica:
    """inference.v1 Generate answered from pre-encoded messages."""

    def __init__(self, replica_id: str) -> None:
        self.replica_id = replica_id
        self._streams: dict[tuple[int, int], list[bytes]] = {}

    def _stream(self, max_tokens: int, every_n: int) -> list[bytes]:
        key = (max_tokens, every_n)
        if key not in self._streams:
            messages = []
            for offset in range(0, max_tokens, every_n):
                count = min(every_n, max_tokens - offset)
                finished = offset + count == max_tokens
                output = generation_pb2.GenerationOutput(
                    request_id="bench",
                    offset=offset,
                    token_ids=[(offset + i) % 256 for i in range(count)],
                    logprobs=[-0.25] * count,
                    policy_versions=[0] * count,
                    finished=finished,
                    finish_reason=generation_pb2.FINISH_REASON_LENGTH if finished else 0,
                    replica_id=self.replica_id,
                )
                messages.append(inference_pb2.GenerateResponse(output=output).SerializeToString())
            self._streams[key] = messages
        return self._streams[key]

    async def generate(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        generation = inference_pb2.GenerateRequest.FromString(request).input
        max_tokens = generation.sampling.max_tokens or 16
        every_n = max_tokens if generation.stream.final_only else (generation.stream.every_n_tokens or 1)
        for message in self._stream(max_tokens, every_n):
            await context.write(message)


async def serve_replica(replica_id: str, port: int) -> None:
    server = grpc.aio.server(options=server_options(64 << 20))
    replica = InstantReplica(replica_id)
    server.add_registered_method_handlers(
        INFERENCE_SERVICE, {"Generate": grpc.unary_stream_rpc_method_handler(replica.generate)}
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    for name in ("", INFERENCE_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


# ----------------------------------------------------------------------------- load generation


@dataclass
class Point:
    """One path at one load: what its measured windows saw, merged."""

    latencies: list[float] = field(default_factory=list)
    messages: int = 0
    window_s: float = 0.0
    router_cpu_s: float = 0.0
    load_cpu_s: float = 0.0

    @property
    def calls_per_s(self) -> float:
        return len(self.latencies) / self.window_s

    def percentile_ms(self, fraction: float) -> float:
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] * 1e3

    def ms_per_call(self, seconds: float) -> float:
        return seconds * 1e3 / len(self.latencies)

    def us_per_message(self, seconds: float) -> float:
        return seconds * 1e6 / self.messages


def request_bytes(*, max_tokens: int, every_n: int, prompt_len: int) -> list[bytes]:
    """A few distinct requests (session keys), as an RL client sends them."""
    requests = []
    for _ in range(64):
        generation = generation_pb2.GenerationInput(
            request_id=uuid.uuid4().hex,
            prompt_token_ids=list(range(prompt_len)),
            sampling=generation_pb2.SamplingParams(max_tokens=max_tokens, temperature=1.0),
            stream=generation_pb2.StreamOptions(every_n_tokens=every_n),
        )
        routing = router_pb2.RoutingHints(session_key=uuid.uuid4().hex)
        requests.append(router_pb2.GenerateRequest(input=generation, routing=routing).SerializeToString())
    return requests


async def drive(
    point: Point,
    methods: list,
    requests: list[bytes],
    *,
    concurrency: int,
    duration_s: float,
    warmup_s: float,
    pids: dict[str, list[int]],
) -> None:
    """Runs `concurrency` callers for warm-up plus duration and adds to `point` what
    happened in the window: the latency of each call that ended in it, the messages
    that arrived in it, and each side's CPU time in it. Tokens are counted as their
    messages arrive: counted when calls end, a 4096-token stream that ends just
    outside the window would not count the tokens it streamed inside it."""
    recording = False
    stop_at = time.perf_counter() + warmup_s + duration_s
    turn = itertools.count()

    async def worker() -> None:
        while time.perf_counter() < stop_at:
            index = next(turn)
            method = methods[index % len(methods)]
            started = time.perf_counter()
            async for _ in method(requests[index % len(requests)]):
                if recording:
                    point.messages += 1
            if recording:
                point.latencies.append(time.perf_counter() - started)

    async def measure() -> None:
        nonlocal recording
        await asyncio.sleep(warmup_s)
        router_before, load_before = cpu_seconds(pids["router"]), cpu_seconds(pids["load"])
        began = time.perf_counter()
        recording = True
        await asyncio.sleep(duration_s)
        recording = False
        point.window_s += time.perf_counter() - began
        point.router_cpu_s += cpu_seconds(pids["router"]) - router_before
        point.load_cpu_s += cpu_seconds(pids["load"]) - load_before

    await asyncio.gather(measure(), *(worker() for _ in range(concurrency)))


async def compare(
    paths: dict[str, list],
    requests: list[bytes],
    *,
    concurrency: int,
    args: argparse.Namespace,
    pids: dict[str, list[int]],
) -> dict[str, Point]:
    """Each path's point, measured in slices that alternate between the paths: a change
    in what else the machine runs then weighs on both paths alike, not on whichever
    ran at that moment."""
    points = {path: Point() for path in paths}
    for _ in range(args.slices):
        for path, methods in paths.items():
            await drive(
                points[path],
                methods,
                requests,
                concurrency=concurrency,
                duration_s=args.duration_s / args.slices,
                warmup_s=args.warmup_s,
                pids=pids,
            )
    return points


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time of the processes, all their threads included."""
    total = 0
    for pid in pids:
        fields = pathlib.Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / CLOCK_TICKS


# ----------------------------------------------------------------------------- main


def write_router_config(path: pathlib.Path, replica_ports: list[int], policy: str) -> None:
    replicas = "\n".join(
        f'[[replicas]]\nreplica_id = "instant-{index}"\naddress = "127.0.0.1:{port}"\n'
        for index, port in enumerate(replica_ports)
    )
    path.write_text(
        f'[policy]\nname = "{policy}"\n\n[observability]\nlog_level = "WARNING"\n\n{replicas}'
        "[routing]\nno_replica_wait_s = 1.0\n"
    )


async def bench(args: argparse.Namespace) -> None:
    replica_ports = [free_port() for _ in range(args.replicas)]
    router_port = free_port()
    env = {**os.environ, **MALLOC_ENV}
    taskset = shutil.which("taskset")
    assert taskset, "needs taskset (util-linux)"
    replicas = [
        ServiceProcess(
            [
                taskset,
                "-c",
                str(LOAD_CORE),
                sys.executable,
                str(HERE),
                "--serve-replica",
                f"instant-{index}",
                str(port),
            ],
            port=port,
            env=env,
        )
        for index, port in enumerate(replica_ports)
    ]
    with tempfile.TemporaryDirectory() as tmp:
        config = pathlib.Path(tmp) / "router.toml"
        write_router_config(config, replica_ports, args.policy)
        router = ServiceProcess(
            [
                taskset,
                "-c",
                str(ROUTER_CORE),
                sys.executable,
                "-m",
                "primerl_router",
                "-c",
                str(config),
                "--server.host",
                "127.0.0.1",
                "--server.port",
                str(router_port),
                "--tls.mode",  # loopback, like the stand-in replicas (bench/tls_overhead.py: mTLS)
                "plaintext",
            ],
            port=router_port,
            env=env,
        )
        async with contextlib.AsyncExitStack() as stack:
            for process in [*replicas, router]:
                await stack.enter_async_context(process)
            await run_all(args, replica_ports, router, replicas, router_port)


async def run_all(
    args: argparse.Namespace,
    replica_ports: list[int],
    router: ServiceProcess,
    replicas: list[ServiceProcess],
    router_port: int,
) -> None:
    options = channel_options(64 << 20)
    direct_channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}", options=options) for p in replica_ports]
    router_channel = grpc.aio.insecure_channel(f"127.0.0.1:{router_port}", options=options)
    direct = [channel.unary_stream(INFERENCE_GENERATE, _registered_method=True) for channel in direct_channels]
    routed = [router_channel.unary_stream(ROUTER_GENERATE, _registered_method=True)]
    # CPU time of each side: the router's core, and the load generator plus the replicas on the other.
    assert router.pid is not None
    router_pids = [router.pid]
    load_pids = [os.getpid()]
    for replica in replicas:
        assert replica.pid is not None
        load_pids.append(replica.pid)

    pids = {"router": router_pids, "load": load_pids}
    paths = {"direct": direct, "router": routed}

    short = request_bytes(max_tokens=args.short_tokens, every_n=args.short_every_n, prompt_len=args.prompt_len)
    print(f"load average before: {os.getloadavg()[0]:.2f}   cores: {os.cpu_count()}   policy: {args.policy}")
    print(
        f"short calls: prompt {args.prompt_len} tokens, {args.short_tokens} tokens back in messages of "
        f"{args.short_every_n}; {args.duration_s:g} s per point, in {args.slices} slices that alternate "
        f"with the other path, each after {args.warmup_s:g} s warm-up"
    )
    print(
        f"{'path':>8} {'conc':>5} {'calls/s':>9} {'p50 ms':>8} {'p99 ms':>8} "
        f"{'router CPU ms/call':>19} {'load core CPU ms/call':>22}"
    )
    results: dict[tuple[str, int], Point] = {}
    for concurrency in args.concurrency:
        points = await compare(paths, short, concurrency=concurrency, args=args, pids=pids)
        for path, point in points.items():
            results[(path, concurrency)] = point
            router_cpu = f"{point.ms_per_call(point.router_cpu_s):.3f}" if path == "router" else ""
            print(
                f"{path:>8} {concurrency:>5} {point.calls_per_s:>9.0f} {point.percentile_ms(0.5):>8.2f} "
                f"{point.percentile_ms(0.99):>8.2f} {router_cpu:>19} {point.ms_per_call(point.load_cpu_s):>22.3f}"
            )

    long = request_bytes(max_tokens=args.stream_tokens, every_n=args.stream_every_n, prompt_len=args.prompt_len)
    print(
        f"long streams: {args.stream_concurrency} at a time, {args.stream_tokens} tokens each in messages of "
        f"{args.stream_every_n}"
    )
    print(f"{'path':>8} {'tokens/s':>12} {'router CPU us/message':>22} {'load core CPU us/message':>25}")
    streams = await compare(paths, long, concurrency=args.stream_concurrency, args=args, pids=pids)
    tokens_per_s = {path: point.messages * args.stream_every_n / point.window_s for path, point in streams.items()}
    for path, point in streams.items():
        router_cpu = f"{point.us_per_message(point.router_cpu_s):.1f}" if path == "router" else ""
        print(f"{path:>8} {tokens_per_s[path]:>12.0f} {router_cpu:>22} {point.us_per_message(point.load_cpu_s):>25.1f}")
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    for channel in [*direct_channels, router_channel]:
        await channel.close()
    added_p50_c1 = results[("router", 1)].percentile_ms(0.5) - results[("direct", 1)].percentile_ms(0.5)
    added_p99_c64 = results[("router", 64)].percentile_ms(0.99) - results[("direct", 64)].percentile_ms(0.99)
    ratio_c64 = results[("router", 64)].calls_per_s / results[("direct", 64)].calls_per_s
    stream_ratio = tokens_per_s["router"] / tokens_per_s["direct"]
    print(
        f"RESULT added_p50_ms_c1={added_p50_c1:.3f} added_p99_ms_c64={added_p99_c64:.3f} "
        f"throughput_ratio_c64={ratio_c64:.3f} stream_tokens_ratio={stream_ratio:.3f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-replica", nargs=2, metavar=("REPLICA_ID", "PORT"), help=argparse.SUPPRESS)
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument(
        "--policy",
        default="round_robin",
        help="the router's policy; round_robin (default) spreads calls as the direct path does, so the "
        "comparison is the router's cost and not a policy's split of the 64 sessions",
    )
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 64, 256])
    # p99 at saturation is set by rare stalls: 6 s per point gave added p99 from -3 to +7 ms between
    # quiet runs of the same code, 18 s in 6 slices 1.5-2.9 ms.
    parser.add_argument("--duration-s", type=float, default=18.0, help="measured seconds per path and point")
    parser.add_argument("--slices", type=int, default=6, help="the duration split in slices that alternate the paths")
    parser.add_argument("--warmup-s", type=float, default=0.5, help="warm-up before each slice")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--short-tokens", type=int, default=16)
    parser.add_argument("--short-every-n", type=int, default=8, help="tokens per message of the short streams")
    parser.add_argument("--stream-tokens", type=int, default=4096)
    parser.add_argument("--stream-every-n", type=int, default=16, help="tokens per message of the long streams")
    parser.add_argument("--stream-concurrency", type=int, default=8)
    parser.add_argument("--burner", action="store_true", help="run beside bench/cpu_burner.py's half-busy process")
    args = parser.parse_args()
    if not {1, 64} <= set(args.concurrency):
        parser.error("--concurrency must include 1 and 64 (the RESULT line compares them)")
    if args.slices < 1:
        parser.error("--slices must be at least 1")
    if args.stream_tokens % args.stream_every_n:
        parser.error("--stream-tokens must be a multiple of --stream-every-n (tokens/s counts messages)")
    if args.serve_replica:
        replica_id, port = args.serve_replica
        asyncio.run(serve_replica(replica_id, int(port)))
        return
    reexec_with_malloc_env()
    if len(os.sched_getaffinity(0)) < 2 or os.cpu_count() < 2:
        sys.exit("needs 2 cores: the router on one, load generator and replicas on the other")
    os.sched_setaffinity(0, {LOAD_CORE})
    with cpu_burner(args.burner) as beside:
        print(beside)
        asyncio.run(bench(args))


if __name__ == "__main__":
    main()
