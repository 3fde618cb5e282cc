"""The admin HTTP listener every process has: /metrics, /healthz, /readyz.

/healthz answers 200 while the event loop runs (liveness). /readyz answers 200
only when the process has declared itself ready and is not draining, else 503
with the reason in the body: Kubernetes stops routing to a draining pod.

A deliberately tiny HTTP/1.1 server: GET/HEAD only, one request per
connection, the request head must arrive within `head_timeout` and fit in 8 KiB,
and at most `max_connections` are open at once (more are closed at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 8192


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


class AdminServer:
    def __init__(
        self,
        readiness: Readiness,
        *,
        registry: CollectorRegistry = REGISTRY,
        head_timeout: float = 5.0,
        max_connections: int = 64,
    ) -> None:
        self._readiness = readiness
        self._registry = registry
        self._head_timeout = head_timeout
        self._max_connections = max_connections
        self._open = 0
        self._server: asyncio.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port, limit=MAX_HEAD_BYTES)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

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
            "404 Not Found", b"not found; try /metrics /healthz /readyz\n", head_only=head_only
        )

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open += 1
        try:
            if self._open > self._max_connections:
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
            parts = head.split(b"\r\n", 1)[0].decode("latin-1").split(" ")
            if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
                writer.write(_response("400 Bad Request", b"malformed request line\n"))
                return
            writer.write(self._route(parts[0], parts[1]))
        finally:
            self._open -= 1
            with contextlib.suppress(ConnectionError):
                await asyncio.wait_for(writer.drain(), self._head_timeout)
            writer.close()
            with contextlib.suppress(ConnectionError, asyncio.TimeoutError):
                await asyncio.wait_for(writer.wait_closed(), 1.0)
