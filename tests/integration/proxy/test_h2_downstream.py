"""HTTP/2 from clients (h2c with prior knowledge, one port with HTTP/1.1) to
HTTP/1.1 backends: the HTTP/1.1 path's rules hold for every stream."""

from __future__ import annotations

import asyncio
import json
import os

import pytest

from tests.support.h2client import H2Client, _Pending
from tests.support.h2harness import running_h2_proxy
from tests.support.poll import until
from tests.support.proxyharness import (
    RecordingUpstream,
    closed_port,
    endpoint,
    exchange,
    route,
    table,
)
from waygate.proxy import http2


@pytest.fixture
async def upstream():
    server = await RecordingUpstream().start()
    yield server
    await server.stop()


@pytest.fixture
async def proxy(upstream):
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_h2_proxy(routes) as (server, port):
        yield server, port


@pytest.fixture
async def client(proxy):
    _, port = proxy
    connection = await H2Client.connect(port)
    yield connection
    await connection.close()


def received(response) -> dict:
    return json.loads(response.body)


def headers_of(record: dict) -> dict[str, list[str]]:
    grouped: dict[str, list[str]] = {}
    for name, value in record["headers"]:
        grouped.setdefault(name.lower(), []).append(value)
    return grouped


async def test_h2c_and_http1_on_one_port(proxy, client):
    _, port = proxy
    response = await client.request("GET", "/a?b=1", "echo.test")
    assert response.status == 200
    record = received(response)
    assert record["target"] == "/a?b=1"
    assert headers_of(record)["host"] == ["echo.test"]
    plain = await exchange(port, b"GET /h1 HTTP/1.1\r\nHost: echo.test\r\n\r\n")
    assert plain.startswith(b"HTTP/1.1 200 ")


async def test_concurrent_streams_each_answered(client):
    ids = [client.start("GET", f"/s{i}", "echo.test") for i in range(30)]
    responses = await asyncio.gather(*(client.wait(i) for i in ids))
    assert [received(r)["target"] for r in responses] == [f"/s{i}" for i in range(30)]


async def test_identity_headers_stripped_and_forwarded_added(client):
    response = await client.request(
        "GET",
        "/",
        "echo.test",
        [("x-remote-user", "admin"), ("x_remote_group", "root"), ("proxy", "http://evil")],
    )
    sent = headers_of(received(response))
    assert "x-remote-user" not in sent and "x_remote_group" not in sent and "proxy" not in sent
    assert sent["x-forwarded-for"] == ["127.0.0.1"]
    assert sent["x-forwarded-host"] == ["echo.test"]


async def test_authority_and_host_must_agree(proxy, client, upstream):
    response = await client.request("GET", "/", "echo.test", [("host", "other.test")])
    # h2 refuses the block itself (a connection error); either way nothing goes on.
    assert response.status == 400 or response.reset is not None
    assert not upstream.requests
    agreeing = await H2Client.connect(proxy[1])
    try:
        same = await agreeing.request("GET", "/", "echo.test", [("host", "echo.test")])
        assert same.status == 200
    finally:
        await agreeing.close()


async def test_crlf_in_a_value_is_refused_not_injected(client, upstream):
    # h2 carries any bytes in a value; as an HTTP/1.1 line they would start a new one.
    stream_id = client.h2.get_next_available_stream_id()
    client.pending[stream_id] = _Pending()
    client.h2.send_headers(
        stream_id,
        [
            (b":method", b"GET"),
            (b":scheme", b"http"),
            (b":authority", b"echo.test"),
            (b":path", b"/"),
            (b"x-a", b"1\r\nx-remote-user: admin"),
        ],
        end_stream=True,
    )
    client.flush()
    response = await client.wait(stream_id)
    assert response.status == 400 or response.reset is not None
    assert not upstream.requests


async def test_no_route_is_503_with_reason(client):
    response = await client.request("GET", "/", "nowhere.test")
    assert response.status == 503
    assert response.header(b"x-waygate-error") == b"no route for host nowhere.test"


