"""The proxy's behaviour over real sockets: headers, framing, keep-alive,
pipelining, balancing, stickiness, redispatch, timeouts, upgrades, leaks."""

from __future__ import annotations

import asyncio
import collections
import json
import os

import pytest
import websockets

from tests.support.poll import until
from tests.support.proxyharness import (
    RecordingUpstream,
    body_json,
    closed_port,
    endpoint,
    exchange,
    read_response,
    request,
    route,
    running_proxy,
    table,
)
from waygate.core.tracing import configure_tracing
from waygate.proxy.routing import Defaults
from waygate.resolver.model import ForwardedHeadersMode, RouteTimeouts, StickySessions

H = b"Host: echo.test\r\n"


@pytest.fixture
async def upstream():
    server = await RecordingUpstream().start()
    yield server
    await server.stop()


@pytest.fixture
async def proxy(upstream):
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes) as (server, port):
        yield server, port


def headers_of(record: dict[str, object]) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = collections.defaultdict(list)
    for name, value in record["headers"]:  # type: ignore[union-attr]
        grouped[name.lower()].append(value)
    return grouped


# ---------------------------------------------------------------- header hygiene


async def test_hop_by_hop_proxy_identity_headers_are_dropped(proxy):
    _, port = proxy
    response = await exchange(
        port,
        b"GET / HTTP/1.1\r\n" + H + b"Connection: keep-alive, X-Secret\r\nX-Secret: s\r\n"
        b"Keep-Alive: timeout=5\r\nTE: trailers\r\nProxy: http://evil:1\r\n"
        b"Proxy-Authorization: Basic x\r\nX-Remote-User: admin\r\nX-Remote-Group: root\r\n"
        b"X-Remote-Extra-Scopes: all\r\nX-SSL-Client-CN: admin\r\nX-Kept: yes\r\n\r\n",
    )
    seen = headers_of(body_json(response))
    for dropped in (
        "connection",
        "x-secret",
        "keep-alive",
        "te",
        "proxy",
        "proxy-authorization",
        "x-remote-user",
        "x-remote-group",
        "x-remote-extra-scopes",
        "x-ssl-client-cn",
    ):
        assert dropped not in seen, dropped
    assert seen["x-kept"] == ["yes"]
    assert seen["host"] == ["echo.test"]


@pytest.mark.parametrize(
    ("mode", "expected_xff", "expected_fwd_count"),
    [
        ("append", ["1.2.3.4", "127.0.0.1"], 2),
        ("replace", ["127.0.0.1"], 1),
        ("if-none", ["1.2.3.4"], 1),
        ("never", ["1.2.3.4"], 1),
    ],
)
async def test_forwarded_headers_modes(upstream, mode, expected_xff, expected_fwd_count):
    routes = table(
        [route("echo.test", [("echo", 100)], forwarded_headers=ForwardedHeadersMode(mode))],
        [endpoint("echo", upstream.port)],
    )
    async with running_proxy(routes) as (_, port):
        response = await exchange(
            port,
            b"GET / HTTP/1.1\r\nHost: Echo.Test:8080\r\nX-Forwarded-For: 1.2.3.4\r\n"
            b"Forwarded: for=1.2.3.4\r\n\r\n",
        )
    seen = headers_of(body_json(response))
    assert seen["x-forwarded-for"] == expected_xff
    assert len(seen["forwarded"]) == expected_fwd_count
    if mode in ("append", "replace"):
        assert seen["forwarded"][-1] == "for=127.0.0.1;host=echo.test;proto=http"
        assert seen["x-forwarded-host"] == ["echo.test"]
        assert seen["x-forwarded-proto"] == ["http"]
        assert seen["x-forwarded-port"]
    if mode == "never":
        assert "x-forwarded-host" not in seen


async def test_traceparent_passes_through_unsampled(proxy):
    _, port = proxy
    parent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    response = await exchange(
        port, b"GET / HTTP/1.1\r\n" + H + b"traceparent: " + parent + b"\r\n\r\n"
    )
    assert headers_of(body_json(response))["traceparent"] == [parent.decode()]


async def test_sampled_traceparent_gets_a_child_span_id(proxy):
    configure_tracing("proxy-test", None)  # the process's real provider, no exporter
    _, port = proxy
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    parent = f"00-{trace_id}-b7ad6b7169203331-01".encode()
    response = await exchange(
        port, b"GET / HTTP/1.1\r\n" + H + b"traceparent: " + parent + b"\r\n\r\n"
    )
    (sent,) = headers_of(body_json(response))["traceparent"]
    version, sent_trace, span_id, flags = sent.split("-")
    assert (version, sent_trace, flags) == ("00", trace_id, "01")
    assert span_id != "b7ad6b7169203331" and len(span_id) == 16


