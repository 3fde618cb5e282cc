"""Logging: JSON lines on stderr, configured once per process.

Modules log through `logging.getLogger(__name__)` and never configure handlers
themselves. Each line carries the service name and, inside a span, the trace
and span ids, so a log line can be found from a trace in Jaeger and back.
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


def configure_logging(service: str, level: str = "info") -> None:
    """Send every logger's records to stderr as JSON. Later calls only adjust the level."""
    global _configured
    root = logging.getLogger()
    root.setLevel(level.upper())
    if _configured:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter(service))
    root.handlers[:] = [handler]
    # grpc's and urllib3's own chatter is only useful when debugging them.
    for noisy in ("grpc", "urllib3", "kubernetes"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
    _configured = True
