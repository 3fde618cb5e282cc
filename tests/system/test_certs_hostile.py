"""certs under a hostile caller (issue 8 items 4, 5 and 8), against a REAL certs process.

Each test reproduces one attack from the issue against `waygate certs serve`
(port 0) and then checks that a well-behaved client is still served: its
Certify and GetTrustBundle answer (within a second, the issue's bound), and
/healthz is 200.

- a 60,000-SAN CSR from a caller entitled to a wildcard: INVALID_ARGUMENT
  naming the cap, nothing issued;
- a CSR with a real RSA-8192 key: INVALID_ARGUMENT naming the RSA bound;
- 20 concurrent expensive CSRs (60,000 SANs to parse, and RSA-4096 keys
  with 100 SANs to sign): GetTrustBundle keeps answering within a second;
- 20 calls with a 4 MB identity: short refusals and a bounded log;
- ListIssued over thousands of records, small and large: every page within
  its count and byte bounds, every record exactly once, the replica named;
- `--ca-dir` pointed at a directory with files certs did not write: start
  refused with one line naming them, files and mode untouched; an empty
  existing directory, and one certs wrote before, still work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import stat
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa

from tests.support.processes import (
    RunningService,
    certs_serve_argv,
    http_get,
    run_cli,
    start_service,
)
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

pytestmark = pytest.mark.system

WILD_TOKEN = "wild-" + "w" * 40
GOOD_TOKEN = "good-" + "g" * 40
ADMIN_TOKEN = "admin-" + "a" * 40
ADMIN = (("authorization", f"Bearer {ADMIN_TOKEN}"),)
GOOD_ID = "spiffe://waygate.local/ns/local/sa/good"
WILD_ID = "spiffe://waygate.local/ns/hostile/sa/wild"
#: The issue's bound for a well-behaved client during an attack.
ANSWER_WITHIN = 1.0


TOKENS = [
    {"token": GOOD_TOKEN, "name": "good", "allowed": [f"uri:{GOOD_ID}"]},
    {
        "token": WILD_TOKEN,
        "name": "wild",
        "allowed": ["dns:*.hostile.test", "uri:spiffe://waygate.local/ns/hostile/*"],
    },
    {"token": ADMIN_TOKEN, "name": "ops", "admin": True},
]


def serve_argv(directory: Path, ca_dir: Path | None = None) -> list[str]:
    return certs_serve_argv(directory, TOKENS, ca_dir=ca_dir)


def csr(
    names: Sequence[x509.GeneralName],
    key: object | None = None,
    encoding: serialization.Encoding = serialization.Encoding.DER,
) -> bytes:
    key = key or ec.generate_private_key(ec.SECP256R1())
    request = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName(names), critical=True)
        .sign(key, hashes.SHA256())  # type: ignore[arg-type]
    )
    return request.public_bytes(encoding)


def wild_names(count: int) -> list[x509.GeneralName]:
    return [x509.UniformResourceIdentifier(WILD_ID)] + [
        x509.DNSName(f"n{index}.hostile.test") for index in range(count - 1)
    ]


async def certs_process(directory: Path) -> RunningService:
    return await start_service(serve_argv(directory))


@pytest.fixture
async def certs(tmp_path: Path) -> AsyncIterator[RunningService]:
    service = await certs_process(tmp_path)
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
async def stub(certs: RunningService) -> AsyncIterator[certs_pb2_grpc.CertsStub]:
    async with grpc.aio.insecure_channel(certs.grpc_address) as channel:
        yield certs_pb2_grpc.CertsStub(channel)


async def timed(call: object) -> tuple[object, float]:
    started = time.monotonic()
    result = await call  # type: ignore[misc]
    return result, time.monotonic() - started


@contextlib.asynccontextmanager
async def own_connection(certs: RunningService) -> AsyncIterator[certs_pb2_grpc.CertsStub]:
    """A client on its own connection (not sharing the attacker's HTTP/2 connection)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    async with grpc.aio.insecure_channel(certs.grpc_address, options=options) as channel:
        # Connected before anyone times a call: the bound is for answers, not set-up.
        await asyncio.wait_for(channel.channel_ready(), 10)
        yield certs_pb2_grpc.CertsStub(channel)


async def assert_well_behaved_client_served(certs: RunningService) -> None:
    """Certify, GetTrustBundle and /healthz answer a well-behaved client within the bound."""
    good = certs_pb2.CertifyRequest(
        identity=GOOD_ID,
        token=GOOD_TOKEN,
        certificate_signing_request=csr([x509.UniformResourceIdentifier(GOOD_ID)]),
    )
    async with own_connection(certs) as stub:
        reply, took = await timed(stub.Certify(good, timeout=10))
        assert reply.serial and took < ANSWER_WITHIN, f"Certify took {took:.2f}s"  # type: ignore[attr-defined]
        request = certs_pb2.GetTrustBundleRequest()
        bundle, took = await timed(stub.GetTrustBundle(request, timeout=10))
        assert bundle.pem and took < ANSWER_WITHIN, f"GetTrustBundle took {took:.2f}s"  # type: ignore[attr-defined]
    assert (await http_get(certs.admin_port, "/healthz"))[0] == 200


async def issued_count(stub: certs_pb2_grpc.CertsStub) -> int:
    count, token = 0, ""
    while True:
        page = await stub.ListIssued(
            certs_pb2.ListIssuedRequest(include_expired=True, page_token=token),
            metadata=ADMIN,
            timeout=10,
        )
        count += len(page.certificates)
        token = page.next_page_token
        if not token:
            return count


@pytest.mark.parametrize("encoding", [serialization.Encoding.DER, serialization.Encoding.PEM])
async def test_a_60000_san_csr_is_refused_naming_the_cap(
    certs: RunningService, stub: certs_pb2_grpc.CertsStub, encoding: serialization.Encoding
) -> None:
    der = await asyncio.to_thread(csr, wild_names(60_000), None, encoding)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Certify(
            certs_pb2.CertifyRequest(
                identity=WILD_ID, token=WILD_TOKEN, certificate_signing_request=der
            ),
            timeout=30,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = refused.value.details() or ""
    assert "more than 100 subject alternative names; at most 100" in details
    assert await issued_count(stub) == 0
    await assert_well_behaved_client_served(certs)


async def test_an_rsa_8192_key_is_refused(
    certs: RunningService, stub: certs_pb2_grpc.CertsStub
) -> None:
    key = await asyncio.to_thread(rsa.generate_private_key, 65537, 8192)
    der = await asyncio.to_thread(csr, [x509.UniformResourceIdentifier(WILD_ID)], key)
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Certify(
            certs_pb2.CertifyRequest(
                identity=WILD_ID, token=WILD_TOKEN, certificate_signing_request=der
            ),
            timeout=30,
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "8192 bits; RSA keys must have 2048 to 4096 bits" in (refused.value.details() or "")
    assert await issued_count(stub) == 0
    await assert_well_behaved_client_served(certs)


async def test_expensive_csrs_never_stall_the_trust_bundle(
    certs: RunningService, stub: certs_pb2_grpc.CertsStub
) -> None:
    huge = await asyncio.to_thread(csr, wild_names(60_000))
    rsa_key = await asyncio.to_thread(rsa.generate_private_key, 65537, 4096)
    widest = await asyncio.to_thread(csr, wild_names(100), rsa_key)

    def attack(der: bytes) -> object:
        return stub.Certify(
            certs_pb2.CertifyRequest(
                identity=WILD_ID, token=WILD_TOKEN, certificate_signing_request=der
            ),
            timeout=60,
        )

    latencies: list[float] = []
    calls: list[asyncio.Future[object]] = []
    try:
        async with own_connection(certs) as client:
            bundle = certs_pb2.GetTrustBundleRequest()
            await client.GetTrustBundle(bundle, timeout=10)  # connected before the attack
            calls = [asyncio.ensure_future(attack(huge)) for _ in range(20)]
            calls += [asyncio.ensure_future(attack(widest)) for _ in range(20)]
            while not all(call.done() for call in calls):
                _, took = await timed(client.GetTrustBundle(bundle, timeout=10))
                latencies.append(took)
                await asyncio.sleep(0.01)
        await assert_well_behaved_client_served(certs)
    finally:
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
    refused = [o for o in outcomes if isinstance(o, grpc.aio.AioRpcError)]
    assert len(refused) == 20 and all(
        o.code() == grpc.StatusCode.INVALID_ARGUMENT for o in refused
    ), [o.code() for o in refused]
    assert sum(1 for o in outcomes if isinstance(o, certs_pb2.CertifyResponse)) == 20
    assert latencies, "the attack ended before the bundle was asked for"
    assert max(latencies) < ANSWER_WITHIN, f"GetTrustBundle stalled {max(latencies):.2f}s"


async def test_a_4mb_identity_gets_a_short_refusal_and_a_bounded_log(
    certs: RunningService, stub: certs_pb2_grpc.CertsStub
) -> None:
    identity = "spiffe://waygate.local/ns/hostile/sa/" + "x" * 4_000_000
    der = csr([x509.UniformResourceIdentifier(WILD_ID)])
    logged_before = len(certs.logs)
    for _ in range(20):
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Certify(
                certs_pb2.CertifyRequest(
                    identity=identity, token=WILD_TOKEN, certificate_signing_request=der
                ),
                timeout=30,
            )
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = refused.value.details() or ""
        assert "at most 2048" in details and len(details) < 200
    await assert_well_behaved_client_served(certs)
    await asyncio.sleep(0.5)  # the process's last lines reach the collector
    new = certs.logs[logged_before:]
    refusals = [e for e in new if e.get("msg") == "certify refused"]
    assert len(refusals) == 20
    log_bytes = sum(len(json.dumps(entry)) for entry in new)
    assert log_bytes < 20 * 1024, f"20 refusals wrote {log_bytes} bytes of log"


async def test_list_issued_pages_thousands_of_records(
    certs: RunningService, stub: certs_pb2_grpc.CertsStub
) -> None:
    small = csr([x509.UniformResourceIdentifier(GOOD_ID)])
    wide = csr(wild_names(100))
    plan = [(GOOD_ID, GOOD_TOKEN, small)] * 2000 + [(WILD_ID, WILD_TOKEN, wide)] * 500
    serials: list[str] = []
    gate = asyncio.Semaphore(16)

    async def issue(identity: str, token: str, der: bytes) -> None:
        async with gate:
            reply = await stub.Certify(
                certs_pb2.CertifyRequest(
                    identity=identity, token=token, certificate_signing_request=der
                ),
                timeout=30,
            )
            serials.append(reply.serial)

    await asyncio.gather(*(issue(*entry) for entry in plan))

    listed: list[str] = []
    replicas: set[str] = set()
    token, pages = "", 0
    while True:
        page = await stub.ListIssued(
            certs_pb2.ListIssuedRequest(page_token=token), metadata=ADMIN, timeout=10
        )
        pages += 1
        assert len(page.certificates) <= 500  # the default page size
        assert page.ByteSize() < 1100 * 1024  # far below the 4 MiB message limit
        listed += [c.serial for c in page.certificates]
        replicas.add(page.replica)
        token = page.next_page_token
        if not token:
            break
    assert sorted(listed) == sorted(serials) and len(set(listed)) == 2501 - 1
    assert pages >= 5
    (replica,) = replicas
    assert replica.endswith(f"/{certs.process.pid}")

    capped = await stub.ListIssued(
        certs_pb2.ListIssuedRequest(page_size=100_000, identity=GOOD_ID),
        metadata=ADMIN,
        timeout=10,
    )
    assert len(capped.certificates) == 1000 and capped.next_page_token

    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.ListIssued(
            certs_pb2.ListIssuedRequest(page_token="not-a-token"), metadata=ADMIN, timeout=10
        )
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    await assert_well_behaved_client_served(certs)


def listing(directory: Path) -> dict[str, tuple[bytes, int, int]]:
    return {
        path.name: (path.read_bytes(), stat.S_IMODE(path.stat().st_mode), path.stat().st_mtime_ns)
        for path in directory.iterdir()
        if path.is_file()
    }


async def test_a_ca_dir_with_foreign_files_is_refused_and_left_untouched(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / ".bashrc").write_text("alias ll='ls -l'\n")
    (home / ".profile").write_text("PATH=$HOME/bin:$PATH\n")
    home.chmod(0o755)
    before, mode_before = listing(home), stat.S_IMODE(home.stat().st_mode)

    code, _, err = await run_cli(*serve_argv(tmp_path, home)[1:], cwd=tmp_path)
    assert code == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"waygate: certs: CA directory {home} holds 2 entries")
    assert "'.bashrc'" in last and "'.profile'" in last
    assert "Traceback" not in err
    assert listing(home) == before
    assert stat.S_IMODE(home.stat().st_mode) == mode_before == 0o755

    # A fresh, empty, existing directory works (and keeps its mode), and so does
    # the same directory on the next start, holding what certs wrote.
    fresh = tmp_path / "fresh"
    fresh.mkdir()
    fresh.chmod(0o750)
    for _ in range(2):
        certs = await start_service(serve_argv(tmp_path, fresh))
        try:
            assert (await http_get(certs.admin_port, "/readyz"))[0] == 200
        finally:
            assert await certs.stop() == 0
    assert stat.S_IMODE(fresh.stat().st_mode) == 0o750
    assert {p.name for p in fresh.iterdir()} == {"state.json", "ca-1.key.pem", "ca-1.cert.pem"}
