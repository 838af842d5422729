"""What mutual TLS costs, against plaintext, in one run: the latency the router path gains at
concurrency 1, and the throughput of a weight push stream.

- Router: `primerl-router` (a process) in front of one instant replica (a process that streams
  pre-encoded inference.v1 Generate answers, bench/router_overhead.py's), the pair once in
  plaintext and once with mutual TLS (certificates made here by primerl_common.security's
  development CA: the router shows its own to the replica, the client an orchestrator's). One
  caller sends Generate calls through each router in slices that alternate the two, so a change
  in what else the machine runs weighs on both alike; added p50 = mTLS p50 - plaintext p50
  (two TLS hops: client -> router -> replica). The two routers run pinned to one core, the two
  replicas to another and the caller to a third (2 cores: the replicas and the caller share
  one), the same cores for both modes: unpinned, where the kernel placed each process moved
  the added p50 by up to 0.2 ms from run to run. The added p50 of each slice is printed too.
  Then one hop alone, for what gRPC's TLS itself costs: the caller calls the mTLS replica
  process straight, on its mTLS port and on a plaintext port it also serves, the two modes
  call by call in turn (one process pair for both: neither mode's processes can be in a
  slower spell than the other's); and the same hop to each mode's own replica process, which
  tells what two processes differ by besides TLS.
- Push: a sink service process (primerl's GrpcService serving inference.v1 UpdateWeights as the
  inference service registers and reads it: requests serialized, each chunk a view of its bytes,
  then dropped) takes UpdateWeights streams of 4 MiB chunks, as the broadcaster
  pushes them, with primerl's channel and server options; GiB/s of each mode in rounds that
  alternate. Three modes: plaintext; mtls, the stream over gRPC's TLS; sealed, the mTLS
  deployment's push path (primerl_common.sealed_streams: sessions opened over mTLS, each round,
  then each stream's chunks sealed with AES-256-GCM in a thread pool and sent to the sink's
  sealed port). RESULT's ratio = sealed / plaintext (medians); mtls / plaintext is printed too. Both
  ends run on this machine: where they use every core (a 2-core box), the throughput is CPU-bound
  and the ratio is what TLS's per-byte work (AES-GCM on each side; TLS records are at most 16 KiB
  whatever the message size) costs against a plaintext path that copies each byte a few times.
  Also printed: CPU seconds per GiB of each mode, both ends together, to tell that cost from a
  bottleneck of the code. Each push is striped over K parallel streams, each on a TCP connection
  of its own (K in --streams): gRPC encrypts and decrypts one connection on one thread per
  direction, so one stream leaves TLS on ~1 core per end; the weight push paths stripe over
  `publish.streams` (trainer) and `push.streams` (broadcaster), both PUSH_STREAMS by default,
  and RESULT's ratio is the one at that K (--push-streams). Per-K rows show the rest.

glibc's malloc thresholds are raised in every process (DESIGN.md).

The push half (the sink, the striped pushes of each mode) lives in bench/tls_push.py.

Last line: RESULT tls_added_p50_ms=<x> tls_push_ratio=<y>
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import shutil
import statistics
import sys
import tempfile
import time

import grpc
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from primerl.inference.v1 import inference_pb2
from primerl.router.v1 import router_pb2
from primerl_common import security
from primerl_common.client import wait_for_serving
from primerl_common.config import TlsConfig
from primerl_common.malloc import MALLOC_ENV, reexec_with_malloc_env
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.server import channel_options, server_options

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from router_overhead import INFERENCE_SERVICE, ROUTER_GENERATE, InstantReplica, request_bytes
from tls_push import (
    MODES,
    PUSH_STREAMS,
    MiB,
    add_port,
    make_certs,
    push_throughput,
    serve_update_sink,
    tls_for,
)

HERE = pathlib.Path(__file__).resolve()
REPLICA_GENERATE = f"/{INFERENCE_SERVICE}/Generate"


async def serve_replica(port: int, tls: TlsConfig, plaintext_port: int | None = None) -> None:
    """The instant replica on `port` (with `tls`), and on `plaintext_port` in plaintext too."""
    server = grpc.aio.server(options=server_options(64 * MiB))
    replica = InstantReplica("instant-0")
    server.add_registered_method_handlers(
        INFERENCE_SERVICE, {"Generate": grpc.unary_stream_rpc_method_handler(replica.generate)}
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_port(server, port, tls)
    if plaintext_port is not None:
        add_port(server, plaintext_port, TlsConfig(mode="plaintext"))
    await server.start()
    for name in ("", INFERENCE_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


async def started(stack: contextlib.AsyncExitStack, process: ServiceProcess, tls: TlsConfig) -> None:
    """Launched, stopped with the stack, and SERVING to a caller showing `tls` (ServiceProcess's
    own wait speaks with this process's identity, which is none here)."""
    process.launch()
    stack.push_async_callback(process.stop)
    stack.callback(process.close)
    assert process.address is not None
    await wait_for_serving(process.address, tls=tls, timeout_s=120)


def latency_cores() -> dict[str, int]:
    """The core of each process on the router path: the same for both modes (where the kernel
    places a process, and so what it shares a core or cache with, moved one mode's p50 against
    the other's by up to 0.2 ms from run to run on the device host: more than TLS's cost)."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) >= 4:
        return {"router": cores[1], "replica": cores[2], "client": cores[3]}
    return {"router": cores[0], "replica": cores[-1], "client": cores[-1]}


def pinned(core: int | None, args: list[str]) -> list[str]:
    if core is None:
        return args
    taskset = shutil.which("taskset")
    assert taskset, "needs taskset (util-linux)"
    return [taskset, "-c", str(core), *args]


def child(
    role: str, port: int, mode: str, certs: pathlib.Path, holder: str, *extra: str, core: int | None = None
) -> ServiceProcess:
    args = [sys.executable, str(HERE), f"--serve-{role}", str(port), "--mode", mode, "--certs", str(certs)]
    return ServiceProcess(pinned(core, [*args, "--holder", holder, *extra]), port=port, env=MALLOC_ENV)


def router_process(
    port: int, replica_port: int, mode: str, certs: pathlib.Path, tmp: pathlib.Path, core: int
) -> ServiceProcess:
    config = tmp / f"router-{mode}.toml"
    config.write_text(
        '[policy]\nname = "round_robin"\n\n[observability]\nlog_level = "WARNING"\n\n'
        f'[[replicas]]\nreplica_id = "instant-0"\naddress = "127.0.0.1:{replica_port}"\n'
        "[routing]\nno_replica_wait_s = 1.0\n"
    )
    tls = ["--tls.mode", mode]
    if mode == "mtls":
        tls += ["--tls.cert", str(certs / "router.pem"), "--tls.key", str(certs / "router-key.pem")]
        tls += ["--tls.ca", str(certs / "ca.pem")]
    args = [sys.executable, "-m", "primerl_router", "-c", str(config), "--server.host", "127.0.0.1"]
    return ServiceProcess(pinned(core, [*args, "--server.port", str(port), *tls]), port=port, env=MALLOC_ENV)


@contextlib.asynccontextmanager
async def generate_calls(ports: dict[str, int], certs: pathlib.Path, method: str, holder: str):
    """Per mode, a function that makes one Generate call (`method`) on that mode's port as
    `holder` and answers its seconds."""
    channels = {
        mode: security.secure_aio_channel(
            f"127.0.0.1:{port}", options=channel_options(64 * MiB), tls=tls_for(mode, certs, holder)
        )
        for mode, port in ports.items()
    }

    def timed(channel: grpc.aio.Channel):
        generate = channel.unary_stream(method, _registered_method=True)

        async def call(request: bytes) -> float:
            began = time.perf_counter()
            async for _ in generate(request):
                pass
            return time.perf_counter() - began

        return call

    try:
        yield {mode: timed(channel) for mode, channel in channels.items()}
    finally:
        for channel in channels.values():
            await channel.close()


async def router_latency(
    ports: dict[str, int], certs: pathlib.Path, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Seconds of each sequential Generate call through each mode's router."""
    requests = request_bytes(max_tokens=args.tokens, every_n=args.every_n, prompt_len=args.prompt_len)
    latencies: dict[str, list[float]] = {mode: [] for mode in ports}
    async with generate_calls(ports, certs, ROUTER_GENERATE, "orchestrator") as call:
        for slice_index in range(args.slices):
            for mode in ports:
                for index in range(args.warmup_calls + args.calls // args.slices):
                    seconds = await call[mode](requests[index % len(requests)])
                    if index >= args.warmup_calls:
                        latencies[mode].append(seconds)
            print(f"  router slice {slice_index + 1}/{args.slices} done", flush=True)
    return latencies


async def hop_latency(ports: dict[str, int], certs: pathlib.Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """Seconds of each Generate call straight to one replica process (`ports`: its plaintext and
    its mTLS port), the modes taken call by call in turn: what gRPC's TLS adds to one hop, with
    no process of either mode in a slower spell than the other's."""
    routed = request_bytes(max_tokens=args.tokens, every_n=args.every_n, prompt_len=args.prompt_len)
    requests = [
        inference_pb2.GenerateRequest(input=router_pb2.GenerateRequest.FromString(r).input).SerializeToString()
        for r in routed
    ]
    latencies: dict[str, list[float]] = {mode: [] for mode in ports}
    async with generate_calls(ports, certs, REPLICA_GENERATE, "router") as call:
        for index in range(args.warmup_calls + args.calls):
            order = list(ports) if index % 2 else list(reversed(ports))
            for mode in order:
                seconds = await call[mode](requests[index % len(requests)])
                if index >= args.warmup_calls:
                    latencies[mode].append(seconds)
    return latencies


def print_hop(what: str, latencies: dict[str, list[float]]) -> None:
    plaintext, mtls = (percentile_ms(latencies[mode], 0.5) for mode in ("plaintext", "mtls"))
    print(
        f"{what}, call by call in turn ({len(latencies['mtls'])} each): p50 {plaintext:.3f} / {mtls:.3f} ms: "
        f"mTLS adds {mtls - plaintext:.3f} ms a hop ({2 * (mtls - plaintext):.3f} for the router path's two)"
    )


def percentile_ms(values: list[float], fraction: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * fraction))] * 1e3


async def bench(args: argparse.Namespace) -> None:
    print(f"load average before: {os.getloadavg()[0]:.2f}   cores: {os.cpu_count()}")
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = pathlib.Path(tmp_name)
        certs = tmp / "certs"
        make_certs(certs)
        async with contextlib.AsyncExitStack() as stack:
            routers, sinks, sink_processes = {}, {}, {}
            cores = latency_cores()
            # The mTLS replica also serves a plaintext port: the one-hop measurement's.
            hop_ports, replica_ports = {"plaintext": free_port()}, {}
            for mode in MODES:
                replica_port, router_port, sink_port = free_port(), free_port(), free_port()
                sealed_port = ["--sealed-port", str(free_port())] if mode == "mtls" else []
                sink = child("sink", sink_port, mode, certs, "inference-0", *sealed_port)
                also = ["--plaintext-port", str(hop_ports["plaintext"])] if mode == "mtls" else []
                hop_ports.setdefault(mode, replica_port)
                replica_ports[mode] = replica_port
                for process, tls in (
                    (
                        child("replica", replica_port, mode, certs, "inference-0", *also, core=cores["replica"]),
                        tls_for(mode, certs, "router"),
                    ),
                    (
                        router_process(router_port, replica_port, mode, certs, tmp, cores["router"]),
                        tls_for(mode, certs, "orchestrator"),
                    ),
                    (sink, tls_for(mode, certs, "trainer")),
                ):
                    await started(stack, process, tls)
                routers[mode], sinks[mode] = router_port, sink_port
                sink_processes[mode] = psutil.Process(sink.pid)
            print(
                f"router: {args.calls} sequential Generate calls per mode ({args.tokens} tokens in messages of "
                f"{args.every_n}, prompt {args.prompt_len}), in {args.slices} alternating slices"
            )
            print(f"cores: router {cores['router']}, replica {cores['replica']}, caller {cores['client']} (both modes)")
            everywhere = os.sched_getaffinity(0)
            os.sched_setaffinity(0, {cores["client"]})
            latencies = await router_latency(routers, certs, args) if args.calls else {}
            hops = await hop_latency(hop_ports, certs, args) if args.calls else {}
            # The same hop, each mode to its own replica process (as the router path's modes are).
            apart = await hop_latency(replica_ports, certs, args) if args.calls else {}
            os.sched_setaffinity(0, everywhere)
            print(f"{'mode':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
            for mode, values in latencies.items():
                print(
                    f"{mode:>10} {percentile_ms(values, 0.5):>8.3f} {percentile_ms(values, 0.9):>8.3f} "
                    f"{percentile_ms(values, 0.99):>8.3f}"
                )
            if hops:
                print_hop("one hop, straight to the mTLS replica process on its plaintext and its mTLS port", hops)
                print_hop("one hop, to each mode's own replica process (two processes' difference too)", apart)
            if latencies:
                per_slice = args.calls // args.slices
                added = [
                    percentile_ms(latencies["mtls"][i : i + per_slice], 0.5)
                    - percentile_ms(latencies["plaintext"][i : i + per_slice], 0.5)
                    for i in range(0, per_slice * args.slices, per_slice)
                ]
                print(f"added p50 of each slice (ms): {' '.join(f'{value:.3f}' for value in added)}")
            print(
                f"push: {args.rounds} rounds per mode and K of {args.push_mib} MiB in {args.message_mib} MiB "
                f"messages over K parallel connections, K in {args.streams}"
            )
            rates, cpu_per_gib, busiest = await push_throughput(sinks, sink_processes, certs, args)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print("busiest thread: CPU s/GiB of the sender's and the sink's busiest thread (medians): 1/that is the most")
    print("  GiB/s that end reaches with cores to spare, whatever its other threads do")
    print(f"{'mode':>10} {'K':>2} {'GiB/s (median)':>15} {'CPU s/GiB':>10} {'busiest thread':>15}   rounds GiB/s")
    for (mode, k), values in sorted(rates.items(), key=lambda item: (item[0][1], item[0][0])):
        sender, receiver = (statistics.median(end) for end in zip(*busiest[(mode, k)], strict=True))
        cpu = statistics.median(cpu_per_gib[(mode, k)])
        print(
            f"{mode:>10} {k:>2} {statistics.median(values):>15.2f} {cpu:>10.2f} {sender:>7.2f} {receiver:>7.2f}"
            f"   {' '.join(f'{v:.2f}' for v in values)}"
        )
    for k in args.streams:
        plaintext = statistics.median(rates[("plaintext", k)])
        mtls, sealed = statistics.median(rates[("mtls", k)]), statistics.median(rates[("sealed", k)])
        print(f"ratio K={k}: sealed / plaintext = {sealed / plaintext:.3f}   mtls (gRPC's TLS) / plaintext = "
              f"{mtls / plaintext:.3f}")  # fmt: skip
    added_p50 = (
        percentile_ms(latencies["mtls"], 0.5) - percentile_ms(latencies["plaintext"], 0.5)
        if latencies
        else float("nan")
    )
    k = args.push_streams
    ratio = statistics.median(rates[("sealed", k)]) / statistics.median(rates[("plaintext", k)])
    print(f"push path's K = {k}; the ratio is sealed / plaintext (an mTLS deployment's push path)")
    print(f"RESULT tls_added_p50_ms={added_p50:.3f} tls_push_ratio={ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-replica", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--serve-sink", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--certs", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--holder", help=argparse.SUPPRESS)
    parser.add_argument("--sealed-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--plaintext-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--calls", type=int, default=3000, help="measured Generate calls per mode")
    parser.add_argument("--slices", type=int, default=6, help="the calls split in slices that alternate the modes")
    parser.add_argument("--warmup-calls", type=int, default=50, help="unmeasured calls before each slice")
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=16)
    parser.add_argument("--every-n", type=int, default=8, help="tokens per message")
    parser.add_argument("--push-mib", type=int, default=1024, help="MiB per push round")
    parser.add_argument("--message-mib", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3, help="push rounds per mode and K")
    parser.add_argument(
        "--streams",
        type=lambda text: [int(k) for k in text.split(",")],
        default=[1, 2, 4, 8],
        help="numbers K of parallel push connections, comma-separated",
    )
    parser.add_argument(
        "--push-streams", type=int, default=PUSH_STREAMS, help="the K of the RESULT ratio (the push path's default)"
    )
    args = parser.parse_args()
    if args.serve_replica or args.serve_sink:
        tls = tls_for(args.mode, args.certs, args.holder)
        if args.serve_replica:
            serve = serve_replica(args.serve_replica, tls, args.plaintext_port)
        else:
            serve = serve_update_sink(args.serve_sink, tls, args.sealed_port)
        asyncio.run(serve)
        return
    if (args.calls and args.calls < args.slices) or args.push_mib < args.message_mib:
        parser.error("--calls must be 0 or at least --slices and --push-mib at least --message-mib")
    if args.push_streams not in args.streams or min(args.streams) < 1:
        parser.error("--streams must hold --push-streams, each at least 1")
    reexec_with_malloc_env()
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
