"""What mutual TLS costs, against plaintext, in one run: the latency the router path gains at
concurrency 1, and the throughput of a weight push stream.

- Router: `primerl-router` (a process) in front of one instant replica (a process that streams
  pre-encoded inference.v1 Generate answers, bench/router_overhead.py's), the pair once in
  plaintext and once with mutual TLS (certificates made here by primerl_common.security's
  development CA: the router shows its own to the replica, the client an orchestrator's). One
  caller sends Generate calls through each router in slices that alternate the two, so a change
  in what else the machine runs weighs on both alike; added p50 = mTLS p50 - plaintext p50
  (two TLS hops: client -> router -> replica).
- Push: a sink server process takes a client stream of 4 MiB `bytes` messages, the transport of
  PublishWeights and UpdateWeights (whose chunks are 4 MiB too), with primerl's channel and server
  options; GiB/s of each mode in rounds that alternate; ratio = mTLS / plaintext (medians). Both
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

Last line: RESULT tls_added_p50_ms=<x> tls_push_ratio=<y>
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import pathlib
import statistics
import sys
import tempfile
import time

import grpc
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from primerl_common import security
from primerl_common.client import wait_for_serving
from primerl_common.config import TlsConfig
from primerl_common.malloc import MALLOC_ENV, reexec_with_malloc_env
from primerl_common.processes import ServiceProcess, free_port
from primerl_common.security.certificates import Holder, make_authority, make_certificate, tls_of
from primerl_common.server import channel_options, server_options
from primerl_common.stripes import DEFAULT_STREAMS

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from router_overhead import INFERENCE_SERVICE, ROUTER_GENERATE, InstantReplica, request_bytes

HERE = pathlib.Path(__file__).resolve()
SINK_PUSH = "/bench.Sink/Push"
MiB = 1 << 20
MODES = ("plaintext", "mtls")
# The default of the trainer's publish.streams and the broadcaster's push.streams.
PUSH_STREAMS = DEFAULT_STREAMS


def make_certs(directory: pathlib.Path) -> None:
    authority = make_authority(directory)
    for text in ("router", "inference-0", "orchestrator", "trainer", "weight_broadcaster"):
        make_certificate(authority, directory, Holder.parse(text))


def tls_for(mode: str, certs: pathlib.Path, holder: str) -> TlsConfig:
    return tls_of(certs, holder) if mode == "mtls" else TlsConfig(mode="plaintext")


def add_port(server: grpc.aio.Server, port: int, tls: TlsConfig) -> None:
    address = f"127.0.0.1:{port}"
    if tls.mode == "mtls":
        server.add_secure_port(address, security.server_credentials(tls))
    else:
        server.add_insecure_port(address)


async def serve_replica(port: int, tls: TlsConfig) -> None:
    server = grpc.aio.server(options=server_options(64 * MiB))
    replica = InstantReplica("instant-0")
    server.add_registered_method_handlers(
        INFERENCE_SERVICE, {"Generate": grpc.unary_stream_rpc_method_handler(replica.generate)}
    )
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_port(server, port, tls)
    await server.start()
    for name in ("", INFERENCE_SERVICE):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


async def serve_sink(port: int, tls: TlsConfig) -> None:
    async def push(request_iterator, context: grpc.aio.ServicerContext) -> bytes:
        async for _ in request_iterator:
            pass
        return b""

    server = grpc.aio.server(options=server_options(64 * MiB))
    server.add_registered_method_handlers("bench.Sink", {"Push": grpc.stream_unary_rpc_method_handler(push)})
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    add_port(server, port, tls)
    await server.start()
    await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
    await server.wait_for_termination()


async def started(stack: contextlib.AsyncExitStack, process: ServiceProcess, tls: TlsConfig) -> None:
    """Launched, stopped with the stack, and SERVING to a caller showing `tls` (ServiceProcess's
    own wait speaks with this process's identity, which is none here)."""
    process.launch()
    stack.push_async_callback(process.stop)
    stack.callback(process.close)
    assert process.address is not None
    await wait_for_serving(process.address, tls=tls, timeout_s=120)


def child(role: str, port: int, mode: str, certs: pathlib.Path, holder: str) -> ServiceProcess:
    args = [sys.executable, str(HERE), f"--serve-{role}", str(port), "--mode", mode, "--certs", str(certs)]
    return ServiceProcess([*args, "--holder", holder], port=port, env=MALLOC_ENV)


def router_process(port: int, replica_port: int, mode: str, certs: pathlib.Path, tmp: pathlib.Path) -> ServiceProcess:
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
    return ServiceProcess([*args, "--server.port", str(port), *tls], port=port, env=MALLOC_ENV)


async def router_latency(
    ports: dict[str, int], certs: pathlib.Path, args: argparse.Namespace
) -> dict[str, list[float]]:
    """Seconds of each sequential Generate call through each mode's router."""
    channels = {
        mode: security.secure_aio_channel(
            f"127.0.0.1:{port}", options=channel_options(64 * MiB), tls=tls_for(mode, certs, "orchestrator")
        )
        for mode, port in ports.items()
    }
    generate = {
        mode: channel.unary_stream(ROUTER_GENERATE, _registered_method=True) for mode, channel in channels.items()
    }
    requests = request_bytes(max_tokens=args.tokens, every_n=args.every_n, prompt_len=args.prompt_len)
    latencies: dict[str, list[float]] = {mode: [] for mode in ports}
    for slice_index in range(args.slices):
        for mode in ports:
            for index in range(args.warmup_calls + args.calls // args.slices):
                began = time.perf_counter()
                async for _ in generate[mode](requests[index % len(requests)]):
                    pass
                if index >= args.warmup_calls:
                    latencies[mode].append(time.perf_counter() - began)
        print(f"  router slice {slice_index + 1}/{args.slices} done", flush=True)
    for channel in channels.values():
        await channel.close()
    return latencies


def cpu_s(sink: psutil.Process) -> float:
    """CPU seconds so far of this process (the pushing client) and the sink process."""
    own, theirs = os.times(), sink.cpu_times()
    return own.user + own.system + theirs.user + theirs.system


def striped_channel(address: str, mode: str, certs: pathlib.Path, stripe: int) -> grpc.aio.Channel:
    """A channel with a TCP connection of its own: a local subchannel pool (and a distinct
    argument) so that gRPC does not share one connection between the stripes."""
    options = [*channel_options(64 * MiB), ("grpc.use_local_subchannel_pool", 1), ("primerl.stripe", stripe)]
    return security.secure_aio_channel(address, options=options, tls=tls_for(mode, certs, "trainer"))


async def push_throughput(
    ports: dict[str, int], sinks: dict[str, psutil.Process], certs: pathlib.Path, args: argparse.Namespace
) -> tuple[dict[tuple[str, int], list[float]], dict[tuple[str, int], list[float]]]:
    """GiB/s of each push round to each mode's sink over K parallel connections (K in
    args.streams; the messages dealt round-robin to the K streams), and its CPU seconds per GiB
    (both ends)."""
    payload = os.urandom(args.message_mib * MiB)
    num_messages = args.push_mib // args.message_mib
    keys = [(mode, k) for k in args.streams for mode in ports]
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    cpu_per_gib: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    channels = {
        (mode, k): [striped_channel(f"127.0.0.1:{ports[mode]}", mode, certs, stripe) for stripe in range(k)]
        for mode, k in keys
    }
    for stripes in channels.values():  # connect (and handshake) before timing
        for channel in stripes:
            await asyncio.wait_for(channel.channel_ready(), 60)

    async def messages(stripe: int, k: int):
        for _ in range(stripe, num_messages, k):
            yield payload

    for _ in range(args.rounds):
        for mode, k in keys:
            cpu_before, began = cpu_s(sinks[mode]), time.perf_counter()
            await asyncio.gather(
                *(
                    channel.stream_unary(SINK_PUSH, _registered_method=True)(messages(stripe, k))
                    for stripe, channel in enumerate(channels[(mode, k)])
                )
            )
            gib = num_messages * len(payload) / (1 << 30)
            rates[(mode, k)].append(gib / (time.perf_counter() - began))
            cpu_per_gib[(mode, k)].append((cpu_s(sinks[mode]) - cpu_before) / gib)
    for stripes in channels.values():
        for channel in stripes:
            await channel.close()
    return rates, cpu_per_gib


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
            for mode in MODES:
                replica_port, router_port, sink_port = free_port(), free_port(), free_port()
                sink = child("sink", sink_port, mode, certs, "weight_broadcaster")
                for process, tls in (
                    (child("replica", replica_port, mode, certs, "inference-0"), tls_for(mode, certs, "router")),
                    (router_process(router_port, replica_port, mode, certs, tmp), tls_for(mode, certs, "orchestrator")),
                    (sink, tls_for(mode, certs, "trainer")),
                ):
                    await started(stack, process, tls)
                routers[mode], sinks[mode] = router_port, sink_port
                sink_processes[mode] = psutil.Process(sink.pid)
            print(
                f"router: {args.calls} sequential Generate calls per mode ({args.tokens} tokens in messages of "
                f"{args.every_n}, prompt {args.prompt_len}), in {args.slices} alternating slices"
            )
            latencies = await router_latency(routers, certs, args) if args.calls else {}
            print(f"{'mode':>10} {'p50 ms':>8} {'p90 ms':>8} {'p99 ms':>8}")
            for mode, values in latencies.items():
                print(
                    f"{mode:>10} {percentile_ms(values, 0.5):>8.3f} {percentile_ms(values, 0.9):>8.3f} "
                    f"{percentile_ms(values, 0.99):>8.3f}"
                )
            print(
                f"push: {args.rounds} rounds per mode and K of {args.push_mib} MiB in {args.message_mib} MiB "
                f"messages over K parallel connections, K in {args.streams}"
            )
            rates, cpu_per_gib = await push_throughput(sinks, sink_processes, certs, args)
    print(f"load average after: {os.getloadavg()[0]:.2f}")
    print(f"{'mode':>10} {'K':>2} {'GiB/s (median)':>15} {'CPU s/GiB':>10}   rounds GiB/s | CPU s/GiB both ends")
    for (mode, k), values in sorted(rates.items(), key=lambda item: (item[0][1], item[0][0])):
        print(
            f"{mode:>10} {k:>2} {statistics.median(values):>15.2f} {statistics.median(cpu_per_gib[(mode, k)]):>10.2f}"
            f"   {' '.join(f'{v:.2f}' for v in values)} | {' '.join(f'{v:.2f}' for v in cpu_per_gib[(mode, k)])}"
        )
    baseline = statistics.median(rates[("plaintext", 1)]) if ("plaintext", 1) in rates else None
    for k in args.streams:
        mtls = statistics.median(rates[("mtls", k)])
        against_one = f"   mtls K={k} / plaintext K=1 = {mtls / baseline:.3f}" if baseline else ""
        print(f"ratio K={k}: mtls / plaintext = {mtls / statistics.median(rates[('plaintext', k)]):.3f}{against_one}")
    added_p50 = (
        percentile_ms(latencies["mtls"], 0.5) - percentile_ms(latencies["plaintext"], 0.5)
        if latencies
        else float("nan")
    )
    k = args.push_streams
    ratio = statistics.median(rates[("mtls", k)]) / statistics.median(rates[("plaintext", k)])
    print(f"push path's K = {k}")
    print(f"RESULT tls_added_p50_ms={added_p50:.3f} tls_push_ratio={ratio:.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--serve-replica", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--serve-sink", type=int, metavar="PORT", help=argparse.SUPPRESS)
    parser.add_argument("--mode", choices=MODES, help=argparse.SUPPRESS)
    parser.add_argument("--certs", type=pathlib.Path, help=argparse.SUPPRESS)
    parser.add_argument("--holder", help=argparse.SUPPRESS)
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
        serve = serve_replica(args.serve_replica, tls) if args.serve_replica else serve_sink(args.serve_sink, tls)
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
