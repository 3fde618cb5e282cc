"""Request mirrors: send a copy of a request head to another backend, fire and forget.

The primary exchange never waits for a mirror: `Mirrors.send` starts a task
and returns. Each copy dials through the proxy's own dialer (so tunnelled
endpoints work), writes the head, waits at most `timeout` for the answer's
head and closes: the answer is dropped. A copy is a protocol on what the
dialer returned (a socket, or a tunnel's data connection as it is:
`upstream.start`), holding at most `MAX_ANSWER_HEAD` bytes of the answer.
Bounded: at most `limit` copies in
flight; beyond that a copy is dropped and counted, so a slow mirror backend
can neither slow the primary nor grow memory. Requests with a body are not
mirrored (the body streams once, to the primary).

Two kinds of copies: Gateway API RequestMirror (an endpoint of a Service, picked
per request by the routing table) and ingress-nginx's mirror-target (a URL:
`UrlMirror`, prepared once per routing table and route). A URL copy goes to the
URL's host and port directly (https: TLS 1.2+, the certificate verified against
the system CAs and the URL's host), with the URL's path -- `$request_uri` in it
replaced by the request's target, else the request's query appended -- and the
Host `mirror-host` names (else the URL's); a request with a body is copied
with it once its buffered body is all in (`send_with_body`: a body in memory,
at most `MAX_BODY` bytes; an unbuffered or larger one is not copied), or
without it under `mirror-request-body: off`. A route's URL copies in flight are
bounded too (`UrlTarget.limit`): one route's slow mirror cannot take every slot.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from typing import Any
from urllib.parse import urlsplit

from waygate.proxy import http1
from waygate.proxy.upstream import start

log = logging.getLogger(__name__)

DEFAULT_LIMIT = 256
DEFAULT_TIMEOUT = 5.0
# An answer's head larger than this is not read further: it is dropped anyway.
MAX_ANSWER_HEAD = 16384
# URL copies in flight per route (beyond: dropped and counted, as past `limit`).
ROUTE_LIMIT = 32
# The largest body a copy carries: a buffered body held in memory up to this (a
# larger one, or one the buffer spilled to disk, is not mirrored; counted dropped).
MAX_BODY = 64 * 1024


class Mirrors:
    def __init__(
        self, dialer: Any, *, limit: int = DEFAULT_LIMIT, timeout: float = DEFAULT_TIMEOUT
    ) -> None:
        self.dialer = dialer
        self.limit = limit
        self.timeout = timeout
        self.tasks: set[asyncio.Task[None]] = set()
        self.sent = 0
        self.dropped = 0
        self.failed = 0

    def send(self, target: Any, head: bytes) -> bool:
        """Start one copy; False when it was dropped (too many in flight, the
        process's or, for a URL copy, its route's)."""
        url = target if isinstance(target, UrlTarget) else None
        if len(self.tasks) >= self.limit or (url is not None and url.in_flight >= url.limit):
            self.dropped += 1
            return False
        task = asyncio.get_running_loop().create_task(self._send(target, head))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if url is not None:
            url.in_flight += 1
            task.add_done_callback(url.done)
        return True

    async def _send(self, target: Any, head: bytes) -> None:
        transport: Any = None
        try:
            async with asyncio.timeout(self.timeout):
                connection = await self.dialer.connect(target, self.timeout, None)
                answer = _Answer(head)
                if isinstance(target, UrlTarget) and target.tls is not None:
                    transport, _ = await start(
                        connection,
                        lambda: answer,
                        tls=target.tls,
                        server_hostname=target.address,
                        timeout=self.timeout,
                    )
                else:
                    transport, _ = await start(connection, lambda: answer)
                answered = await answer.done
            if answered:
                self.sent += 1
            else:
                self.failed += 1
        except (OSError, TimeoutError, ssl.SSLError):
            self.failed += 1
        except Exception as exc:  # a dialer's own error type (ConnectError)
            self.failed += 1
            log.debug("mirror copy to %s failed: %s", target, exc)
        finally:
            if transport is not None:
                transport.close()

    async def close(self) -> None:
        """Cancel the copies in flight (the proxy is stopping)."""
        for task in list(self.tasks):
            task.cancel()
        for task in list(self.tasks):
            with contextlib.suppress(asyncio.CancelledError):
                await task


class _Answer(asyncio.Protocol):
    """Writes the copy's head; `done` is True once the answer's head arrived, False
    when the backend closed first or sent more than `MAX_ANSWER_HEAD` bytes without one
    (a result, not an exception: nobody may be waiting for it any more)."""

    def __init__(self, head: bytes) -> None:
        self.head = head
        self.seen = bytearray()
        self.done: asyncio.Future[bool] = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        transport.write(self.head)

    def data_received(self, data: bytes) -> None:
        if self.done.done():
            return
        # Only the tail of what came before can hold the start of the blank line.
        start_at = max(0, len(self.seen) - 3)
        self.seen += data
        if self.seen.find(b"\r\n\r\n", start_at) >= 0:
            self.done.set_result(True)
        elif len(self.seen) > MAX_ANSWER_HEAD:
            self.done.set_result(False)

    def eof_received(self) -> bool:
        self._ended()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._ended()

    def _ended(self) -> None:
        if not self.done.done():
            self.done.set_result(False)


# ---------------------------------------------------------------- ingress-nginx mirror-target

_TLS: ssl.SSLContext | None = None


def _client_tls() -> ssl.SSLContext:
    """The system CAs, TLS 1.2+, the host name checked: made once, on first use."""
    global _TLS
    if _TLS is None:
        _TLS = ssl.create_default_context()
        _TLS.minimum_version = ssl.TLSVersion.TLSv1_2
    return _TLS


class UrlTarget:
    """Where one route's URL copies go (dialled as a routing Target is: direct)."""

    __slots__ = ("address", "in_flight", "limit", "port", "tls")

    tunnel = False
    node = ""

    def __init__(self, address: str, port: int, tls: ssl.SSLContext | None) -> None:
        self.address = address
        self.port = port
        self.tls = tls
        self.limit = ROUTE_LIMIT
        self.in_flight = 0

    def done(self, _task: Any) -> None:
        self.in_flight -= 1


