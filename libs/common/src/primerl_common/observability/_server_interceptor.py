"""A SERVER span and the server metrics for every call a grpc.aio server handles."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from prometheus_client import REGISTRY, CollectorRegistry

from primerl_common.grpc_handlers import wrap_method_handler
from primerl_common.observability._metrics import ServerMetrics, server_metrics
from primerl_common.observability._tracing import METADATA_GETTER


def _status_code(context: grpc.aio.ServicerContext, exc: BaseException | None) -> grpc.StatusCode:
    """The code grpc.aio sends for this call: what set_code/abort stored, else OK or UNKNOWN."""
    code = context.code()  # None until set_code or abort
    if exc is None:
        return code or grpc.StatusCode.OK
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        expired = remaining is not None and remaining <= 0
        return grpc.StatusCode.DEADLINE_EXCEEDED if expired else grpc.StatusCode.CANCELLED
    # grpc.aio answers a raised exception with a code set before it (abort sets one), else UNKNOWN.
    return code if code not in (None, grpc.StatusCode.OK) else grpc.StatusCode.UNKNOWN


class _MethodObserver:
    """The span and the metrics of one method's calls: the only place either concern is
    written. What depends on the method alone (span name and attributes, the metrics' label
    children) is made once; per call there is the span, a timer and three metric updates."""

    def __init__(self, tracer: trace.Tracer, metrics: ServerMetrics, full_method: str) -> None:
        self._name = full_method.lstrip("/")  # "/pkg.Service/Method" -> semconv span name "pkg.Service/Method"
        service, _, method = self._name.rpartition("/")
        self._tracer = tracer
        self._attributes = {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}
        self._labels = (service, method)
        self._handled_metric = metrics.handled
        self._handled: dict[grpc.StatusCode, Any] = {}  # label children by status code, as they occur
        self._handling_seconds = metrics.handling_seconds.labels(service, method)
        self._in_flight = metrics.in_flight.labels(service, method)

    def start(self, context: grpc.aio.ServicerContext) -> _CallObserver:
        parent = propagate.extract(context.invocation_metadata() or (), getter=METADATA_GETTER)
        span = self._tracer.start_span(
            self._name, context=parent, kind=trace.SpanKind.SERVER, attributes=self._attributes
        )
        self._in_flight.inc()
        return _CallObserver(span)

    def finish(self, call: _CallObserver, context: grpc.aio.ServicerContext, exc: BaseException | None) -> None:
        code = _status_code(context, exc)
        span = call.span
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code is not grpc.StatusCode.OK:
            span.set_status(trace.Status(trace.StatusCode.ERROR, code.name))
        if isinstance(exc, Exception) and not isinstance(exc, grpc.aio.AbortError):
            span.record_exception(exc)
        span.end()
        handled = self._handled.get(code)
        if handled is None:
            handled = self._handled[code] = self._handled_metric.labels(*self._labels, code.name)
        handled.inc()
        self._handling_seconds.observe(time.perf_counter() - call.started)
        self._in_flight.dec()


class _CallObserver:
    """One call's span, current only while the handler runs (`attach`/`detach` around each
    step: left attached across a yield, its token could be detached from another context
    when grpc closes the generator). Status and exceptions are recorded by
    _MethodObserver.finish, which knows the gRPC code."""

    __slots__ = ("context", "span", "started")

    def __init__(self, span: trace.Span) -> None:
        self.span = span
        self.context = trace.set_span_in_context(span)
        self.started = time.perf_counter()


def _wrap_coroutine(behavior: Callable, observer: _MethodObserver) -> Callable:
    """Unary responses, and streaming handlers that write through context.write and return None."""

    async def observed(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        call = observer.start(context)
        try:
            token = otel_context.attach(call.context)
            try:
                response = await behavior(request_or_iterator, context)
            finally:
                otel_context.detach(token)
        except BaseException as exc:
            observer.finish(call, context, exc)
            raise
        observer.finish(call, context, None)
        return response

    return observed


def _wrap_async_generator(behavior: Callable, observer: _MethodObserver) -> Callable:
    """Streaming responses from an async generator: the span and the timer cover the whole stream."""

    async def observed(request_or_iterator: Any, context: grpc.aio.ServicerContext) -> Any:
        responses = behavior(request_or_iterator, context)  # runs nothing yet: it is a generator
        call = observer.start(context)
        failure: BaseException | None = None
        try:
            while True:
                token = otel_context.attach(call.context)
                try:
                    response = await anext(responses)
                except StopAsyncIteration:
                    break
                finally:
                    otel_context.detach(token)
                yield response
        except BaseException as exc:
            failure = exc
            raise
        finally:
            try:
                await responses.aclose()  # runs the handler's own cleanup when the client went away
            finally:
                observer.finish(call, context, failure)

    return observed


class _ObservabilityServerInterceptor(grpc.aio.ServerInterceptor):
    """Wraps each method's handler with its _MethodObserver. The wrapping depends on the
    method alone (per-call data comes from the servicer context), so a caller may keep the
    handler it returns for later calls of the method (as primerl_common.server does)."""

    def __init__(self, tracer: trace.Tracer, metrics: ServerMetrics) -> None:
        self._tracer, self._metrics = tracer, metrics
        self._observers: dict[str, _MethodObserver] = {}

    async def intercept_service(self, continuation: Callable, handler_call_details: grpc.HandlerCallDetails) -> Any:
        handler = await continuation(handler_call_details)
        if handler is None:  # unknown method: grpc answers UNIMPLEMENTED itself
            return None
        method = handler_call_details.method
        observer = self._observers.get(method)
        if observer is None:
            observer = self._observers[method] = _MethodObserver(self._tracer, self._metrics, method)
        return wrap_method_handler(
            handler,
            coroutine=lambda behavior: _wrap_coroutine(behavior, observer),
            async_generator=lambda behavior: _wrap_async_generator(behavior, observer),
        )


def server_interceptors(
    *, tracer_provider: trace.TracerProvider | None = None, registry: CollectorRegistry = REGISTRY
) -> list[grpc.aio.ServerInterceptor]:
    """Interceptors for grpc.aio.server: a SERVER span per call (parent taken from the metadata)
    and the primerl_grpc_server_* metrics. Without a provider, the global one is used, also when
    setup_tracing runs after this call."""
    tracer = trace.get_tracer("primerl_common.observability", tracer_provider=tracer_provider)
    return [_ObservabilityServerInterceptor(tracer, server_metrics(registry))]
