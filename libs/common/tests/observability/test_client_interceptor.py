"""primerl_common.observability's client interceptors: the caller's trace context reaches the
server, the caller's metadata is kept."""

from __future__ import annotations

import grpc
import grpc.aio
import pytest
from opentelemetry import trace

from .observed_rpcs import KINDS, SERVICE, call_kind, finished_server_span, rpc


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", list(KINDS))
async def test_client_span_is_parent_of_server_span(channel, tracer_provider, spans, kind):
    method, expected = KINDS[kind]
    tracer = tracer_provider.get_tracer("test")
    with tracer.start_as_current_span("client", kind=trace.SpanKind.CLIENT) as client_span:
        assert await call_kind(channel, kind) == expected
    server_span = finished_server_span(spans, method)
    client_context = client_span.get_span_context()
    assert server_span.context.trace_id == client_context.trace_id
    assert server_span.parent is not None and server_span.parent.span_id == client_context.span_id
    assert server_span.parent.is_remote
    assert server_span.attributes["rpc.grpc.status_code"] == grpc.StatusCode.OK.value[0]
    assert server_span.attributes["rpc.service"] == SERVICE and server_span.attributes["rpc.method"] == method
    assert server_span.status.status_code is trace.StatusCode.UNSET


@pytest.mark.asyncio
async def test_client_interceptor_keeps_caller_metadata(channel, tracer_provider, servicer):
    metadata = grpc.aio.Metadata(("x-request-id", "r-1"))
    with tracer_provider.get_tracer("test").start_as_current_span("client"):
        await rpc(channel, "unary_unary", "Echo")(b"hi", metadata=metadata)
    keys = [key for key, _ in servicer.echo_metadata]
    assert ("x-request-id", "r-1") in servicer.echo_metadata and keys.count("traceparent") == 1
    assert list(metadata) == [("x-request-id", "r-1")]  # the caller's object is left as it was
