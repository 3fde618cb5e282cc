"""The rotation client against the real certs service, in-process on port 0.

certs here is the real thing: its Authority with a directory CA, static tokens
from a 0600 file, its SAN policy, its gRPC boundary, and its self-issued
serving certificate (server TLS). The client side is what every Waygate
process runs: `start_process_certificates` from settings, over real TLS sockets.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509

from tests.support.poll import until
from waygate.certs.auth import StaticTokenAuthenticator
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.client import GrpcIssuer, TrustBundleWatcher, start_process_certificates
from waygate.certs.policy import Policy
from waygate.certs.selftls import serving_certificate
from waygate.certs.server import registration
from waygate.certs.service import CertsService
from waygate.certs.store import DirectoryCAStore
from waygate.core import errors
from waygate.core.backoff import Backoff
from waygate.core.grpcserver import GrpcServer
from waygate.core.rotation import CertificateRotator, TrustBundle, TrustStore
from waygate.core.settings import GrpcServerSettings, load_settings

DOMAIN = "waygate.local"
RESOLVER = f"spiffe://{DOMAIN}/ns/local/sa/resolver"
RESOLVER_SANS = ("dns:resolver.waygate.local", "ip:127.0.0.1")


class Certs:
    """A running certs: address, CA bundle file and one token per caller."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.tokens = {name: secrets.token_urlsafe(32) for name in ("resolver", "user")}
        self.tokens_file = tmp / "tokens.yaml"
        entries = [
            {
                "token": self.tokens["resolver"],
                "name": "resolver",
                "allowed": [f"uri:{RESOLVER}", *RESOLVER_SANS],
            },
            {
                "token": self.tokens["user"],
                "name": "user",
                "allowed": [f"uri:spiffe://{DOMAIN}/ns/local/sa/user"],
            },
        ]
        self.tokens_file.write_text(yaml.safe_dump({"tokens": entries}))
        self.tokens_file.chmod(0o600)
        self.authority = Authority.open(DirectoryCAStore(tmp / "ca"), AuthorityConfig())
        self.bundle_file = tmp / "ca.pem"
        self.bundle_file.write_text(self.authority.trust_bundle().pem)
        self.server: GrpcServer | None = None

    def token_file(self, name: str) -> Path:
        path = self.tmp / f"{name}.token"
        path.write_text(self.tokens[name] + "\n")
        path.chmod(0o600)
        return path

    @property
    def address(self) -> str:
        assert self.server is not None
        return f"127.0.0.1:{self.server.port}"

    async def start(self, port: int = 0, **server_options: float) -> None:
        service = CertsService(StaticTokenAuthenticator.from_file(self.tokens_file), Policy(DOMAIN))
        service.attach(self.authority)
        _, credentials = await serving_certificate(
            self.authority, f"spiffe://{DOMAIN}/ns/local/sa/certs", ("ip:127.0.0.1",)
        )
        self.server = GrpcServer(
            host="127.0.0.1",
            port=port,
            registrations=[registration(service)],
            credentials=credentials,
            **server_options,  # type: ignore[arg-type]
        )
        await self.server.start()
        await self.server.set_serving()

    async def stop(self) -> None:
        if self.server is not None:
            await self.server.stop(0)


@pytest.fixture
async def certs(tmp_path):
    running = Certs(tmp_path)
    await running.start()
    yield running
    await running.stop()


def settings_for(certs: Certs, token: str = "resolver", **more: str) -> GrpcServerSettings:
    flags = {
        "certs_address": certs.address,
        "certs_token_file": str(certs.token_file(token)),
        "certs_ca_file": str(certs.bundle_file),
        "cert_identity": RESOLVER,
        "cert_sans": ",".join(RESOLVER_SANS),
        **more,
    }
    return load_settings(GrpcServerSettings, flags=flags, env={})


class Tasks:
    """`spawn` for ProcessCertificates, cancelled at the end of the test."""

    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[object]] = []

    def __call__(self, coro, name: str) -> asyncio.Task[object]:
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self.tasks.append(task)
        return task

    async def cancel(self) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


@pytest.fixture
async def tasks():
    spawned = Tasks()
    yield spawned
    await spawned.cancel()


async def test_process_gets_its_certificate_from_certify_and_serves_mtls_with_it(
    certs, tasks
) -> None:
    process = await start_process_certificates(settings_for(certs), tasks)
    held = process.rotator.current
    ca = x509.load_pem_x509_certificate(certs.bundle_file.read_bytes())
    held.leaf.verify_directly_issued_by(ca)
    sans = held.leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [RESOLVER]
    assert [str(a) for a in sans.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    # certs recorded who asked: the caller behind the token.
    records = certs.authority.list_issued(identity=RESOLVER, include_expired=False)
    assert [r.requested_by for r in records] == ["resolver"]
    assert {t.get_name() for t in tasks.tasks} == {
        "certificate-rotation",
        "trust-bundle-watch",
        "trust-report",
    }
    # The process acknowledged the bundle it applied (ReportTrust), under its identity.
    await until(lambda: len(certs.authority.consumers) == 1, "the trust report")
    (reported,) = certs.authority.consumers.snapshot()
    assert reported.identity == RESOLVER
    assert reported.fingerprints == {
        a.fingerprint for a in certs.authority.trust_bundle().authorities
    }

    # Serve mTLS with it: a client with a certs-issued certificate gets in.
    user = CertificateRotator(
        GrpcIssuer(certs.address, certs.token_file("user"), process.trust),
        f"spiffe://{DOMAIN}/ns/local/sa/user",
    )
    await user.obtain(timeout=10)
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[],
        credentials=process.server_credentials(client_auth=True),
    )
    await server.start()
    try:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        credentials = grpc.ssl_channel_credentials(
            certs.bundle_file.read_bytes(), user.current.key_pem(), user.current.chain_pem()
        )
        async with grpc.aio.secure_channel(f"127.0.0.1:{server.port}", credentials) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
        assert reply.status == health_pb2.HealthCheckResponse.NOT_SERVING  # not marked ready
    finally:
        await server.stop(0)