async def test_request_bodies_both_framings(client, upstream):
    body = os.urandom(700_000)
    response = await client.request("POST", "/up", "echo.test", body=body)
    assert received(response)["body_length"] == len(body)
    sized = await client.request(
        "PUT", "/sized", "echo.test", [("content-length", "5")], body=b"hello"
    )
    assert received(sized)["body_length"] == 5


async def test_large_response_respects_the_client_window(proxy, upstream):
    _, port = proxy
    client = await H2Client.connect(port, settings={4: 65535})
    try:
        response = await client.request("GET", "/big?n=3000000", "echo.test", timeout=30)
        assert response.status == 200
        assert len(response.body) == 3_000_000
    finally:
        await client.close()


@pytest.mark.parametrize("window", [65535, (1 << 31) - 1])
async def test_a_body_in_several_reads_ends_with_its_last_bytes(proxy, window):
    # /big writes its body in 64 KiB blocks: the proxy reads it in several
    # pieces. END_STREAM rides on the DATA frame with the last bytes, both when
    # they go at once (a wide window) and when the window held them (65,535):
    # no empty DATA frame after the body.
    _, port = proxy
    client = await H2Client.connect(port, settings={4: window})
    try:
        for _ in range(3):
            response = await client.request("GET", "/big?n=200000", "echo.test", timeout=30)
            assert response.status == 200
            assert len(response.body) == 200_000
        assert client.frames_seen["DataFrame"] >= 3 * 4
        assert client.empty_data_ends == 0
    finally:
        await client.close()


async def test_upstream_failure_explained(proxy):
    server, port = proxy
    server.set_table(
        table([route("dead.test", [("dead", 100)])], [endpoint("dead", closed_port())])
    )
    client = await H2Client.connect(port)
    try:
        response = await client.request("GET", "/", "dead.test")
        assert response.status == 502
        assert b"refused" in (response.header(b"x-waygate-error") or b"")
        grpc = await client.request(
            "POST", "/pkg.Svc/Call", "dead.test", [("content-type", "application/grpc")], b""
        )
        assert grpc.status == 200
        assert grpc.header(b"grpc-status") == b"14"
        assert b"refused" in (grpc.header(b"grpc-message") or b"")
        missing = await client.request(
            "POST", "/pkg.Svc/Call", "none.test", [("content-type", "application/grpc")], b""
        )
        assert missing.header(b"grpc-status") == b"14"
        assert missing.header(b"grpc-message") == b"no route for host none.test"
    finally:
        await client.close()


async def test_streams_leave_no_exchange_behind(proxy, client):
    server, _ = proxy
    for _ in range(3):
        await asyncio.gather(*(client.request("GET", "/", "echo.test") for _ in range(10)))
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    h2_connections = [c for c in server.connections if isinstance(c, http2.H2ClientConnection)]
    assert len(h2_connections) == 1
    assert len(server.connections) == 1  # the stream exchanges are gone
    assert h2_connections[0].streams == {}
    assert http2.STATS.held_bytes == 0


async def test_upgrade_to_h2c_is_refused_not_forwarded(proxy, upstream):
    # The way around a proxy's rules: an upgraded connection is a tunnel to the backend.
    _, port = proxy
    response = await exchange(
        port,
        b"GET /up HTTP/1.1\r\nHost: echo.test\r\nConnection: Upgrade, HTTP2-Settings\r\n"
        b"Upgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAAP__\r\n\r\n",
    )
    assert response.startswith(b"HTTP/1.1 200 ")
    sent = headers_of(upstream.requests[-1])
    assert "upgrade" not in sent and "http2-settings" not in sent
    assert b"h2c" not in upstream.received


