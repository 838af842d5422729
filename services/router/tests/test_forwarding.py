from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider

from primerl_router.forwarding import _trace_metadata


def test_trace_context_is_the_w3c_traceparent_the_propagators_write():
    assert _trace_metadata() == ()  # no span: nothing to propagate
    span = TracerProvider().get_tracer("test").start_span("router call")
    with trace.use_span(span):
        written: dict[str, str] = {}
        propagate.inject(written)
        assert _trace_metadata() == tuple(written.items())
