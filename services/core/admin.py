"""The admin HTTP listener every process has: /metrics, /healthz, /readyz, and the
status page: / (HTML) and /status.json (the same data; `waygate.core.statuspage`).

/healthz answers 200 while the event loop runs (liveness). /readyz answers 200
only when the process has declared itself ready and is not draining, else 503
with the reason in the body: Kubernetes stops routing to a draining pod.

A deliberately tiny HTTP/1.1 server: GET/HEAD only, one request per
connection, the request head must arrive within `head_timeout` and fit in 8 KiB.

Probes keep answering while slow or hostile clients hold connections
(a reconnecting slowloris must never turn /healthz into 503s, or Kubernetes
kills the pod again and again). The room is shared like this:
- at most `max_connections` are open at once, counted from accept until the
  socket is gone (a connection still sending its answer counts);
- each source IP may have at most `max_connections_per_source` heads pending;
- when a new connection finds its source's share or the whole room full, the
  OLDEST pending head (of that source, else of anyone) is aborted to make room
  (its socket goes at once, so one newcomer costs one pending head): a probe
  sends its head at once, so it is always among the newest and the one that
  has dawdled longest goes. Only when nothing can be dropped (every place is
  answering) is the new connection answered 503.
- an answer the peer does not read within `head_timeout` is aborted: the socket
  is released then, not when the peer finally reads.

Host names (DNS rebinding): a web page can point a name of its own at 127.0.0.1
or a pod IP and have the victim's browser read what this port answers. So a
request is answered only when its Host is an IP literal (what kubelet's probes
and Prometheus's pod scrapes send), `localhost`, or one of the names the
process was given (`--admin-hosts`, for a Service name a scraper uses); any
other Host is answered 421 with the reason. A request without Host (HTTP/1.0
tools) is answered: browsers always send one.
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import time
from typing import TYPE_CHECKING

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    generate_latest,
)

from waygate.core.statuspage import StatusSource, page_html

if TYPE_CHECKING:
    from waygate.core.settings import ProcessSettings

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192

DROPPED = Counter(
    "waygate_admin_connections_dropped_total",
    "Admin HTTP connections closed by a limit, by reason.",
    ["reason"],
)


class Readiness:
    """Whether the process should receive traffic, and why not."""

    def __init__(self) -> None:
        self._ready = False
        self.reason = "starting"

    @property
    def ready(self) -> bool:
        return self._ready

    def set_ready(self) -> None:
        self._ready, self.reason = True, "ready"

    def set_not_ready(self, reason: str) -> None:
        self._ready, self.reason = False, reason


def _response(
    status: str,
    body: bytes,
    content_type: str = "text/plain; charset=utf-8",
    head_only: bool = False,
) -> bytes:
    head = (
        f"HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {len(body)}\r\n"
        "Cache-Control: no-store\r\nConnection: close\r\n\r\n"
    ).encode()
    return head if head_only else head + body


class _Pending:
    """A connection whose request head has not arrived yet."""

    __slots__ = ("source", "started", "transport")

    def __init__(self, source: str, transport: asyncio.WriteTransport) -> None:
        self.source = source
        self.transport = transport
        self.started = time.monotonic()


class AdminServer:
    def __init__(
        self,
        readiness: Readiness,
        *,
        registry: CollectorRegistry = REGISTRY,
        head_timeout: float = 2.0,
        max_connections: int = 64,
        max_connections_per_source: int = 8,
        status: StatusSource | None = None,
        allowed_hosts: tuple[str, ...] = (),
    ) -> None:
        self._readiness = readiness
        # Names besides IP literals and localhost that Host may carry (lower case).
        self._allowed_hosts = frozenset(_bare_host(h) for h in allowed_hosts)
        # The status page (None: / and /status.json answer 404). Set before start.
        self.status = status
        self._page = page_html() if status is not None else b""
        self._registry = registry
        self._head_timeout = head_timeout
        self._max_connections = max_connections
        self._max_per_source = max_connections_per_source
        # Connections holding a place: from admission until their socket is gone.
        self._open: set[asyncio.StreamWriter] = set()
        # Insertion order is age order: the first entry is the oldest pending head.
        self._pending: dict[asyncio.StreamWriter, _Pending] = {}
        self._pending_by_source: dict[str, int] = {}
        self._server: asyncio.Server | None = None
        self.port = 0

    @classmethod
    def from_settings(
        cls,
        readiness: Readiness,
        settings: ProcessSettings,
        status: StatusSource | None = None,
    ) -> AdminServer:
        return cls(
            readiness,
            head_timeout=settings.admin_head_timeout,
            max_connections=settings.admin_max_connections,
            max_connections_per_source=settings.admin_max_connections_per_source,
            status=status,
            allowed_hosts=settings.admin_hosts,
        )

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEAD_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _answer(self, method: str, path: str) -> bytes:
        """The status page's two paths (its document may be gathered from elsewhere,
        as `waygate up`'s is); everything else from `_route`."""
        bare = path.split("?", 1)[0]
        if method in ("GET", "HEAD") and self.status is not None:
            head_only = method == "HEAD"
            if bare == "/":
                return _response("200 OK", self._page, "text/html; charset=utf-8", head_only)
            if bare == "/status.json":
                document = await self.status.document()
                body = json.dumps(document, separators=(",", ":"), default=str).encode()
                return _response("200 OK", body, "application/json", head_only)
        return self._route(method, path)

    def _route(self, method: str, path: str) -> bytes:
        head_only = method == "HEAD"
        if method not in ("GET", "HEAD"):
            return _response("405 Method Not Allowed", b"only GET and HEAD\n")
        path = path.split("?", 1)[0]
        if path == "/healthz":
            return _response("200 OK", b"ok\n", head_only=head_only)
        if path == "/readyz":
            if self._readiness.ready:
                return _response("200 OK", b"ready\n", head_only=head_only)
            return _response(
                "503 Service Unavailable",
                f"not ready: {self._readiness.reason}\n".encode(),
                head_only=head_only,
            )
        if path == "/metrics":
            return _response(
                "200 OK", generate_latest(self._registry), CONTENT_TYPE_LATEST, head_only
            )
        return _response(
            "404 Not Found",
            b"not found; try / /status.json /metrics /healthz /readyz\n",
            head_only=head_only,
        )

    # -------------------------------------------------------- room sharing

    def _drop_oldest_pending(self, source: str | None, reason: str) -> bool:
        """Abort the oldest pending head (of `source`, or of anyone); False if there is none."""
        for writer, pending in self._pending.items():
            if source is None or pending.source == source:
                self._forget(writer)
                self._open.discard(writer)  # its place is free now: abort drops the socket
                pending.transport.abort()  # its handler sees the reset and ends
                DROPPED.labels(reason).inc()
                return True
        return False

    def _admit(self, writer: asyncio.StreamWriter, source: str) -> bool:
        """Make room for a new connection's head; False when there is none to make."""
        if self._pending_by_source.get(source, 0) >= self._max_per_source:
            self._drop_oldest_pending(source, "source_limit")
        if len(self._open) >= self._max_connections and not self._drop_oldest_pending(
            None, "connection_limit"
        ):
            return False
        self._open.add(writer)
        self._pending[writer] = _Pending(source, writer.transport)
        self._pending_by_source[source] = self._pending_by_source.get(source, 0) + 1
        return True

    def _forget(self, writer: asyncio.StreamWriter) -> None:
        pending = self._pending.pop(writer, None)
        if pending is None:
            return
        left = self._pending_by_source[pending.source] - 1
        if left:
            self._pending_by_source[pending.source] = left
        else:
            del self._pending_by_source[pending.source]

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        peer = writer.get_extra_info("peername")
        source = str(peer[0]) if isinstance(peer, tuple) else "local"
        try:
            if not self._admit(writer, source):
                DROPPED.labels("connection_limit").inc()
                writer.write(_response("503 Service Unavailable", b"too many admin connections\n"))
                return
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), self._head_timeout)
            except (
                TimeoutError,
                asyncio.IncompleteReadError,
                asyncio.LimitOverrunError,
                ConnectionError,
            ):
                writer.write(
                    _response("400 Bad Request", b"incomplete, oversized or slow request head\n")
                )
                return
            finally:
                self._forget(writer)
            request_line, *header_lines = head.decode("latin-1").split("\r\n")
            parts = request_line.split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                writer.write(_response("400 Bad Request", b"malformed request line\n"))
                return
            refusal = self._host_refusal(header_lines)
            if refusal is not None:
                writer.write(refusal)
                return
            writer.write(await self._answer(parts[0], parts[1]))
        finally:
            try:
                await self._close(writer)
            finally:
                self._open.discard(writer)

    def _host_refusal(self, header_lines: list[str]) -> bytes | None:
        """The answer for a request whose Host this port does not serve (see the
        module docstring), or None when it does."""
        hosts = [
            line.split(":", 1)[1].strip() for line in header_lines if line[:5].lower() == "host:"
        ]
        if not hosts:
            return None
        if len(hosts) > 1:
            return _response("400 Bad Request", b"more than one Host header\n")
        host = _bare_host(hosts[0])
        if host == "localhost" or host in self._allowed_hosts or _is_ip(host):
            return None
        return _response(
            "421 Misdirected Request",
            b"this admin port answers only IP addresses, localhost and its --admin-hosts "
            b"names as Host (DNS rebinding protection)\n",
        )

    async def _close(self, writer: asyncio.StreamWriter) -> None:
        """Send what was written, then close; abort a peer that does not read it in time
        (close() alone would keep the socket until the peer reads)."""
        try:
            await asyncio.wait_for(writer.drain(), self._head_timeout)
            writer.close()
            await asyncio.wait_for(writer.wait_closed(), 1.0)
        except (ConnectionError, TimeoutError):
            writer.transport.abort()


def _bare_host(value: str) -> str:
    """A Host value without its port, brackets and trailing dot, lower case."""
    host = value.strip().lower()
    if host.startswith("["):
        return host[1:].split("]", 1)[0]
    name, colon, port = host.rpartition(":")
    if colon and port.isdigit() and ":" not in name:
        host = name
    return host.rstrip(".")


def _is_ip(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
    except ValueError:
        return False
    return True
