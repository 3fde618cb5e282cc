"""Every per-request rule of `waygate.proxy.decision`, through every pair of protocols.

Each rule runs once for each of HTTP/1.1 and HTTP/2 (h2c) clients x HTTP/1.1
and HTTP/2 (h2c) backends, against a real proxy on real sockets with real
backends (`RecordingUpstream`, `H2Backend`). The backend is always the one
Service `other/svc` with two ports, `http` (HTTP/1.1) and `grpc`
(appProtocol kubernetes.io/h2c), named by a route of namespace `demo`: every
case is a cross-namespace backendRef to one port of a multi-port Service,
and the backend, not the client, decides the upstream protocol.
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
import dataclasses
import hashlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import h2.exceptions as h2_exceptions
import pytest

from tests.support.authservice import AuthService
from tests.support.h2client import H2Client
from tests.support.h2harness import H2Backend
from tests.support.proxyharness import RecordingUpstream, running_proxy
from waygate.core.tracing import configure_tracing
from waygate.proxy import ratelimit
from waygate.proxy.routing import Defaults, Target, build_table
from waygate.proxy.upstream import Dialer, tcp_connect
from waygate.resolver.model import (
    BalancePolicy,
    Cors,
    Endpoint,
    EndpointPort,
    ExternalAuth,
    InsecureEdgePolicy,
    Mirror,
    PathMatchType,
    RateLimit,
    Redirect,
    Route,
    RouteAccess,
    RouteBackend,
    RouteFilters,
    RouteMatch,
    RouteTLS,
    Service,
    ServicePort,
    TLSTermination,
)

CLIENTS = ("http/1.1", "h2c")
BACKENDS = ("http/1.1", "h2c")
PAIRS = [(client, backend) for client in CLIENTS for backend in BACKENDS]
HOST = "core.test"
SERVICE = Service(
    namespace="other",
    name="svc",
    ports=(
        ServicePort("http", 80, "http"),
        ServicePort("grpc", 81, "h2", app_protocol="kubernetes.io/h2c"),
    ),
)


class Answer:
    def __init__(self, status: int, headers: dict[str, str], body: bytes) -> None:
        self.status = status
        self.headers = headers
        self.body = body


class Backends:
    """The two real backends behind other/svc's two ports."""

    def __init__(self) -> None:
        self.h1 = RecordingUpstream()
        self.h2 = H2Backend()

    def endpoint(self, address: str = "127.0.0.1", **kw: Any) -> Endpoint:
        return Endpoint(
            namespace="other",
            service="svc",
            address=address,
            ports=(EndpointPort("http", self.h1.port), EndpointPort("h2", self.h2.port)),
            **kw,
        )

    def traceparents(self, backend: str) -> list[str]:
        """The traceparent each request carried, as the backend received it."""
        if backend == "h2c":
            return [dict(fields).get(b"traceparent", b"").decode() for fields in self.h2.headers]
        out = []
        for record in self.h1.requests:
            values = [v for k, v in record["headers"] if k.lower() == "traceparent"]  # type: ignore[attr-defined]
            out.append(values[0] if values else "")
        return out

    def requests(self, backend: str) -> int:
        return len(self.h2.received if backend == "h2c" else self.h1.requests)


@pytest.fixture
async def backends() -> AsyncIterator[Backends]:
    made = Backends()
    await made.h1.start()
    await made.h2.start()
    yield made
    await made.h1.stop()
    await made.h2.stop()


def core_route(backend: str, **kw: Any) -> Route:
    port = "grpc" if backend == "h2c" else "http"
    backends = kw.pop(
        "backends", (RouteBackend(service="svc", namespace="other", port=port, weight=1),)
    )
    return Route(namespace="demo", name="core", host=HOST, backends=backends, **kw)


def built(routes: list[Route], endpoints: list[Endpoint], **kw: Any) -> Any:
    grouped: dict[tuple[str, str], tuple[Endpoint, ...]] = {}
    for ep in endpoints:
        grouped[ep.service_key] = (*grouped.get(ep.service_key, ()), ep)
    return build_table(
        {r.key: r for r in routes},
        grouped,
        {SERVICE.key: SERVICE},
        defaults=Defaults(**kw),
        cookie_key=b"k" * 32,
    )


async def ask(
    client: str,
    port: int,
    path: str = "/",
    headers: list[tuple[str, str]] | None = None,
    method: str = "GET",
) -> Answer:
    """One request (a GET unless `method`) from a client of that protocol (a new
    connection each time)."""
    if client == "h2c":
        h2 = await H2Client.connect(port)
        try:
            response = await h2.request(method, path, HOST, headers)
        finally:
            await h2.close()
        return Answer(
            response.status,
            {k.decode(): v.decode() for k, v in response.headers},
            response.body,
        )
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    extra = "".join(f"{k}: {v}\r\n" for k, v in headers or [])
    writer.write(
        f"{method} {path} HTTP/1.1\r\nHost: {HOST}\r\n{extra}Connection: close\r\n\r\n".encode()
    )
    return await _h1_answer(reader, writer)


