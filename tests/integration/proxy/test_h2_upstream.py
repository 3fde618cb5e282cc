"""HTTP/2 to backends: multiplexing, an h2 client to an h2 backend, GOAWAY from a
backend (only the streams it never processed are sent again), stream-id exhaustion."""

from __future__ import annotations

import asyncio

from tests.integration.proxy.h2harness import H2Backend, running_h2_proxy, serve_h2_upstreams
from tests.integration.proxy.harness import endpoint, route, table
from tests.support.h2client import H2Client
from waygate.proxy import h2upstream


async def proxied(backend: H2Backend):
    routes = [route("h2.test", [("h2", 100)], upstream_protocol="h2c")]
    return routes, table(routes, [endpoint("h2", backend.port)])


async def test_streams_share_one_backend_connection():
    backend = await H2Backend().start()
    routes, built = await proxied(backend)
    async with running_h2_proxy(built) as (server, port):
        serve_h2_upstreams(server, routes)
        client = await H2Client.connect(port)
        try:
            ids = [client.start("GET", f"/m{i}", "h2.test") for i in range(20)]
            answers = await asyncio.gather(*(client.wait(i) for i in ids))
        finally:
            await client.close()
    await backend.stop()
    assert [a.body for a in answers] == [f"/m{i}".encode() for i in range(20)]
    assert backend.connections == 1
    assert server.metrics.upstream_opened == 1


async def test_backend_goaway_resends_only_unprocessed_streams():
    backend = await H2Backend(goaway_after=2).start()
    routes, built = await proxied(backend)
    async with running_h2_proxy(built) as (server, port):
        serve_h2_upstreams(server, routes)
        client = await H2Client.connect(port)
        try:
            first = client.start("POST", "/first", "h2.test")
            await asyncio.sleep(0.05)
            second = client.start("POST", "/second", "h2.test")
            a, b = await client.wait(first), await client.wait(second)
        finally:
            await client.close()
    await backend.stop()
    assert (a.status, a.body, b.status, b.body) == (200, b"/first", 200, b"/second")
    # The first was processed once on the first connection; the second, above the
    # GOAWAY's last stream id, was never processed there and went to a new one, once.
    assert backend.processed == [(1, "/first"), (2, "/second")]
    assert backend.received.count((1, "/second")) == 1
    assert server.metrics.redispatches == 1


async def test_stream_ids_exhausted_take_a_new_connection(monkeypatch):
    backend = await H2Backend().start()
    routes, built = await proxied(backend)
    async with running_h2_proxy(built) as (server, port):
        serve_h2_upstreams(server, routes)
        client = await H2Client.connect(port)
        try:
            assert (await client.request("GET", "/a", "h2.test")).status == 200
            # The connection's next stream id would pass the largest one allowed.
            (connection,) = [c for cs in server.h2_upstreams.pool.connections.values() for c in cs]
            connection.h2.highest_outbound_stream_id = h2upstream.MAX_STREAM_ID - 1
            assert not connection.has_room()
            assert (await client.request("GET", "/b", "h2.test")).status == 200
        finally:
            await client.close()
    await backend.stop()
    assert backend.connections == 2
    assert backend.processed == [(1, "/a"), (2, "/b")]