async def test_alpn_h2_and_http11_on_the_https_port(tmp_path, upstream):
    import ssl

    from tests.support.pki import LocalCA
    from waygate.proxy.passthrough import TlsFront
    from waygate.proxy.tls import DefaultCertificate, EdgeCertificates

    ca = LocalCA()
    files = ca.write_files(tmp_path, dns=["echo.test"], prefix="default-")
    certificates = EdgeCertificates(DefaultCertificate.from_files(files.cert, files.key))
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_h2_proxy(routes) as (server, _):
        front = TlsFront(server, certificates, "127.0.0.1", 0)
        await front.start()
        try:
            context = ssl.create_default_context(cadata=ca.pem.decode())
            context.set_alpn_protocols(["h2", "http/1.1"])
            client = await H2Client.connect(
                front.bound_port, tls=context, server_hostname="echo.test"
            )
            try:
                assert client.writer.get_extra_info("ssl_object").selected_alpn_protocol() == "h2"
                response = await client.request("GET", "/tls", "echo.test")
                assert response.status == 200
                sent = headers_of(received(response))
                assert sent["x-forwarded-proto"] == ["https"]
            finally:
                await client.close()
            # A client offering only http/1.1 gets HTTP/1.1 on the same port.
            plain = ssl.create_default_context(cadata=ca.pem.decode())
            plain.set_alpn_protocols(["http/1.1"])
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", front.bound_port, ssl=plain, server_hostname="echo.test"
            )
            writer.write(b"GET / HTTP/1.1\r\nHost: echo.test\r\nConnection: close\r\n\r\n")
            answer = await asyncio.wait_for(reader.read(), 10)
            writer.close()
            assert answer.startswith(b"HTTP/1.1 200 ")
        finally:
            await front.drain(1.0)


async def test_drain_sends_goaway_and_finishes_streams_in_flight(proxy, upstream):
    server, port = proxy
    client = await H2Client.connect(port)
    try:
        slow = client.start("GET", "/slow?s=0.5", "echo.test")
        await asyncio.sleep(0.1)  # the request is at the backend
        draining = asyncio.create_task(server.drain(5.0))
        response = await client.wait(slow)
        assert response.status == 200
        await asyncio.wait_for(client.closed.wait(), 10)
        assert client.goaway is not None
        assert client.goaway.error_code == 0
        assert client.goaway.last_stream_id == slow
        await draining
    finally:
        await client.close()


async def test_metrics_by_protocol(client):
    from prometheus_client import CollectorRegistry, generate_latest

    registry = CollectorRegistry()
    registry.register(http2.H2Collector())
    before = http2.STATS.streams["h2c"]
    for _ in range(3):
        assert (await client.request("GET", "/", "echo.test")).status == 200
    text = generate_latest(registry).decode()
    assert f'waygate_proxy_h2_streams_total{{protocol="h2c"}} {before + 3}.0' in text
    assert "waygate_proxy_h2_held_bytes 0.0" in text


async def test_idle_h2_connections_make_room_and_busy_ones_stay(upstream):
    """Issue 18's idle-eviction rule holds for HTTP/2 too: at the connection bound
    the oldest connection with no stream open is closed with GOAWAY NO_ERROR (its
    last stream id: the client knows nothing later was processed); one with a
    stream in flight is never chosen, however old."""
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_h2_proxy(routes, max_connections=3) as (server, port):
        busy = await H2Client.connect(port)
        idle: list[H2Client] = []
        newcomer = None
        try:
            slow = busy.start("GET", "/slow?s=1.5", "echo.test")
            await until(
                lambda: any(getattr(c, "streams", None) for c in server.connections),
                "the slow stream open",
            )
            for _ in range(2):
                connection = await H2Client.connect(port)
                idle.append(connection)
                assert (await connection.request("GET", "/", "echo.test")).status == 200
            newcomer = await H2Client.connect(port)
            assert (await newcomer.request("GET", "/", "echo.test")).status == 200
            await asyncio.wait_for(idle[0].closed.wait(), 10)
            assert idle[0].goaway is not None
            assert idle[0].goaway.error_code == 0
            assert idle[0].goaway.last_stream_id == 1
            assert server.metrics.evicted_idle == 1
            assert not idle[1].closed.is_set()
            assert (await busy.wait(slow)).status == 200  # the oldest, but busy
        finally:
            for connection in [busy, *idle, *([newcomer] if newcomer else [])]:
                await connection.close()