async def test_access_log_lines_are_rate_limited(upstream, caplog):
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    caplog.set_level("INFO", logger="waygate.proxy.access")
    async with running_proxy(routes, access_log_rate=3) as (server, port):
        for _ in range(6):
            await exchange(port, b"GET /x HTTP/1.1\r\n" + H + b"\r\n")
        lines = [r for r in caplog.records if r.name == "waygate.proxy.access"]
        assert len(lines) == 3
        assert lines[0].status == 200 and lines[0].route == "demo/r" and lines[0].path == "/x"
        assert server.records.suppressed == 3


# ---------------------------------------------------------------- routing


async def test_routing_exact_wildcard_longest_prefix_and_503s():
    a = await RecordingUpstream("a").start()
    b = await RecordingUpstream("b").start()
    c = await RecordingUpstream("c").start()
    routes = table(
        [
            route("echo.test", [("a", 1)], name="root"),
            route("echo.test", [("b", 1)], path="/api", name="api"),
            route("*.wild.test", [("c", 1)], name="wild"),
            route("x.wild.test", [("a", 1)], name="exact"),
            route("empty.test", [("none", 1)], name="empty"),
        ],
        [endpoint("a", a.port), endpoint("b", b.port), endpoint("c", c.port)],
    )
    async with running_proxy(routes) as (_, port):

        async def who(host: bytes, path: bytes) -> str:
            response = await exchange(
                port, b"GET " + path + b" HTTP/1.1\r\nHost: " + host + b"\r\n\r\n"
            )
            return str(body_json(response)["upstream"])

        assert await who(b"echo.test", b"/") == "a"
        assert await who(b"ECHO.test:80", b"/api") == "b"
        assert await who(b"echo.test", b"/api/x?q") == "b"
        assert await who(b"echo.test", b"/apix") == "a"
        # Matched in the form the resolver stores route paths in: /%61pi is /api.
        assert await who(b"echo.test", b"/%61pi/x") == "b"
        assert await who(b"y.wild.test", b"/") == "c"
        assert await who(b"x.wild.test", b"/") == "a"
        no_route = await exchange(port, b"GET / HTTP/1.1\r\nHost: a.b.wild.test\r\n\r\n")
        assert no_route.startswith(b"HTTP/1.1 503 ")
        assert b"no route for host a.b.wild.test" in no_route
        no_endpoint = await exchange(port, b"GET / HTTP/1.1\r\nHost: empty.test\r\n\r\n")
        assert no_endpoint.startswith(b"HTTP/1.1 503 ")
        assert b"no endpoint ready for route demo/empty" in no_endpoint
        health = await exchange(port, b"GET /_waygate/healthz HTTP/1.1\r\nHost: any\r\n\r\n")
        assert health.startswith(b"HTTP/1.1 200 ")
    for server in (a, b, c):
        await server.stop()


