"""The process-wide OTel tracer provider, and reading trace context from gRPC metadata."""

from __future__ import annotations

import threading
from typing import Any

from opentelemetry import trace
from opentelemetry.propagators.textmap import Getter
from opentelemetry.sdk.resources import SERVICE_NAME, SERVICE_VERSION, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SimpleSpanProcessor

_lock = threading.Lock()

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


METADATA_GETTER = _MetadataGetter()
