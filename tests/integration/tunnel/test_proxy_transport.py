"""The proxy reaches a tunnelled endpoint through the tunnel's data connection itself
(issue 19 item 2): `transport_dialer` hands the proxy's upstream protocol the
`relay.Link`, with no socketpair in between. Real proxy, tunnel server, agent
and backend in one process; mTLS on both tunnel hops.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from tests.integration.proxy.harness import (
    RecordingUpstream,
    endpoint,
    read_response,
    route,
    running_proxy,
    table,
)
from tests.integration.tunnel.harness import NODE, Tunnel
from tests.support.poll import until
from waygate.proxy.upstream import ConnectError, Dialer
from waygate.tunnel.client import socket_dialer, transport_dialer
from waygate.tunnel.relay import Link

HOST = b"Host: edge.test\r\n"


@pytest.fixture
async def backend() -> AsyncIterator[RecordingUpstream]:
    server = await RecordingUpstream().start()
    yield server
    await server.stop()


def tunnelled(backend: RecordingUpstream):  # type: ignore[no-untyped-def]
    return table(
        [route("edge.test", [("edge", 1)])],
        [endpoint("edge", backend.port, tunnel=True, node_name=NODE)],
    )


def dialer(tunnel: Tunnel) -> Dialer:
    client = tunnel.client(pool_size=2)
    return Dialer(
        tunnel=socket_dialer(client, ConnectError),
        tunnel_open=transport_dialer(client, ConnectError),
    )


async def test_requests_ride_the_data_connection_as_the_upstream_transport(
    tunnel: Tunnel, backend: RecordingUpstream
) -> None:
    async with running_proxy(tunnelled(backend), dialer=dialer(tunnel)) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for _ in range(3):  # keep-alive: one upstream connection for all three
                writer.write(b"GET / HTTP/1.1\r\n" + HOST + b"\r\n")
                response = await read_response(reader)
                assert response.startswith(b"HTTP/1.1 200 "), response[:200]
            (upstream,) = server.upstreams
            assert isinstance(upstream.transport, Link)  # no socketpair between
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


async def test_an_upstream_that_closes_closes_its_data_connection(
    tunnel: Tunnel, backend: RecordingUpstream
) -> None:
    async with running_proxy(tunnelled(backend), dialer=dialer(tunnel)) as (server, port):
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
        await until(
            lambda: all(not s.data for s in tunnel.hub.sessions_all()),
            "the server's data connection to end",
        )
