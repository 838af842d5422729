"""primerl_common.observability's server interceptors: a SERVER span and the
primerl_grpc_server_* metrics per call, as the client sees the call."""

from __future__ import annotations

import asyncio

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import trace

from .observed_rpcs import KINDS, SERVICE, call_kind, finished_server_span, handled_count, recorded, rpc


@pytest.mark.asyncio
async def test_handler_runs_inside_server_span(channel, servicer, spans):
    await call_kind(channel, "stream_stream")
    await call_kind(channel, "stream_unary")
    assert servicer.seen_span_ids == [finished_server_span(spans, "Chat").context.span_id] * 2 + [
        finished_server_span(spans, "Total").context.span_id
    ]


@pytest.mark.asyncio
async def test_call_without_client_span_starts_a_new_trace(channel, spans):
    await call_kind(channel, "unary_unary")
    assert finished_server_span(spans, "Echo").parent is None


@pytest.mark.asyncio
async def test_streaming_span_covers_the_whole_stream(channel, servicer, spans):
    call = rpc(channel, "unary_stream", "Count")(b"3")
    assert await call.read() == b"0"
    assert not spans.get_finished_spans()  # the handler is parked between messages: span still open
    servicer.release_stream.set()
    assert [await call.read(), await call.read()] == [b"1", b"2"]
    assert await call.read() is grpc.aio.EOF
    span = finished_server_span(spans, "Count")
    assert span.attributes["rpc.grpc.status_code"] == 0
    # Every message was produced with the same span current, so the span spans the stream.
    assert set(servicer.seen_span_ids) == {span.context.span_id} and len(servicer.seen_span_ids) == 3


@pytest.mark.asyncio
async def test_failed_calls_mark_span_as_error(channel, spans):
    for name in ("Invalid", "Boom"):
        with pytest.raises(grpc.aio.AioRpcError):
            await rpc(channel, "unary_unary", name)(b"")
    await recorded(lambda: len(spans.get_finished_spans()) == 2)
    invalid, boom = finished_server_span(spans, "Invalid"), finished_server_span(spans, "Boom")
    assert invalid.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert invalid.status.status_code is trace.StatusCode.ERROR
    assert not invalid.events  # an abort is an answer, not a crash
    assert boom.attributes["rpc.grpc.status_code"] == grpc.StatusCode.UNKNOWN.value[0]
    assert [event.name for event in boom.events] == ["exception"]
    assert boom.events[0].attributes["exception.type"] == "RuntimeError"


@pytest.mark.asyncio
async def test_status_codes_counted_as_the_client_sees_them(channel, registry):
    for name in ("Invalid", "Boom", "NotFound", "NotFoundThenRaise"):
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await rpc(channel, "unary_unary", name)(b"")
        seen = error.value.code().name
        await recorded(lambda name=name, seen=seen: handled_count(registry, name, seen) == 1)
    assert handled_count(registry, "Invalid", "INVALID_ARGUMENT") == 1
    assert handled_count(registry, "Boom", "UNKNOWN") == 1
    assert handled_count(registry, "NotFound", "NOT_FOUND") == 1
    assert handled_count(registry, "NotFoundThenRaise", "NOT_FOUND") == 1

    with pytest.raises(grpc.aio.AioRpcError) as error:
        [r async for r in rpc(channel, "unary_stream", "StreamBoom")(b"")]
    assert error.value.code() is grpc.StatusCode.UNKNOWN
    assert handled_count(registry, "StreamBoom", "UNKNOWN") == 1


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_ok_calls_counted_and_timed_for_every_kind(channel, registry, kind):
    method, _ = KINDS[kind]
    await call_kind(channel, kind)
    await call_kind(channel, kind)
    assert handled_count(registry, method, "OK") == 2
    labels = {"service": SERVICE, "method": method}
    assert registry.get_sample_value("primerl_grpc_server_handling_seconds_count", labels) == 2
    assert registry.get_sample_value("primerl_grpc_server_in_flight", labels) == 0


@pytest.mark.asyncio
async def test_stream_in_flight_and_timed_until_its_end(channel, servicer, registry):
    labels = {"service": SERVICE, "method": "Count"}
    call = rpc(channel, "unary_stream", "Count")(b"2")
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
    call = rpc(channel, "unary_stream", "Count")(b"5")
    await call.read()
    call.cancel()
    await recorded(lambda: handled_count(registry, "Count", "CANCELLED") == 1)  # the server learns it later
    assert finished_server_span(spans, "Count").attributes["rpc.grpc.status_code"] == grpc.StatusCode.CANCELLED.value[0]


@pytest.mark.asyncio
async def test_health_servicer_is_observed(channel, registry):
    response = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
    assert response.status == health_pb2.HealthCheckResponse.SERVING
    labels = {"service": "grpc.health.v1.Health", "method": "Check", "code": "OK"}
    assert registry.get_sample_value("primerl_grpc_server_handled_total", labels) == 1
