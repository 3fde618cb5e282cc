"""The proxy reaches a tunnelled endpoint through the tunnelled connection itself
(issue 19 item 2): `transport_dialer` hands every upstream step (HTTP/1.1, reencrypt
TLS, HTTP/2 over h2c and TLS, TLS passthrough, request mirrors) the data connection
(`relay.Link`) or, on the gRPC fallback, the Tunnel.Dial stream as a transport
(`StreamTransport`), with no socketpair in between. Real proxy, tunnel server, agent
and backends in one process; mTLS on both tunnel hops, and the backend's own TLS
inside it for reencrypt. Every test runs on both paths.

Every test here runs with `socket.socketpair` replaced by one that fails and
records the call (`no_socketpair`): a path that still bridged through one fails.
"""

from __future__ import annotations

import asyncio
import os
import socket
import ssl
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.integration.proxy.test_passthrough import front_to, tls_get
from tests.integration.proxy.test_reencrypt import TlsBackend, reencrypt
from tests.integration.tunnel.harness import NODE, Tunnel, echo_server
from tests.support.h2client import H2Client
from tests.support.h2harness import H2Backend, running_h2_proxy, serve_h2_upstreams
from tests.support.pki import LocalCA
from tests.support.poll import until
from tests.support.proxyharness import (
    RecordingUpstream,
    endpoint,
    read_response,
    route,
    running_proxy,
    table,
)
from waygate.core.flow import HIGH_WATER
from waygate.core.tls import server_context
from waygate.proxy.upstream import ConnectError, Dialer
from waygate.proxy.upstream_tls import UpstreamTLS
from waygate.resolver.model import Mirror, RouteFilters
from waygate.tunnel.client import (
    StreamTransport,
    TunnelClient,
    bridged_socket,
    early_transport_dialer,
    transport_dialer,
)
from waygate.tunnel.relay import Link

HOST = b"Host: edge.test\r\n"


@pytest.fixture(params=["data", "grpc"])
async def tunnel(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Tunnel]:
    """One server replica and one agent; every test runs on both of the tunnel's paths:
    raw data connections, and Tunnel.Dial streams (the gRPC fallback, no data listener)."""
    t = Tunnel(tmp_path, data_path=request.param == "data")
    await t.start_server()
    await t.start_agent()
    try:
        yield t
    finally:
        await t.close()


