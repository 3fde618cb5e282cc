"""HTTP/2 to backends: multiplexing, an h2 client to an h2 backend, GOAWAY from a
backend (only the streams it never processed are sent again), stream-id exhaustion."""

from __future__ import annotations

import asyncio

from tests.support.h2client import H2Client
from tests.support.h2harness import H2Backend, running_h2_proxy, serve_h2_upstreams
from tests.support.proxyharness import endpoint, route, table
from waygate.proxy import h2upstream
from waygate.proxy.http2 import H2Limits
from waygate.resolver.model import HeaderModifier, RouteFilters


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


async def test_a_stream_whose_body_went_is_not_sent_again_after_goaway():
    # Its DATA left with its HEADERS and is no longer held: a resend would reach
    # the backend without the body, so the client gets a 502 that says why.
    backend = await H2Backend(goaway_after=2).start()
    routes, built = await proxied(backend)
    async with running_h2_proxy(built) as (server, port):
        serve_h2_upstreams(server, routes)
        client = await H2Client.connect(port)
        try:
            first = client.start("POST", "/first", "h2.test")
            await asyncio.sleep(0.05)
            # HEADERS and the whole body in one write: they reach the backend
            # before its GOAWAY comes back.
            flush = client.flush
            client.flush = lambda: None  # type: ignore[method-assign]
            second = client.start("POST", "/second", "h2.test", end=False)
            client.h2.send_data(second, b"payload", end_stream=True)
            client.flush = flush  # type: ignore[method-assign]
            client.flush()
            a, b = await client.wait(first), await client.wait(second)
        finally:
            await client.close()
    await backend.stop()
    assert (a.status, b.status) == (200, 502)
    assert b.header(b"x-waygate-error") == b"upstream went away before answering"
    assert backend.received.count((2, "/second")) == 0
    assert server.metrics.redispatches == 0


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


async def at_the_bound(bound: int, queue: int, streams: int):
    """`streams` concurrent streams to an h2c backend, one stream per backend
    connection, at most `bound` connections to the endpoint and `queue` waiting:
    the answers, the backend, and the endpoint's count in the pool afterwards."""
    backend = await H2Backend().start()
    routes, built = await proxied(backend)
    async with running_h2_proxy(built) as (server, port):
        server.pool.max_per_endpoint = bound
        server.pool.max_queue = queue
        serve_h2_upstreams(server, routes, H2Limits(max_concurrent_streams=1))
        client = await H2Client.connect(port)
        try:
            ids = [client.start("GET", f"/m{i}", "h2.test") for i in range(streams)]
            answers = await asyncio.gather(*(client.wait(i) for i in ids))
        finally:
            await client.close()
        counted = dict(server.pool.opened)
    await backend.stop()
    return answers, backend, counted


async def test_backend_connections_count_in_the_endpoint_bound():
    """HTTP/2 connections to a backend count in --max-connections-per-endpoint as
    HTTP/1.1 ones do: with room for one stream per connection and a bound of 2,
    20 concurrent streams take turns on 2 connections instead of opening 20."""
    answers, backend, counted = await at_the_bound(2, 1024, 20)
    assert [a.status for a in answers] == [200] * 20
    assert backend.connections == 2
    assert all(count <= 2 for count in counted.values())


async def test_at_the_endpoint_bound_with_a_full_queue_the_stream_gets_503():
    answers, backend, _ = await at_the_bound(1, 0, 5)
    statuses = [a.status for a in answers]
    assert 200 in statuses and 503 in statuses
    refused = next(a for a in answers if a.status == 503)
    assert b"is at its limit of 1 connections" in refused.body
    assert backend.connections == 1


async def test_route_header_filters_apply_to_h2_backends():
    """HTTPRoute RequestHeaderModifier and ResponseHeaderModifier hold when the
    backend speaks h2c, as they do for HTTP/1.1 backends."""
    backend = await H2Backend().start()
    filters = RouteFilters(
        request_headers=HeaderModifier(
            set=(("X-Set", "one"),), add=(("X-Add", "two"),), remove=("x-drop",)
        ),
        response_headers=HeaderModifier(set=(("X-Resp", "three"),), remove=("x-backend",)),
    )
    routes = [route("h2.test", [("h2", 100)], upstream_protocol="h2c", filters=filters)]
    async with running_h2_proxy(table(routes, [endpoint("h2", backend.port)])) as (server, port):
        serve_h2_upstreams(server, routes)
        client = await H2Client.connect(port)
        try:
            stream_id = client.start(
                "GET", "/f", "h2.test", headers=[("x-drop", "gone"), ("x-set", "client")]
            )
            response = await client.wait(stream_id)
        finally:
            await client.close()
    await backend.stop()
    assert (response.status, response.body) == (200, b"/f")
    (seen,) = backend.headers
    names = [name for name, _ in seen]
    assert (b"x-set", b"one") in seen and names.count(b"x-set") == 1
    assert (b"x-add", b"two") in seen
    assert b"x-drop" not in names
    assert response.header(b"x-resp") == b"three"
    assert response.header(b"x-backend") is None
