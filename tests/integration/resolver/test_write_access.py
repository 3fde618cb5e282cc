"""Write RPCs over real mTLS: only the configured client identities may write.

A real CA (tests.support.pki.LocalCA, signing with `cryptography`) issues
the resolver's serving certificate and one client certificate per identity;
the listener requires client certificates, as `waygate up` and a cluster do.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.integration.resolver.conftest import ROUTES
from tests.integration.resolver.test_routes_and_tunnels import Reporter, route
from tests.support.pki import LocalCA
from tests.support.poll import until as eventually
from waygate.core.grpcserver import GrpcServer
from waygate.resolver.access import WriteAccess
from waygate.resolver.filesource import FileSource
from waygate.resolver.server import ResolverServicer
from waygate.resolver.store import Store
from waygate.resolver.tunnels import TunnelRegistry
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

SA = "spiffe://waygate.local/ns/local/sa/"
USER = SA + "user"
TUNNEL_SERVER = SA + "tunnel-server"
PROXY = SA + "proxy"
OPERATOR_DNS = "ops.example.com"


class Cluster:
    """A resolver behind an mTLS listener, and clients with chosen identities."""

    def __init__(self, tmp_path: Path) -> None:
        self.ca = LocalCA()
        self.store = Store()
        path = tmp_path / "routes.yaml"
        path.write_text(ROUTES)
        self.file = FileSource(self.store, path)
        assert self.file.load()
        self.tunnels = TunnelRegistry(self.store)
        self.servicer = ResolverServicer(
            self.store,
            routes=self.file,
            tunnels=self.tunnels,
            access=WriteAccess(
                tunnel_reporters=(SA + "tunnel-*",),
                route_admins=(USER, OPERATOR_DNS),
                route_readers=(PROXY,),
                authenticated=True,
            ),
        )
        self.channels: list[grpc.aio.Channel] = []

    async def start(self) -> None:
        cert, key = self.ca.issue(uris=(SA + "resolver",), ips=("127.0.0.1",))
        credentials = grpc.ssl_server_credentials(
            [(key, cert)], root_certificates=self.ca.pem, require_client_auth=True
        )
        self.server = GrpcServer(
            host="127.0.0.1",
            port=0,
            registrations=[self.servicer.registration()],
            credentials=credentials,
        )
        self.port = await self.server.start()
        await self.server.set_serving()

    def client(
        self, *, uris: tuple[str, ...] = (), dns: tuple[str, ...] = ()
    ) -> resolver_pb2_grpc.ResolverStub:
        cert, key = self.ca.issue(uris=uris, dns=dns)
        credentials = grpc.ssl_channel_credentials(
            root_certificates=self.ca.pem, private_key=key, certificate_chain=cert
        )
        channel = grpc.aio.secure_channel(
            f"127.0.0.1:{self.port}",
            credentials,
            options=[("grpc.use_local_subchannel_pool", 1)],
        )
        self.channels.append(channel)
        return resolver_pb2_grpc.ResolverStub(channel)

    async def stop(self) -> None:
        for channel in self.channels:
            await channel.close()
        await self.server.stop(0)


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    handle = Cluster(tmp_path)
    await handle.start()
    try:
        yield handle
    finally:
        await handle.stop()


def holders(cluster: Cluster, node: str) -> list[str]:
    presence = cluster.store.tunnel_presence(node)
    return [s.id for s in presence.servers] if presence else []


async def denied(call: object) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await asyncio.wait_for(call, 10)  # type: ignore[arg-type]
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED, info.value
    return info.value.details() or ""


async def test_route_admin_may_apply_and_delete_others_get_permission_denied(
    cluster: Cluster,
) -> None:
    admin = cluster.client(uris=(USER,))
    proxy = cluster.client(uris=(PROXY,))

    message = await denied(proxy.ApplyRoute(pb.ApplyRouteRequest(route=route()), timeout=5))
    assert PROXY in message and "--route-admins" in message
    assert cluster.store.get_route("shop", "api") is None

    await admin.ApplyRoute(pb.ApplyRouteRequest(route=route()), timeout=5)
    assert cluster.store.get_route("shop", "api") is not None

    ref = pb.RouteRef(namespace="shop", name="api")
    message = await denied(proxy.DeleteRoute(pb.DeleteRouteRequest(ref=ref), timeout=5))
    assert PROXY in message
    assert cluster.store.get_route("shop", "api") is not None

    # Reads stay open to every client the listener accepts.
    listed = await proxy.ListRoutes(pb.ListRoutesRequest(), timeout=5)
    assert "api" in [r.name for r in listed.routes]

    await admin.DeleteRoute(pb.DeleteRouteRequest(ref=ref), timeout=5)
    assert cluster.store.get_route("shop", "api") is None


async def test_a_dns_identity_can_be_a_route_admin(cluster: Cluster) -> None:
    operator = cluster.client(dns=("OPS.example.com",))
    await operator.ApplyRoute(pb.ApplyRouteRequest(route=route()), timeout=5)
    assert cluster.store.get_route("shop", "api") is not None
    stranger = cluster.client(dns=("ops.example.com.evil.test",))
    message = await denied(stranger.ApplyRoute(pb.ApplyRouteRequest(route=route()), timeout=5))
    assert "ops.example.com.evil.test" in message


async def test_only_tunnel_reporters_may_report_tunnels(cluster: Cluster) -> None:
    intruder = cluster.client(uris=(USER,))
    fake = Reporter()
    fake.send("ts-x", ["edge-1"])
    message = await denied(intruder.ReportTunnels(fake.requests()))
    assert USER in message and "--tunnel-reporters" in message
    assert holders(cluster, "edge-1") == []

    tunnel_server = cluster.client(uris=(TUNNEL_SERVER,))
    real = Reporter()
    call = tunnel_server.ReportTunnels(real.requests())
    try:
        real.send("ts-a", ["edge-1"])
        await eventually(lambda: holders(cluster, "edge-1") == ["ts-a"])
    finally:
        call.cancel()
    await eventually(lambda: cluster.tunnels.open_streams == 0)


async def test_route_keys_go_over_watch_to_route_readers_only(cluster: Cluster) -> None:
    """Issue 8: any certificate certs signed could watch route keys; now only the proxy."""
    from tests.support.pki import self_signed

    cert, key = self_signed("api.example.com")
    tls = pb.RouteTLS(termination=pb.TLS_TERMINATION_EDGE, certificate=cert, key=key)
    admin = cluster.client(uris=(USER,))
    await admin.ApplyRoute(pb.ApplyRouteRequest(route=route(tls=tls)), timeout=10)

    async def watched_keys(stub: resolver_pb2_grpc.ResolverStub) -> tuple[str, str]:
        """The key in the snapshot, and in the Changes of a re-applied route."""
        call = stub.Watch(pb.WatchRequest(kinds=[pb.RESOURCE_KIND_ROUTES]))
        try:
            event = await asyncio.wait_for(call.read(), 10)
            (api,) = [r for r in event.snapshot.routes if r.name == "api"]
            other_cert, other_key = self_signed("api.example.com")
            replaced = pb.RouteTLS(
                termination=pb.TLS_TERMINATION_EDGE, certificate=other_cert, key=other_key
            )
            await admin.ApplyRoute(pb.ApplyRouteRequest(route=route(tls=replaced)), timeout=10)
            change = await asyncio.wait_for(call.read(), 10)
            (upserted,) = [c.route_upserted for c in change.changes.changes]
            assert upserted.tls.certificate == other_cert
            return api.tls.key, upserted.tls.key
        finally:
            call.cancel()

    snapshot_key, change_key = await watched_keys(cluster.client(uris=(PROXY,)))
    assert "PRIVATE KEY" in snapshot_key and "PRIVATE KEY" in change_key
    for identities in ({"uris": (USER,)}, {"uris": (SA + "proxy-impostor",)}, {"dns": ("proxy",)}):
        assert await watched_keys(cluster.client(**identities)) == ("", "")  # type: ignore[arg-type]
