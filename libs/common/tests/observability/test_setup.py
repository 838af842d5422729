"""primerl_common.observability.setup_observability: logging, tracing and the metrics endpoint at once, idempotent."""

from __future__ import annotations

import urllib.request

from opentelemetry import trace

from primerl_common.observability import setup_observability, setup_tracing
from primerl_common.observability._logging import _PrimerlHandler
from primerl_common.observability._metrics import stop_metrics_server


def test_setup_observability_is_idempotent(root_logger):
    first = setup_observability(service="router", version="0.3.0", metrics_port=0)
    try:
        second = setup_observability(service="router", version="0.3.0", metrics_port=0)
        assert second.tracer_provider is first.tracer_provider
        assert trace.get_tracer_provider() is first.tracer_provider
        assert setup_tracing(service="router", version="0.3.0") is first.tracer_provider
        assert second.metrics_port == first.metrics_port and first.metrics_port > 0
        assert len([h for h in root_logger.handlers if isinstance(h, _PrimerlHandler)]) == 1
        body = urllib.request.urlopen(f"http://127.0.0.1:{first.metrics_port}/metrics", timeout=5).read()
        assert b"python_info" in body or b"process_" in body
    finally:
        stop_metrics_server(first.metrics_port)
