"""ReportBackendCertificates over real gRPC: a proxy's reporter (waygate.proxy.
backendreport) streams what its record of served certificates needs attention;
the resolver gives the route a BackendCertificate condition (ResolvedRefs stays
True), refuses an unbounded report with INVALID_ARGUMENT, and a state no report
refreshes lapses."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest

from tests.integration.resolver.conftest import ROUTES
from tests.support.poll import until
from waygate.core.grpcserver import GrpcServer
from waygate.proxy.backendcerts import BackendCertificates, Served
from waygate.proxy.backendreport import BackendCertificateReporter
from waygate.resolver.backendcerts import BackendCertificateReports
from waygate.resolver.filesource import FileSource
from waygate.resolver.server import ResolverServicer
from waygate.resolver.store import Store
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

NOW = dt.datetime.now(dt.UTC)
DAY = dt.timedelta(days=1)


@contextlib.asynccontextmanager
async def serving(tmp_path: Path, ttl: float) -> AsyncIterator[tuple[Store, grpc.aio.Channel]]:
    store = Store()
    path = tmp_path / "routes.yaml"
    path.write_text(ROUTES)
    source = FileSource(store, path)
    assert source.load(), source.last_error
    servicer = ResolverServicer(store, backend_certificates=BackendCertificateReports(ttl=ttl))
    server = GrpcServer(host="127.0.0.1", port=0, registrations=[servicer.registration()])
    port = await server.start()
    await server.set_serving()
    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
    try:
        yield store, channel
    finally:
        await channel.close()
        await server.stop(0)


def condition(store: Store, type: str) -> object:
    route = store.get_route("shop", "web")
    assert route is not None and route.status is not None
    return route.status.condition(type)


async def test_a_proxys_report_becomes_the_routes_condition_and_lapses(tmp_path: Path) -> None:
    async with serving(tmp_path, ttl=1.5) as (store, channel):
        book = BackendCertificates()
        book.record(
            Served(
                "shop/web",
                "10.1.0.1:8443",
                NOW - DAY,
                NOW + 3 * DAY,
                "CN=ca",
                ("web.shop.svc",),
                True,
                NOW,
            )
        )
        book.record(  # months left: nothing to say
            Served(
                "shop/web",
                "10.1.0.9:8443",
                NOW - DAY,
                NOW + 90 * DAY,
                "CN=ca",
                ("web.shop.svc",),
                True,
                NOW,
            )
        )

        @contextlib.asynccontextmanager
        async def hold() -> AsyncIterator[grpc.aio.Channel]:
            yield channel

        reporter = BackendCertificateReporter(book, hold, "proxy-1", interval=0.05, refresh=60)
        task = asyncio.create_task(reporter.run())
        try:
            await until(lambda: condition(store, "BackendCertificate") is not None, timeout=10)
            found = condition(store, "BackendCertificate")
            assert found.reason == "ExpiringSoon"  # type: ignore[attr-defined]
            assert "backend 10.1.0.1:8443 serves a certificate for web.shop.svc" in (
                found.message  # type: ignore[attr-defined]
            )
            assert "10.1.0.9" not in found.message  # type: ignore[attr-defined]
            assert condition(store, "ResolvedRefs").status == "True"  # type: ignore[attr-defined]
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        # The proxy is gone: nothing refreshes its state, which lapses after the TTL.
        await until(lambda: condition(store, "BackendCertificate") is None, timeout=10)


async def test_an_unbounded_or_malformed_report_is_refused_with_the_reason(
    tmp_path: Path,
) -> None:
    async with serving(tmp_path, ttl=60) as (_, channel):
        stub = resolver_pb2_grpc.ResolverStub(channel)
        too_many = pb.BackendCertificateReport(
            proxy="p",
            certificates=[
                pb.BackendCertificateState(
                    namespace="shop",
                    route="web",
                    endpoint=f"10.0.{i // 250}.{i % 250}:1",
                    verdict="Expired",
                )
                for i in range(1001)
            ],
        )
        bad_verdict = pb.BackendCertificateReport(
            proxy="p",
            certificates=[
                pb.BackendCertificateState(
                    namespace="shop", route="web", endpoint="10.0.0.1:1", verdict="Fine"
                )
            ],
        )
        for report, words in ((too_many, "at most 1000"), (bad_verdict, "verdict")):

            async def one(report: pb.BackendCertificateReport = report) -> AsyncIterator[object]:
                yield report

            with pytest.raises(grpc.aio.AioRpcError) as raised:
                await stub.ReportBackendCertificates(one())
            assert raised.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert words in (raised.value.details() or "")
