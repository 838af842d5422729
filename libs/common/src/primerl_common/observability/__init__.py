"""Logs, traces and metrics of every primerl service, set up in one place.

A service calls `setup_observability(...)` once at startup, passes `server_interceptors()`
to `grpc.aio.server(interceptors=...)` and `client_interceptors()` to every channel it
opens, and sets `policy_version_var` when it knows the policy version it serves.

One module per concern: `_logging` (JSON or text lines with the trace and policy version),
`_tracing` (the OTel tracer provider), `_metrics` (the server metrics and their HTTP
endpoint), `_server_interceptor` (a span and the metrics per call), `_client_interceptor`
(trace context on outgoing calls) and `_setup` (all three at once). Callers use the names
re-exported here.
"""

from primerl_common.observability._client_interceptor import client_interceptors
from primerl_common.observability._logging import policy_version_var, setup_logging
from primerl_common.observability._metrics import start_metrics_server
from primerl_common.observability._server_interceptor import server_interceptors
from primerl_common.observability._setup import ObservabilityHandles, setup_observability
from primerl_common.observability._tracing import setup_tracing

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
