"""primerl_common.observability's tracer provider: the service's resource, the exporters, one provider per process."""

from __future__ import annotations

import pytest

from primerl_common.observability import setup_tracing
from primerl_common.observability._tracing import _build_tracer_provider


@pytest.mark.parametrize("exporter", ["none", "console", "otlp"])
def test_tracer_provider_resource_and_exporters(exporter):
    provider = _build_tracer_provider(
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