class UrlMirror:
    """One route's mirror-target, parsed once: `head(req, ...)` is a request's copy."""

    __slots__ = ("host", "path", "query_appended", "request_body", "target")

    def __init__(self, url: str, host: str, request_body: bool) -> None:
        split = urlsplit(url.replace("$request_uri", "/"))
        secure = split.scheme == "https"
        address = split.hostname or ""
        self.target = UrlTarget(
            address, split.port or (443 if secure else 80), _client_tls() if secure else None
        )
        rest = url.split("://", 1)[1]
        cut = min((i for i in (rest.find("/"), rest.find("$")) if i >= 0), default=len(rest))
        self.path = rest[cut:].encode() or b"/"
        self.query_appended = b"$request_uri" not in self.path
        self.host = b"Host: " + (host or address).encode()
        self.request_body = request_body

    def head(self, req: http1.RequestHead, context: Any, mode: str) -> bytes | None:
        """The copy's head, without a body (None: an upgrade, never mirrored); a
        request with a body gets it added by `send_with_body` (mirror-request-body on)."""
        if req.upgrade:
            return None
        copy = req.copy()
        if self.query_appended:
            query = req.target.find(b"?")
            copy.target = self.path + (req.target[query:] if query >= 0 else b"")
        else:
            copy.target = self.path.replace(b"$request_uri", req.target)
        fields = req.fields
        copy.fields = self.host + fields[fields.find(b"\r\n") :]
        copy.content_length = -1
        copy.chunked = False
        return http1.build_upstream_head(copy, context, mode, b"")


def send_with_body(mirrors: Mirrors, forward: Any, buffer: Any) -> None:
    """A request's buffered body is all in (`bodybuffer.BodyBuffer`, not replayed yet):
    its copy goes with it when it is in memory and at most `MAX_BODY` bytes (once)."""
    target, head = forward.body_mirror
    forward.body_mirror = None
    if buffer.file is not None or buffer.size != buffer.memory or buffer.size > MAX_BODY:
        mirrors.dropped += 1
        return
    body = b"".join(buffer.chunks)
    if forward.req.chunked and not forward.http10:
        # The buffer holds the body as it goes upstream: chunk-framed (re-chunked by
        # the Exchange's reader; proxy-http-version 1.0's is the bare payload).
        mirrors.send(target, head[:-2] + b"Transfer-Encoding: chunked\r\n\r\n" + body)
        return
    mirrors.send(target, head[:-2] + b"Content-Length: %d\r\n\r\n" % len(body) + body)
