"""Logging: one line per record on stderr, configured once per process.

Modules log through `logging.getLogger(__name__)` and never configure handlers
themselves. Each line carries the service name and, inside a span, the trace
and span ids, so a log line can be found from a trace in Jaeger and back.

Format (`log_format`): `json` (one JSON object per line, for collectors),
`text` (one readable line: time, level, service, message, key=value fields),
or `auto`: text when stderr is a terminal, JSON otherwise. `waygate up`
decides for its children from its own stderr (theirs is a pipe).

gRPC core (C) writes its own log lines (absl format, e.g. one per failed TLS
handshake) straight to stderr. `waygate.core.settings.quiet_grpc_core` keeps
those below ERROR off stderr; grpc reads that setting once, when it is
imported, so the `waygate` package calls it first thing (waygate/__init__.py),
and child processes inherit it through the environment.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

from opentelemetry import trace

_configured = False

# Attributes every LogRecord has; anything else was passed with `extra=` and
# is emitted as a field of its own.
_STANDARD_ATTRS = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
}


class JsonFormatter(logging.Formatter):
    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "service": self._service,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            entry["trace_id"] = format(context.trace_id, "032x")
            entry["span_id"] = format(context.span_id, "016x")
        for key, value in vars(record).items():
            if key not in _STANDARD_ATTRS and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """One readable line per record: `12:00:01.250 INFO    resolver  ready  key=value`."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self._service = service

    def format(self, record: logging.LogRecord) -> str:
        stamp = time.strftime("%H:%M:%S", time.localtime(record.created))
        fields = [
            f"{key}={value}"
            for key, value in vars(record).items()
            if key not in _STANDARD_ATTRS and not key.startswith("_")
        ]
        context = trace.get_current_span().get_span_context()
        if context.is_valid and not hasattr(record, "trace_id"):
            fields.append(f"trace_id={context.trace_id:032x}")
        line = (
            f"{stamp}.{int(record.msecs):03d} {record.levelname:<7} {self._service}  "
            f"{record.getMessage()}"
        )
        if fields:
            line += "  " + " ".join(fields)
        if record.exc_info:
            line += "\n" + self.formatException(record.exc_info)
        return line


def span_fields(span: Any) -> dict[str, str]:
    """`extra=` fields naming `span`, for a line logged outside its context.

    Inside a span (gRPC handlers, tasks started under one) the formatters add the
    current span's ids themselves; code driven by protocol callbacks (the proxy's
    exchanges) has no current span, so it names the request's own, and its
    access-log and other lines of a traced request carry the trace id too.
    Empty for None or an invalid (unsampled, no-op) span.
    """
    if span is None:
        return {}
    context = span.get_span_context()
    if not context.is_valid:
        return {}
    return {
        "trace_id": format(context.trace_id, "032x"),
        "span_id": format(context.span_id, "016x"),
    }


def text_wanted(log_format: str, stream: Any = None) -> bool:
    """Whether `log_format` (auto|json|text) means text lines on `stream` (default stderr)."""
    if log_format == "auto":
        stream = sys.stderr if stream is None else stream
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError):
            return False
    return log_format == "text"


def resolved_format(log_format: str) -> str:
    """`log_format` with auto decided for this process's stderr: json or text."""
    return "text" if text_wanted(log_format) else "json"


def configure_logging(service: str, level: str = "info", log_format: str = "auto") -> None:
    """Send every logger's records to stderr, one line each. Later calls only adjust the level."""
    global _configured
    root = logging.getLogger()
    root.setLevel(level.upper())
    if _configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        TextFormatter(service) if text_wanted(log_format) else JsonFormatter(service)
    )
    root.handlers[:] = [handler]
    # grpc's and urllib3's own chatter is only useful when debugging them.
    for noisy in ("grpc", "urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    _configured = True
