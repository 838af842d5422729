"""primerl_common.observability against a real grpc.aio server on 127.0.0.1:0 and real channels."""

from __future__ import annotations

import asyncio
import functools
import io
import json
import logging
import urllib.request

import grpc
import grpc.aio
import pytest
import pytest_asyncio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from prometheus_client import CollectorRegistry

from primerl_common import observability
from primerl_common.observability import (
    client_interceptors,
    policy_version_var,
    server_interceptors,
    setup_logging,
    setup_observability,
    setup_tracing,
    start_metrics_server,
)
from primerl_common.testing import bare_server, eventually

SERVICE = "primerl.test.v1.TestService"


class _TestServicer:
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


@pytest.fixture
def spans() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracer_provider(spans: InMemorySpanExporter) -> TracerProvider:
    # Our own provider: OTel's global one can be set once per process, and setup_tracing owns it.
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    return provider


@pytest.fixture
def registry() -> CollectorRegistry:
    return CollectorRegistry()


@pytest.fixture
def servicer() -> _TestServicer:
    return _TestServicer()


@pytest_asyncio.fixture
async def channel(tracer_provider, registry, servicer):
    async with (
        bare_server(
            lambda server: server.add_generic_rpc_handlers([servicer.generic_handler()]),
            functools.partial(health_pb2_grpc.add_HealthServicer_to_server, health_aio.HealthServicer()),
            interceptors=server_interceptors(tracer_provider=tracer_provider, registry=registry),
        ) as address,
        grpc.aio.insecure_channel(address, interceptors=client_interceptors()) as channel,
    ):
        yield channel


