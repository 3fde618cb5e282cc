"""What the reencrypt step keeps between connections stays bounded: the last TLS
session per server name (not the dead connection's SSLObject), only for names a
route still uses, and the facts of a failed verification (one probe handshake per
backend and name per FACTS_TTL, not one per request)."""

from __future__ import annotations

import contextlib
import datetime as dt
import ssl
from collections.abc import AsyncIterator

from tests.integration.proxy.test_reencrypt import TlsBackend, get, reencrypt
from tests.support.pki import LocalCA
from tests.support.proxyharness import endpoint, route, running_proxy, table
from waygate.proxy.upstream_tls import UpstreamTLS
from waygate.resolver.model import Route, RouteTLS


@contextlib.asynccontextmanager
async def proxy_with(
    backend: TlsBackend, tls: RouteTLS, **kw: object
) -> AsyncIterator[tuple[int, UpstreamTLS, list[Route]]]:
    routes = [route("secure.test", [("web", 100)], name="secure", tls=tls)]
    async with running_proxy(table(routes, [endpoint("web", backend.port)]), **kw) as (
        server,
        port,
    ):
        server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
        yield port, server.upstream_tls, routes


async def test_sessions_are_held_as_sessions_and_pruned_with_their_routes() -> None:
    ca = LocalCA()
    backend = await TlsBackend(ca.issue(dns=["web.demo.svc"])).start()
    try:
        async with proxy_with(backend, reencrypt(ca.pem), max_idle_per_endpoint=0) as (
            port,
            upstream_tls,
            routes,
        ):
            for _ in range(3):
                assert (await get(port)).startswith(b"HTTP/1.1 200")
            (context,) = upstream_tls._contexts.values()
            upstream_tls.keep_only(routes)  # a resolver view with the route still there
            held = context.last  # type: ignore[attr-defined]
            assert list(held) == ["web.demo.svc"]
            assert all(isinstance(value, ssl.SSLSession) for value in held.values()), held
            upstream_tls.keep_only([])  # the route went
            assert not held
        assert backend.resumed == [False, True, True]
    finally:
        await backend.stop()


async def test_a_failing_backend_is_probed_once_not_per_request() -> None:
    old = LocalCA(lambda: dt.datetime(2021, 10, 29, 13, 47, 51, tzinfo=dt.UTC))
    backend = await TlsBackend(old.issue(dns=["web.demo.svc"])).start()
    try:
        async with proxy_with(backend, reencrypt(old.pem)) as (port, _, _):
            for _ in range(5):
                response = await get(port)
                assert response.startswith(b"HTTP/1.1 502 "), response[:100]
                assert b"upstream certificate expired at 2021-" in response
        # The backend serves only the probe's (unverified) handshakes.
        assert len(backend.resumed) == 1, backend.resumed
    finally:
        await backend.stop()
