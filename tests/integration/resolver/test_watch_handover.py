"""The resolver Watch moves to the renewed channel after a real certificate renewal.

The proxy lends its rotating mTLS channel to its Watch (`RotatingChannel.lend`).
A renewal retires that channel; the watch opens a new stream on the renewed one,
resuming from the view it holds, while the old stream keeps applying; then the
old call is cancelled and the old channel let go, so it closes (before this it
stayed open under the stream with no bound). Real gRPC over mTLS, a real CA
(`LocalCA`), a real `CertificateRotator.renew_once()`, routes written all the
while: no update lost or applied twice, no reconnect, no task or fd left.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import pytest
from cryptography import x509
from prometheus_client import REGISTRY

from tests.support.pki import LocalCA
from tests.support.poll import until
from waygate.core.backoff import Backoff
from waygate.core.grpcserver import GrpcServer
from waygate.core.grpctls import (
    LentChannel,
    RotatingChannel,
    client_credentials,
    dynamic_server_credentials,
)
from waygate.core.rotation import CertificateRotator, HeldCertificate, TrustBundle, TrustStore
from waygate.resolver.client import ResolverWatch, View, in_turn
from waygate.resolver.model import Service, ServicePort
from waygate.resolver.server import ResolverServicer
from waygate.resolver.store import Store

RESOLVER_ID = "spiffe://waygate.local/ns/local/sa/resolver"
PROXY_ID = "spiffe://waygate.local/ns/local/sa/proxy"
# A fresh connection per channel: grpc otherwise shares subchannels between
# channels with the same target, and a reused connection proves nothing.
FRESH = [("grpc.use_local_subchannel_pool", 1)]
GRACE = 0.05  # the rotating channel's close grace: past it, only the hold keeps it open


class RecordingServicer(ResolverServicer):
    """The real resolver servicer, noting the client certificate of each Watch."""

    def __init__(self, store: Store) -> None:
        super().__init__(store)
        self.watch_serials: list[str] = []

    async def Watch(self, request, context):  # type: ignore[no-untyped-def,override]
        pem = (context.auth_context().get("x509_pem_cert") or [b""])[0]
        self.watch_serials.append(format(x509.load_pem_x509_certificate(pem).serial_number, "x"))
        async for event in super().Watch(request, context):
            yield event


@dataclass
class Setup:
    store: Store
    servicer: RecordingServicer
    server_trust: TrustStore
    client: CertificateRotator
    rotating: RotatingChannel
    views: list[View] = field(default_factory=list)
    disconnects: list[str] = field(default_factory=list)


@contextlib.asynccontextmanager
async def mtls_resolver(client_held: list[HeldCertificate] | None = None) -> AsyncIterator[Setup]:
    """A resolver over mTLS and a proxy-side rotating channel to it. `client_held`,
    when given, is what the channel presents (index 0; the test may swap it)."""
    ca = LocalCA()
    server_rotator = CertificateRotator(ca, RESOLVER_ID, ["ip:127.0.0.1"])
    await server_rotator.obtain()
    client = CertificateRotator(ca, PROXY_ID, ["ip:127.0.0.1"])
    await client.obtain()
    server_trust, client_trust = TrustStore(ca.bundle()), TrustStore(ca.bundle())
    store = Store()
    servicer = RecordingServicer(store)
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[servicer.registration()],
        credentials=dynamic_server_credentials(server_rotator, server_trust, client_auth=True),
    )
    port = await server.start()

    def credentials() -> grpc.ChannelCredentials:
        if client_held is None:
            return client_credentials(client, client_trust)
        return grpc.ssl_channel_credentials(
            client_trust.current.pem, client_held[0].key_pem(), client_held[0].chain_pem()
        )

    rotating = RotatingChannel(
        f"127.0.0.1:{port}",
        credentials,
        (client.subscribe, client_trust.subscribe),
        close_grace=GRACE,
        options=FRESH,
    )
    try:
        yield Setup(store, servicer, server_trust, client, rotating)
    finally:
        await rotating.close()
        await server.stop(0)


def watch_of(setup: Setup, handover_timeout: float = 10.0) -> ResolverWatch:
    """The proxy's shape (`waygate.proxy.app.resolver_watch`): each stream lent the channel."""
    return ResolverWatch(
        in_turn([setup.rotating.lend]),
        on_view=setup.views.append,
        backoff=Backoff(initial=0.05, maximum=0.2),
        on_disconnect=lambda reason, _delay: setup.disconnects.append(reason),
        handover_timeout=handover_timeout,
    )


def service(name: str) -> Service:
    return Service("shop", name, ports=(ServicePort("http", 80, "8080"),))


def handovers(outcome: str) -> float:
    value = REGISTRY.get_sample_value(
        "waygate_resolver_client_handovers_total", {"outcome": outcome}
    )
    return value or 0.0


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


