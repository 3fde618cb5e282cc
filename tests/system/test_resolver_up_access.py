"""Under `waygate up`, only the user changes routes and only the tunnel server reports.

Real processes: `waygate up` in a scratch directory; a real mTLS client with
the user's certificate that `up` wrote (identity .../sa/user). ApplyRoute
succeeds for it, ReportTunnels (reserved to .../sa/tunnel-server) is
PERMISSION_DENIED naming it, the routes file holding the new key is 0600,
and neither ListRoutes nor the user's Watch returns the key (only the
proxy, the route reader, receives it).
"""

from __future__ import annotations

import asyncio
import signal

import grpc
import pytest

from tests.support.pki import self_signed
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

from .test_up_tls import mode, up  # noqa: F401 (the `up` fixture)

pytestmark = pytest.mark.system

USER = "spiffe://waygate.local/ns/local/sa/user"


async def test_up_lets_the_user_change_routes_but_not_report_tunnels(up) -> None:  # noqa: F811
    await up.start()
    client = up.state / "client"
    credentials = grpc.ssl_channel_credentials(
        root_certificates=(up.state / "ca.pem").read_bytes(),
        private_key=(client / "key.pem").read_bytes(),
        certificate_chain=(client / "cert.pem").read_bytes(),
    )
    channel = grpc.aio.secure_channel(up.address("resolver"), credentials)
    try:
        stub = resolver_pb2_grpc.ResolverStub(channel)
        cert, key = self_signed("api.example.com")
        await stub.ApplyRoute(
            pb.ApplyRouteRequest(
                route=pb.Route(
                    namespace="demo",
                    name="api",
                    host="api.example.com",
                    backends=[pb.RouteBackend(service="hello", weight=100)],
                    tls=pb.RouteTLS(termination=pb.TLS_TERMINATION_EDGE, certificate=cert, key=key),
                )
            ),
            timeout=10,
        )
        assert mode(up.state / "routes.yaml") == 0o600
        listed = await stub.ListRoutes(pb.ListRoutesRequest(namespace="demo"), timeout=10)
        (api,) = [r for r in listed.routes if r.name == "api"]
        assert api.tls.certificate == cert and api.tls.key == ""
        # Watch carries route keys to the proxy alone (--route-readers), not to the user.
        call = stub.Watch(pb.WatchRequest(kinds=[pb.RESOURCE_KIND_ROUTES]))
        event = await asyncio.wait_for(call.read(), 10)
        call.cancel()
        (watched,) = [r for r in event.snapshot.routes if r.name == "api"]
        assert watched.tls.certificate == cert and watched.tls.key == ""

        async def reports():
            yield pb.TunnelReport(
                server=pb.TunnelServer(id="ts-fake", address="127.0.0.1:1"), nodes=["edge-1"]
            )

        with pytest.raises(grpc.aio.AioRpcError) as info:
            await asyncio.wait_for(stub.ReportTunnels(reports()), 10)
        assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert USER in (info.value.details() or "")
    finally:
        await channel.close()
    assert up.process is not None
    up.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(up.process.wait(), 60) == 0