async def test_route_change_applies_to_next_request_and_removed_endpoint_is_never_picked():
    a = await RecordingUpstream("a").start()
    b = await RecordingUpstream("b").start()
    first = table([route("echo.test", [("s", 1)])], [endpoint("s", a.port)])
    async with running_proxy(first) as (server, port):
        response, reader, writer = await request(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
        assert body_json(response)["upstream"] == "a"
        server.set_table(
            table([route("echo.test", [("s", 1)])], [endpoint("s", b.port)], previous=server.table)
        )
        for _ in range(5):
            writer.write(b"GET / HTTP/1.1\r\n" + H + b"\r\n")
            assert body_json(await read_response(reader))["upstream"] == "b"
        writer.close()
    await a.stop()
    await b.stop()


# ---------------------------------------------------------------- framing and keep-alive


async def test_keep_alive_pipelining_in_order_and_upstream_reuse(proxy, upstream):
    server, port = proxy
    burst = b"".join(b"GET /%d HTTP/1.1\r\n" % i + H + b"\r\n" for i in range(20))
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(burst)
    for i in range(20):
        assert body_json(await read_response(reader))["target"] == f"/{i}"
    writer.close()
    assert upstream.connections == 1
    assert server.metrics.pool_reused >= 19


async def test_bodies_content_length_and_chunked_with_trailers_dropped(proxy, upstream):
    _, port = proxy
    body = os.urandom(300_000)
    response = await exchange(
        port,
        b"POST /u HTTP/1.1\r\n" + H + b"Content-Length: %d\r\n\r\n" % len(body) + body,
    )
    assert body_json(response)["body_length"] == len(body)
    chunked = b"4;ext=1\r\nwiki\r\n5\r\npedia\r\n0\r\nX-Trailer: smuggled\r\nHost: evil\r\n\r\n"
    response = await exchange(
        port, b"POST /c HTTP/1.1\r\n" + H + b"Transfer-Encoding: chunked\r\n\r\n" + chunked
    )
    assert body_json(response)["body_length"] == 9
    assert b"X-Trailer" not in upstream.received
    assert b"ext=1" not in upstream.received


async def test_head_204_http10_and_chunked_response(proxy):
    _, port = proxy
    head = await exchange(port, b"HEAD / HTTP/1.1\r\n" + H + b"\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
    assert b"Content-Length: " in head
    no_content = await exchange(port, b"GET /204 HTTP/1.1\r\n" + H + b"\r\n")
    assert no_content.startswith(b"HTTP/1.1 204 ") and no_content.endswith(b"\r\n\r\n")
    chunked = await exchange(port, b"GET /chunked HTTP/1.1\r\n" + H + b"\r\n")
    assert b"Transfer-Encoding: chunked" in chunked and chunked.endswith(b"0\r\n\r\n")
    # An HTTP/1.0 client gets the chunked response de-chunked, delimited by close.
    old = await exchange(port, b"GET /chunked HTTP/1.0\r\n" + H + b"\r\n", half_close=False)
    assert b"Transfer-Encoding" not in old and b"Connection: close" in old
    assert body_json(old)["target"] == "/chunked"


async def test_expect_100_continue(proxy):
    _, port = proxy
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(b"POST / HTTP/1.1\r\n" + H + b"Expect: 100-continue\r\nContent-Length: 5\r\n\r\n")
    # The client waits for the upstream's 100 before it sends the body.
    async with asyncio.timeout(5):
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
    writer.write(b"hello")
    response = await read_response(reader)
    writer.close()
    assert json.loads(response.split(b"\r\n\r\n", 1)[1])["body_length"] == 5


async def test_malformed_upstream_response_is_502_and_connection_discarded(proxy, upstream):
    _server, port = proxy
    response = await exchange(port, b"GET /bad HTTP/1.1\r\n" + H + b"\r\n")
    assert response.startswith(b"HTTP/1.1 502 ")
    assert b"malformed response" in response
    ok = await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
    assert ok.startswith(b"HTTP/1.1 200 ")
    assert upstream.connections == 2


# ---------------------------------------------------------------- balancing


async def test_weighted_spread_and_sticky_cookie():
    a = await RecordingUpstream("a").start()
    b = await RecordingUpstream("b").start()
    routes = table(
        [route("echo.test", [("a", 64), ("b", 192)], balance="roundrobin")],
        [endpoint("a", a.port), endpoint("b", b.port)],
    )
    async with running_proxy(routes) as (_, port):
        seen = collections.Counter()
        cookies = {}
        for _ in range(40):
            response = await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
            who = body_json(response)["upstream"]
            seen[who] += 1
            line = next(x for x in response.split(b"\r\n") if x.startswith(b"Set-Cookie: "))
            cookies[who] = line[len(b"Set-Cookie: ") :].split(b";")[0]
            assert b"HttpOnly" in line and b"SameSite=Lax" in line
            assert b"127.0.0.1" not in line and str(a.port).encode() not in line
        assert seen == {"a": 10, "b": 30}
        for who, cookie in cookies.items():
            for _ in range(5):
                response = await exchange(
                    port, b"GET / HTTP/1.1\r\n" + H + b"Cookie: x=1; " + cookie + b"\r\n\r\n"
                )
                assert body_json(response)["upstream"] == who
                assert b"Set-Cookie" not in response
    await a.stop()
    await b.stop()


async def test_sticky_cookie_disabled(upstream):
    routes = table(
        [route("echo.test", [("echo", 1)], sticky=StickySessions(disable_cookies=True))],
        [endpoint("echo", upstream.port)],
    )
    async with running_proxy(routes) as (_, port):
        response = await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
    assert b"Set-Cookie" not in response


async def test_redispatch_after_refused_connect_and_passive_health(upstream):
    dead = closed_port()
    routes = table(
        [route("echo.test", [("echo", 1)], balance="roundrobin")],
        [endpoint("echo", dead, address="127.0.0.2"), endpoint("echo", upstream.port)],
    )
    async with running_proxy(routes) as (server, port):
        for _ in range(6):
            response = await exchange(
                port, b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 2\r\n\r\nhi"
            )
            assert response.startswith(b"HTTP/1.1 200 "), response
        assert server.metrics.redispatches >= 1
        assert server.metrics.connect_errors.get("refused", 0) == server.metrics.redispatches
        # Passive health: the dead endpoint is skipped, so not every request retried.
        assert server.metrics.redispatches < 6
        assert server.metrics.passive_health_skipped == 1


async def test_every_endpoint_refusing_answers_502_with_reason():
    routes = table(
        [route("echo.test", [("echo", 1)])],
        [endpoint("echo", closed_port()), endpoint("echo", closed_port(), address="127.0.0.3")],
    )
    async with running_proxy(routes) as (_server, port):
        response = await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
    assert response.startswith(b"HTTP/1.1 502 ")
    assert b"connection refused by 127.0.0." in response


async def test_sent_post_is_never_resent_when_upstream_dies():
    async def die(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        attempts.append(1)
        writer.transport.abort()

    attempts: list[int] = []
    dying = await asyncio.start_server(die, "127.0.0.1", 0)
    routes = table(
        [route("echo.test", [("echo", 1)])],
        [endpoint("echo", dying.sockets[0].getsockname()[1])],
    )
    async with running_proxy(routes) as (_, port):
        response = await exchange(port, b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 0\r\n\r\n")
    dying.close()
    assert response.startswith(b"HTTP/1.1 502 ")
    assert attempts == [1]


async def test_tunnel_endpoint_without_dialer_is_502_with_reason():
    routes = table(
        [route("echo.test", [("edge", 1)])],
        [endpoint("edge", 8090, tunnel=True, node_name="edge-local")],
    )
    async with running_proxy(routes) as (_, port):
        response = await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
    assert response.startswith(b"HTTP/1.1 502 ")
    assert b"edge node edge-local" in response and b"tunnel" in response


# ---------------------------------------------------------------- timeouts


async def test_slow_headers_get_408(upstream):
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes, defaults=Defaults(http_request_timeout=0.3)) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\nHost: ech")
        async with asyncio.timeout(5):
            response = await reader.read()
        writer.close()
    assert response.startswith(b"HTTP/1.1 408 ")
    assert upstream.received == b""


async def test_slow_upstream_gets_504_and_idle_keep_alive_closes(upstream):
    routes = table(
        [route("echo.test", [("echo", 1)], timeouts=RouteTimeouts(server=0.3))],
        [endpoint("echo", upstream.port)],
        keep_alive_timeout=0.3,
    )
    async with running_proxy(routes, defaults=Defaults(keep_alive_timeout=0.3)) as (_, port):
        response = await exchange(port, b"GET /slow?s=2 HTTP/1.1\r\n" + H + b"\r\n")
        assert response.startswith(b"HTTP/1.1 504 ")
        assert b"upstream did not answer within 0.3s" in response
        # After a response, an idle keep-alive connection closes at the keep-alive timeout.
        response, reader, writer = await request(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
        assert response.startswith(b"HTTP/1.1 200 ")
        async with asyncio.timeout(5):
            assert await reader.read() == b""
        writer.close()


# ---------------------------------------------------------------- upgrades


async def test_websocket_session_through_the_proxy():
    async def echo(ws):
        async for message in ws:
            await ws.send("echo:" + message)

    async with websockets.serve(echo, "127.0.0.1", 0) as ws_server:
        ws_port = next(iter(ws_server.sockets)).getsockname()[1]
        routes = table([route("ws.test", [("ws", 1)])], [endpoint("ws", ws_port)])
        async with (
            running_proxy(routes) as (_, port),
            websockets.connect("ws://ws.test/chat", host="127.0.0.1", port=port) as ws,
        ):
            for i in range(10):
                await ws.send(f"m{i}")
                assert await asyncio.wait_for(ws.recv(), 5) == f"echo:m{i}"


async def test_upgrade_refused_by_upstream_is_a_normal_response(proxy):
    _, port = proxy
    response = await exchange(
        port, b"GET / HTTP/1.1\r\n" + H + b"Connection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    )
    assert response.startswith(b"HTTP/1.1 200 ")


# ---------------------------------------------------------------- drain and leaks


async def test_drain_finishes_in_flight_and_no_fds_or_tasks_leak(upstream):
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    fds_before = len(os.listdir("/proc/self/fd"))
    tasks_before = len(asyncio.all_tasks())
    async with running_proxy(routes) as (server, port):
        for _ in range(30):
            await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
        slow = asyncio.create_task(exchange(port, b"GET /slow?s=0.5 HTTP/1.1\r\n" + H + b"\r\n"))
        await asyncio.sleep(0.2)
        idle_reader, idle_writer = await asyncio.open_connection("127.0.0.1", port)
        await asyncio.sleep(0.05)
        await server.drain(5)
        assert (await slow).startswith(b"HTTP/1.1 200 ")
        assert b"Connection: close" in (await slow)
        async with asyncio.timeout(2):
            assert await idle_reader.read() == b""
        idle_writer.close()
    await asyncio.sleep(0.1)
    assert len(server.connections) == 0 and len(server.upstreams) == 0
    assert len(asyncio.all_tasks()) == tasks_before
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 1


async def test_max_connections_refuses_the_extra_connection_when_none_is_idle(upstream):
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes, max_connections=2) as (server, port):
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
        for _, held_writer in held:  # busy: each in the middle of its head
            held_writer.write(b"GET / HTTP/1.1\r\n")
        await until(lambda: sum(len(c.buf) > 0 for c in server.connections) == 2, "busy heads")
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET / HTTP/1.1\r\n" + H + b"\r\n")
        async with asyncio.timeout(5):
            response = await reader.read()
        assert response.startswith(b"HTTP/1.1 503 ")
        assert b"at its connection limit" in response
        writer.close()
        for _, held_writer in held:
            held_writer.close()


async def test_aborted_clients_and_upstreams_leak_nothing(upstream):
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    fds_before = len(os.listdir("/proc/self/fd"))
    tasks_before = len(asyncio.all_tasks())
    async with running_proxy(routes) as (server, port):
        for i in range(30):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            if i % 3 == 0:  # gone mid-body
                writer.write(b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 100000\r\n\r\nabc")
            elif i % 3 == 1:  # gone mid-download
                writer.write(b"GET /big?n=50000000 HTTP/1.1\r\n" + H + b"\r\n")
                await reader.readexactly(1000)
            else:  # gone while the upstream is still thinking
                writer.write(b"GET /slow?s=0.2 HTTP/1.1\r\n" + H + b"\r\n")
            await asyncio.sleep(0.01)
            writer.transport.abort()
        await asyncio.sleep(0.5)
        assert len(server.connections) == 0
        assert all(u.exchange is None for u in server.upstreams)
    await asyncio.sleep(0.3)
    assert len(server.upstreams) == 0
    assert len(asyncio.all_tasks()) == tasks_before
    assert len(os.listdir("/proc/self/fd")) <= fds_before + 2


async def test_pool_keeps_at_most_max_idle_and_closes_idle_connections(upstream):
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes, max_idle_per_endpoint=2, pool_idle_timeout=0.3) as (
        server,
        port,
    ):
        await asyncio.gather(
            *(exchange(port, b"GET /slow?s=0.2 HTTP/1.1\r\n" + H + b"\r\n") for _ in range(4))
        )
        assert upstream.connections == 4
        assert server.pool.idle_count() == 2
        deadline = asyncio.get_running_loop().time() + 5
        while server.upstreams:
            assert asyncio.get_running_loop().time() < deadline, "idle upstreams not closed"
            await asyncio.sleep(0.05)
        assert server.pool.idle_count() == 0


async def test_unavailable_page_is_served_with_the_reason():
    page = b"<html><body>Sorry: {reason}</body></html>"
    async with running_proxy(table([], []), unavailable_page=page) as (_, port):
        response = await exchange(port, b"GET / HTTP/1.1\r\nHost: nowhere.test\r\n\r\n")
    assert response.startswith(b"HTTP/1.1 503 ")
    assert b"Content-Type: text/html" in response
    assert response.endswith(b"<html><body>Sorry: no route for host nowhere.test</body></html>")


async def test_upgraded_connection_relays_raw_bytes_both_ways_and_half_closes():
    async def raw_upgrade(reader, writer):
        await reader.readuntil(b"\r\n\r\n")
        writer.write(
            b"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\n"
        )
        data = await reader.read()  # until the client's half-close reaches us
        writer.write(b"got:" + data)
        await writer.drain()
        writer.close()

    backend = await asyncio.start_server(raw_upgrade, "127.0.0.1", 0)
    routes = table(
        [route("up.test", [("u", 1)])], [endpoint("u", backend.sockets[0].getsockname()[1])]
    )
    async with running_proxy(routes) as (_, port):
        response = await exchange(
            port,
            b"GET / HTTP/1.1\r\nHost: up.test\r\nConnection: Upgrade\r\nUpgrade: x\r\n\r\n"
            b"\x00\x01binary\xff",
        )
    backend.close()
    assert response.startswith(b"HTTP/1.1 101 ")
    assert response.endswith(b"got:\x00\x01binary\xff")


async def test_head_trickled_byte_by_byte_is_parsed(proxy, upstream):
    _, port = proxy
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for byte in b"GET /trickle HTTP/1.1\r\n" + H + b"X-A: " + b"a" * 300 + b"\r\n\r\n":
        writer.write(bytes([byte]))
        await writer.drain()
    response = await read_response(reader)
    writer.close()
    assert body_json(response)["target"] == "/trickle"


@pytest.mark.parametrize("first", [1, 3, 4, 20])
async def test_head_split_anywhere_across_reads_is_parsed(proxy, upstream, first):
    # A first read of exactly 3 bytes once passed the one-head fast path's length
    # check (find() == -1, -1 + 4 == 3) and was refused as a malformed head.
    _, port = proxy
    head = b"GET /split HTTP/1.1\r\n" + H + b"\r\n"
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(head[:first])
    await writer.drain()
    await asyncio.sleep(0.05)  # a read of its own
    writer.write(head[first:])
    response = await read_response(reader)
    writer.close()
    assert body_json(response)["target"] == "/split"


async def test_non_idempotent_request_avoids_a_long_idle_pooled_connection(
    proxy, upstream, monkeypatch
):
    from waygate.proxy import exchange as exchange_module

    monkeypatch.setattr(exchange_module, "SAFE_REUSE_IDLE", 0.2)
    _, port = proxy
    assert (await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")).startswith(b"HTTP/1.1 200")
    await asyncio.sleep(0.4)
    post = b"POST / HTTP/1.1\r\n" + H + b"Content-Length: 2\r\n\r\nhi"
    assert (await exchange(port, post)).startswith(b"HTTP/1.1 200")
    assert upstream.connections == 2  # the POST did not take the connection idle for 0.4 s
    assert (await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")).startswith(b"HTTP/1.1 200")
    assert upstream.connections == 2  # a GET may reuse it


async def test_leastconn_counts_requests_in_flight_and_releases_them(upstream):
    """A request in flight counts for its endpoint (least-connections reads it) and
    is released when answered; a one-endpoint route has no choice to make and
    counts nothing."""
    other = await RecordingUpstream("other").start()
    routes = table(
        [
            route("echo.test", [("echo", 1)], name="two"),
            route("one.test", [("solo", 1)], name="one"),
        ],
        [
            endpoint("echo", upstream.port),
            endpoint("echo", other.port),
            endpoint("solo", upstream.port),
        ],
    )
    try:
        async with running_proxy(routes) as (server, port):
            two = server.table.lookup(b"echo.test", b"/")
            one = server.table.lookup(b"one.test", b"/")
            assert two is not None and one is not None and one.single is not None
            picker = two.backends[0].picker
            slow = asyncio.ensure_future(
                exchange(port, b"GET /slow?s=0.5 HTTP/1.1\r\n" + H + b"\r\n")
            )
            async with asyncio.timeout(5):
                while sum(picker.inflight(t) for t in picker.targets) != 1:
                    await asyncio.sleep(0.01)
            # The next request goes to the endpoint without one in flight.
            response = await exchange(port, b"GET / HTTP/1.1\r\n" + H + b"\r\n")
            busy = next(t for t in picker.targets if picker.inflight(t) == 1)
            assert body_json(response)["upstream"] == ("up" if busy.port == other.port else "other")
            assert (await slow).startswith(b"HTTP/1.1 200 ")
            assert [picker.inflight(t) for t in picker.targets] == [0, 0]
            await exchange(port, b"GET / HTTP/1.1\r\nHost: one.test\r\n\r\n")
            solo = one.backends[0].picker
            assert [solo.inflight(t) for t in solo.targets] == [0]
    finally:
        await other.stop()