async def test_a_renewal_moves_the_watch_and_closes_the_old_channel_losing_nothing() -> None:
    async with mtls_resolver() as setup:
        store = setup.store
        store.upsert_service(service("first"), source="t")
        watch = watch_of(setup)
        task = asyncio.create_task(watch.run())
        written: list[str] = []
        stop = asyncio.Event()

        async def writer() -> None:
            # Routes keep changing through the renewal and the handover.
            while not stop.is_set():
                name = f"svc-{len(written)}"
                store.upsert_service(service(name), source="t")
                written.append(name)
                await asyncio.sleep(0.003)

        try:
            await watch.wait_synced(10)
            # Warm-up: gRPC's own threads and sockets exist before the counts.
            await asyncio.sleep(0.2)
            tasks_before, fds_before = len(asyncio.all_tasks()), open_fds()
            moved_before = handovers("moved")
            writing = asyncio.create_task(writer())
            old = setup.rotating.channel()
            first_serial = setup.client.current.serial
            for _ in range(3):  # three renewals: each moves the stream once
                await until(lambda: len(written) > 20, "some writes before the renewal")
                written_at = len(written)
                previous = setup.rotating.channel()
                await setup.client.renew_once()
                await until(
                    lambda previous=previous: (
                        previous.get_state() == grpc.ChannelConnectivity.SHUTDOWN
                    ),
                    "the retired channel to close (the handover let go of it)",
                    timeout=15,
                )
                await until(lambda at=written_at: len(written) > at + 20, "writes after the move")
            stop.set()
            await writing
            store.upsert_service(service("last"), source="t")
            await until(
                lambda: ("shop", "last") in watch.view.services,  # type: ignore[union-attr]
                "the last write",
            )
            view = watch.view
            assert view is not None
            # Nothing lost: the view is the store's, every write included.
            assert set(view.services) == {s.key for s in store.snapshot().services}
            assert {("shop", name) for name in written} <= set(view.services)
            # Nothing applied twice or out of order, and never a fresh snapshot.
            versions = [v.version for v in setup.views]
            assert versions == sorted(set(versions)), "a version published twice or backwards"
            assert not any(v.from_snapshot for v in setup.views[1:])
            assert setup.disconnects == [], "moved, not reconnected"
            assert handovers("moved") == moved_before + 3
            # A stream per certificate, in order (an attempt dropped because the old
            # stream applied something meanwhile is tried again on the same one);
            # the last runs on the last renewal's.
            serials = list(dict.fromkeys(setup.servicer.watch_serials))
            assert len(serials) == 4
            assert serials[0] == first_serial
            assert serials[-1] == setup.client.current.serial
            assert old.get_state() == grpc.ChannelConnectivity.SHUTDOWN
            # Held now: the current channel only, by the one stream.
            assert setup.rotating._holders == {setup.rotating.channel(): 1}
            # The retired channels' closing tasks end just after their state says so.
            await until(lambda: len(asyncio.all_tasks()) == tasks_before, "tasks at baseline")
            # A call made through the tracing interceptors keeps its connection
            # until the cyclic GC frees it (`open_channel`'s docstring); collected,
            # the retired channels' connections are gone.
            gc.collect()
            await until(
                lambda: open_fds() <= fds_before + 1, "the retired channels' sockets to close"
            )
        finally:
            stop.set()
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert not setup.rotating._holders, "the watch let go of what it was lent"
        assert not setup.rotating._retiring


async def test_a_handover_that_cannot_complete_reconnects_within_the_bound() -> None:
    """The renewed channel is refused (its certificate is from a CA the resolver
    does not trust yet): the old stream keeps serving until the bound, then the
    watch lets go of the retired channel and reconnects; the held view serves
    meanwhile, and once the resolver trusts the new CA the watch resumes."""
    stranger_ca = LocalCA(name="another CA")
    stranger = CertificateRotator(stranger_ca, PROXY_ID, ["ip:127.0.0.1"])
    await stranger.obtain()
    held: list[HeldCertificate] = []
    async with mtls_resolver(held) as setup:
        held.append(setup.client.current)
        setup.store.upsert_service(service("first"), source="t")
        watch = watch_of(setup, handover_timeout=0.5)
        task = asyncio.create_task(watch.run())
        try:
            await watch.wait_synced(10)
            reconnected_before = handovers("reconnected")
            old = setup.rotating.channel()
            held[0] = stranger.current
            await setup.client.renew_once()
            await until(
                lambda: old.get_state() == grpc.ChannelConnectivity.SHUTDOWN,
                "the retired channel to close after the bound",
            )
            assert handovers("reconnected") == reconnected_before + 1
            assert any("did not move to the renewed channel" in r for r in setup.disconnects)
            # The view held keeps serving while no stream is open.
            assert watch.view is not None and ("shop", "first") in watch.view.services
            setup.store.upsert_service(service("meanwhile"), source="t")
            setup.server_trust.update(
                TrustBundle(
                    version=2,
                    certificates=(
                        *setup.server_trust.current.certificates,
                        stranger_ca.certificate,
                    ),
                )
            )
            await until(
                lambda: ("shop", "meanwhile") in watch.view.services,  # type: ignore[union-attr]
                "the change made while the handover failed",
            )
            assert setup.servicer.watch_serials[-1] == stranger.current.serial
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        assert not setup.rotating._holders


async def test_a_handover_that_fails_unexpectedly_reconnects_and_lets_go(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A bug in the move (here: renew() raising) ends in an ordinary reconnect, so the
    retired channel is still let go and the watch goes on."""
    async with mtls_resolver() as setup:
        setup.store.upsert_service(service("first"), source="t")
        watch = watch_of(setup)
        task = asyncio.create_task(watch.run())
        try:
            await watch.wait_synced(10)
            old = setup.rotating.channel()

            def broken(_self: LentChannel) -> LentChannel:
                raise RuntimeError("a bug in the handover")

            monkeypatch.setattr(LentChannel, "renew", broken)
            await setup.client.renew_once()
            await until(
                lambda: old.get_state() == grpc.ChannelConnectivity.SHUTDOWN,
                "the retired channel to close",
            )
            assert any("did not move to the renewed channel" in r for r in setup.disconnects)
            setup.store.upsert_service(service("after"), source="t")
            await until(
                lambda: ("shop", "after") in watch.view.services,  # type: ignore[union-attr]
                "a change after the reconnect",
            )
            assert not task.done()
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
