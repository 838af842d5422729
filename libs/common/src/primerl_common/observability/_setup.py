"""Logging, tracing and metrics of a service, set up in one call."""

from __future__ import annotations

import dataclasses

from opentelemetry.sdk.trace import TracerProvider

from primerl_common.observability._logging import setup_logging
from primerl_common.observability._metrics import start_metrics_server, stop_metrics_server
from primerl_common.observability._tracing import setup_tracing


@dataclasses.dataclass(frozen=True)
class ObservabilityHandles:
    tracer_provider: TracerProvider
    metrics_port: int | None  # None when no metrics server was asked for

    def shutdown(self) -> None:
        """Flush pending spans and stop the metrics server; for the end of the process."""
        self.tracer_provider.shutdown()
        if self.metrics_port is not None:
            stop_metrics_server(self.metrics_port)


def setup_observability(
    *,
    service: str,
    version: str,
    log_level: str = "INFO",
    log_json: bool = True,
    trace_exporter: str = "none",
    otlp_endpoint: str | None = None,
    metrics_port: int | None = None,
    metrics_host: str = "127.0.0.1",
) -> ObservabilityHandles:
    """Logging, tracing and (when metrics_port is not None) the metrics endpoint on
    `metrics_host`, in that order."""
    setup_logging(service=service, version=version, level=log_level, json=log_json)
    provider = setup_tracing(service=service, version=version, exporter=trace_exporter, otlp_endpoint=otlp_endpoint)
    port = start_metrics_server(metrics_port, metrics_host) if metrics_port is not None else None
    return ObservabilityHandles(tracer_provider=provider, metrics_port=port)