@pytest.fixture
def root_logger():
    """Leaves the root logger as it found it (pytest's own capture handlers included)."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield root
    root.handlers[:] = handlers
    root.setLevel(level)


async def _eventually(predicate) -> None:
    """For what the server records after the client has its answer: context.abort sends the
    status first and raises afterwards, and client and server share this event loop."""
    await eventually(predicate, timeout_s=5.0, interval_s=0.005, what="the server recorded it")


def _method(channel: grpc.aio.Channel, kind: str, name: str):
    return getattr(channel, kind)(f"/{SERVICE}/{name}")


def _server_span(spans: InMemorySpanExporter, method: str):
    [span] = [s for s in spans.get_finished_spans() if s.name == f"{SERVICE}/{method}"]
    assert span.kind is trace.SpanKind.SERVER
    return span


async def _requests(*items: bytes):
    for item in items:
        yield item


async def _call(channel: grpc.aio.Channel, kind: str) -> object:
    if kind == "unary_unary":
        return await _method(channel, kind, "Echo")(b"hi")
    if kind == "unary_stream":
        return [r async for r in _method(channel, kind, "CountByWrites")(b"3")]
    if kind == "stream_unary":
        return await _method(channel, kind, "Total")(_requests(b"1", b"2", b"3"))
    return [r async for r in _method(channel, kind, "Chat")(_requests(b"a", b"b"))]


KINDS = {
    "unary_unary": ("Echo", b"hi"),
    "unary_stream": ("CountByWrites", [b"0", b"1", b"2"]),
    "stream_unary": ("Total", b"6"),
    "stream_stream": ("Chat", [b"A", b"B"]),
}


# ----------------------------------------------------------------------------- tracing


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_client_span_is_parent_of_server_span(channel, tracer_provider, spans, kind):
    method, expected = KINDS[kind]
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("client", kind=trace.SpanKind.CLIENT) as client_span:
        assert await _call(channel, kind) == expected
    server_span = _server_span(spans, method)
    client_context = client_span.get_span_context()
    assert server_span.context.trace_id == client_context.trace_id
    assert server_span.parent is not None and server_span.parent.span_id == client_context.span_id
    assert server_span.parent.is_remote
    assert server_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert server_span.attributes["rpc.service"] == SERVICE and server_span.attributes["rpc.method"] == method
    assert server_span.status.status_code is trace.StatusCode.UNSET


@pytest.mark.asyncio
async def test_handler_runs_inside_server_span(channel, servicer, spans):
    await _call(channel, "stream_stream")
    await _call(channel, "stream_unary")
    assert servicer.seen_span_ids == [_server_span(spans, "Chat").context.span_id] * 2 + [
        _server_span(spans, "Total").context.span_id
    ]


@pytest.mark.asyncio
async def test_client_interceptor_keeps_caller_metadata(channel, tracer_provider, servicer):
    metadata = grpc.aio.Metadata(("x-request-id", "r-1"))
    with tracer_provider.get_tracer("test").start_as_current_span("client"):
        await _method(channel, "unary_unary", "Echo")(b"hi", metadata=metadata)
    keys = [key for key, _ in servicer.echo_metadata]
    assert ("x-request-id", "r-1") in servicer.echo_metadata and keys.count("traceparent") == 1
    assert list(metadata) == [("x-request-id", "r-1")]  # the caller's object is left as it was


@pytest.mark.asyncio
async def test_call_without_client_span_starts_a_new_trace(channel, spans):
    await _call(channel, "unary_unary")
    assert _server_span(spans, "Echo").parent is None


@pytest.mark.asyncio
async def test_streaming_span_covers_the_whole_stream(channel, servicer, spans):
    call = _method(channel, "unary_stream", "Count")(b"3")
    assert await call.read() == b"0"
    assert not spans.get_finished_spans()  # the handler is parked between messages: span still open
    servicer.release_stream.set()
    assert [await call.read(), await call.read()] == [b"1", b"2"]
    assert await call.read() is grpc.aio.EOF
    span = _server_span(spans, "Count")
    assert span.attributes["rpc.grpc.status_code"] == 0
    # Every message was produced with the same span current, so the span spans the stream.
    assert set(servicer.seen_span_ids) == {span.context.span_id} and len(servicer.seen_span_ids) == 3


@pytest.mark.asyncio
async def test_failed_calls_mark_span_as_error(channel, spans):
    for name in ("Invalid", "Boom"):
        with pytest.raises(grpc.aio.AioRpcError):
            await _method(channel, "unary_unary", name)(b"")
    await _eventually(lambda: len(spans.get_finished_spans()) == 2)
    invalid, boom = _server_span(spans, "Invalid"), _server_span(spans, "Boom")
    assert invalid.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert invalid.status.status_code is trace.StatusCode.ERROR
    assert not invalid.events  # an abort is an answer, not a crash
    assert boom.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNKNOWN.value[0]
    assert [event.name for event in boom.events] == ["exception"]
    assert boom.events[0].attributes["exception.type"] == "RuntimeError"


# ----------------------------------------------------------------------------- metrics


def _handled(registry: CollectorRegistry, method: str, code: str) -> float | None:
    labels = {"service": SERVICE, "method": method, "code": code}
    return registry.get_sample_value("primerl_grpc_server_handled_total", labels)


@pytest.mark.asyncio
async def test_status_codes_counted_as_the_client_sees_them(channel, registry):
    for name in ("Invalid", "Boom", "NotFound", "NotFoundThenRaise"):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _method(channel, "unary_unary", name)(b"")
        seen = error.value.code().name
        await _eventually(lambda name=name, seen=seen: _handled(registry, name, seen) == 1)
    assert _handled(registry, "Invalid", "INVALID_ARGUMENT") == 1
    assert _handled(registry, "Boom", "UNKNOWN") == 1
    assert _handled(registry, "NotFound", "NOT_FOUND") == 1
    assert _handled(registry, "NotFoundThenRaise", "NOT_FOUND") == 1

    with pytest.raises(grpc.aio.AioRpcError) as error:
        [r async for r in _method(channel, "unary_stream", "StreamBoom")(b"")]
    assert error.value.code() is grpc.StatusCode.UNKNOWN
    assert _handled(registry, "StreamBoom", "UNKNOWN") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_ok_calls_counted_and_timed_for_every_kind(channel, registry, kind):
    method, _ = KINDS[kind]
    await _call(channel, kind)
    await _call(channel, kind)
    assert _handled(registry, method, "OK") == 2
    labels = {"service": SERVICE, "method": method}
    assert registry.get_sample_value("primerl_grpc_server_handling_seconds_count", labels) == 2
    assert registry.get_sample_value("primerl_grpc_server_in_flight", labels) == 0


@pytest.mark.asyncio
async def test_stream_in_flight_and_timed_until_its_end(channel, servicer, registry):
    labels = {"service": SERVICE, "method": "Count"}
    call = _method(channel, "unary_stream", "Count")(b"2")
    await call.read()
    assert registry.get_sample_value("primerl_grpc_server_in_flight", labels) == 1
    assert registry.get_sample_value("primerl_grpc_server_handling_seconds_count", labels) in (None, 0)
    await asyncio.sleep(0.05)
    servicer.release_stream.set()
    assert [await call.read(), await call.read()] == [b"1", grpc.aio.EOF]
    assert registry.get_sample_value("primerl_grpc_server_in_flight", labels) == 0
    assert registry.get_sample_value("primerl_grpc_server_handling_seconds_sum", labels) >= 0.05


@pytest.mark.asyncio
async def test_cancelled_stream_counted_as_cancelled(channel, registry, spans):
    call = _method(channel, "unary_stream", "Count")(b"5")
    await call.read()
    call.cancel()
    await _eventually(lambda: _handled(registry, "Count", "CANCELLED") == 1)  # the server learns it later
    assert _server_span(spans, "Count").attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


@pytest.mark.asyncio
async def test_health_servicer_is_observed(channel, registry):
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    labels = {"service": "grpc.health.v1.Health", "method": "Check", "code": "OK"}
    assert registry.get_sample_value("primerl_grpc_server_handled_total", labels) == 1


@pytest.mark.asyncio
async def test_metrics_endpoint_serves_the_counters(channel, registry):
    await _call(channel, "unary_unary")
    with pytest.raises(grpc.aio.AioRpcError):
        await _method(channel, "unary_unary", "Invalid")(b"")
    await _eventually(lambda: _handled(registry, "Invalid", "INVALID_ARGUMENT") == 1)
    port = start_metrics_server(0, host="127.0.0.1", registry=registry)
    assert port > 0
    assert start_metrics_server(0, host="127.0.0.1", registry=registry) == port
    try:
        url = f"http://127.0.0.1:{port}/metrics"
        body = await asyncio.to_thread(lambda: urllib.request.urlopen(url, timeout=5).read().decode())
    finally:
        observability._stop_metrics_server(port)
    assert f'primerl_grpc_server_handled_total{{code="OK",method="Echo",service="{SERVICE}"}} 1.0' in body
    assert (
        f'primerl_grpc_server_handled_total{{code="INVALID_ARGUMENT",method="Invalid",service="{SERVICE}"}} 1.0' in body
    )
    assert f'primerl_grpc_server_in_flight{{method="Echo",service="{SERVICE}"}} 0.0' in body
    assert "primerl_grpc_server_handling_seconds_bucket" in body


# ----------------------------------------------------------------------------- logging


def _json_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_logs_carry_service_version_trace_and_policy_version(root_logger, tracer_provider):
    stream = io.StringIO()
    setup_logging(service="router", version="1.2.3", level="debug", stream=stream)
    log = logging.getLogger("primerl_router.server")
    log.debug("outside", extra={"replica": "r0", "num_tokens": 7})
    with tracer_provider.get_tracer("test").start_as_current_span("work") as span:
        token = policy_version_var.set(42)
        try:
            log.info("inside %s", "span")
        finally:
            policy_version_var.reset(token)
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")

    outside, inside, failed = _json_lines(stream)
    assert outside["message"] == "outside" and outside["level"] == "DEBUG"
    assert outside["logger"] == "primerl_router.server"
    assert (outside["service"], outside["version"]) == ("router", "1.2.3")
    assert (outside["replica"], outside["num_tokens"]) == ("r0", 7)
    assert "trace_id" not in outside and "policy_version" not in outside
    assert outside["ts"].endswith("Z")
    assert inside["message"] == "inside span"
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert inside["span_id"] == format(span.get_span_context().span_id, "016x")
    assert inside["policy_version"] == 42
    assert failed["level"] == "ERROR" and "ValueError: bad" in failed["exc_info"]
    assert "policy_version" not in failed


@pytest.mark.asyncio
async def test_handler_logs_carry_the_server_trace_id(root_logger, channel, tracer_provider, spans):
    stream = io.StringIO()
    setup_logging(service="test", version="0", stream=stream)
    with tracer_provider.get_tracer("test").start_as_current_span("client") as client_span:
        await _call(channel, "unary_unary")
    [line] = [entry for entry in _json_lines(stream) if entry["logger"] == "test.echo"]
    assert line["trace_id"] == format(client_span.get_span_context().trace_id, "032x")
    assert line["span_id"] == format(_server_span(spans, "Echo").context.span_id, "016x")


def test_text_logs_are_readable(root_logger):
    stream = io.StringIO()
    setup_logging(service="trainer", version="0.1.0", json=False, stream=stream)
    token = policy_version_var.set(3)
    try:
        logging.getLogger("primerl_trainer").warning("step %d done", 5)
    finally:
        policy_version_var.reset(token)
    line = stream.getvalue().strip()
    assert "WARNING" in line and "primerl_trainer: step 5 done" in line
    assert line.endswith("[service=trainer version=0.1.0 policy_version=3]")


def test_setup_logging_is_idempotent_and_keeps_other_handlers(root_logger):
    foreign = logging.NullHandler()
    root_logger.addHandler(foreign)
    first, second = io.StringIO(), io.StringIO()
    setup_logging(service="a", version="1", stream=first)
    setup_logging(service="a", version="1", level="WARNING", stream=second)
    ours = [h for h in root_logger.handlers if isinstance(h, observability._PrimerlHandler)]
    assert len(ours) == 1 and foreign in root_logger.handlers
    assert root_logger.level == logging.WARNING
    logging.getLogger("x").warning("once")
    assert first.getvalue() == "" and len(second.getvalue().splitlines()) == 1


def test_setup_logging_rejects_unknown_level(root_logger):
    with pytest.raises(ValueError, match="log level"):
        setup_logging(service="a", version="1", level="LOUD")


# ----------------------------------------------------------------------------- setup


@pytest.mark.parametrize("exporter", ["none", "console", "otlp"])
def test_tracer_provider_resource_and_exporters(exporter):
    provider = observability._build_tracer_provider(
        service="router", version="0.3.0", exporter=exporter, otlp_endpoint="http://127.0.0.1:4317"
    )
    try:
        attributes = provider.resource.attributes
        assert (attributes["service.name"], attributes["service.version"]) == ("router", "0.3.0")
    finally:
        provider.shutdown()


def test_setup_tracing_rejects_unknown_exporter():
    with pytest.raises(ValueError, match="trace exporter"):
        setup_tracing(service="a", version="1", exporter="zipkin")


def test_setup_observability_is_idempotent(root_logger):
    first = setup_observability(service="router", version="0.3.0", metrics_port=0)
    try:
        second = setup_observability(service="router", version="0.3.0", metrics_port=0)
        assert second.tracer_provider is first.tracer_provider
        assert trace.get_tracer_provider() is first.tracer_provider
        assert setup_tracing(service="router", version="0.3.0") is first.tracer_provider
        assert second.metrics_port == first.metrics_port and first.metrics_port > 0
        assert len([h for h in root_logger.handlers if isinstance(h, observability._PrimerlHandler)]) == 1
        body = urllib.request.urlopen(f"http://127.0.0.1:{first.metrics_port}/metrics", timeout=5).read()
        assert b"python_info" in body or b"process_" in body
    finally:
        observability._stop_metrics_server(first.metrics_port)
