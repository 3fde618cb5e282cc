"""Fair limits of the core gRPC server, in-process on port 0 over real sockets and real TLS.

Long-lived calls (every streaming method; here grpc.health.v1.Health/Watch) are
capped per peer - the client-certificate identity, else the peer IP, with a
lower cap without a certificate - and in total; unary calls have a budget of
their own that streams never use. Each refusal is RESOURCE_EXHAUSTED naming the
cap and its setting, and a closed stream gives its place back.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support import demo_server
from tests.support.pki import LocalCA
from tests.support.poll import until
from waygate.core import grpcserver
from waygate.core.grpcclient import ClientTLS, open_channel
from waygate.core.grpcserver import CallLimits, GrpcServer, ServiceRegistration

LIMITS = CallLimits(
    max_concurrent_unary=50,
    max_streams=6,
    max_streams_per_peer=4,
    max_streams_per_unauthenticated_peer=2,
)


def make_server(credentials: grpc.ServerCredentials | None = None) -> GrpcServer:
    return GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
        credentials=credentials,
        limits=LIMITS,
    )


@contextlib.asynccontextmanager
async def running(server: GrpcServer) -> AsyncIterator[int]:
    """The server started (its port), and stopped whatever the test does."""
    port = await server.start()
    try:
        yield port
    finally:
        await server.stop(0)


class Watches:
    """Health Watch streams held open by one client; each is open once its first reply came."""

    def __init__(self, channel: grpc.aio.Channel) -> None:
        self._stub = health_pb2_grpc.HealthStub(channel)
        self.calls: list[grpc.aio.UnaryStreamCall] = []

    async def open(self) -> grpc.aio.UnaryStreamCall:
        """A new stream, once the server has answered it (raises its refusal)."""
        call = self._stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
        self.calls.append(call)
        await asyncio.wait_for(call.read(), 5)
        return call

    async def refusal(self) -> grpc.aio.AioRpcError:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await self.open()
        return refused.value

    def close(self) -> None:
        for call in self.calls:
            call.cancel()


async def health_check(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=5
    )
    return reply.status


async def test_an_unauthenticated_peer_gets_its_cap_and_unary_calls_still_pass() -> None:
    server = make_server()
    async with running(server) as port, open_channel(f"127.0.0.1:{port}", retry=False) as channel:
        watches = Watches(channel)
        try:
            first = await watches.open()
            await watches.open()
            refused = await watches.refusal()
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            details = refused.details() or ""
            assert "127.0.0.1" in details and "is 2 per address" in details
            assert "--max-streams-per-unauthenticated-peer" in details
            # Unary calls have their own budget: the held streams cannot starve them.
            assert await health_check(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            # A stream that ends gives its place back.
            first.cancel()
            await until(lambda: server.admission.streams == 1, "the cancelled stream's release")
            await watches.open()
            assert server.admission.streams_by_peer == {"127.0.0.1": 2}
        finally:
            watches.close()
        await until(lambda: server.admission.streams == 0, "every stream released")
        assert server.admission.unary == 0 and server.admission.streams_by_peer == {}


async def test_peers_with_a_certificate_are_counted_by_identity_with_the_higher_cap(
    tmp_path: Path,
) -> None:
    ca = LocalCA()
    server_files = ca.write_files(tmp_path / "server", ips=["127.0.0.1"])
    alice = ca.write_files(tmp_path / "alice", uris=["spiffe://test/ns/a/sa/alice"])
    bob = ca.write_files(tmp_path / "bob", uris=["spiffe://test/ns/b/sa/bob"])
    credentials = grpc.ssl_server_credentials(
        [(server_files.key.read_bytes(), server_files.cert.read_bytes())],
        root_certificates=ca.pem,
        require_client_auth=True,
    )
    server = make_server(credentials)
    async with running(server) as port:
        address = f"127.0.0.1:{port}"
        async with (
            open_channel(address, tls=ClientTLS(alice.ca, alice.cert, alice.key), retry=False) as a,
            open_channel(address, tls=ClientTLS(bob.ca, bob.cert, bob.key), retry=False) as b,
        ):
            alice_watches, bob_watches = Watches(a), Watches(b)
            try:
                for _ in range(4):  # above the unauthenticated cap of 2
                    await alice_watches.open()
                refused = await alice_watches.refusal()
                assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "spiffe://test/ns/a/sa/alice" in (refused.details() or "")
                assert "--max-streams-per-peer" in (refused.details() or "")
                # Same IP, other identity: its own share, until the server's total (6) is reached.
                await bob_watches.open()
                await bob_watches.open()
                total = await bob_watches.refusal()
                assert total.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "--max-streams" in (total.details() or "")
                assert await health_check(b) == health_pb2.HealthCheckResponse.NOT_SERVING
            finally:
                alice_watches.close()
                bob_watches.close()
        await until(lambda: server.admission.streams == 0, "every stream released")


async def test_unary_calls_over_their_budget_are_refused_by_name() -> None:
    limits = CallLimits(
        max_concurrent_unary=3,
        max_streams=6,
        max_streams_per_peer=4,
        max_streams_per_unauthenticated_peer=2,
    )
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
        limits=limits,
    )
    async with running(server) as port, open_channel(f"127.0.0.1:{port}", retry=False) as channel:
        # Three calls that sleep hold the three unary places.
        sleep = channel.unary_unary(f"/{demo_server.SERVICE}/Sleep")
        held = [asyncio.ensure_future(sleep(b"2", timeout=10)) for _ in range(3)]
        try:
            await until(lambda: server.admission.unary == 3, "three unary calls in flight")
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await sleep(b"0", timeout=5)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-concurrent-unary" in (refused.value.details() or "")
            # Health has a budget of its own: it answers while the unary one is full.
            assert await health_check(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
            # Streams do not use the unary budget.
            watches = Watches(channel)
            await watches.open()
            watches.close()
        finally:
            assert await asyncio.gather(*held) == [b"slept"] * 3
        assert server.admission.unary == 0


async def test_a_registration_can_leave_its_own_streams_uncapped() -> None:
    """A service that bounds a stream itself (the tunnel's Dial) names it in uncapped_streams."""
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[
            ServiceRegistration(
                demo_server.SERVICE, demo_server._add, None, uncapped_streams=frozenset({"Ticks"})
            )
        ],
        limits=LIMITS,
    )
    async with running(server) as port, open_channel(f"127.0.0.1:{port}", retry=False) as channel:
        ticks = channel.unary_stream(f"/{demo_server.SERVICE}/Ticks")
        calls = [ticks(b"", timeout=30) for _ in range(5)]  # above every stream cap
        try:
            for call in calls:
                assert await asyncio.wait_for(call.read(), 5) == b"tick"
            assert server.admission.streams == 0  # not counted
            # Other streaming methods of the same server are still capped.
            watches = Watches(channel)
            await watches.open()
            await watches.open()
            assert (await watches.refusal()).code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            watches.close()
        finally:
            for call in calls:
                call.cancel()


