"""The collaborators an exchange may use, named, built once and passed in.

An exchange (`exchange.Exchange`, HTTP/1.1 upstream; `h2upstream.H2Exchange`,
HTTP/2 upstream) and the upstream connections see the proxy only through an
`ExchangeContext`: no exchange reaches into `server.ProxyServer`, and nothing
is attached to either after construction. `ProxyServer` builds the one
context of its process and swaps `view` when a resolver view arrives;
`draining` turns True once, on SIGTERM.
"""

from __future__ import annotations

import asyncio
from typing import Any

from waygate.proxy.bodybuffer import BufferLimits, RequestBuffers
from waygate.proxy.metrics import ProxyMetrics
from waygate.proxy.mirror import Mirrors
from waygate.proxy.pool import Pool
from waygate.proxy.records import Records
from waygate.proxy.upstream import Dialer
from waygate.proxy.upstream_h1 import UpstreamConnection
from waygate.proxy.view import ProxyView


class ExchangeContext:
    """Everything an exchange may use (see the module docstring)."""

    __slots__ = (
        "buffers",
        "dialer",
        "draining",
        "h2",
        "limits",
        "loop",
        "metrics",
        "mirrors",
        "pool",
        "records",
        "upstream_tls",
        "upstreams",
        "view",
    )

    def __init__(
        self,
        *,
        loop: asyncio.AbstractEventLoop,
        view: ProxyView,
        limits: Any,
        metrics: ProxyMetrics,
        records: Records,
        pool: Pool[UpstreamConnection],
        dialer: Dialer,
        mirrors: Mirrors,
        upstream_tls: Any = None,
    ) -> None:
        self.loop = loop
        self.view = view  # the current ProxyView (swapped whole)
        self.limits = limits  # server.Limits
        # Request buffering's memory and files (waygate.proxy.bodybuffer).
        self.buffers = RequestBuffers(getattr(limits, "request_buffer", BufferLimits()))
        self.metrics = metrics
        self.records = records
        # The endpoints' connection bound and the idle HTTP/1.1 connections.
        self.pool = pool
        self.dialer = dialer  # the one connect step (direct or tunnelled)
        self.mirrors = mirrors  # RequestMirror copies in flight
        # Reencrypt (waygate.proxy.upstream_tls.UpstreamTLS; None: no route reencrypts).
        self.upstream_tls = upstream_tls
        # The open upstream connections, HTTP/1.1 and HTTP/2 (closed with the server).
        self.upstreams: set[Any] = set()
        # The HTTP/2 upstream connections (h2upstream.H2Upstreams), set once by it.
        self.h2: Any = None
        self.draining = False
