"""Logs, traces and metrics of every primerl service, set up in one place.

A service calls `setup_observability(...)` once at startup, passes `server_interceptors()`
to `grpc.aio.server(interceptors=...)` and `client_interceptors()` to every channel it
opens, and sets `policy_version_var` when it knows the policy version it serves.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import datetime
import json as _json
import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, TextIO
from wsgiref.simple_server import WSGIServer

import grpc
import grpc.aio
import prometheus_client
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor
from prometheus_client import REGISTRY, CollectorRegistry, Counter, Gauge, Histogram

from primerl_common.grpc_handlers import wrap_method_handler

__all__ = [
    "ObservabilityHandles",
    "client_interceptors",
    "policy_version_var",
    "server_interceptors",
    "setup_logging",
    "setup_observability",
    "setup_tracing",
    "start_metrics_server",
]

policy_version_var: contextvars.ContextVar[int | None] = contextvars.ContextVar("primerl_policy_version", default=None)

_lock = threading.Lock()

# ----------------------------------------------------------------------------- logging

# Everything a LogRecord carries by itself; whatever else is on a record came from `extra=`.
_RECORD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {"message", "asctime", "taskName"}


def _context_fields() -> dict[str, Any]:
    fields: dict[str, Any] = {}
    span_context = trace.get_current_span().get_span_context()
    if span_context.is_valid:
        fields["trace_id"] = trace.format_trace_id(span_context.trace_id)
        fields["span_id"] = trace.format_span_id(span_context.span_id)
    policy_version = policy_version_var.get()
    if policy_version is not None:
        fields["policy_version"] = policy_version
    return fields


class _JsonFormatter(logging.Formatter):
    """One JSON object per line: what log shippers (Loki, Vector, fluent-bit) parse without rules."""

    def __init__(self, *, service: str, version: str) -> None:
        super().__init__()
        self._service, self._version = service, version

    def format(self, record: logging.LogRecord) -> str:
        ts = datetime.datetime.fromtimestamp(record.created, tz=datetime.UTC)
        entry: dict[str, Any] = {
            "ts": ts.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
            "service": self._service,
            "version": self._version,
            **_context_fields(),
        }
        for key, value in vars(record).items():
            if key not in _RECORD_ATTRS:
                entry.setdefault(key, value)  # an extra never overrides the fields above
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        if record.stack_info:
            entry["stack_info"] = self.formatStack(record.stack_info)
        return _json.dumps(entry, default=str, ensure_ascii=False)


class _TextFormatter(logging.Formatter):
    """For people at a terminal; the same context fields as the JSON lines, as a suffix."""

    def __init__(self, *, service: str, version: str) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")
        self._prefix = f"service={service} version={version}"

    def formatMessage(self, record: logging.LogRecord) -> str:
        context = " ".join(f"{key}={value}" for key, value in _context_fields().items())
        return f"{super().formatMessage(record)} [{self._prefix}{' ' + context if context else ''}]"


class _PrimerlHandler(logging.StreamHandler):
    """Marks the handler we own, so a second setup replaces it and leaves other handlers alone."""


def setup_logging(
    *, service: str, version: str, level: str = "INFO", json: bool = True, stream: TextIO | None = None
) -> None:
    """Route the root logger to `stream` (stderr by default) as JSON lines or readable text."""
    levels = logging.getLevelNamesMapping()
    if level.upper() not in levels:
        raise ValueError(f"unknown log level {level!r}; expected one of {sorted(levels)}")
    handler = _PrimerlHandler(stream if stream is not None else sys.stderr)
    formatter_cls = _JsonFormatter if json else _TextFormatter
    handler.setFormatter(formatter_cls(service=service, version=version))
    root = logging.getLogger()
    with _lock:
        for old in [h for h in root.handlers if isinstance(h, _PrimerlHandler)]:
            root.removeHandler(old)
        root.addHandler(handler)
        root.setLevel(levels[level.upper()])


# ----------------------------------------------------------------------------- tracing

_TRACE_EXPORTERS = ("none", "console", "otlp")
_tracer_provider: TracerProvider | None = None


def _build_tracer_provider(*, service: str, version: str, exporter: str, otlp_endpoint: str | None) -> TracerProvider:
    # Even with no exporter the SDK provider mints real trace ids, so logs still correlate.
    provider = TracerProvider(resource=Resource.create({SERVICE_NAME: service, SERVICE_VERSION: version}))
    if exporter == "console":
        provider.add_span_processor(SimpleSpanProcessor(ConsoleSpanExporter()))
    elif exporter == "otlp":
        # Imported here: it pulls in a second gRPC stack that services without a collector never need.
        try:
            from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
        except ImportError:
            raise ValueError(
                "observability.trace_exporter = 'otlp' needs opentelemetry-exporter-otlp-proto-grpc "
                "(pip install 'primerl-common[otlp]')"
            ) from None

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint)))
    return provider


def setup_tracing(
    *, service: str, version: str, exporter: str = "none", otlp_endpoint: str | None = None
) -> TracerProvider:
    """Install the process-wide tracer provider; later calls return the first one (OTel allows one)."""
    global _tracer_provider
    if exporter not in _TRACE_EXPORTERS:
        raise ValueError(f"unknown trace exporter {exporter!r}; expected one of {_TRACE_EXPORTERS}")
    with _lock:
        if _tracer_provider is None:
            _tracer_provider = _build_tracer_provider(
                service=service, version=version, exporter=exporter, otlp_endpoint=otlp_endpoint
            )
            trace.set_tracer_provider(_tracer_provider)
        return _tracer_provider


class _MetadataGetter(Getter):
    """Reads W3C trace context from grpc.aio invocation metadata (a sequence of key/value pairs)."""

    def get(self, carrier: Any, key: str) -> list[str] | None:
        return [value for k, value in carrier if k == key] or None

    def keys(self, carrier: Any) -> list[str]:
        return [k for k, _ in carrier]


_METADATA_GETTER = _MetadataGetter()


# ----------------------------------------------------------------------------- metrics


@dataclasses.dataclass(frozen=True)
class _ServerMetrics:
    handled: Counter
    handling_seconds: Histogram
    in_flight: Gauge


# Streams (generation, weight pushes) last far longer than the default buckets reach.
_SECONDS_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
_metrics_by_registry: dict[CollectorRegistry, _ServerMetrics] = {}
_metrics_servers: dict[tuple[str, int, CollectorRegistry], WSGIServer] = {}


def _server_metrics(registry: CollectorRegistry) -> _ServerMetrics:
    # A registry refuses a second metric of the same name, so each registry gets its set once.
    with _lock:
        if registry not in _metrics_by_registry:
            labels = ("service", "method")  # service is the gRPC one, e.g. primerl.router.v1.RouterService
            _metrics_by_registry[registry] = _ServerMetrics(
                handled=Counter("primerl_grpc_server_handled", "Completed RPCs.", (*labels, "code"), registry=registry),
                handling_seconds=Histogram(
                    "primerl_grpc_server_handling_seconds",
                    "RPC start to end (of the stream, for streams).",
                    labels,
                    buckets=_SECONDS_BUCKETS,
                    registry=registry,
                ),
                in_flight=Gauge("primerl_grpc_server_in_flight", "RPCs not yet completed.", labels, registry=registry),
            )
        return _metrics_by_registry[registry]


def start_metrics_server(port: int, host: str = "0.0.0.0", *, registry: CollectorRegistry = REGISTRY) -> int:
    """Serve Prometheus metrics over HTTP from a daemon thread; return the bound port (port 0 picks one).

    Calling again with the same host, port and registry returns the running server's port.
    """
    with _lock:
        key = (host, port, registry)
        if key not in _metrics_servers:
            server, _thread = prometheus_client.start_http_server(port, addr=host, registry=registry)
            _metrics_servers[key] = server
        return _metrics_servers[key].server_port


def _stop_metrics_server(port: int) -> None:
    with _lock:
        for key, server in list(_metrics_servers.items()):
            if server.server_port == port:
                server.shutdown()
                server.server_close()
                del _metrics_servers[key]


# ----------------------------------------------------------------------------- server interceptor


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

    def __init__(self, tracer: trace.Tracer, metrics: _ServerMetrics, full_method: str) -> None:
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
        parent = propagate.extract(context.invocation_metadata() or (), getter=_METADATA_GETTER)
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

    def __init__(self, tracer: trace.Tracer, metrics: _ServerMetrics) -> None:
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
    tracer = trace.get_tracer(__name__, tracer_provider=tracer_provider)
    return [_ObservabilityServerInterceptor(tracer, _server_metrics(registry))]


# ----------------------------------------------------------------------------- client interceptor


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


# ----------------------------------------------------------------------------- all three


@dataclasses.dataclass(frozen=True)
class ObservabilityHandles:
    tracer_provider: TracerProvider
    metrics_port: int | None  # None when no metrics server was asked for

    def shutdown(self) -> None:
        """Flush pending spans and stop the metrics server; for the end of the process."""
        self.tracer_provider.shutdown()
        if self.metrics_port is not None:
            _stop_metrics_server(self.metrics_port)


def setup_observability(
    *,
    service: str,
    version: str,
    log_level: str = "INFO",
    log_json: bool = True,
    trace_exporter: str = "none",
    otlp_endpoint: str | None = None,
    metrics_port: int | None = None,
) -> ObservabilityHandles:
    """Logging, tracing and (when metrics_port is not None) the metrics endpoint, in that order."""
    setup_logging(service=service, version=version, level=log_level, json=log_json)
    provider = setup_tracing(service=service, version=version, exporter=trace_exporter, otlp_endpoint=otlp_endpoint)
    port = start_metrics_server(metrics_port) if metrics_port is not None else None
    return ObservabilityHandles(tracer_provider=provider, metrics_port=port)
