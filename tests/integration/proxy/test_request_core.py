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

from tests.support.h2client import H2Client
from tests.support.h2harness import H2Backend
from tests.support.proxyharness import RecordingUpstream, running_proxy
from waygate.core.tracing import configure_tracing
from waygate.proxy.routing import Defaults, Target, build_table
from waygate.proxy.upstream import Dialer, tcp_connect
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    InsecureEdgePolicy,
    Mirror,
    Redirect,
    Route,
    RouteAccess,
    RouteBackend,
    RouteFilters,
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
    client: str, port: int, path: str = "/", headers: list[tuple[str, str]] | None = None
) -> Answer:
    """One GET from a client of that protocol (a new connection each time)."""
    if client == "h2c":
        h2 = await H2Client.connect(port)
        try:
            response = await h2.request("GET", path, HOST, headers)
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
        f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n{extra}Connection: close\r\n\r\n".encode()
    )
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
    # The Authorization header reaches the backend, as nginx passes it on.
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
    table = built([core_route(backend)], [backends.endpoint(), backends.endpoint("127.0.0.3")])
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
