"""bench/tls_overhead.py's push half, and the pieces its two halves (and bench/tls_transports.py)
share: the certificates, each mode's TLS settings, the push sink (an UpdateWeights service read
as the inference service reads it) and the striped push of each mode (plaintext, gRPC's mTLS,
sealed), with the CPU each end spends. bench/tls_overhead.py says what is measured."""

from __future__ import annotations

import argparse
import asyncio
import os
import pathlib
import time

import grpc
import psutil
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from router_overhead import INFERENCE_SERVICE  # bench/ is on the path of whoever imports this

from primerl.common.v1 import tensor_pb2
from primerl.inference.v1 import inference_pb2, inference_pb2_grpc
from primerl_common import security
from primerl_common.config import ServiceConfig, TlsConfig, service_settings
from primerl_common.sealed_streams import SealedCaller
from primerl_common.security.certificates import Holder, make_authority, make_certificate, tls_of
from primerl_common.server import GrpcService, ServiceDefinition, channel_options, server_options
from primerl_common.stripes import DEFAULT_STREAMS
from primerl_inference.update_requests import add_inference_service, parse_update_request

SINK_PUSH = "/bench.Sink/Push"
UPDATE_WEIGHTS = f"/{INFERENCE_SERVICE}/UpdateWeights"
PUSH_MODES = ("plaintext", "mtls", "sealed")
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


class SinkConfig(ServiceConfig):
    """The push sink's config."""

    service_name = "sink"
    model_config = service_settings("sink")


class DrainingReplica(inference_pb2_grpc.InferenceServiceServicer):
    """Takes UpdateWeights streams as the inference service does (serialized, each chunk read
    from its bytes: primerl_inference.update_requests) and drops their chunks (its other
    methods: UNIMPLEMENTED)."""

    async def UpdateWeights(self, request_iterator, context):
        async for raw in request_iterator:
            parse_update_request(raw)
        return inference_pb2.UpdateWeightsResponse()


async def serve_update_sink(port: int, tls: TlsConfig, sealed_port: int | None) -> None:
    descriptor = inference_pb2.DESCRIPTOR.services_by_name["InferenceService"]
    definition = ServiceDefinition(
        name="sink",
        version="0",
        servicers=[(add_inference_service, DrainingReplica(), descriptor)],
        permissions={f"/{descriptor.full_name}/{method.name}": security.ANY for method in descriptor.methods},
        sealed_methods=[UPDATE_WEIGHTS],
    )
    server = {"host": "127.0.0.1", "port": port, "sealed_port": sealed_port}
    service = GrpcService(definition, SinkConfig(server=server, tls=tls))
    await service.start()
    await service.wait_for_termination()


def cpu_s(sink: psutil.Process) -> float:
    """CPU seconds so far of this process (the pushing client) and the sink process."""
    own, theirs = os.times(), sink.cpu_times()
    return own.user + own.system + theirs.user + theirs.system


def thread_cpu(process: psutil.Process) -> dict[int, float]:
    return {thread.id: thread.user_time + thread.system_time for thread in process.threads()}


def busiest_thread_s(before: dict[int, float], after: dict[int, float]) -> float:
    """CPU seconds of the thread of a process that used the most between two snapshots."""
    return max((seconds - before.get(thread, 0.0) for thread, seconds in after.items()), default=0.0)


def striped_channel(address: str, mode: str, certs: pathlib.Path, stripe: int) -> grpc.aio.Channel:
    """A channel with a TCP connection of its own: a local subchannel pool (and a distinct
    argument) so that gRPC does not share one connection between the stripes."""
    options = [*channel_options(64 * MiB), ("grpc.use_local_subchannel_pool", 1), ("primerl.stripe", stripe)]
    return security.secure_aio_channel(address, options=options, tls=tls_for(mode, certs, "trainer"))


async def push_throughput(
    ports: dict[str, int], sinks: dict[str, psutil.Process], certs: pathlib.Path, args: argparse.Namespace
) -> tuple[dict, dict, dict]:
    """GiB/s of each push round to each mode's sink over K parallel streams (K in args.streams;
    the chunks dealt round-robin to the K streams), its CPU seconds per GiB (both ends) and the
    CPU seconds per GiB of each end's busiest thread.
    `ports`: the plaintext sink's port, the mTLS sink's (which serves the sealed port too)."""
    chunk = tensor_pb2.TensorChunk(data=os.urandom(args.message_mib * MiB))
    message = inference_pb2.UpdateWeightsRequest(chunk=chunk).SerializeToString()
    num_messages = args.push_mib // args.message_mib
    # A push reads a whole version's bytes, each once: the messages of a round are distinct
    # buffers (not one message sent again, which stays in the L3 cache and flatters the copies).
    distinct = [bytes(bytearray(message)) for _ in range(num_messages)]
    keys = [(mode, k) for k in args.streams for mode in PUSH_MODES]
    rates: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    cpu_per_gib: dict[tuple[str, int], list[float]] = {key: [] for key in keys}
    busiest: dict[tuple[str, int], list[tuple[float, float]]] = {key: [] for key in keys}
    address = {"plaintext": f"127.0.0.1:{ports['plaintext']}", "mtls": f"127.0.0.1:{ports['mtls']}"}
    channels = {
        (mode, k): [striped_channel(address[mode], mode, certs, stripe) for stripe in range(k)]
        for mode, k in keys
        if mode != "sealed"
    }
    control = striped_channel(address["mtls"], "mtls", certs, -1)
    sealed = SealedCaller(control, "127.0.0.1", options=channel_options(64 * MiB))
    for stripes in [*channels.values(), [control]]:  # connect (and handshake) before timing
        for channel in stripes:
            await asyncio.wait_for(channel.channel_ready(), 60)

    async def messages(stripe: int, k: int):
        for index in range(stripe, num_messages, k):
            yield distinct[index]

    async def push(mode: str, k: int) -> None:
        if mode != "sealed":
            calls = [
                channel.stream_unary(UPDATE_WEIGHTS, _registered_method=True)(messages(stripe, k))
                for stripe, channel in enumerate(channels[(mode, k)])
            ]
        else:
            opened = await sealed.open(UPDATE_WEIGHTS, k, timeout_s=30)
            if opened is None:
                raise RuntimeError(f"the sink takes no sealed streams: {sealed.unavailable}")
            port, stream_keys = opened
            calls = [
                sealed.call(port, key, stripe, messages(stripe, k), inference_pb2.UpdateWeightsResponse, timeout_s=600)
                for stripe, key in enumerate(stream_keys)
            ]
        await asyncio.gather(*calls)

    await push("sealed", max(args.streams))  # the sealed port's connections, before timing
    for _ in range(args.rounds):
        for mode, k in keys:
            sink = sinks["plaintext" if mode == "plaintext" else "mtls"]
            threads_before = [thread_cpu(psutil.Process()), thread_cpu(sink)]
            cpu_before, began = cpu_s(sink), time.perf_counter()
            await push(mode, k)
            gib = num_messages * args.message_mib / 1024
            rates[(mode, k)].append(gib / (time.perf_counter() - began))
            cpu_per_gib[(mode, k)].append((cpu_s(sink) - cpu_before) / gib)
            sender, receiver = (
                busiest_thread_s(before, thread_cpu(end)) / gib
                for before, end in zip(threads_before, [psutil.Process(), sink], strict=True)
            )
            busiest[(mode, k)].append((sender, receiver))
    for stripes in [*channels.values(), [control]]:
        for channel in stripes:
            await channel.close()
    await sealed.close()
    return rates, cpu_per_gib, busiest