async def _h1_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Answer:
    """The answer an HTTP/1.1 client reads to the end (the proxy closes)."""
    data = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:])
    return Answer(int(lines[0].split(" ")[1]), {k.lower(): v for k, v in fields.items()}, body)


@pytest.fixture(autouse=True)
def _tracing() -> None:
    configure_tracing("proxy-test", None)  # the process's real provider, no exporter


# ---------------------------------------------------------------- the rules


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_the_backend_decides_the_upstream_protocol(backends, client, backend):
    table = built([core_route(backend)], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        answer = await ask(client, port, "/which")
    assert answer.status == 200
    # A cross-namespace backendRef to the h2c port of a multi-port Service is spoken
    # to in HTTP/2, by HTTP/1.1 clients too; its http port in HTTP/1.1, by HTTP/2 ones too.
    assert backends.requests(backend) == 1
    assert backends.requests("http/1.1" if backend == "h2c" else "h2c") == 0
    if backend == "h2c":
        assert answer.body == b"/which" and answer.headers["x-backend"] == "h2"
    assert server.metrics.requests[("demo/core", b"GET", 2)] == 1


@pytest.mark.parametrize("framing", ["length", "chunked"])
async def test_an_http1_clients_body_reaches_an_http2_backend(backends, framing):
    # The bridge's request side: Content-Length and chunked bodies (the payload
    # alone, as DATA), the window respected, END_STREAM once at the body's end.
    body = bytes(range(256)) * 1024  # 256 KiB: more than the stream's first window
    if framing == "length":
        framed = b"Content-Length: %d\r\n\r\n" % len(body) + body
    else:
        framed = b"Transfer-Encoding: chunked\r\n\r\n" + b"".join(
            b"%x\r\n%s\r\n" % (len(body[i : i + 30000]), body[i : i + 30000])
            for i in range(0, len(body), 30000)
        )
        framed += b"0\r\n\r\n"
    table = built([core_route("h2c")], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            f"POST /upload HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n".encode() + framed
        )
        data = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
    head, _, answer = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert answer == b"%d %s" % (len(body), hashlib.sha256(body).hexdigest().encode())
    assert backends.h2.received == [(1, "/upload")]


async def test_an_http2_answer_without_length_is_chunked_for_an_http1_client(backends):
    # The connection stays reusable: the answer is re-framed chunked (its
    # trailers dropped, as on HTTP/1.1), never close-delimited.
    table = built([core_route("h2c")], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        answers = []
        for path in ("/nolength-1", "/nolength-2"):
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
            assert head.startswith(b"HTTP/1.1 200") and b"Transfer-Encoding: chunked" in head
            body = b""
            while True:
                size = int(await asyncio.wait_for(reader.readline(), 5), 16)
                chunk = await reader.readexactly(size + 2)
                if size == 0:
                    break
                body += chunk[:-2]
            answers.append(body)
        writer.close()
    assert answers == [b"first,/nolength-1", b"first,/nolength-2"]
    assert backends.h2.connections == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_tracing_at_the_sample_ratio_with_span_ids_in_the_access_log(
    backends, client, backend, caplog
):
    caplog.set_level("INFO", logger="waygate.proxy.access")
    table = built([core_route(backend)], [backends.endpoint()])
    async with running_proxy(table, trace_ratio=1.0) as (_, port):
        assert (await ask(client, port, "/traced")).status == 200
    (sent,) = backends.traceparents(backend)
    version, trace_id, span_id, flags = sent.split("-")
    assert (version, flags, len(trace_id)) == ("00", "01", 32)
    (line,) = [r for r in caplog.records if r.name == "waygate.proxy.access"]
    # The access-log line names the span the backend got as its parent.
    assert (line.trace_id, line.span_id) == (trace_id, span_id)  # type: ignore[attr-defined]
    assert line.protocol == ("h2c" if client == "h2c" else "http/1.1")  # type: ignore[attr-defined]


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_untraced_requests_are_not_traced_at_ratio_zero(backends, client, backend):
    table = built([core_route(backend)], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        assert (await ask(client, port)).status == 200
    assert backends.traceparents(backend) == [""]


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_edge_redirect_policy_answers_302(backends, client, backend):
    tls = RouteTLS(
        TLSTermination.EDGE, insecure_edge_termination_policy=InsecureEdgePolicy.REDIRECT
    )
    table = built([core_route(backend, tls=tls)], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        answer = await ask(client, port, "/page?x=1")
    assert answer.status == 302
    assert answer.headers["location"] == f"https://{HOST}/page?x=1"
    assert backends.requests(backend) == 0
    assert server.metrics.requests[("demo/core", b"GET", 3)] == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_edge_none_policy_refuses_plain_http_under_the_route(backends, client, backend):
    tls = RouteTLS(TLSTermination.EDGE)
    table = built([core_route(backend, tls=tls)], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        answer = await ask(client, port)
    assert answer.status == 503
    assert "served on HTTPS only" in answer.headers["x-waygate-error"]
    # Issue 29: a matched route's refusals count under that route, never route="".
    assert server.metrics.requests[("demo/core", b"GET", 5)] == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_route_redirect_filter(backends, client, backend):
    filters = RouteFilters(redirect=Redirect(scheme="https", status=301))
    table = built([core_route(backend, filters=filters)], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        answer = await ask(client, port, "/r")
    assert answer.status == 301 and answer.headers["location"] == f"https://{HOST}/r"
    assert backends.requests(backend) == 0


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_access_refuses_challenges_and_lets_through(backends, client, backend):
    # waygate.proxy.access: the client (127.0.0.1) outside the allowed range, so under
    # satisfy any its credentials decide: 401 with the challenge until they match.
    creds = ("ann:{SHA}" + base64.b64encode(hashlib.sha1(b"pw").digest()).decode(),)
    rules = RouteAccess(
        allow=("10.0.0.0/8",), auth_type="basic", auth_realm="staff", credentials=creds
    )
    either = dataclasses.replace(rules, satisfy_any=True)
    table = built([core_route(backend, access=either)], [backends.endpoint()])
    token = "Basic " + base64.b64encode(b"ann:pw").decode()
    async with running_proxy(table) as (server, port):
        challenged = await ask(client, port)
        wrong = await ask(client, port, headers=[("authorization", "Basic YW5uOng=")])
        assert backends.requests(backend) == 0
        passed = await ask(client, port, "/in", headers=[("authorization", token)])
        assert server.metrics.requests[("demo/core", b"GET", 4)] == 2
    for answer in (challenged, wrong):
        assert answer.status == 401
        assert answer.headers["www-authenticate"] == 'Basic realm="staff"'
        assert b"401 Authorization Required" in answer.body
    assert passed.status == 200 and backends.requests(backend) == 1
    # The rule itself keeps the Authorization header (ingress-nginx's routes drop it
    # with a request filter the resolver adds: tests/unit/resolver/test_ingress_nginx_access).
    if backend == "h2c":
        assert dict(backends.h2.headers[-1]).get(b"authorization") == token.encode()
    else:
        record = backends.h1.requests[-1]
        assert ("authorization", token) in [(k.lower(), v) for k, v in record["headers"]]  # type: ignore[attr-defined]
    table = built([core_route(backend, access=rules)], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        refused = await ask(client, port, headers=[("authorization", token)])
    assert refused.status == 403
    assert refused.headers["x-waygate-error"] == "the client address is not allowed"
    assert backends.requests(backend) == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_invalid_backend_ref_answers_500_under_the_route(backends, client, backend):
    refs = (RouteBackend(service="svc", namespace="other", invalid="backendRef not granted"),)
    table = built([core_route(backend, backends=refs)], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        answer = await ask(client, port)
    assert answer.status == 500
    assert answer.headers["x-waygate-error"] == "backendRef not granted"
    assert server.metrics.requests[("demo/core", b"GET", 5)] == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_no_endpoint_counts_under_the_route_and_no_route_as_unrouted(
    backends, client, backend
):
    table = built([core_route(backend)], [])
    async with running_proxy(table) as (server, port):
        assert (await ask(client, port)).status == 503
        h1 = await asyncio.open_connection("127.0.0.1", port)
        h1[1].write(b"GET / HTTP/1.1\r\nHost: nowhere.test\r\nConnection: close\r\n\r\n")
        assert (await h1[0].read(-1)).startswith(b"HTTP/1.1 503")
        h1[1].close()
    assert server.metrics.requests[("demo/core", b"GET", 5)] == 1
    assert server.metrics.requests[("", b"GET", 5)] == 1  # route="": unrouted


async def _dead_port() -> int:
    server = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()
    return int(port)


async def dead_endpoint() -> Endpoint:
    """An endpoint of other/svc whose ports refuse connections."""
    dead = await _dead_port()
    return Endpoint(
        namespace="other",
        service="svc",
        address="127.0.0.2",
        ports=(EndpointPort("http", dead), EndpointPort("h2", dead)),
    )


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_redispatch_after_a_failed_connect(backends, client, backend):
    table = built([core_route(backend)], [await dead_endpoint(), backends.endpoint()])
    async with running_proxy(table) as (server, port):
        answers = [await ask(client, port, f"/{i}") for i in range(4)]
    assert [a.status for a in answers] == [200] * 4
    assert server.metrics.redispatches >= 1
    assert backends.requests(backend) == 4


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_trace_context_goes_into_the_tunnel_dial(backends, client, backend):
    dials: list[str | None] = []

    async def tunnel(target: Target, timeout: float, trace_context: str | None) -> Any:
        # A stand-in for the tunnel client's dial (tunnel/client.py's
        # transport_dialer, covered by tests/integration/tunnel): it records the
        # trace context the proxy hands it, then connects directly.
        dials.append(trace_context)
        direct = Target(target.address, target.port)
        return await tcp_connect(direct, timeout, trace_context)

    table = built([core_route(backend)], [backends.endpoint(tunnel=True, node_name="edge-1")])
    dialer = Dialer(tunnel=tunnel)
    async with running_proxy(table, dialer=dialer, trace_ratio=1.0) as (_, port):
        assert (await ask(client, port, "/tunnelled")).status == 200
    (sent,) = backends.traceparents(backend)
    assert dials == [sent]  # the dial continues the request's trace


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_request_mirrors_get_a_copy(backends, client, backend):
    mirror = await RecordingUpstream().start()
    try:
        mirror_endpoint = Endpoint(
            namespace="other",
            service="mirror",
            address="127.0.0.1",
            ports=(EndpointPort("http", mirror.port),),
        )
        filters = RouteFilters(mirrors=(Mirror("mirror", namespace="other"),))
        table = built(
            [core_route(backend, filters=filters)], [backends.endpoint(), mirror_endpoint]
        )
        async with running_proxy(table) as (_, port):
            assert (await ask(client, port, "/mirrored")).status == 200
            for _ in range(100):
                if mirror.requests:
                    break
                await asyncio.sleep(0.02)
    finally:
        await mirror.stop()
    assert [r["target"] for r in mirror.requests] == ["/mirrored"]
    assert backends.requests(backend) == 1


@pytest.mark.parametrize("client", CLIENTS)
async def test_gets_to_an_h2_backend_on_a_reused_connection_all_succeed(backends, client):
    # Issue 31 finding 5: a bodiless request on a reused upstream h2 connection
    # ended its stream twice; GETs alternated 200 and 502.
    table = built([core_route("h2c")], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        statuses = [(await ask(client, port, f"/g{i}")).status for i in range(8)]
    assert statuses == [200] * 8
    assert backends.h2.connections == 1
    assert server.metrics.upstream_opened == 1


# ---------------------------------------------------------------- reservations


def _held(server: Any) -> dict[str, Any]:
    """Every counter an exchange reserves on: endpoint slots (opened and queued),
    pickers' in-flight counts, open upstream connections' streams."""
    entry = next(iter(server.table.entries()))
    in_flight = {
        target: backend.picker.inflight(target)
        for backend in entry.backends
        for target in backend.picker.targets
    }
    h2_streams = sum(
        len(c.exchanges) for cs in server.h2_upstreams.pool.connections.values() for c in cs
    )
    # Connections open (busy or idle) count themselves in the endpoint's bound;
    # what is counted beyond them is a reservation some exchange still holds.
    open_connections = collections.Counter(
        c.target for c in server.upstreams if getattr(c, "counted", False)
    )
    reserved = {
        target: count - open_connections[target]
        for target, count in server.pool.opened.items()
        if count != open_connections[target]
    }
    return {
        "opened": reserved,
        "waiting": {k: len(v) for k, v in server.pool.waiting.items()},
        "in_flight": {k: v for k, v in in_flight.items() if v},
        "h2_streams": h2_streams,
    }


class GatedDialer(Dialer):
    """The real connect step, held at a gate: a test ends the exchange while a
    connect waits there (every await point of the connect: before the task ran,
    in the dial, after it)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.entered = 0

    async def connect(self, target: Target, timeout: float, trace_context: str | None) -> Any:
        self.entered += 1
        await self.gate.wait()
        return await super().connect(target, timeout, trace_context)


@pytest.mark.parametrize(("client", "backend"), PAIRS)
@pytest.mark.parametrize("stage", ["before_connect", "in_dial", "waiting_answer", "mid_body"])
async def test_every_reservation_is_released_however_the_exchange_ends(
    backends, client, backend, stage
):
    from waygate.proxy.server import Limits

    dialer = GatedDialer()
    # A limit-connections slot is held too (ratelimit), and given back the same way.
    route = _limited(client, backend, f"held-{stage}", connections=4)
    table = built([route], [backends.endpoint(), backends.endpoint("127.0.0.3")])
    limits = Limits(max_connections_per_endpoint=4)
    async with running_proxy(table, dialer=dialer, limits=limits) as (server, port):
        # (An HTTP/1.1 client that goes away while it waits is seen at the answer:
        # its FIN is a half-close, which HTTP/1.1 allows; /slow answers in 1 s.)
        path = "/slow?s=1" if stage == "waiting_answer" else "/big?n=4000000"
        if stage != "in_dial":
            dialer.gate.set()
        if client == "h2c":
            h2 = await H2Client.connect(port)
            stream = h2.start("GET", path, HOST)
            if stage == "before_connect":
                # HEADERS and RST_STREAM in one write: the connect task is
                # cancelled before it ever ran (issue 31 finding 1).
                h2.h2.reset_stream(stream)
            h2.flush()
        else:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        if stage == "in_dial":
            for _ in range(200):
                if dialer.entered:
                    break
                await asyncio.sleep(0.01)
            assert dialer.entered
        elif stage in ("waiting_answer", "mid_body"):
            await asyncio.sleep(0.3)
        if client == "h2c":
            if stage != "before_connect":
                with contextlib.suppress(h2_exceptions.StreamClosedError):
                    h2.h2.reset_stream(stream)  # (an h2 backend may have answered already)
                h2.flush()
            await asyncio.sleep(0.05)
            await h2.close()
        else:
            writer.transport.abort()
        dialer.gate.set()
        for _ in range(200):
            await asyncio.sleep(0.02)
            held = _held(server)
            if not any(held.values()):
                break
        assert _held(server) == {"opened": {}, "waiting": {}, "in_flight": {}, "h2_streams": 0}
        assert ratelimit.limiter_for(route).in_flight == {}
        # The endpoint still serves.
        assert (await ask(client, port, "/after")).status == 200


async def test_header_and_reset_pairs_do_not_exhaust_the_endpoint(backends):
    """Issue 31 finding 1, reproduced against a real proxy: 1,024 HEADERS+RST_STREAM
    pairs, each in one read with its connect still to come; the endpoint (bounded at
    8 connections) then serves a bystander at once, and no slot stays taken."""
    from waygate.proxy.server import Limits

    table = built([core_route("http/1.1")], [backends.endpoint()], connect_timeout=2.0)
    limits = Limits(max_connections_per_endpoint=8)
    async with running_proxy(table, limits=limits) as (server, port):
        attacker = await H2Client.connect(port)
        try:
            for _batch in range(32):
                for _ in range(32):
                    stream = attacker.start("GET", "/", HOST)
                    attacker.h2.reset_stream(stream)
                attacker.flush()
                await attacker.drain()
                await asyncio.sleep(0)
        finally:
            with contextlib.suppress(Exception):
                await attacker.close()
        for _ in range(100):
            await asyncio.sleep(0.02)
            if not server.pool.opened or sum(server.pool.opened.values()) <= 1:
                break
        started = asyncio.get_running_loop().time()
        answer = await ask("http/1.1", port, "/bystander")
        elapsed = asyncio.get_running_loop().time() - started
        assert answer.status == 200
        assert elapsed < 2.0  # not the 30 s wait at a full endpoint
        await asyncio.sleep(0.1)
        held = _held(server)
        # Only the bystander's idle keep-alive connection may stay counted.
        assert sum(held["opened"].values()) <= 1 and held["waiting"] == {}
        assert held["in_flight"] == {}


# ---------------------------------------------------------------- access log


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_one_access_log_line_per_request(backends, client, backend, caplog):
    caplog.set_level(logging.INFO, logger="waygate.proxy.access")
    table = built([core_route(backend)], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        assert (await ask(client, port, "/logged")).status == 200
    (line,) = [r for r in caplog.records if r.name == "waygate.proxy.access"]
    assert (line.route, line.status, line.path) == ("demo/core", 200, "/logged")  # type: ignore[attr-defined]


# ---------------------------------------------------------------- rate limits (ratelimit)


def _limited(client: str, backend: str, what: str, **limits: Any) -> Route:
    # A name of its own: a limiter outlives tables (and tests) for the same route.
    return dataclasses.replace(
        core_route(backend, rate_limit=RateLimit(**limits)), name=f"{what}-{client}-{backend}"
    )


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_limit_rps_answers_past_the_burst_with_the_configured_status(
    backends, client, backend
):
    route = _limited(client, backend, "rps", rps=1, burst_multiplier=2, request_status=429)
    table = built([route], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        statuses = [(await ask(client, port, "/limited")).status for _ in range(4)]
        refused = await ask(client, port, "/limited")
    # nginx limit_req burst=2 nodelay: a fresh client gets 3 at once, then the rate.
    assert statuses == [200, 200, 200, 429]
    assert refused.status == 429
    assert refused.headers["x-waygate-error"] == "request rate limit exceeded"
    assert backends.requests(backend) == 3
    assert server.metrics.refused["rate_limited"] == 2


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_limit_connections_slots_are_released_by_every_driver(backends, client, backend):
    route = _limited(client, backend, "conns", connections=1)
    table = built([route], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        # One in flight at a time: each succeeds only if the last gave its slot back.
        statuses = [(await ask(client, port, f"/one-{i}")).status for i in range(3)]
    assert statuses == [200, 200, 200]
    assert ratelimit.limiter_for(route).in_flight == {}


@pytest.mark.parametrize("client", CLIENTS)
async def test_limit_connections_refuses_what_is_past_the_limit_in_flight(backends, client):
    route = _limited(client, "http/1.1", "inflight", connections=1, connection_status=503)
    table = built([route], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        slow = asyncio.ensure_future(ask(client, port, "/slow?s=1"))
        limiter = ratelimit.limiter_for(route)
        for _ in range(100):
            if limiter.in_flight:
                break
            await asyncio.sleep(0.01)
        refused = await ask(client, port, "/fast")
        assert (await slow).status == 200
        after = await ask(client, port, "/fast")
    assert refused.status == 503
    assert refused.headers["x-waygate-error"] == "connection limit exceeded"
    assert after.status == 200
    assert limiter.in_flight == {}


# ---------------------------------------------------------------- external auth (extauth)


@pytest.fixture
async def auth() -> AsyncIterator[AuthService]:
    service = await AuthService(slow_seconds=10).start()
    yield service
    await service.stop()


def _authed(backend: str, url: str, **kw: Any) -> Route:
    spec = ExternalAuth(url, response_headers=("X-User",), **kw)
    return core_route(backend, external_auth=spec)


def _backend_header(backends: Backends, backend: str, name: str) -> list[str]:
    """Every value of `name` the backend's last request carried."""
    if backend == "h2c":
        fields = backends.h2.headers[-1]
        return [v.decode() for k, v in fields if k == name.lower().encode()]
    record = backends.h1.requests[-1]
    return [v for k, v in record["headers"] if k.lower() == name.lower()]  # type: ignore[attr-defined]


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_external_auth_lets_a_2xx_through_with_its_headers(backends, auth, client, backend):
    table = built([_authed(backend, auth.url("/auth?x=1"))], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        answer = await ask(
            client,
            port,
            "/app/page?q=2",
            [("authorization", "Bearer good"), ("x-user", "mallory"), ("x-sent-from", "me")],
        )
    assert answer.status == 200
    # auth-response-headers: the service's X-User replaces the client's; nothing else copied.
    assert _backend_header(backends, backend, "X-User") == ["alice"]
    assert _backend_header(backends, backend, "X-Auth-Extra") == []
    # The subrequest (nginx auth_request as ingress-nginx renders it).
    (sub,) = auth.requests
    assert sub["method"] == "GET" and sub["target"] == "/auth?x=1"
    assert auth.header(0, "Host") == f"127.0.0.1:{auth.port}"
    assert auth.header(0, "X-Original-URL") == f"http://{HOST}/app/page?q=2"
    assert auth.header(0, "X-Original-Method") == "GET"
    assert auth.header(0, "X-Sent-From") == "nginx-ingress-controller"
    assert auth.header(0, "X-Auth-Request-Redirect") == "/app/page?q=2"
    assert auth.header(0, "X-Real-IP") == "127.0.0.1"
    assert auth.header(0, "Authorization") == "Bearer good"
    assert auth.open == 0


# ---------------------------------------------------------------- ingress-nginx responses


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_cors_preflight_is_answered_and_answers_carry_the_headers(backends, client, backend):
    cors = Cors(allow_origins=("https://*.example.com", "https://app.test:8443"), max_age=60)
    table = built([core_route(backend, cors=cors)], [backends.endpoint()])
    origin = [("Origin", "https://a.example.com")]
    async with running_proxy(table) as (server, port):
        preflight = await ask(client, port, "/api", origin, method="OPTIONS")
        allowed = await ask(client, port, "/api", origin)
        other = await ask(client, port, "/api", [("Origin", "https://evil.test")])
        suffix = await ask(
            client, port, "/api", [("Origin", "https://evil.test/https://a.example.com")]
        )
        passed = await ask(client, port, "/api", [("Origin", "https://evil.test")], "OPTIONS")
    assert preflight.status == 204
    assert preflight.headers["access-control-allow-origin"] == "https://a.example.com"
    assert preflight.headers["access-control-max-age"] == "60"
    assert preflight.headers["access-control-allow-credentials"] == "true"
    assert preflight.headers["content-type"] == "text/plain charset=UTF-8"
    assert allowed.status == 200
    assert allowed.headers["access-control-allow-origin"] == "https://a.example.com"
    assert "GET, PUT, POST" in allowed.headers["access-control-allow-methods"]
    for refused in (other, suffix):
        assert refused.status == 200 and "access-control-allow-origin" not in refused.headers
    # Not an allowed origin: the OPTIONS is the backend's (the preflight and one
    # GET answered here or with headers; three requests reached it).
    assert passed.status == 200
    assert backends.requests(backend) == 4
    assert server.metrics.requests[("demo/core", b"OPTIONS", 2)] == 2


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_cors_any_origin_answers_every_preflight(backends, client, backend):
    cors = Cors(allow_credentials=False, expose_headers="X-Total")
    table = built([core_route(backend, cors=cors)], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        preflight = await ask(client, port, "/", method="OPTIONS")
        answer = await ask(client, port, "/")
    assert preflight.status == 204 and preflight.headers["access-control-allow-origin"] == "*"
    assert "access-control-allow-credentials" not in answer.headers
    assert answer.headers["access-control-allow-origin"] == "*"
    assert answer.headers["access-control-expose-headers"] == "X-Total"
    assert backends.requests(backend) == 1


async def post(client: str, port: int, body: bytes, *, length: bool) -> Answer:
    """One POST of `body`, with a Content-Length (`length`) or without one (HTTP/1.1
    chunked in 400-byte chunks; HTTP/2 DATA without content-length)."""
    if client == "h2c":
        h2 = await H2Client.connect(port)
        try:
            headers = [("content-length", str(len(body)))] if length else []
            response = await h2.request("POST", "/up", HOST, headers, body)
        finally:
            await h2.close()
        return Answer(
            response.status, {k.decode(): v.decode() for k, v in response.headers}, response.body
        )
    if length:
        framed = b"Content-Length: %d\r\n\r\n" % len(body) + body
    else:
        pieces = [body[i : i + 400] for i in range(0, len(body), 400)]
        framed = b"Transfer-Encoding: chunked\r\n\r\n"
        framed += b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in pieces) + b"0\r\n\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"POST /up HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n".encode() + framed)
    with contextlib.suppress(ConnectionError):
        await writer.drain()
    return await _h1_answer(reader, writer)


@pytest.mark.parametrize(("client", "backend"), PAIRS)
@pytest.mark.parametrize("length", [True, False], ids=["content-length", "streamed"])
async def test_proxy_body_size_answers_413(backends, client, backend, length):
    table = built([core_route(backend, max_request_body=2000)], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        small = await post(client, port, b"s" * 2000, length=length)
        large = await post(client, port, b"L" * 4800, length=length)
    assert small.status == 200
    assert large.status == 413
    assert "larger than 2000 bytes" in large.headers["x-waygate-error"]
    if length:  # refused up front: the backend never asked
        assert backends.requests(backend) == 1
    assert server.metrics.refused["body_too_large"] == 1
    assert server.metrics.requests[("demo/core", b"POST", 4)] == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
@pytest.mark.parametrize(
    ("credential", "status"),
    [("", 401), ("Bearer forbidden", 403), ("Bearer broken", 500)],
)
async def test_external_auth_answers_401_403_and_500_itself(
    backends, auth, client, backend, credential, status
):
    table = built([_authed(backend, auth.url())], [backends.endpoint()])
    headers = [("authorization", credential)] if credential else []
    async with running_proxy(table) as (server, port):
        answer = await ask(client, port, "/private", headers)
    assert answer.status == status
    assert backends.requests(backend) == 0
    assert server.metrics.refused["external_auth"] == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_external_auth_401_redirects_to_signin_with_rd(backends, auth, client, backend):
    route = _authed(backend, auth.url(), signin="https://login.test/start?app=1")
    table = built([route], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        answer = await ask(client, port, "/private/x?y=1")
    assert answer.status == 302
    assert answer.headers["location"] == (
        "https://login.test/start?app=1&rd=http://core.test%2Fprivate%2Fx%3Fy%3D1"
    )
    assert backends.requests(backend) == 0


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_external_auth_service_down_is_500(backends, client, backend):
    dead = await _dead_port()
    table = built([_authed(backend, f"http://127.0.0.1:{dead}/auth")], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        answer = await ask(client, port, "/private", [("authorization", "Bearer good")])
    assert answer.status == 500
    assert backends.requests(backend) == 0


# CVE-2026-24513 (auth-url bypass): encoded and dot-segment paths, each checked.
BYPASS_PATHS = [
    "/%2e%2e/admin",
    "/./admin",
    "//admin",
    "/admin/..%2f",
    "/%61dmin",
    "/a/../admin",
    "/admin;x=1",
    "/admin%00",
]


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_external_auth_checks_every_path_cve_2026_24513(backends, auth, client, backend):
    table = built([_authed(backend, auth.url())], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        statuses = [(await ask(client, port, path)).status for path in BYPASS_PATHS]
    # Refused (401) or refused as a bad request; never the backend's answer.
    assert all(status in (400, 401) for status in statuses), statuses
    assert backends.requests(backend) == 0


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_external_auth_subrequest_is_released_when_the_client_goes(
    backends, auth, client, backend
):
    # (An HTTP/1.1 client that goes away while it waits is seen when its answer is
    # due, as in test_every_reservation_is_released_however_the_exchange_ends: the
    # subrequest then ends with the auth service's answer, 1 s here; an HTTP/2
    # client's reset cancels it at once.)
    auth.slow_seconds = 1.0 if client == "http/1.1" else 10.0
    table = built([_authed(backend, auth.url("/slow"))], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        before = len(asyncio.all_tasks())
        if client == "h2c":
            h2 = await H2Client.connect(port)
            stream = h2.start("GET", "/private", HOST)
            h2.flush()
        else:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(f"GET /private HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
        for _ in range(200):
            if auth.open:
                break
            await asyncio.sleep(0.01)
        assert auth.open == 1
        if client == "h2c":
            h2.h2.reset_stream(stream)
            h2.flush()
            await asyncio.sleep(0.05)
            await h2.close()
        else:
            writer.transport.abort()
        for _ in range(300):
            if not auth.open:
                break
            await asyncio.sleep(0.01)
        # The subrequest's connection closed, its task gone, no slot held.
        assert auth.open == 0
        await asyncio.sleep(0.05)
        assert len(asyncio.all_tasks()) <= before
        assert not any(server.pool.opened.values())
    assert backends.requests(backend) == 0


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_external_auth_answers_are_cached_by_key_and_status(backends, auth, client, backend):
    route = _authed(
        backend,
        auth.url(),
        cache_key="$http_authorization",
        cache_durations=((200, 60.0),),
    )
    route = dataclasses.replace(route, name=f"cached-{client}-{backend}")
    table = built([route], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        good = [("authorization", "Bearer good")]
        statuses = [(await ask(client, port, f"/c{i}", good)).status for i in range(3)]
        assert len(auth.requests) == 1  # the first asked, the others from the cache
        assert _backend_header(backends, backend, "X-User") == ["alice"]  # (cached too)
        # Another key asks again; a status without a duration is not kept.
        forbidden = [("authorization", "Bearer forbidden")]
        assert (await ask(client, port, "/c", forbidden)).status == 403
        assert (await ask(client, port, "/c", forbidden)).status == 403
    assert statuses == [200, 200, 200]
    assert len(auth.requests) == 3


@pytest.mark.parametrize(("client", "backend"), PAIRS)
@pytest.mark.parametrize(
    ("next_upstream", "redispatched"), [("error", True), ("timeout", False), ("off", False)]
)
async def test_proxy_next_upstream_says_which_failed_connects_redispatch(
    backends, client, backend, next_upstream, redispatched
):
    # A refused connect is nginx's `error`, never its `timeout`.
    dead = await _dead_port()
    dead_endpoint = Endpoint(
        namespace="other",
        service="svc",
        address="127.0.0.2",
        ports=(EndpointPort("http", dead), EndpointPort("h2", dead)),
    )
    route = core_route(backend, next_upstream=next_upstream)
    table = built([route], [dead_endpoint, backends.endpoint()])
    async with running_proxy(table) as (server, port):
        answers = [await ask(client, port, f"/{i}") for i in range(4)]
    statuses = [a.status for a in answers]
    if redispatched:
        assert statuses == [200] * 4 and server.metrics.redispatches >= 1
    else:
        assert 502 in statuses and server.metrics.redispatches == 0


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_capture_group_rewrite_target(backends, client, backend):
    # ingress-nginx rewrite-target `/$2/$1` on the regex path `/api/(v[0-9]+)/(.*)`.
    match = RouteMatch(PathMatchType.REGEX, "(?i)(?:/api/(v[0-9]+)/(.*)).*")
    route = core_route(backend, matches=(match,), rewrite_target="/$2/$1")
    table = built([route], [backends.endpoint()])
    async with running_proxy(table) as (_, port):
        answer = await ask(client, port, "/API/v2/users/7?x=1")
    assert answer.status == 200
    if backend == "h2c":
        assert answer.body == b"/users/7/v2?x=1"
    else:
        assert backends.h1.requests[-1]["target"] == "/users/7/v2?x=1"


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_default_backend_takes_what_no_endpoint_can(backends, client, backend):
    # ingress-nginx default-backend: the Service (its first port) of the route's
    # namespace, when the route's own Service has no ready endpoint.
    first = (
        ServicePort("grpc", 81, "h2", app_protocol="kubernetes.io/h2c")
        if backend == "h2c"
        else ServicePort("http", 80, "http")
    )
    fallback = Service(namespace="other", name="fallback", ports=(first,))
    endpoint = Endpoint(
        namespace="other",
        service="fallback",
        address="127.0.0.1",
        ports=(
            EndpointPort("h2", backends.h2.port)
            if backend == "h2c"
            else EndpointPort("http", backends.h1.port),
        ),
    )
    route = Route(
        namespace="other",
        name="core",
        host=HOST,
        backends=(RouteBackend(service="gone", weight=1),),
        default_backend="fallback",
    )
    table = build_table(
        {route.key: route},
        {fallback.key: (endpoint,)},
        {fallback.key: fallback},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
    )
    async with running_proxy(table) as (server, port):
        answer = await ask(client, port, "/fell?x=1")
    assert answer.status == 200
    assert backends.requests(backend) == 1
    if backend == "h2c":
        assert answer.body == b"/fell?x=1"
    else:
        assert backends.h1.requests[-1]["target"] == "/fell?x=1"
    assert server.metrics.requests[("other/core", b"GET", 2)] == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_upstream_hash_by_a_header(backends, client, backend):
    route = core_route(backend, balance=BalancePolicy.SOURCE, hash_by="$http_x_user")
    # (The same key's endpoint, whichever it is: tests/unit/proxy/test_hashkey.py.)
    async with running_proxy(built([route], [backends.endpoint()])) as (server, port):
        answers = [await ask(client, port, "/h", [("X-User", str(i % 2))]) for i in range(4)]
    assert [a.status for a in answers] == [200] * 4
    assert backends.requests(backend) == 4
    assert server.metrics.requests[("demo/core", b"GET", 2)] == 4
