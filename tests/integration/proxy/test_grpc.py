"""gRPC through the proxy (h2c to the proxy, HTTP/2 to a real grpcio backend):
all four call kinds, deadlines, trailers, and the proxy's own answers as gRPC statuses."""

from __future__ import annotations

import grpc
import pytest

from tests.support.h2harness import GrpcBackend, running_h2_proxy, serve_h2_upstreams
from tests.support.proxyharness import closed_port, endpoint, route, table


@pytest.fixture
async def backend():
    server = await GrpcBackend().start()
    yield server
    await server.stop()


def grpc_routes(port: int) -> tuple[list, list]:
    routes = [
        route("grpc.test", [("echo", 100)], upstream_protocol="grpc"),
        route("dead.test", [("dead", 100)], upstream_protocol="grpc", name="dead"),
        route("empty.test", [("none", 100)], upstream_protocol="grpc", name="empty"),
    ]
    return routes, [endpoint("echo", port), endpoint("dead", closed_port())]


@pytest.fixture
async def proxied(backend):
    routes, endpoints = grpc_routes(backend.port)
    async with running_h2_proxy(table(routes, endpoints)) as (server, port):
        serve_h2_upstreams(server, routes)
        yield server, port


def channel(port: int, authority: str = "grpc.test") -> grpc.aio.Channel:
    return grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.default_authority", authority)]
    )


async def test_four_call_kinds_through_the_proxy(proxied, backend):
    server, port = proxied
    async with channel(port) as ch:
        unary = ch.unary_unary("/test.Echo/Unary")
        reply = await unary(b"hello", timeout=10)
        # The backend saw the proxy's X-Forwarded-For: the rule book ran.
        assert reply == b"hello|127.0.0.1"
        ticks = [r async for r in ch.unary_stream("/test.Echo/ServerStream")(b"5", timeout=10)]
        assert ticks == [b"tick"] * 5

        async def pieces():
            for piece in (b"a", b"b", b"c"):
                yield piece

        assert await ch.stream_unary("/test.Echo/ClientStream")(pieces(), timeout=10) == b"abc"
        call = ch.stream_stream("/test.Echo/Bidi")(timeout=10)
        for word in (b"x", b"y"):
            await call.write(word)
            assert await call.read() == word
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
    assert backend.calls == 4
    # One multiplexed connection carried every call.
    assert server.metrics.upstream_opened == 1


async def test_status_and_message_in_trailers_are_relayed(proxied):
    _, port = proxied
    async with channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await ch.unary_unary("/test.Echo/Fail")(b"5", timeout=10)
    assert failed.value.code() == grpc.StatusCode.NOT_FOUND
    assert failed.value.details() == "failed as asked"


async def test_grpc_timeout_is_the_request_timeout(proxied):
    _, port = proxied
    async with channel(port) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await ch.unary_unary("/test.Echo/Unary")(b"sleep:5", timeout=0.5)
    assert failed.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


@pytest.mark.parametrize(
    ("authority", "message"),
    [
        ("nowhere.test", "no route for host nowhere.test"),
        ("dead.test", "refused"),
        ("empty.test", "no endpoint ready for route demo/empty"),
    ],
)
async def test_proxy_answers_are_grpc_statuses(proxied, authority, message):
    _, port = proxied
    async with channel(port, authority) as ch:
        with pytest.raises(grpc.aio.AioRpcError) as failed:
            await ch.unary_unary("/test.Echo/Unary")(b"x", timeout=10)
    assert failed.value.code() == grpc.StatusCode.UNAVAILABLE
    assert message in failed.value.details()


async def test_deadlines_of_both_kinds_of_stream_on_one_connection(backend):
    # One client connection carrying a gRPC call (HTTP/2 backend, grpc-timeout 300m)
    # and a request to an HTTP/1.1 backend: each stream's deadline fires on its own.
    from tests.support.h2client import H2Client
    from tests.support.proxyharness import RecordingUpstream

    web = await RecordingUpstream().start()
    routes = [
        route("grpc.test", [("echo", 100)], upstream_protocol="grpc"),
        route("web.test", [("web", 100)], name="web"),
    ]
    built = table(routes, [endpoint("echo", backend.port), endpoint("web", web.port)])
    async with running_h2_proxy(built) as (server, port):
        serve_h2_upstreams(server, routes)
        client = await H2Client.connect(port)
        try:
            message = b"sleep:5"
            call = client.start(
                "POST",
                "/test.Echo/Unary",
                "grpc.test",
                [
                    ("content-type", "application/grpc"),
                    ("te", "trailers"),
                    ("grpc-timeout", "300m"),
                ],
                b"\x00" + len(message).to_bytes(4, "big") + message,
            )
            page = client.start("GET", "/slow?s=1", "web.test")
            answered = await client.wait(call)
            assert answered.trailer(b"grpc-status") == b"4"
            assert (await client.wait(page)).status == 200
        finally:
            await client.close()
    await web.stop()


async def test_sampled_trace_context_gets_the_proxy_span(proxied, backend):
    from waygate.core.tracing import configure_tracing

    configure_tracing("proxy-test", None)  # the process's real provider, no exporter
    _, port = proxied
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    parent = f"00-{trace_id}-b7ad6b7169203331-01"
    seen: list[str] = []

    async with channel(port) as ch:
        call = ch.unary_unary("/test.Echo/Unary")(
            b"trace", timeout=10, metadata=(("traceparent", parent),)
        )
        assert (await call).startswith(b"trace|")
    seen = backend.traceparents
    (sent,) = seen
    version, sent_trace, span_id, flags = sent.split("-")
    assert (version, sent_trace, flags) == ("00", trace_id, "01")
    assert span_id != "b7ad6b7169203331"
