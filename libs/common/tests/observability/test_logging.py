"""primerl_common.observability's log lines: JSON or text, with service, version, trace and policy version."""

from __future__ import annotations

import io
import json
import logging

import pytest

from primerl_common.observability import policy_version_var, setup_logging
from primerl_common.observability._logging import _PrimerlHandler

from .observed_rpcs import call_kind, finished_server_span


def _json_lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_logs_carry_service_version_trace_and_policy_version(root_logger, tracer_provider):
    stream = io.StringIO()
    setup_logging(service="router", version="1.2.3", level="debug", stream=stream)
    log = logging.getLogger("primerl_router.server")
    log.debug("outside", extra={"replica": "r0", "num_tokens": 7})
    with tracer_provider.get_tracer("test").start_as_current_span("work") as span:
        token = policy_version_var.set(42)
        try:
            log.info("inside %s", "span")
        finally:
            policy_version_var.reset(token)
    try:
        raise ValueError("bad")
    except ValueError:
        log.exception("failed")

    outside, inside, failed = _json_lines(stream)
    assert outside["message"] == "outside" and outside["level"] == "DEBUG"
    assert outside["logger"] == "primerl_router.server"
    assert (outside["service"], outside["version"]) == ("router", "1.2.3")
    assert (outside["replica"], outside["num_tokens"]) == ("r0", 7)
    assert "trace_id" not in outside and "policy_version" not in outside
    assert outside["ts"].endswith("Z")
    assert inside["message"] == "inside span"
    assert inside["trace_id"] == format(span.get_span_context().trace_id, "032x")
    assert inside["span_id"] == format(span.get_span_context().span_id, "016x")
    assert inside["policy_version"] == 42
    assert failed["level"] == "ERROR" and "ValueError: bad" in failed["exc_info"]
    assert "policy_version" not in failed


@pytest.mark.asyncio
async def test_handler_logs_carry_the_server_trace_id(root_logger, channel, tracer_provider, spans):
    stream = io.StringIO()
    setup_logging(service="test", version="0", stream=stream)
    with tracer_provider.get_tracer("test").start_as_current_span("client") as client_span:
        await call_kind(channel, "unary_unary")
    [line] = [entry for entry in _json_lines(stream) if entry["logger"] == "test.echo"]
    assert line["trace_id"] == format(client_span.get_span_context().trace_id, "032x")
    assert line["span_id"] == format(finished_server_span(spans, "Echo").context.span_id, "016x")


def test_text_logs_are_readable(root_logger):
    stream = io.StringIO()
    setup_logging(service="trainer", version="0.1.0", json=False, stream=stream)
    token = policy_version_var.set(3)
    try:
        logging.getLogger("primerl_trainer").warning("step %d done", 5)
    finally:
        policy_version_var.reset(token)
    line = stream.getvalue().strip()
    assert "WARNING" in line and "primerl_trainer: step 5 done" in line
    assert line.endswith("[service=trainer version=0.1.0 policy_version=3]")


def test_setup_logging_is_idempotent_and_keeps_other_handlers(root_logger):
    foreign = logging.NullHandler()
    root_logger.addHandler(foreign)
    first, second = io.StringIO(), io.StringIO()
    setup_logging(service="a", version="1", stream=first)
    setup_logging(service="a", version="1", level="WARNING", stream=second)
    ours = [h for h in root_logger.handlers if isinstance(h, _PrimerlHandler)]
    assert len(ours) == 1 and foreign in root_logger.handlers
    assert root_logger.level == logging.WARNING
    logging.getLogger("x").warning("once")
    assert first.getvalue() == "" and len(second.getvalue().splitlines()) == 1


def test_setup_logging_rejects_unknown_level(root_logger):
    with pytest.raises(ValueError, match="log level"):
        setup_logging(service="a", version="1", level="LOUD")