async def test_a_wrong_token_stops_start_up_with_certs_message(certs, tasks, tmp_path) -> None:
    settings = settings_for(certs)
    (tmp_path / "resolver.token").write_text("not-a-token-that-certs-knows-about-at-all")
    with pytest.raises(errors.Unauthenticated, match=r"certs at 127\.0\.0\.1:\d+: UNAUTHENTICATED"):
        await start_process_certificates(settings, tasks)
    assert tasks.tasks == []


async def test_a_name_the_caller_may_not_have_is_permission_denied(certs, tasks) -> None:
    settings = settings_for(certs, cert_sans="dns:certs.waygate.local")
    with pytest.raises(errors.PermissionDenied, match="certs.waygate.local"):
        await start_process_certificates(settings, tasks)


async def test_unreachable_certs_is_retried_then_reported(certs) -> None:
    await certs.stop()
    trust = TrustStore(TrustBundle.from_pem(certs.bundle_file.read_bytes()))
    rotator = CertificateRotator(
        GrpcIssuer(certs.address, certs.token_file("resolver"), trust, timeout=1), RESOLVER
    )
    with pytest.raises(errors.Unavailable, match="UNAVAILABLE"):
        await rotator.obtain(timeout=1.5)
    assert not rotator.has_certificate


async def test_trust_bundle_watch_follows_a_ca_rotation(certs, tasks) -> None:
    process = await start_process_certificates(settings_for(certs), tasks)
    assert len(process.trust.current.certificates) == 1
    changed = asyncio.Event()
    process.trust.subscribe(lambda _bundle: changed.set())
    async with asyncio.timeout(10):
        while process.watcher is None or process.watcher.received == 0:
            await asyncio.sleep(0.02)
    certs.authority.rotate(propagation_delay=None, ca_lifetime=None)
    async with asyncio.timeout(10):
        await changed.wait()
    assert len(process.trust.current.certificates) == 2
    assert process.trust.current.pem.decode() == certs.authority.trust_bundle().pem


async def test_trust_bundle_watcher_reconnects_after_certs_restarts(certs, tasks) -> None:
    trust = TrustStore(TrustBundle.from_pem(certs.bundle_file.read_bytes()))
    watcher = TrustBundleWatcher(certs.address, trust, backoff=Backoff(initial=0.05, maximum=0.2))
    tasks(watcher.run(), "watch")
    async with asyncio.timeout(10):
        while watcher.received == 0:
            await asyncio.sleep(0.02)
    port = certs.server.port
    await certs.stop()
    certs.authority.rotate(propagation_delay=None, ca_lifetime=None)  # while nobody listens
    await certs.start(port=port)
    async with asyncio.timeout(10):
        while len(trust.current.certificates) < 2:
            await asyncio.sleep(0.02)
    assert watcher.received >= 2


async def test_a_stream_cut_by_the_connection_age_is_an_info_reconnect_not_a_warning(
    certs, tasks, caplog
) -> None:
    port = certs.server.port
    await certs.stop()
    await certs.start(port=port, max_connection_age=1.0, max_connection_age_grace=0.5)
    trust = TrustStore(TrustBundle.from_pem(certs.bundle_file.read_bytes()))
    watcher = TrustBundleWatcher(certs.address, trust, backoff=Backoff(initial=0.05, maximum=0.2))
    caplog.set_level(logging.INFO, logger="waygate.certs.client")
    tasks(watcher.run(), "watch")
    async with asyncio.timeout(20):
        while watcher.received < 3:  # two connections aged out, a third stream got its bundle
            await asyncio.sleep(0.05)
    mine = [r for r in caplog.records if r.name == "waygate.certs.client"]
    assert not [r for r in mine if r.levelno >= logging.WARNING], [r.getMessage() for r in mine]
    assert any("reconnect" in r.getMessage() for r in mine)


async def test_service_to_service_mtls_with_certificates_from_certs(certs, tasks) -> None:
    """One process serves mTLS, another calls it through `client_channel`: both from certs."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    server_side = await start_process_certificates(settings_for(certs), tasks)
    client_side = await start_process_certificates(settings_for(certs), tasks)
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[],
        credentials=server_side.server_credentials(client_auth=True),
    )
    await server.start()
    await server.set_serving()
    try:
        async with client_side.client_channel(f"127.0.0.1:{server.port}") as channels:
            for _ in range(2):
                reply = await health_pb2_grpc.HealthStub(channels.channel()).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
                assert reply.status == health_pb2.HealthCheckResponse.SERVING
                # Renew through certs: the next channel() presents the new certificate.
                await client_side.rotator.renew_once()
            assert channels.opened == 2
    finally:
        await server.stop(0)