@pytest.fixture
async def no_socketpair(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[list[object]]:
    """socket.socketpair fails (and is recorded) from here to the end of the test."""
    calls: list[object] = []

    def refuse(*args: object, **kwargs: object) -> None:
        calls.append(args)
        raise AssertionError("a socketpair was made on the proxy's tunnel path")

    monkeypatch.setattr(socket, "socketpair", refuse)
    yield calls
    assert not calls


@pytest.fixture
async def backend() -> AsyncIterator[RecordingUpstream]:
    server = await RecordingUpstream().start()
    yield server
    await server.stop()


def tunnelled(backend_port: int, connect_timeout: float = 5.0, **route_kw: object):  # type: ignore[no-untyped-def]
    return table(
        [route("edge.test", [("edge", 1)], **route_kw)],
        [endpoint("edge", backend_port, tunnel=True, node_name=NODE)],
        connect_timeout=connect_timeout,
    )


def dialer(tunnel: Tunnel, **client_kw: object) -> Dialer:
    """The proxy's dialer as the proxy process wires it: a GET/HEAD head goes with the
    tunnel's dial as its early data (`early_transport_dialer`), everything else after."""
    client = tunnel.client(**client_kw)
    return Dialer(
        tunnel=transport_dialer(client, ConnectError),  # type: ignore[arg-type]
        tunnel_early=early_transport_dialer(client, ConnectError),  # type: ignore[arg-type]
    )


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def data_connections(tunnel: Tunnel) -> int:
    """Tunnelled connections the server replica still holds (either path)."""
    return sum(session.open_connections() for session in tunnel.hub.sessions_all())


def settled(tunnel: Tunnel) -> bool:
    """No tunnelled connection open and the agent's warm pool full again: the state
    in which the process's fds and tasks are compared (the pool refills after a dial,
    so its connections come and go by design)."""
    agent = tunnel.agents[0]
    return not data_connections(tunnel) and (
        not tunnel.data_path
        or all(
            s.pool is not None and len(s.pool.idle) >= agent.pool_size
            for s in agent.streams.values()
        )
    )


async def baseline(tunnel: Tunnel) -> tuple[int, int]:
    """(open fds, tasks) once the tunnel has settled."""
    await until(lambda: settled(tunnel), "the tunnel to settle")
    return open_fds(), len(asyncio.all_tasks())


async def back_to(tunnel: Tunnel, fds: int, tasks: int) -> None:
    await until(
        lambda: settled(tunnel) and open_fds() <= fds and len(asyncio.all_tasks()) <= tasks,
        f"fds back to {fds} and tasks to {tasks}",
    )


def tunnel_layer(transport: object) -> Link | StreamTransport:
    """The tunnelled connection under an upstream's transport: the transport itself, or
    the one a TLS Link runs inside."""
    if isinstance(transport, Link) and isinstance(transport.raw, Link | StreamTransport):
        return transport.raw
    assert isinstance(transport, Link | StreamTransport), transport
    return transport


@pytest.mark.usefixtures("no_socketpair")
async def test_requests_ride_the_data_connection_as_the_upstream_transport(
    tunnel: Tunnel, backend: RecordingUpstream
) -> None:
    async with running_proxy(tunnelled(backend.port), dialer=dialer(tunnel, pool_size=2)) as (
        server,
        port,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(3):  # keep-alive: one upstream connection for all three
                writer.write(b"GET / HTTP/1.1\r\n" + HOST + b"\r\n")
                response = await read_response(reader)
                assert response.startswith(b"HTTP/1.1 200 "), response[:200]
            (upstream,) = server.upstreams
            assert tunnel_layer(upstream.transport) is upstream.transport  # nothing between
            assert backend.connections == 1 and len(backend.requests) == 3

            upload = b"u" * 1_000_000  # (the recording backend counts bodies under 1 MiB)
            writer.write(
                b"POST /up HTTP/1.1\r\n" + HOST + b"Content-Length: %d\r\n\r\n" % len(upload)
            )
            writer.write(upload)
            response = await read_response(reader, timeout=30)
            assert response.startswith(b"HTTP/1.1 200 ")
            assert backend.requests[-1]["body_length"] == len(upload)

            size = 8 * 1024 * 1024
            writer.write(b"GET /big?n=%d HTTP/1.1\r\n" % size + HOST + b"\r\n")
            async with asyncio.timeout(30):
                head = await reader.readuntil(b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200 ")
                assert len(await reader.readexactly(size)) == size
        finally:
            writer.close()


@pytest.mark.usefixtures("no_socketpair")
async def test_a_get_head_goes_with_the_dial_and_a_body_after_it(
    tunnel: Tunnel, backend: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new upstream connection for a bodiless GET: its head is the dial's early data
    and reaches the backend once; a POST's head and body go after the dial."""
    early: list[bytes] = []
    dial = TunnelClient.dial

    async def recording(self: TunnelClient, *args: object, **kwargs: object) -> object:
        early.append(kwargs.get("early", b""))  # type: ignore[arg-type]
        return await dial(self, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(TunnelClient, "dial", recording)
    for request in (
        b"GET /first HTTP/1.1\r\n" + HOST + b"\r\n",
        b"POST /second HTTP/1.1\r\n" + HOST + b"Content-Length: 4\r\n\r\nbody",
    ):  # a proxy each: each request on a new upstream connection
        async with running_proxy(tunnelled(backend.port), dialer=dialer(tunnel)) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                writer.write(request)
                response = await read_response(reader)
                assert response.startswith(b"HTTP/1.1 200 "), response[:200]
            finally:
                writer.close()
    assert len(early) == 2
    assert early[0].startswith(b"GET /first HTTP/1.1\r\n")  # the upstream head, whole
    assert early[1] == b""
    assert [r["target"] for r in backend.requests] == ["/first", "/second"]
    assert backend.requests[1]["body_length"] == 4


@pytest.mark.usefixtures("no_socketpair")
async def test_a_response_in_before_the_exchange_attaches_is_its_response(
    tunnel: Tunnel, backend: RecordingUpstream
) -> None:
    """With the head sent as early data the response can be held in the tunnelled
    connection before the exchange has it (here: the dial returns only once the backend
    answered): it is delivered at attach, to the exchange already bound to it."""
    proxied = dialer(tunnel)
    early = proxied.tunnel_early
    assert early is not None

    async def answered_first(*args: object) -> object:
        dialled = await early(*args)  # type: ignore[arg-type]
        await until(lambda: len(backend.requests) == 1, "the backend's answer")
        await asyncio.sleep(0.2)  # its response on the way back, into the held bytes
        return dialled

    proxied.tunnel_early = answered_first  # type: ignore[assignment]
    async with running_proxy(tunnelled(backend.port), dialer=proxied) as (_server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /early HTTP/1.1\r\n" + HOST + b"\r\n")
            response = await read_response(reader)
            assert response.startswith(b"HTTP/1.1 200 "), response[:200]
        finally:
            writer.close()


@pytest.mark.usefixtures("no_socketpair")
async def test_an_upstream_that_closes_closes_its_data_connection(
    tunnel: Tunnel, backend: RecordingUpstream
) -> None:
    async with running_proxy(tunnelled(backend.port), dialer=dialer(tunnel, pool_size=2)) as (
        server,
        port,
    ):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET /close HTTP/1.1\r\n" + HOST + b"\r\n")
            async with asyncio.timeout(10):
                response = await reader.read()  # the proxy closes after a Connection: close
            assert response.startswith(b"HTTP/1.1 200 ")
        finally:
            writer.close()
        await until(lambda: not server.upstreams, "the upstream data connection to close")
        # The tunnel server let go of it too (the agent's side: its relay ended).
        await until(lambda: not data_connections(tunnel), "the server's side to end")


@pytest.mark.usefixtures("no_socketpair")
async def test_a_client_gone_mid_download_releases_the_tunnelled_connection(
    tunnel: Tunnel, backend: RecordingUpstream
) -> None:
    # The client reads a little of a large answer and goes away: the upstream is
    # aborted, and with it the tunnelled connection, its tasks and its fds.
    async with running_proxy(tunnelled(backend.port), dialer=dialer(tunnel)) as (server, port):
        await get(port)  # the tunnel's channel is up
        server.pool.close_all()  # (that request's upstream, kept alive)
        fds, tasks = await baseline(tunnel)
        for _ in range(3):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /big?n=%d HTTP/1.1\r\n" % (64 << 20) + HOST + b"\r\n")
            async with asyncio.timeout(15):
                await reader.readuntil(b"\r\n\r\n")
                await reader.readexactly(1 << 20)
            writer.transport.abort()
        await until(lambda: not server.upstreams, "the upstreams to be let go")
        await back_to(tunnel, fds, tasks)


# ---------------------------------------------------------------- reencrypt


def reencrypting(tunnel: Tunnel, backend_port: int, ca: LocalCA, connect_timeout: float = 5.0):  # type: ignore[no-untyped-def]
    return running_proxy(
        tunnelled(backend_port, connect_timeout, name="secure", tls=reencrypt(ca.pem)),
        dialer=dialer(tunnel),
    )


async def get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET / HTTP/1.1\r\n" + HOST + b"\r\n")
        return await read_response(reader, timeout=15)
    finally:
        writer.close()


@pytest.mark.usefixtures("no_socketpair")
async def test_reencrypt_runs_the_backends_tls_inside_the_data_connection(
    tunnel: Tunnel,
) -> None:
    ca = LocalCA()
    # The proxy verifies the backend as SERVICE.NAMESPACE.svc (the route's service "edge").
    backend = await TlsBackend(ca.issue(dns=["edge.demo.svc"])).start()
    try:
        async with reencrypting(tunnel, backend.port, ca) as (server, port):
            server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                for _ in range(3):  # keep-alive: one TLS connection, pooled
                    writer.write(b"GET / HTTP/1.1\r\n" + HOST + b"\r\n")
                    response = await read_response(reader, timeout=15)
                    assert response.startswith(b"HTTP/1.1 200"), response[:300]
                    assert response.endswith(b"secured\n")
                (upstream,) = server.upstreams
                inner = upstream.transport
                # TLS to the backend is a Link whose transport is the tunnelled connection.
                assert isinstance(inner, Link) and tunnel_layer(inner) is inner.raw
                ssl_object = inner.get_extra_info("ssl_object")
                assert ssl_object is not None and ssl_object.server_hostname == "edge.demo.svc"
                assert len(backend.requests) == 3 and len(backend.resumed) == 1
            finally:
                writer.close()
    finally:
        await backend.stop()


@pytest.mark.usefixtures("no_socketpair")
async def test_a_failed_reencrypt_handshake_in_the_tunnel_says_why_and_lets_go(
    tunnel: Tunnel,
) -> None:
    ca = LocalCA()
    # Issued for another name: the proxy must refuse it, name both, and close the
    # data connection (the explaining probe goes through the tunnel too).
    backend = await TlsBackend(ca.issue(dns=["other.demo.svc"])).start()
    try:
        async with reencrypting(tunnel, backend.port, ca) as (server, port):
            server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
            await get(port)  # the tunnel's channel and TLS contexts are up
            fds, tasks = await baseline(tunnel)
            for _ in range(10):
                response = await get(port)
                assert response.startswith(b"HTTP/1.1 502"), response[:300]
                assert b"upstream certificate is for other.demo.svc, not edge.demo.svc" in response
            assert not server.upstreams
            await back_to(tunnel, fds, tasks)
    finally:
        await backend.stop()


@pytest.mark.usefixtures("no_socketpair")
async def test_a_reencrypt_handshake_that_stalls_times_out_and_lets_go(tunnel: Tunnel) -> None:
    # A backend that takes the connection and never answers the ClientHello.
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    stalled = await asyncio.start_server(hold, "127.0.0.1", 0)
    ca = LocalCA()
    try:
        async with reencrypting(
            tunnel, stalled.sockets[0].getsockname()[1], ca, connect_timeout=0.5
        ) as (server, port):
            server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
            await get(port)
            fds, tasks = await baseline(tunnel)
            for _ in range(3):
                response = await get(port)
                assert response.startswith(b"HTTP/1.1 502"), response[:300]
                assert b"upstream TLS handshake timed out" in response
            # (the stalled backend still holds its side of each attempt)
            await until(lambda: len(held) == 4, "the backend to hold every attempt")
            await back_to(tunnel, fds + 3, tasks)
    finally:
        for writer in held:
            writer.close()
        stalled.close()


# ---------------------------------------------------------------- HTTP/2


@pytest.mark.parametrize("over_tls", [False, True], ids=["h2c", "h2"])
@pytest.mark.usefixtures("no_socketpair")
async def test_http2_backends_behind_the_tunnel(tunnel: Tunnel, over_tls: bool) -> None:
    ca = LocalCA()
    tls = None
    if over_tls:
        chain, key = ca.issue(dns=["edge.demo.svc"])
        tls = server_context(chain_pem=chain, key_pem=key)
        tls.set_alpn_protocols(["h2"])
    backend = await H2Backend(tls=tls).start()
    route_kw: dict[str, object] = {"upstream_protocol": "h2c"}
    if over_tls:
        route_kw = {"upstream_protocol": "h2", "tls": reencrypt(ca.pem)}
    routes = [route("edge.test", [("edge", 1)], **route_kw)]
    built = table(routes, [endpoint("edge", backend.port, tunnel=True, node_name=NODE)])
    try:
        async with running_h2_proxy(built, dialer=dialer(tunnel)) as (server, port):
            server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
            serve_h2_upstreams(server, routes)
            client = await H2Client.connect(port)
            try:
                ids = [client.start("GET", f"/m{i}", "edge.test") for i in range(10)]
                async with asyncio.timeout(15):
                    answers = await asyncio.gather(*(client.wait(i) for i in ids))
            finally:
                await client.close()
            assert [a.body for a in answers] == [f"/m{i}".encode() for i in range(10)]
            assert backend.connections == 1  # ten streams, one tunnelled connection
            ((connection,),) = server.h2_upstreams.pool.connections.values()  # type: ignore[attr-defined]
            layer = tunnel_layer(connection.transport)
            if over_tls:
                assert connection.transport is not layer  # TLS inside the tunnelled one
                ssl_object = connection.transport.get_extra_info("ssl_object")
                assert ssl_object.selected_alpn_protocol() == "h2"
    finally:
        await backend.stop()


# ---------------------------------------------------------------- passthrough


@pytest.mark.usefixtures("no_socketpair")
async def test_passthrough_relays_the_clients_tls_through_the_tunnel(
    tunnel: Tunnel, tmp_path: Path
) -> None:
    backend_ca = LocalCA(name="Backend CA")
    certificate = backend_ca.issue(dns=["pass.test"])
    backend = await TlsBackend(certificate).start()
    try:
        async with front_to(
            backend.port, tmp_path, LocalCA(), dialer=dialer(tunnel), tunnel=True, node_name=NODE
        ) as front:
            for _ in range(3):
                der, response = await tls_get(front.bound_port, "pass.test", backend_ca.pem)
                # The backend's own certificate, byte for byte, through the tunnel.
                assert ssl.DER_cert_to_PEM_cert(der).encode() == certificate[0]
                assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"secured\n")
            assert backend.requests == [b"GET / HTTP/1.1\r\nHost: pass.test\r\n\r\n"] * 3
            await until(lambda: not front.relays, "the relays to end with their connections")
            await until(lambda: not data_connections(tunnel), "the tunnelled connections to end")
    finally:
        await backend.stop()


@pytest.mark.usefixtures("no_socketpair")
async def test_a_passthrough_client_that_reads_slowly_backs_up_into_the_tunnel(
    tunnel: Tunnel, tmp_path: Path
) -> None:
    # A backend that streams 32 MiB after the handshake; the client reads nothing at
    # first: what the proxy holds stays bounded (the relay pauses the data connection,
    # TCP holds the rest back), and once the client reads, every byte arrives.
    async def flood(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            chunk = b"x" * 65536
            for _ in range(512):
                writer.write(chunk)
                await writer.drain()
        except (ConnectionError, ssl.SSLError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    backend_ca = LocalCA(name="Backend CA")
    chain, key = backend_ca.issue(dns=["pass.test"])
    flooding = await asyncio.start_server(
        flood, "127.0.0.1", 0, ssl=server_context(chain_pem=chain, key_pem=key)
    )
    try:
        async with front_to(
            flooding.sockets[0].getsockname()[1],
            tmp_path,
            LocalCA(),
            dialer=dialer(tunnel),
            tunnel=True,
            node_name=NODE,
        ) as front:
            context = ssl.create_default_context(cadata=backend_ca.pem.decode())
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", front.bound_port, ssl=context, server_hostname="pass.test"
            )
            try:
                writer.write(b"GET / HTTP/1.1\r\nHost: pass.test\r\n\r\n")
                await until(lambda: len(front.relays) == 1, "the relay")
                (relay,) = front.relays
                # The proxy's side towards the client fills to its high-water mark, and
                # the tunnelled connection's reading pauses (core.flow, reason PEER).
                await until(
                    lambda: relay.backend.flow is not None and relay.backend.flow.reading_paused,
                    "the tunnelled connection's reading to pause",
                )
                assert relay.client.transport is not None
                # At most its high-water mark and one read of the tunnelled connection past it.
                assert relay.client.transport.get_write_buffer_size() <= 2 * HIGH_WATER
                received = 0
                async with asyncio.timeout(60):
                    while piece := await reader.read(1 << 20):
                        received += len(piece)
                assert received == 512 * 65536
            finally:
                writer.close()
            await until(lambda: not front.relays, "the relay to end")
            await until(lambda: not data_connections(tunnel), "the tunnelled connection to end")
    finally:
        flooding.close()


# ---------------------------------------------------------------- mirrors


@pytest.mark.usefixtures("no_socketpair")
async def test_a_mirror_copy_reaches_a_tunnelled_endpoint(
    tunnel: Tunnel, backend: RecordingUpstream
) -> None:
    mirror = await RecordingUpstream().start()
    try:
        routes = [
            route(
                "edge.test",
                [("web", 1)],
                filters=RouteFilters(mirrors=(Mirror(service="mirror"),)),
            )
        ]
        endpoints = [
            endpoint("web", backend.port),
            endpoint("mirror", mirror.port, tunnel=True, node_name=NODE),
        ]
        async with running_proxy(table(routes, endpoints), dialer=dialer(tunnel)) as (
            server,
            port,
        ):
            for i in range(3):
                response = await get_path(port, f"/copy{i}")
                assert response.startswith(b"HTTP/1.1 200")
            await until(lambda: server.mirrors.sent == 3, "three copies answered")
            assert sorted(r["target"] for r in mirror.requests) == ["/copy0", "/copy1", "/copy2"]
            assert server.mirrors.failed == 0
            await until(lambda: not server.mirrors.tasks, "the copies to finish")
            await until(lambda: not data_connections(tunnel), "their tunnelled connections to end")
    finally:
        await mirror.stop()


async def get_path(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\n".encode() + HOST + b"\r\n")
        return await read_response(reader, timeout=15)
    finally:
        writer.close()


# ---------------------------------------------------------------- a socket for tools


async def test_bridged_socket_carries_both_ways_with_half_close(tunnel: Tunnel) -> None:
    # For callers that need a socket (tests, bench/tunnel): one splice between a
    # socketpair's end and the data connection or, on the gRPC path, the stream.
    server, port = await echo_server()
    async with server:
        stream = await tunnel.client().dial(NODE, port)
        sock = await bridged_socket(stream)
        reader, writer = await asyncio.open_connection(sock=sock)
        payload = os.urandom(4 * 1024 * 1024)
        writer.write(payload)
        writer.write_eof()  # the echo server half-closes after echoing everything
        async with asyncio.timeout(30):
            assert await reader.read() == payload
        writer.close()
        await until(lambda: not data_connections(tunnel), "the tunnelled connection to end")


@pytest.mark.usefixtures("no_socketpair")
async def test_a_proxy_that_dials_end_to_end_holds_tls_with_the_agent(
    tunnel: Tunnel, backend: RecordingUpstream
) -> None:
    """`--tunnel-end-to-end`: the upstream transport is a TLS session with the agent
    (the replica copies ciphertext), no request goes with the dial, and uploads and
    downloads cross it whole; on the gRPC path the dial is relayed as before."""
    async with running_proxy(
        tunnelled(backend.port), dialer=dialer(tunnel, pool_size=2, end_to_end=True)
    ) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            writer.write(b"GET / HTTP/1.1\r\n" + HOST + b"\r\n")
            assert (await read_response(reader)).startswith(b"HTTP/1.1 200 ")
            (upstream,) = server.upstreams
            if tunnel.data_path:
                agent_der = ssl.PEM_cert_to_DER_cert(tunnel.agent_files.cert.read_text())
                assert upstream.transport.get_extra_info("peercert_der") == agent_der
                (connection,) = tunnel.hub.sessions[NODE].data.values()
                assert connection.end_to_end and connection.kernel_relay is not None
            upload = b"u" * 1_000_000
            writer.write(
                b"POST /up HTTP/1.1\r\n" + HOST + b"Content-Length: %d\r\n\r\n" % len(upload)
            )
            writer.write(upload)
            assert (await read_response(reader, timeout=30)).startswith(b"HTTP/1.1 200 ")
            assert backend.requests[-1]["body_length"] == len(upload)
            size = 8 * 1024 * 1024
            writer.write(b"GET /big?n=%d HTTP/1.1\r\n" % size + HOST + b"\r\n")
            async with asyncio.timeout(30):
                assert (await reader.readuntil(b"\r\n\r\n")).startswith(b"HTTP/1.1 200 ")
                assert len(await reader.readexactly(size)) == size
            assert backend.connections == 1  # one upstream connection, kept alive
        finally:
            writer.close()
