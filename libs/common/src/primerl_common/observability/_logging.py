"""Log lines of a service: JSON (for log shippers) or text (for people), each with the
service, its version, the current trace and the policy version served."""

from __future__ import annotations

import contextvars
import datetime
import json as _json
import logging
import sys
import threading
from typing import Any, TextIO

from opentelemetry import trace

policy_version_var: contextvars.ContextVar[int | None] = contextvars.ContextVar("primerl_policy_version", default=None)

_lock = threading.Lock()

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
