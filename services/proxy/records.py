"""What every exchange leaves behind, in one place: its span, its access-log line, its counts.

Both client protocols (HTTP/1.1, HTTP/2 streams) and both upstream protocols
record an exchange here and nowhere else, so the three records cannot drift:

- the span: `start_span` opens a SERVER span for a sampled request (its parent
  the client's trace context, or none when this proxy starts the trace) and
  returns the traceparent the backend and the tunnel's dial get; `finish`
  ends it with the status (5xx, or no answer at all, is an error);
- the access log: one JSON line per answered request, within a per-second
  budget (`tick` renews it and logs how many were suppressed), naming the
  request's span explicitly (exchanges run in protocol callbacks with no
  current span: `core.logs.span_fields`);
- the metrics: `ProxyMetrics.request(route, method, status)`. `route` is the
  route's "namespace/name" whenever a route matched, whatever the answer (a
  broken route's 503s count under its own name); "" means no route took the
  request (the status page's "unrouted" row relies on it).

Nothing here runs per chunk; `finish` runs once per exchange and does no
work for the access log while its logger is off (checked once a second).
"""

from __future__ import annotations

import logging
from typing import Any

from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from waygate.core.logs import span_fields
from waygate.core.tracing import tracer
from waygate.proxy.http1 import RequestHead
from waygate.proxy.metrics import ProxyMetrics
from waygate.proxy.routing import Target

access_log = logging.getLogger("waygate.proxy.access")

_PROPAGATOR = TraceContextTextMapPropagator()

# The route label of a request no route took (see the module docstring).
UNROUTED = ""


def start_span(
    req: RequestHead,
    route: str,
    http_version: str,
    name: tuple[bytes, ...] = (),
    scheme: bytes = b"http",
    trusted: bool = True,
) -> tuple[Any, bytes]:
    """A SERVER span for a sampled request (a child of the client's trace context when
    it sent one and it is `trusted`); returns it and the traceparent to send on
    (backend, tunnel dial). `name`: the route's span name (routing.span_name_parts); none:
    "proxy " + route."""
    # Extracted even when empty: a trace this proxy starts has no parent at all.
    parent = _PROPAGATOR.extract(
        {"traceparent": req.traceparent.decode("ascii", "replace") if trusted else ""}
    )
    span = tracer().start_span(
        span_name(name, req, scheme) if name else "proxy " + route,
        context=parent,
        kind=SpanKind.SERVER,
        attributes={
            "http.request.method": req.method.decode("ascii", "replace"),
            "url.path": req.target.decode("ascii", "replace")[:256],
            "server.address": req.host.decode("ascii", "replace"),
            "waygate.route": route,
            "network.protocol.version": http_version,
        },
    )
    context = span.get_span_context()
    return span, b"00-%032x-%016x-01" % (context.trace_id, context.span_id)


def span_name(parts: tuple[bytes, ...], req: RequestHead, scheme: bytes) -> str:
    """The span's name for this request (ingress-nginx's variables filled in)."""
    out = []
    for part in parts:
        if part == b"$request_method":
            part = req.method
        elif part == b"$request_uri":
            part = req.target
        elif part == b"$uri":
            part = req.target.partition(b"?")[0]
        elif part == b"$host":
            part = req.host
        elif part == b"$scheme":
            part = scheme
        out.append(part)
    return b"".join(out).decode("utf-8", "replace")[:256]


def end_span(span: Any, status: int, reason: str = "") -> None:
    """End a request's span with its answer (0: none was sent; an error like 5xx)."""
    if status:
        span.set_attribute("http.response.status_code", status)
    if not status or status >= 500:
        span.set_status(Status(StatusCode.ERROR, reason) if reason else Status(StatusCode.ERROR))
    span.end()


class Records:
    """The metrics and the budgeted access log of one proxy process's exchanges."""

    __slots__ = ("budget", "logging", "metrics", "quiet", "rate", "suppressed")

    def __init__(self, metrics: ProxyMetrics, rate: int) -> None:
        self.metrics = metrics
        # Access-log lines allowed per second; the rest are counted and summarised.
        self.rate = rate
        self.budget = rate
        self.suppressed = 0
        # Whether the access logger logs INFO at all, checked once a second (not
        # per request): while it is off no record is built.
        self.logging = access_log.isEnabledFor(logging.INFO)
        # Routes whose requests are not logged (ingress-nginx enable-access-log
        # "false"), set with each routing table (ProxyServer.set_view).
        self.quiet: frozenset[str] = frozenset()

    def tick(self) -> None:
        """Once a second: the suppressed lines' summary, and a new budget."""
        if self.suppressed:
            access_log.info(
                "access log lines suppressed",
                extra={"suppressed": self.suppressed, "per_second": self.rate},
            )
            self.suppressed = 0
        self.budget = self.rate
        self.logging = access_log.isEnabledFor(logging.INFO)

    def refused(self, kind: str) -> None:
        """A request the proxy answered itself, by the reason's kind."""
        refused = self.metrics.refused
        refused[kind] = refused.get(kind, 0) + 1

    def finish(
        self,
        route: str,
        req: RequestHead,
        status: int,
        client: bytes,
        target: Target | None,
        duration: float,
        span: Any,
        protocol: str,
    ) -> None:
        """One answered request: counted under `route` ("": unrouted), its access-log
        line (naming `span`) when within budget, then its span ended."""
        self.metrics.request(route, req.method, status)
        if self.logging:
            self.log(route, req, status, client, target, duration, span, protocol)
        if span is not None:
            end_span(span, status)

    def log(
        self,
        route: str,
        req: RequestHead,
        status: int,
        client: bytes,
        target: Target | None,
        duration: float,
        span: Any,
        protocol: str,
    ) -> None:
        """The access-log line of one request, within the per-second budget (call it
        only while `logging`; `finish` does)."""
        if route in self.quiet:
            return
        if self.budget > 0:
            self.budget -= 1
            _log(route, req, status, client, target, duration, span, protocol)
        else:
            self.suppressed += 1


def _log(
    route: str,
    req: RequestHead,
    status: int,
    client: bytes,
    target: Target | None,
    duration: float,
    span: Any,
    protocol: str,
) -> None:
    access_log.info(
        "request",
        extra={
            "client": client.decode("ascii", "replace"),
            "method": req.method.decode("ascii", "replace"),
            "host": req.host.decode("ascii", "replace"),
            "path": req.target.decode("ascii", "replace")[:256],
            "status": status,
            "route": route,
            "protocol": protocol,
            "upstream": f"{target.address}:{target.port}" if target is not None else "",
            "duration_ms": round(duration * 1000, 3),
            **span_fields(span),
        },
    )
