"""CertsService under hostile input (issue 8 item 4): bounded fields, a bounded signing
pool, bounded refusal logs, ListIssued pages and their tokens, per-workload names.

In-process (no sockets): the domain service with a real authority in a temp
directory and real static tokens; the gRPC path is in tests/integration/certs
and against a real process in tests/system/test_certs_hostile.py.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from tests.unit.certs.helpers import RESOLVER, RESOLVER_ID, csr_der, make_csr, open_authority
from waygate.certs.auth import ADMIN_GROUP, Caller, StaticTokenAuthenticator
from waygate.certs.policy import Policy, ServiceInfo
from waygate.certs.service import MAX_PAGE_SIZE, CertsService, SigningExecutor
from waygate.core.errors import (
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
)

TOKEN = "t" * 40
ADMIN_TOKEN = "a" * 40
SA_TOKEN = "s" * 40
ADMIN = Caller(name="ops", groups=(ADMIN_GROUP,))
WEB = Caller(name="system:serviceaccount:shop:web", namespace="shop", service_account="web")


class Services:
    async def service(self, namespace: str, name: str) -> ServiceInfo | None:
        if (namespace, name) == ("shop", "web"):
            return ServiceInfo(namespace, name, None)
        if (namespace, name) == ("shop", "db"):
            return ServiceInfo(namespace, name, "postgres")
        return None


def make_service(tmp_path: Path, *, replica: str = "here/1", **config: object) -> CertsService:
    authenticator = StaticTokenAuthenticator(
        [(TOKEN, RESOLVER), (ADMIN_TOKEN, ADMIN), (SA_TOKEN, WEB)]
    )
    service = CertsService(
        authenticator,
        Policy("waygate.local", services=Services()),
        replica=replica,
        executor=SigningExecutor(2, 8),
    )
    service.attach(open_authority(tmp_path / "ca", **config))
    return service


async def certify(service: CertsService, **overrides: object) -> object:
    fields: dict[str, object] = {
        "token": TOKEN,
        "identity": RESOLVER_ID,
        "csr_der": csr_der(),
        "lifetime": None,
    }
    fields.update(overrides)
    return await service.certify(**fields)  # type: ignore[arg-type]


async def test_an_identity_over_its_bound_is_refused_before_any_work(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    service = make_service(tmp_path)
    huge = "x" * 4_000_000
    with (
        caplog.at_level(logging.INFO, logger="waygate.certs.service"),
        pytest.raises(InvalidArgument) as refused,
    ):
        await certify(service, identity=huge, token="not a token")
    assert str(refused.value) == "identity is 4000000 characters long; at most 2048 are allowed"
    (line,) = [r for r in caplog.records if r.getMessage() == "certify refused"]
    assert len(line.identity) < 120  # type: ignore[attr-defined]
    assert "4000000 characters" in line.identity  # type: ignore[attr-defined]


async def test_a_token_over_its_bound_is_refused_without_repeating_it(tmp_path: Path) -> None:
    service = make_service(tmp_path)
    with pytest.raises(InvalidArgument) as refused:
        await certify(service, token="secret-" * 5000)
    assert "secret" not in str(refused.value)
    assert "at most 16384" in str(refused.value)


async def test_a_full_signing_pool_refuses_at_once_and_recovers() -> None:
    executor = SigningExecutor(workers=1, queue=1)
    release = threading.Event()
    running = [asyncio.ensure_future(executor.run(release.wait, 10)) for _ in range(2)]
    await asyncio.sleep(0.05)
    with pytest.raises(ResourceExhausted, match="signing_workers 1 \\+ signing_queue 1"):
        await executor.run(lambda: None)
    # A caller that gives up keeps its slot until its thread is done: no overfill.
    running[1].cancel()
    with pytest.raises(ResourceExhausted):
        await executor.run(lambda: None)
    release.set()
    await asyncio.gather(*running, return_exceptions=True)
    for _ in range(100):
        try:
            assert await executor.run(lambda: 7) == 7
            break
        except ResourceExhausted:
            await asyncio.sleep(0.01)
    else:
        raise AssertionError("the pool never freed its slots")
    executor.close()


async def test_list_issued_pages_with_opaque_tokens(tmp_path: Path) -> None:
    service = make_service(tmp_path)
    for _ in range(7):
        await certify(service)
    serials: list[str] = []
    token, pages = "", 0
    while True:
        listing = await service.list_issued(
            token=ADMIN_TOKEN, identity="", include_expired=False, page_size=3, page_token=token
        )
        assert listing.replica == "here/1"
        assert len(listing.records) <= 3
        serials += [r.serial for r in listing.records]
        pages += 1
        token = listing.next_page_token
        if not token:
            break
    assert pages == 3 and len(set(serials)) == 7
    assert serials == [r.serial for r in service.authority.list_issued()]


async def test_page_size_defaults_and_caps(tmp_path: Path) -> None:
    service = make_service(tmp_path)
    await certify(service)
    listing = await service.list_issued(
        token=ADMIN_TOKEN, identity="", include_expired=False, page_size=10**9
    )
    assert len(listing.records) == 1 and listing.next_page_token == ""
    assert MAX_PAGE_SIZE == 1000


@pytest.mark.parametrize(
    ("token", "match"),
    [
        ("garbage!", "not a next_page_token this server gave out"),
        ("e30=", "not a next_page_token"),  # {}
        ("x" * 600, "page_token is 600 characters long"),
    ],
)
async def test_bad_page_tokens_are_invalid_argument(tmp_path: Path, token: str, match: str) -> None:
    service = make_service(tmp_path)
    with pytest.raises(InvalidArgument, match=match):
        await service.list_issued(
            token=ADMIN_TOKEN, identity="", include_expired=False, page_token=token
        )


async def test_a_token_of_another_replica_or_query_is_refused(tmp_path: Path) -> None:
    one = make_service(tmp_path / "one", replica="pod-a/1")
    other = make_service(tmp_path / "two", replica="pod-b/1")
    for service in (one, other):
        for _ in range(3):
            await certify(service)
    first = await one.list_issued(
        token=ADMIN_TOKEN, identity="", include_expired=False, page_size=1
    )
    with pytest.raises(InvalidArgument, match="another certs replica"):
        await other.list_issued(
            token=ADMIN_TOKEN, identity="", include_expired=False, page_token=first.next_page_token
        )
    with pytest.raises(InvalidArgument, match="different query"):
        await one.list_issued(
            token=ADMIN_TOKEN, identity="", include_expired=True, page_token=first.next_page_token
        )


async def test_a_service_account_gets_its_own_service_name_only(tmp_path: Path) -> None:
    service = make_service(tmp_path)
    spiffe = "spiffe://waygate.local/ns/shop/sa/web"
    own, _ = make_csr((f"uri:{spiffe}", "dns:web.shop.svc"))
    der = own.public_bytes(serialization.Encoding.DER)
    issued = await certify(service, token=SA_TOKEN, identity=spiffe, csr_der=der)
    assert issued is not None
    theirs, _ = make_csr((f"uri:{spiffe}", "dns:db.shop.svc"))
    with pytest.raises(PermissionDenied, match="names ServiceAccount 'postgres'"):
        await certify(
            service,
            token=SA_TOKEN,
            identity=spiffe,
            csr_der=theirs.public_bytes(serialization.Encoding.DER),
        )
    assert len(service.authority.list_issued()) == 1


class NotLeading:
    """The elector of a follower replica (what `certs_elector` answers there)."""

    def is_leader(self) -> bool:
        return False

    def leader_description(self) -> str:
        return "replica-0"


async def test_trust_reports_go_to_the_leader_and_only_for_the_callers_identity(
    tmp_path: Path,
) -> None:
    service = make_service(tmp_path)
    fields = {
        "token": TOKEN,
        "identity": RESOLVER_ID,
        "instance": "pod-1",
        "version": 1,
        "fingerprints": [service.authority.active_authority().fingerprint],
        "leaving": False,
    }
    await service.report_trust(**fields)  # type: ignore[arg-type]
    assert [c.identity for c in service.authority.consumers.snapshot()] == [RESOLVER_ID]
    with pytest.raises(PermissionDenied, match="may not report for identity"):
        await service.report_trust(**{**fields, "identity": "spiffe://waygate.local/ns/x/sa/y"})  # type: ignore[arg-type]
    with pytest.raises(Unauthenticated):
        await service.report_trust(**{**fields, "token": "wrong"})  # type: ignore[arg-type]
    service.leader = NotLeading()
    with pytest.raises(Unavailable, match="not the leader.*replica-0 does"):
        await service.report_trust(**fields)  # type: ignore[arg-type]
    service.close()
