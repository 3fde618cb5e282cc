"""ingress-nginx's proxy-http-version "1.0" and literal redirect targets, on real sockets.

proxy-http-version 1.0 (waygate.proxy.http10): backends that record the raw request
bytes they get (the request line says HTTP/1.0, `Connection: close`, a chunked
client body arrives whole with its Content-Length, from HTTP/1.1 and HTTP/2
clients alike), answer as HTTP/1.0 servers do (no Content-Length: the body runs to
the close), or keep the connection open regardless (the proxy still never reuses
it). The expectations are nginx 1.22's `proxy_http_version 1.0` as seen on the wire
(request bytes recorded behind a real nginx: `POST /b HTTP/1.0`, `Connection:
close`, `Content-Length: 6` for a chunked 6-byte body, with and without
`proxy_request_buffering off`).

permanent-redirect / temporal-redirect (the route's `redirect_location`):
ingress-nginx renders `return CODE URL;`, so the Location is the target as
written, with or without the client's own query; a code that is not a redirect
(300) answers the target as the body, as nginx's return does.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from tests.integration.proxy.test_ingress_responses import SERVICE  # demo/svc: http, h2c
from tests.integration.proxy.test_request_core import HOST, ask
from tests.support.h2client import H2Client
from tests.support.h2harness import H2Backend
from tests.support.proxyharness import RecordingUpstream, running_proxy
from waygate.proxy.bodybuffer import BufferLimits
from waygate.proxy.routing import Defaults, build_table
from waygate.proxy.server import Limits
from waygate.proxy.upstream_tls import UpstreamTLS
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    InsecureEdgePolicy,
    Redirect,
    Route,
    RouteBackend,
    RouteFilters,
    RouteTLS,
    StickySessions,
    TLSTermination,
)

CLIENTS = ["http/1.1", "h2c"]
# A reencrypt route (never asked here): the proxy has the reencrypt step.
_REENCRYPT = RouteTLS(
    termination=TLSTermination.REENCRYPT,
    insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW,
    destination_system_ca=True,
)


def _route(name: str = "old-0", port: str = "http", **kw: Any) -> Route:
    return Route(
        namespace="demo",
        name=name,
        host=HOST,
        backends=(RouteBackend(service="svc", port=port, weight=1),),
        origin="Ingress demo/old",
        sticky=StickySessions(disable_cookies=True),
        **kw,
    )


def _table(routes: list[Route], h1_port: int, h2_port: int = 0) -> Any:
    endpoint = Endpoint(
        namespace="demo",
        service="svc",
        address="127.0.0.1",
        ports=(EndpointPort("http", h1_port), EndpointPort("h2", h2_port)),
    )
    return build_table(
        {r.key: r for r in routes},
        {SERVICE.key: (endpoint,)},
        {SERVICE.key: SERVICE},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
    )


class RawBackend:
    """A real backend that records each connection's raw request bytes. It reads one
    request (its head, then a Content-Length body; a chunked one to its last chunk)
    and answers as `answer` says: "http10" (HTTP/1.0, no Content-Length, then closes),
    or "keep" (HTTP/1.1 with a Content-Length, keeping the connection open whatever
    the request asked: the proxy must not reuse it)."""

    def __init__(self, answer: str = "http10") -> None:
        self.answer = answer
        self.connections: list[bytearray] = []
        self.closed_by_peer = 0  # connections the proxy closed (EOF read here)
        self.port = 0
        self._server: asyncio.AbstractServer | None = None
        self._writers: set[asyncio.StreamWriter] = set()

    async def __aenter__(self) -> RawBackend:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for writer in list(self._writers):
            writer.transport.abort()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raw = bytearray()
        self.connections.append(raw)
        self._writers.add(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                raw += head
                lower = head.lower()
                if b"\r\ncontent-length: " in lower:
                    length = int(lower.split(b"\r\ncontent-length: ")[1].split(b"\r\n")[0])
                    raw += await reader.readexactly(length)
                elif b"\r\ntransfer-encoding: chunked" in lower:
                    while not raw.endswith(b"\r\n0\r\n\r\n") and not raw.endswith(b"\n0\r\n\r\n"):
                        raw += await reader.readuntil(b"\r\n")
                if self.answer == "http10":
                    writer.write(b"HTTP/1.0 200 OK\r\nContent-Type: text/plain\r\n\r\nold server")
                    await writer.drain()
                    return
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\nkept")
                await writer.drain()
        except asyncio.IncompleteReadError as exc:
            if not exc.partial:
                self.closed_by_peer += 1
        except ConnectionError:
            pass
        finally:
            self._writers.discard(writer)
            writer.close()


async def _until(check: Callable[[], bool], what: str) -> None:
    async with asyncio.timeout(10):
        while not check():
            await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def _proxy(
    routes: list[Route], h1_port: int, h2_port: int = 0, **kw: Any
) -> AsyncIterator[Any]:
    async with running_proxy(_table(routes, h1_port, h2_port), **kw) as (server, port):
        yield server, port


async def _post(client: str, port: int, body: bytes, *, chunked: bool) -> Any:
    """A POST of `body` in two pieces: chunked (HTTP/1.1) or without a content-length
    (HTTP/2), else with its length."""
    half = len(body) // 2
    if client == "h2c":
        h2 = await H2Client.connect(port)
        try:
            headers = [] if chunked else [("content-length", str(len(body)))]
            stream = h2.start("POST", "/upload", HOST, headers, end=False)
            await h2.send_body(stream, body[:half], end=False)
            await h2.send_body(stream, body[half:], end=True)
            response = await h2.wait(stream)
        finally:
            await h2.close()
        return response.status, response.body
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        if chunked:
            framing = b"Transfer-Encoding: chunked\r\n"
            pieces = [b"%x\r\n%s\r\n" % (len(p), p) for p in (body[:half], body[half:])]
            pieces.append(b"0\r\n\r\n")
        else:
            framing = b"Content-Length: %d\r\n" % len(body)
            pieces = [body[:half], body[half:]]
        writer.write(b"POST /upload HTTP/1.1\r\nHost: %s\r\n%s\r\n" % (HOST.encode(), framing))
        for piece in pieces:
            writer.write(piece)
            await writer.drain()
        data = await asyncio.wait_for(reader.read(-1), 10)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    if b"transfer-encoding: chunked" in head.lower():
        out = b""
        while True:
            size_line, _, rest = rest.partition(b"\r\n")
            size = int(size_line, 16)
            if not size:
                break
            out, rest = out + rest[:size], rest[size + 2 :]
        rest = out
    return status, rest


def _request_head(raw: bytes) -> tuple[bytes, dict[bytes, bytes], bytes]:
    head, _, body = bytes(raw).partition(b"\r\n\r\n")
    line, *fields = head.split(b"\r\n")
    names = {}
    for field in fields:
        name, _, value = field.partition(b":")
        assert name.lower() not in names, f"{name!r} twice"
        names[name.lower()] = value.strip()
    return line, names, body


# ---------------------------------------------------------------- proxy-http-version 1.0


@pytest.mark.parametrize("client", CLIENTS)
async def test_the_request_is_http_1_0_with_connection_close_and_read_to_the_close(client):
    # proxy.go: It("should change the default proxy HTTP version") (proxy_http_version
    # 1.0): asserted on what the backend receives and what the client gets.
    async with (
        RawBackend("http10") as backend,
        _proxy([_route(upstream_http10=True)], backend.port) as (server, port),
    ):
        answer = await ask(client, port, "/path?q=1")
        assert (answer.status, answer.body) == (200, b"old server")
        [raw] = backend.connections
        line, fields, body = _request_head(raw)
        assert line == b"GET /path?q=1 HTTP/1.0"
        assert fields[b"connection"] == b"close"
        assert b"transfer-encoding" not in fields and body == b""
        assert server.pool.idle_count() == 0


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("buffering", [True, False])
async def test_a_body_of_unknown_length_is_sent_whole_with_its_content_length(client, buffering):
    # nginx buffers a chunked body for HTTP/1.0 even with proxy_request_buffering off.
    payload = b"0123456789" * 5000
    route = _route(upstream_http10=True, request_buffering=buffering)
    async with RawBackend("http10") as backend, _proxy([route], backend.port) as (_, port):
        status, body = await _post(client, port, payload, chunked=True)
        assert (status, body) == (200, b"old server")
        [raw] = backend.connections
        line, fields, sent = _request_head(raw)
        assert line == b"POST /upload HTTP/1.0"
        assert fields[b"content-length"] == b"%d" % len(payload)
        assert b"transfer-encoding" not in fields
        assert fields[b"connection"] == b"close"
        assert sent == payload  # the bare payload: no chunk framing left


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_body_with_its_length_goes_as_it_came(client):
    payload = b"x" * 70000
    route = _route(upstream_http10=True, request_buffering=False)
    async with RawBackend("http10") as backend, _proxy([route], backend.port) as (_, port):
        status, _ = await _post(client, port, payload, chunked=False)
        assert status == 200
        line, fields, sent = _request_head(backend.connections[0])
        assert line == b"POST /upload HTTP/1.0"
        assert fields[b"content-length"] == b"70000" and sent == payload


async def test_a_chunked_body_past_the_buffers_is_answered_413(tmp_path):
    limits = Limits(
        request_buffer=BufferLimits(
            memory_per_request=1024, memory_total=1 << 20, max_body=8192, directory=str(tmp_path)
        )
    )
    route = _route(upstream_http10=True, request_buffering=False)
    async with (
        RawBackend("http10") as backend,
        _proxy([route], backend.port, limits=limits) as (
            _,
            port,
        ),
    ):
        status, body = await _post("http/1.1", port, b"y" * 20000, chunked=True)
        assert status == 413
        assert b"larger than the proxy buffers" in body
        assert backend.connections == []  # the backend never asked


async def test_the_connection_is_never_reused_nor_taken_from_the_pool():
    plain = _route("plain-0", path="/plain")
    old = _route("old-0", upstream_http10=True)
    async with RawBackend("keep") as backend, _proxy([plain, old], backend.port) as (server, port):
        # A plain route's request leaves an idle keep-alive connection in the pool...
        answer = await ask("http/1.1", port, "/plain")
        assert (answer.status, answer.body) == (200, b"kept")
        await _until(lambda: server.pool.idle_count() == 1, "the plain connection pooled")
        # ...which an HTTP/1.0 request does not take; and its own is closed after it,
        # though the backend would keep it open.
        for _ in range(2):
            answer = await ask("http/1.1", port, "/old")
            assert (answer.status, answer.body) == (200, b"kept")
        assert len(backend.connections) == 3
        assert [bytes(c).split(b"\r\n", 1)[0] for c in backend.connections] == [
            b"GET /plain HTTP/1.1",
            b"GET /old HTTP/1.0",
            b"GET /old HTTP/1.0",
        ]
        await _until(lambda: backend.closed_by_peer == 2, "the proxy closed both 1.0 connections")
        assert server.pool.idle_count() == 1  # the plain one, still there


@pytest.mark.parametrize("client", CLIENTS)
async def test_beside_a_reencrypt_route_it_dials_plain_and_never_reuses(client):
    # Regression (merge a8edc24, kept by c9965f2): the 1.0 pool scope once rode on
    # RouteEntry.upstream_scope, whose non-None value now means TLS to the backend
    # (Forward.upstream_scope), so with the reencrypt step present (a route
    # reencrypts; the real proxy always has it) a 1.0 route sent a TLS handshake
    # to its plain backend.
    plain = _route("plain-0", path="/plain")
    old = _route("old-0", upstream_http10=True)
    secure = _route("secure-0", path="/secure", tls=_REENCRYPT)
    async with (
        RawBackend("keep") as backend,
        _proxy([plain, old, secure], backend.port) as (server, port),
    ):
        server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
        answer = await ask("http/1.1", port, "/plain")  # leaves an idle plain connection
        assert (answer.status, answer.body) == (200, b"kept")
        await _until(lambda: server.pool.idle_count() == 1, "the plain connection pooled")
        for _ in range(2):
            answer = await ask(client, port, "/old")
            assert (answer.status, answer.body) == (200, b"kept")
        assert [bytes(c).split(b"\r\n", 1)[0] for c in backend.connections] == [
            b"GET /plain HTTP/1.1",
            b"GET /old HTTP/1.0",  # in plain HTTP, on a connection of its own
            b"GET /old HTTP/1.0",
        ]
        await _until(lambda: backend.closed_by_peer == 2, "the proxy closed both 1.0 connections")
        assert server.pool.idle_count() == 1  # the plain one, untaken


@pytest.mark.parametrize("client", CLIENTS)
async def test_without_it_the_backend_gets_http_1_1_and_keep_alive(client):
    async with RawBackend("keep") as backend, _proxy([_route()], backend.port) as (server, port):
        answer = await ask(client, port, "/")
        assert answer.status == 200
        line, fields, _ = _request_head(backend.connections[0])
        assert line == b"GET / HTTP/1.1" and b"connection" not in fields
        await _until(lambda: server.pool.idle_count() == 1, "pooled")


async def test_an_upgrade_is_refused_with_the_reason():
    async with (
        RawBackend("http10") as backend,
        _proxy([_route(upstream_http10=True)], backend.port) as (_, port),
    ):
        answer = await ask(
            "http/1.1", port, "/ws", [("Upgrade", "websocket"), ("Connection", "Upgrade")]
        )
        assert answer.status == 502
        reason = answer.headers.get("x-waygate-error", "")
        assert "HTTP/1.0" in reason and "websocket" in reason
        assert backend.connections == []


async def test_connection_proxy_header_gives_way_to_connection_close():
    route = _route(upstream_http10=True, connection_header="keep-alive")
    async with RawBackend("http10") as backend, _proxy([route], backend.port) as (_, port):
        assert (await ask("http/1.1", port, "/")).status == 200
        _, fields, _ = _request_head(backend.connections[0])  # (no Connection twice)
        assert fields[b"connection"] == b"close"


@pytest.mark.parametrize("client", CLIENTS)
async def test_an_http2_backend_is_unaffected(client):
    backend = H2Backend()
    await backend.start()
    try:
        route = _route(port="grpc", upstream_http10=True)
        async with _proxy([route], 0, backend.port) as (_, port):
            answer = await ask(client, port, "/h2")
            assert answer.status == 200
    finally:
        await backend.stop()


# ---------------------------------------------------------------- literal redirects


def _redirecting(location: str, status: int) -> Route:
    return _route(
        redirect_location=location, filters=RouteFilters(redirect=Redirect(status=status))
    )


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("path", ["/something", "/something?client=query&x=1"])
async def test_the_location_is_the_target_exactly_as_written(client, path):
    # redirect.go: It("should respond with a standard redirect code") / "custom redirect
    # code": `return CODE URL;` — nginx's return appends no $args.
    cases = [
        ("http://redirect.example.com", 301),
        ("https://new.example.com/landing?from=old&b=%20c", 308),
        ("https://t.example.com:8443/a/?x=1", 302),
    ]
    upstream = RecordingUpstream()
    await upstream.start()
    try:
        for location, status in cases:
            async with _proxy([_redirecting(location, status)], upstream.port) as (_, port):
                answer = await ask(client, port, path)
                assert answer.status == status
                assert answer.headers["location"] == location
        assert upstream.requests == []  # answered by the proxy
    finally:
        await upstream.stop()


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_target_path_is_made_absolute_as_nginx(client):
    async with _proxy([_redirecting("/landing?x=1", 301)], 1) as (_, port):
        answer = await ask(client, port, "/old?q=2")
        assert answer.status == 301
        assert answer.headers["location"] == f"http://{HOST}/landing?x=1"


@pytest.mark.parametrize("client", CLIENTS)
async def test_code_300_answers_the_target_as_the_body(client):
    # nginx's `return 300 URL` (redirect.go accepts 300): the text as the body, no Location.
    location = "https://choices.example.com/?a=1"
    async with _proxy([_redirecting(location, 300)], 1) as (_, port):
        answer = await ask(client, port, "/x?y=z")
        assert (answer.status, answer.body) == (300, location.encode())
        assert "location" not in answer.headers
        assert answer.headers["content-type"] == "text/html"
        answer = await ask(client, port, "/x", method="HEAD")
        assert (answer.status, answer.body) == (300, b"")


async def test_expect_100_continue_is_answered_by_the_proxy():
    # An HTTP/1.0 backend sends no 100 (RFC 9110 section 10.1.1): the proxy invites the
    # body itself, as nginx does, with request buffering off too.
    route = _route(upstream_http10=True, request_buffering=False)
    async with RawBackend("http10") as backend, _proxy([route], backend.port) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(
                b"PUT /up HTTP/1.1\r\nHost: %s\r\nContent-Length: 5\r\n"
                b"Expect: 100-continue\r\n\r\n" % HOST.encode()
            )
            interim = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
            assert interim.startswith(b"HTTP/1.1 100")
            writer.write(b"hello")
            data = await asyncio.wait_for(reader.read(-1), 10)
        finally:
            writer.close()
        assert data.startswith(b"HTTP/1.1 200") and data.endswith(b"old server")
        line, _, sent = _request_head(backend.connections[0])
        assert line == b"PUT /up HTTP/1.0" and sent == b"hello"
