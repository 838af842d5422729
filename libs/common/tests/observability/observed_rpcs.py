"""A raw-bytes test service whose calls the observability tests observe, and helpers to
call it and read what the server recorded."""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from primerl_common.testing import eventually

SERVICE = "primerl.test.v1.TestService"


class ObservedServicer:
    """Raw-bytes methods of all four kinds, plus the failure modes whose status codes matter."""

    def __init__(self) -> None:
        self.seen_span_ids: list[int] = []  # the span that was current inside each handler
        self.release_stream = asyncio.Event()
        self.echo_metadata: list[tuple[str, str]] = []

    def _note_span(self) -> None:
        self.seen_span_ids.append(trace.get_current_span().get_span_context().span_id)

    async def echo(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        self._note_span()
        self.echo_metadata = [(m.key, m.value) for m in context.invocation_metadata()]
        logging.getLogger("test.echo").info("echo handled")
        return request

    async def count(self, request: bytes, context: grpc.aio.ServicerContext):
        self._note_span()
        yield b"0"
        await self.release_stream.wait()  # the test holds the stream open here
        for i in range(1, int(request)):
            self._note_span()
            yield str(i).encode()

    async def count_by_writes(self, request: bytes, context: grpc.aio.ServicerContext) -> None:
        for i in range(int(request)):
            await context.write(str(i).encode())

    async def total(self, request_iterator, context: grpc.aio.ServicerContext) -> bytes:
        self._note_span()
        return str(sum([int(r) async for r in request_iterator])).encode()

    async def chat(self, request_iterator, context: grpc.aio.ServicerContext):
        async for request in request_iterator:
            self._note_span()
            yield request.upper()

    async def invalid(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "bad field")

    async def boom(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        raise RuntimeError("boom")

    async def stream_boom(self, request: bytes, context: grpc.aio.ServicerContext):
        yield b"first"
        raise RuntimeError("boom mid-stream")

    async def not_found(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        context.set_code(grpc.StatusCode.NOT_FOUND)
        context.set_details("no such thing")
        return b""

    async def not_found_then_raise(self, request: bytes, context: grpc.aio.ServicerContext) -> bytes:
        context.set_code(grpc.StatusCode.NOT_FOUND)
        raise KeyError("missing")

    def generic_handler(self) -> grpc.GenericRpcHandler:
        return grpc.method_handlers_generic_handler(
            SERVICE,
            {
                "Echo": grpc.unary_unary_rpc_method_handler(self.echo),
                "Count": grpc.unary_stream_rpc_method_handler(self.count),
                "CountByWrites": grpc.unary_stream_rpc_method_handler(self.count_by_writes),
                "Total": grpc.stream_unary_rpc_method_handler(self.total),
                "Chat": grpc.stream_stream_rpc_method_handler(self.chat),
                "Invalid": grpc.unary_unary_rpc_method_handler(self.invalid),
                "Boom": grpc.unary_unary_rpc_method_handler(self.boom),
                "StreamBoom": grpc.unary_stream_rpc_method_handler(self.stream_boom),
                "NotFound": grpc.unary_unary_rpc_method_handler(self.not_found),
                "NotFoundThenRaise": grpc.unary_unary_rpc_method_handler(self.not_found_then_raise),
            },
        )


async def recorded(predicate) -> None:
    """For what the server records after the client has its answer: context.abort sends the
    status first and raises afterwards, and client and server share this event loop."""
    await eventually(predicate, timeout_s=5.0, interval_s=0.005, what="the server recorded it")


def rpc(channel: grpc.aio.Channel, kind: str, name: str):
    return getattr(channel, kind)(f"/{SERVICE}/{name}")


def finished_server_span(spans: InMemorySpanExporter, method: str):
    [span] = [s for s in spans.get_finished_spans() if s.name == f"{SERVICE}/{method}"]
    assert span.kind is trace.SpanKind.SERVER
    return span


async def _requests(*items: bytes):
    for item in items:
        yield item


async def call_kind(channel: grpc.aio.Channel, kind: str) -> object:
    if kind == "unary_unary":
        return await rpc(channel, kind, "Echo")(b"hi")
    if kind == "unary_stream":
        return [r async for r in rpc(channel, kind, "CountByWrites")(b"3")]
    if kind == "stream_unary":
        return await rpc(channel, kind, "Total")(_requests(b"1", b"2", b"3"))
    return [r async for r in rpc(channel, kind, "Chat")(_requests(b"a", b"b"))]


KINDS = {
    "unary_unary": ("Echo", b"hi"),
    "unary_stream": ("CountByWrites", [b"0", b"1", b"2"]),
    "stream_unary": ("Total", b"6"),
    "stream_stream": ("Chat", [b"A", b"B"]),
}


def handled_count(registry: CollectorRegistry, method: str, code: str) -> float | None:
    labels = {"service": SERVICE, "method": method, "code": code}
    return registry.get_sample_value("primerl_grpc_server_handled_total", labels)
