"""Certs over a real grpc.aio server on port 0: every RPC, every bad input of issue 3 item 8.

Each refusal is checked for its status code and message, and for having
changed nothing: ListIssued (admin) returns the same list and the CA
directory holds the same bytes with the same modification times.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import socket
import ssl
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.x509 import verification
from google.protobuf import duration_pb2
from prometheus_client import REGISTRY

from tests.unit.certs.helpers import (
    RESOLVER_ID,
    RESOLVER_SANS,
    csr_der,
    duplicate_san_csr_der,
    snapshot,
    tampered_csr_der,
)
from waygate.certs.auth import StaticTokenAuthenticator
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.policy import Policy
from waygate.certs.selftls import serving_certificate
from waygate.certs.server import registration
from waygate.certs.service import CertsService
from waygate.certs.store import DirectoryCAStore
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc
from waygate.core.errors import FailedPrecondition
from waygate.core.grpcserver import GrpcServer

RESOLVER_TOKEN = "resolver-" + "r" * 40
ADMIN_TOKEN = "admin-" + "a" * 40
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)


@dataclass
class Running:
    stub: certs_pb2_grpc.CertsStub
    service: CertsService
    ca_dir: Path
    port: int
    server: GrpcServer


def write_tokens(path: Path) -> Path:
    path.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {"token": RESOLVER_TOKEN, "name": "resolver", "allowed": list(RESOLVER_SANS)},
                    {"token": ADMIN_TOKEN, "name": "ops", "admin": True},
                ]
            }
        )
    )
    path.chmod(0o600)
    return path


@contextlib.asynccontextmanager
async def certs_server(
    tmp_path: Path, *, credentials: grpc.ServerCredentials | None = None, load: bool = True
) -> AsyncIterator[Running]:
    authenticator = StaticTokenAuthenticator.from_file(write_tokens(tmp_path / "tokens.yaml"))
    service = CertsService(authenticator, Policy("waygate.local"))
    ca_dir = tmp_path / "ca"
    if load:
        service.attach(
            Authority.open(
                DirectoryCAStore(ca_dir), AuthorityConfig(max_lifetime=dt.timedelta(days=2))
            )
        )
    server = GrpcServer(
        host="127.0.0.1", port=0, registrations=[registration(service)], credentials=credentials
    )
    port = await server.start()
    await server.set_serving()
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        try:
            yield Running(certs_pb2_grpc.CertsStub(channel), service, ca_dir, port, server)
        finally:
            await server.stop(0)


def certify_request(**overrides: object) -> certs_pb2.CertifyRequest:
    fields: dict[str, object] = {
        "identity": RESOLVER_ID,
        "token": RESOLVER_TOKEN,
        "certificate_signing_request": csr_der(),
    }
    fields.update(overrides)
    return certs_pb2.CertifyRequest(**fields)  # type: ignore[arg-type]


async def issued_serials(stub: certs_pb2_grpc.CertsStub) -> list[str]:
    reply = await stub.ListIssued(
        certs_pb2.ListIssuedRequest(include_expired=True), metadata=ADMIN, timeout=10
    )
    return [c.serial for c in reply.certificates]


async def test_certify_returns_a_leaf_that_chains_to_the_bundle(tmp_path: Path) -> None:
    async with certs_server(tmp_path) as certs:
        reply = await certs.stub.Certify(certify_request(), timeout=10)
        bundle = await certs.stub.GetTrustBundle(certs_pb2.GetTrustBundleRequest(), timeout=10)
        leaf = x509.load_der_x509_certificate(reply.leaf_certificate)
        assert format(leaf.serial_number, "x") == reply.serial
        assert reply.valid_until.ToDatetime(tzinfo=dt.UTC) == leaf.not_valid_after_utc
        assert list(reply.intermediate_certificates) == []
        roots = x509.load_pem_x509_certificates(bundle.pem.encode())
        assert [a.state for a in bundle.authorities] == [certs_pb2.CA_STATE_ACTIVE]
        verification.PolicyBuilder().store(verification.Store(roots)).build_server_verifier(
            x509.DNSName("resolver.waygate.local")
        ).verify(leaf, [])
        listed = await certs.stub.ListIssued(
            certs_pb2.ListIssuedRequest(), metadata=ADMIN, timeout=10
        )
        (record,) = listed.certificates
        assert record.serial == reply.serial and record.requested_by == "resolver"
        assert record.identity == RESOLVER_ID and list(record.uris) == [RESOLVER_ID]
        assert record.issuer_fingerprint_sha256 == bundle.authorities[0].fingerprint_sha256


def _lifetime(seconds: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds)


BAD_INPUT = [
    pytest.param({"certificate_signing_request": b""}, "INVALID_ARGUMENT", "empty", id="empty-csr"),
    pytest.param(
        {"certificate_signing_request": b"\x30\x82garbage"},
        "INVALID_ARGUMENT",
        "not a PKCS#10 CSR",
        id="malformed-csr",
    ),
    pytest.param(
        {"certificate_signing_request": tampered_csr_der()},
        "INVALID_ARGUMENT",
        "signature does not verify",
        id="unsigned-csr",
    ),
    pytest.param({"token": "x" * 40}, "UNAUTHENTICATED", "does not authenticate", id="wrong-token"),
    pytest.param({"token": ""}, "UNAUTHENTICATED", "token is required", id="no-token"),
    pytest.param(
        {"certificate_signing_request": csr_der((f"uri:{RESOLVER_ID}", "dns:proxy.waygate.local"))},
        "PERMISSION_DENIED",
        "resolver may not get a certificate for 'dns:proxy.waygate.local'",
        id="forbidden-san",
    ),
    pytest.param(
        {
            "identity": "spiffe://waygate.local/ns/local/sa/proxy",
            "certificate_signing_request": csr_der(
                ("uri:spiffe://waygate.local/ns/local/sa/proxy",)
            ),
        },
        "PERMISSION_DENIED",
        "sa/proxy",
        id="forbidden-identity",
    ),
    pytest.param(
        {"identity": "spiffe://waygate.local/ns/local/sa/other"},
        "INVALID_ARGUMENT",
        "not among the CSR's subject alternative names",
        id="identity-not-in-csr",
    ),
    pytest.param(
        {"lifetime": _lifetime(3 * 86400)},
        "INVALID_ARGUMENT",
        "lifetime 3d exceeds the maximum 2d",
        id="lifetime-above-max",
    ),
    pytest.param(
        {"identity": "spiffe://waygate.local/" + "i" * 3_000_000},
        "INVALID_ARGUMENT",
        "identity is 3000023 characters long; at most 2048 are allowed",
        id="huge-identity",
    ),
    pytest.param(
        {"token": "t" * 20_000},
        "INVALID_ARGUMENT",
        "token is 20000 characters long; at most 16384",
        id="huge-token",
    ),
    pytest.param(
        {
            "certificate_signing_request": csr_der(
                (f"uri:{RESOLVER_ID}", *(f"dns:n{i}.waygate.local" for i in range(200)))
            )
        },
        "INVALID_ARGUMENT",
        "more than 100 subject alternative names; at most 100",
        id="too-many-sans",
    ),
]


@pytest.mark.parametrize(("overrides", "code", "message"), BAD_INPUT)
async def test_bad_input_is_refused_and_changes_nothing(
    tmp_path: Path, overrides: dict, code: str, message: str
) -> None:
    async with certs_server(tmp_path) as certs:
        await certs.stub.Certify(certify_request(), timeout=10)
        serials = await issued_serials(certs.stub)
        files = snapshot(certs.ca_dir)
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await certs.stub.Certify(certify_request(**overrides), timeout=10)
        assert caught.value.code() == getattr(grpc.StatusCode, code)
        assert message in (caught.value.details() or "")
        assert await issued_serials(certs.stub) == serials
        assert snapshot(certs.ca_dir) == files


async def test_unreadable_ca_key_is_failed_precondition(tmp_path: Path) -> None:
    ca_dir = tmp_path / "ca"
    Authority.open(DirectoryCAStore(ca_dir))
    (key,) = ca_dir.glob("*.key.pem")
    key.chmod(0o644)
    files = snapshot(ca_dir)
    async with certs_server(tmp_path, load=False) as certs:
        with pytest.raises(FailedPrecondition) as failure:
            Authority.open(DirectoryCAStore(ca_dir))
        certs.service.unavailable(str(failure.value))
        for call in (
            certs.stub.Certify(certify_request(), timeout=10),
            certs.stub.GetTrustBundle(certs_pb2.GetTrustBundleRequest(), timeout=10),
        ):
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call
            assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
            assert "mode 0644" in (caught.value.details() or "")
    assert snapshot(ca_dir) == files


async def test_admin_calls_need_an_admin(tmp_path: Path) -> None:
    async with certs_server(tmp_path) as certs:
        cases = [
            ((), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", "Bearer " + "x" * 40),), grpc.StatusCode.UNAUTHENTICATED),
            ((("authorization", f"Bearer {RESOLVER_TOKEN}"),), grpc.StatusCode.PERMISSION_DENIED),
        ]
        for metadata, code in cases:
            for call in (
                certs.stub.RotateCA(certs_pb2.RotateCARequest(), metadata=metadata, timeout=10),
                certs.stub.ListIssued(certs_pb2.ListIssuedRequest(), metadata=metadata, timeout=10),
            ):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await call
                assert caught.value.code() == code
        bundle = await certs.stub.GetTrustBundle(certs_pb2.GetTrustBundleRequest(), timeout=10)
        assert len(bundle.authorities) == 1


def _cancelled_watches() -> float:
    return (
        REGISTRY.get_sample_value(
            "waygate_grpc_server_handled_total",
            {
                "grpc_service": "waygate.certs.v1.Certs",
                "grpc_method": "WatchTrustBundle",
                "grpc_code": "CANCELLED",
            },
        )
        or 0.0
    )


async def test_watch_rotate_and_cancel(tmp_path: Path) -> None:
    async with certs_server(tmp_path) as certs:
        cancelled_before = _cancelled_watches()
        watch = certs.stub.WatchTrustBundle(certs_pb2.WatchTrustBundleRequest())
        first = await asyncio.wait_for(watch.read(), 10)
        assert [a.state for a in first.authorities] == [certs_pb2.CA_STATE_ACTIVE]

        rotation = await certs.stub.RotateCA(
            certs_pb2.RotateCARequest(propagation_delay=duration_pb2.Duration(seconds=3600)),
            metadata=ADMIN,
            timeout=10,
        )
        assert rotation.new_authority.state == certs_pb2.CA_STATE_STAGED
        staged = await asyncio.wait_for(watch.read(), 10)
        assert staged.version == first.version + 1
        assert [a.state for a in staged.authorities] == [
            certs_pb2.CA_STATE_ACTIVE,
            certs_pb2.CA_STATE_STAGED,
        ]
        assert staged.pem.count("BEGIN CERTIFICATE") == 2
        assert rotation.signing_switch_at.ToDatetime(tzinfo=dt.UTC) > dt.datetime.now(dt.UTC)

        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await certs.stub.RotateCA(certs_pb2.RotateCARequest(), metadata=ADMIN, timeout=10)
        assert caught.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "still in progress" in (caught.value.details() or "")

        watch.cancel()
        # The server's handler ends (and is counted) once the client went away.
        async with asyncio.timeout(10):
            while _cancelled_watches() <= cancelled_before:
                await asyncio.sleep(0.05)


async def test_self_issued_serving_certificate_is_renewed_in_place(tmp_path: Path) -> None:
    authority = Authority.open(DirectoryCAStore(tmp_path / "ca"))
    serving, credentials = await serving_certificate(
        authority,
        "spiffe://waygate.local/ns/local/sa/certs",
        ("dns:certs.waygate.local", "ip:127.0.0.1"),
    )
    authenticator = StaticTokenAuthenticator.from_file(write_tokens(tmp_path / "tokens.yaml"))
    service = CertsService(authenticator, Policy("waygate.local"))
    service.attach(authority)
    server = GrpcServer(
        host="127.0.0.1", port=0, registrations=[registration(service)], credentials=credentials
    )
    port = await server.start()
    try:
        bundle_pem = authority.trust_bundle().pem.encode()
        # A gRPC client that verifies the server by its IP SAN against the bundle.
        channel_credentials = grpc.ssl_channel_credentials(root_certificates=bundle_pem)
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", channel_credentials) as channel:
            stub = certs_pb2_grpc.CertsStub(channel)
            reply = await stub.Certify(certify_request(), timeout=10)
            assert reply.serial

            first_serial = await asyncio.to_thread(_served_serial, port, bundle_pem)
            assert first_serial == serving.current.leaf.serial_number
            await serving.renew_once()
            second_serial = await asyncio.to_thread(_served_serial, port, bundle_pem)
            assert second_serial == serving.current.leaf.serial_number
            assert second_serial != first_serial
            # The connection opened before the renewal still works.
            await stub.GetTrustBundle(certs_pb2.GetTrustBundleRequest(), timeout=10)
    finally:
        await server.stop(0)


def _served_serial(port: int, bundle_pem: bytes) -> int:
    """Serial of the certificate a new TLS handshake gets; refuses anything below TLS 1.2."""
    context = ssl.create_default_context(cadata=bundle_pem.decode())
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.set_alpn_protocols(["h2"])
    with (
        socket.create_connection(("127.0.0.1", port), timeout=10) as raw,
        context.wrap_socket(raw, server_hostname="certs.waygate.local") as tls,
    ):
        der = tls.getpeercert(binary_form=True)
    assert der is not None
    return x509.load_der_x509_certificate(der).serial_number


@pytest.mark.parametrize(
    ("request_fields", "message"),
    [
        pytest.param(
            {"certificate_signing_request": duplicate_san_csr_der()},
            "the CSR's extensions do not parse",
            id="duplicate-san-extension",
        ),
        pytest.param(
            {"lifetime": duration_pb2.Duration(seconds=2**62)},
            "lifetime must be between 0 and 100 years",
            id="lifetime-overflow",
        ),
        pytest.param(
            {"lifetime": duration_pb2.Duration(seconds=-60)},
            "lifetime must be between 0 and 100 years",
            id="negative-lifetime",
        ),
    ],
)
async def test_odd_requests_are_invalid_argument_never_internal(
    tmp_path: Path, request_fields: dict, message: str
) -> None:
    async with certs_server(tmp_path) as certs:
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await certs.stub.Certify(certify_request(**request_fields), timeout=10)
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (caught.value.details() or "")


@pytest.mark.parametrize(
    ("rotate_fields", "message"),
    [
        ({"propagation_delay": duration_pb2.Duration(seconds=2**40)}, "between 0 and 100 years"),
        ({"ca_lifetime": duration_pb2.Duration(seconds=2**40)}, "between 0 and 100 years"),
        (
            {"propagation_delay": duration_pb2.Duration(seconds=400 * 86400)},
            "ends after the active CA expires",
        ),
    ],
)
async def test_rotation_durations_out_of_range_are_refused(
    tmp_path: Path, rotate_fields: dict, message: str
) -> None:
    async with certs_server(tmp_path) as certs:
        before = (await certs.stub.GetTrustBundle(certs_pb2.GetTrustBundleRequest())).version
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await certs.stub.RotateCA(
                certs_pb2.RotateCARequest(**rotate_fields), metadata=ADMIN, timeout=10
            )
        assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert message in (caught.value.details() or "")
        after = await certs.stub.GetTrustBundle(certs_pb2.GetTrustBundleRequest())
        assert after.version == before and len(after.authorities) == 1


async def test_draining_ends_trust_bundle_watches_with_unavailable(tmp_path: Path) -> None:
    async with certs_server(tmp_path) as certs:
        watch = certs.stub.WatchTrustBundle(certs_pb2.WatchTrustBundleRequest())
        await asyncio.wait_for(watch.read(), 10)
        certs.service.end_watches()
        with pytest.raises(grpc.aio.AioRpcError) as caught:
            await asyncio.wait_for(watch.read(), 10)
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down; reconnect" in (caught.value.details() or "")


async def test_list_issued_pages_name_the_replica(tmp_path: Path) -> None:
    async with certs_server(tmp_path) as certs:
        for _ in range(5):
            await certs.stub.Certify(certify_request(), timeout=10)
        serials: list[str] = []
        token, pages, replicas = "", 0, set()
        while True:
            page = await certs.stub.ListIssued(
                certs_pb2.ListIssuedRequest(page_size=2, page_token=token),
                metadata=ADMIN,
                timeout=10,
            )
            pages += 1
            serials += [c.serial for c in page.certificates]
            replicas.add(page.replica)
            token = page.next_page_token
            if not token:
                break
        assert pages == 3 and len(set(serials)) == 5
        assert len(replicas) == 1 and replicas.pop() == certs.service.replica
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await certs.stub.ListIssued(
                certs_pb2.ListIssuedRequest(page_token="bm90IGEgdG9rZW4="),
                metadata=ADMIN,
                timeout=10,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "not a next_page_token" in (refused.value.details() or "")