async def test_connections_past_their_age_end_after_the_grace_and_clients_reconnect() -> None:
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
        max_connection_age=1.0,
        max_connection_age_grace=1.0,
    )
    async with running(server) as port, open_channel(f"127.0.0.1:{port}", retry=False) as channel:
        watches = Watches(channel)
        call = await watches.open()
        # The stream outlives neither the age (about 1 s, with grace's jitter) nor the grace.
        with pytest.raises(grpc.aio.AioRpcError) as ended:
            await asyncio.wait_for(call.read(), 10)
        assert ended.value.code() == grpc.StatusCode.UNAVAILABLE
        await until(lambda: server.admission.streams == 0, "the ended stream released")
        # A new call simply opens a new connection.
        assert await health_check(channel) == health_pb2.HealthCheckResponse.NOT_SERVING


async def test_a_connection_that_never_handshakes_is_closed_after_the_handshake_timeout() -> None:
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
        handshake_timeout=1.0,
    )
    async with running(server) as port:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)  # says nothing
        try:
            async with asyncio.timeout(10):
                while await reader.read(65536):  # the server's SETTINGS, then EOF
                    pass
        except ConnectionError:
            pass  # a reset is a close too
        finally:
            writer.close()


async def test_unauthenticated_streams_have_a_total_cap_below_the_servers() -> None:
    """Peers without a certificate, together (many addresses, or many clients behind one
    SNAT), cannot take the room peers with one need. One address stands in for many
    here: its own share (4) is above the total (3)."""
    limits = CallLimits(
        max_streams=6, max_unauthenticated_streams=3, max_streams_per_peer=4,
        max_streams_per_unauthenticated_peer=4,
    )  # fmt: skip
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
        limits=limits,
    )
    async with running(server) as port, open_channel(f"127.0.0.1:{port}", retry=False) as anonymous:
        watches = Watches(anonymous)
        try:
            for _ in range(3):
                await watches.open()
            refused = await watches.refusal()
            assert refused.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "--max-unauthenticated-streams" in (refused.details() or "")
            # A peer with a certificate still has room (the server's total is 6).
            admission = server.admission
            assert admission.admit_stream("spiffe://test/ns/a/sa/alice", True) is None
            admission.release_stream("spiffe://test/ns/a/sa/alice", True)
            assert admission.unauthenticated_streams == 3
        finally:
            watches.close()
        await until(lambda: server.admission.streams == 0, "every stream released")
        assert server.admission.unauthenticated_streams == 0


async def test_a_stream_whose_handler_cannot_start_gives_its_place_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    server = make_server()

    def broken_span(self: object, context: object) -> None:
        raise RuntimeError("no span today")

    async with running(server) as port, open_channel(f"127.0.0.1:{port}", retry=False) as channel:
        monkeypatch.setattr(grpcserver._MethodBoundary, "start_span", broken_span)
        with pytest.raises(grpc.aio.AioRpcError):
            await Watches(channel).open()
        monkeypatch.undo()
        await until(lambda: server.admission.streams == 0, "the failed stream's release")


async def test_a_connection_carries_at_most_max_concurrent_streams_calls_at_once() -> None:
    """HTTP/2 MAX_CONCURRENT_STREAMS: a third call on one connection waits client-side."""
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
        max_concurrent_streams=2,
    )
    async with running(server) as port, open_channel(f"127.0.0.1:{port}", retry=False) as channel:
        watches = Watches(channel)
        try:
            first = await watches.open()
            await watches.open()
            stub = health_pb2_grpc.HealthStub(channel)
            third = stub.Watch(health_pb2.HealthCheckRequest(), timeout=30)
            watches.calls.append(third)
            waiting = asyncio.ensure_future(third.read())
            await asyncio.sleep(1.0)
            assert not waiting.done()  # held by the client: the connection is full
            assert server.admission.streams == 2
            first.cancel()
            await asyncio.wait_for(waiting, 10)  # a place on the connection came free
            assert server.admission.streams == 2
        finally:
            watches.close()
        await until(lambda: server.admission.streams == 0, "every stream released")
