"""The current trace context (W3C traceparent) on every call a grpc.aio channel makes."""

from __future__ import annotations

import grpc
import grpc.aio
from opentelemetry import propagate


def _with_trace_context(details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """The call's details with the current trace context (W3C traceparent) added to its metadata."""
    metadata = grpc.aio.Metadata(*(details.metadata or ()))  # a copy: the caller's stays as given
    propagate.inject(metadata)
    return details._replace(metadata=metadata)


class _UnaryUnaryTraceContext(grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _UnaryStreamTraceContext(grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(self, continuation, client_call_details, request):
        return await continuation(_with_trace_context(client_call_details), request)


class _StreamUnaryTraceContext(grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


class _StreamStreamTraceContext(grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(self, continuation, client_call_details, request_iterator):
        return await continuation(_with_trace_context(client_call_details), request_iterator)


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    """Interceptors for grpc.aio channels that propagate the trace context on all four RPC kinds.

    One object per kind: grpc.aio files each interceptor under the first kind it implements only.
    """
    return [
        _UnaryUnaryTraceContext(),
        _UnaryStreamTraceContext(),
        _StreamUnaryTraceContext(),
        _StreamStreamTraceContext(),
    ]
