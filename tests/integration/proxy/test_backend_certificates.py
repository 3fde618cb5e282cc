"""The proxy sees a backend's certificate before a client hits it.

Real HTTPS backends (`TlsBackend` of test_reencrypt) with certificates from
`LocalCA`; the proxy's reencrypt path records, at every handshake, what each
endpoint served (`waygate.proxy.backendcerts`), exports its expiry, marks an
expired or untrusted endpoint unusable, warns days before expiry, probes at a
bounded rate, and raises a verification failure as a retryable ConnectError
(the redispatch signal a refused connect gives).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json

from prometheus_client import REGISTRY

from tests.integration.proxy.test_reencrypt import TlsBackend, reencrypt
from tests.support.pki import LocalCA
from tests.support.poll import until
from tests.support.proxyharness import route
from waygate.proxy.backendcerts import (
    BackendCertificates,
    Served,
    Verdict,
    check_findings,
    section,
)
from waygate.proxy.routing import Target
from waygate.proxy.upstream import ConnectError, tcp_connect
from waygate.proxy.upstream_tls import UpstreamTLS

# The records' own times hang off this; a real handshake's certificate is judged at the
# test's now (collection can come minutes before a test runs).
NOW = dt.datetime.now(dt.UTC)
DAY = dt.timedelta(days=1)


class Held(asyncio.Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport


def served(
    endpoint: str, not_after: dt.datetime, *, verified: bool = True, seen: dt.datetime = NOW
) -> Served:
    return Served(
        "demo/secure", endpoint, NOW - DAY, not_after, "CN=ca", ("web.demo.svc",), verified, seen
    )


def test_verdicts_warnings_and_probes_are_decided_without_io() -> None:
    book = BackendCertificates(probes_per_tick=2, max_entries=3)
    book.record(served("10.0.0.1:443", NOW + 30 * DAY, seen=NOW - dt.timedelta(hours=1)))
    book.record(served("10.0.0.2:443", NOW + 2 * DAY))
    book.record(served("10.0.0.3:443", NOW + 30 * DAY, verified=False))
    assert book.usable("demo/secure", "10.0.0.1:443", NOW)
    assert not book.usable("demo/secure", "10.0.0.3:443", NOW)  # untrusted
    assert book.get("demo/secure", "10.0.0.3:443").verdict(NOW) is Verdict.UNTRUSTED
    assert book.get("demo/secure", "10.0.0.2:443").verdict(NOW + 3 * DAY) is Verdict.EXPIRED
    assert [s.endpoint for s in book.expiring(NOW)] == ["10.0.0.2:443"]  # 2 days < 7
    assert book.due_probes(NOW) == [("demo/secure", "10.0.0.1:443")]  # handshaken an hour ago
    assert (
        REGISTRY.get_sample_value(
            "waygate_proxy_upstream_certificate_expiry_timestamp_seconds",
            {"route": "demo/secure", "endpoint": "10.0.0.2:443"},
        )
        == (NOW + 2 * DAY).timestamp()
    )
    book.record(served("10.0.0.4:443", NOW + 30 * DAY))  # past max_entries: the oldest goes
    assert book.get("demo/secure", "10.0.0.1:443") is None
    book.keep_only([("demo/secure", "10.0.0.4:443")])
    assert len(book) == 1
    assert (
        REGISTRY.get_sample_value(
            "waygate_proxy_upstream_certificate_expiry_timestamp_seconds",
            {"route": "demo/secure", "endpoint": "10.0.0.2:443"},
        )
        is None
    )


async def test_every_handshake_records_what_the_endpoint_served() -> None:
    ca = LocalCA()
    backend = await TlsBackend(ca.issue(dns=["web.demo.svc"])).start()
    tls = UpstreamTLS(lambda: None, lambda: None, tcp_connect)
    secure = route("secure.test", [("web", 100)], name="secure", tls=reencrypt(ca.pem))
    target = Target("127.0.0.1", backend.port, namespace="demo", service="web")
    try:
        connection = await tcp_connect(target, 5.0, None)
        protocol = await tls.open(Held, connection, secure, target, 5.0)
        protocol.transport.close()  # nothing is sent: the handshake is what is recorded
        record = tls.certificates.get("demo/secure", f"127.0.0.1:{backend.port}")
        assert record is not None and record.verified
        assert record.names == ("web.demo.svc",)
        assert record.issuer == ca.certificate.subject.rfc4514_string()
        assert tls.certificates.usable(
            "demo/secure", f"127.0.0.1:{backend.port}", dt.datetime.now(dt.UTC)
        )
        assert await tls.probe(target, secure, 5.0) is True
    finally:
        await backend.stop()


async def test_an_expired_endpoint_is_recorded_unusable_and_its_failure_is_retryable() -> None:
    old = LocalCA(lambda: dt.datetime(2021, 10, 29, 13, 47, 51, tzinfo=dt.UTC))
    backend = await TlsBackend(old.issue(dns=["web.demo.svc"])).start()
    untrusted: list[Target] = []
    tls = UpstreamTLS(lambda: None, lambda: None, tcp_connect, on_untrusted=untrusted.append)
    secure = route("secure.test", [("web", 100)], name="secure", tls=reencrypt(old.pem))
    target = Target("127.0.0.1", backend.port, namespace="demo", service="web")
    try:
        connection = await tcp_connect(target, 5.0, None)
        try:
            await tls.open(asyncio.Protocol, connection, secure, target, 5.0)
        except ConnectError as exc:
            failure = exc
        else:
            raise AssertionError("an expired backend certificate was accepted")
        assert failure.retryable and failure.kind == "tls_expired"
        endpoint = f"127.0.0.1:{backend.port}"
        record = tls.certificates.get("demo/secure", endpoint)
        assert record is not None and not record.verified
        assert not tls.certificates.usable("demo/secure", endpoint, dt.datetime.now(dt.UTC))
        assert record.names == ("web.demo.svc",)
        # A probe (what the bounded prober runs) records it again, says it failed, and
        # takes the endpoint out of rotation (the proxy's passive health skips it).
        assert untrusted == []
        assert await tls.probe(target, secure, 5.0) is False
        assert untrusted == [target]
    finally:
        await backend.stop()


def test_the_status_page_section_flags_an_untrusted_or_expiring_endpoint() -> None:
    book = BackendCertificates()
    book.record(served("10.0.0.1:443", NOW + 30 * DAY))
    assert section(book, NOW).state == "ok"
    book.record(served("10.0.0.2:443", NOW + 2 * DAY))
    assert section(book, NOW).state == "warn"
    book.record(served("10.0.0.3:443", NOW + 30 * DAY, verified=False))
    page = section(book, NOW)
    assert page.state == "bad"
    assert [row[1] for row in page.rows] == ["10.0.0.2:443", "10.0.0.1:443", "10.0.0.3:443"]
    assert page.rows[2][4] == "untrusted"


async def test_the_prober_handshakes_with_endpoints_no_request_used_lately() -> None:
    ca = LocalCA()
    backend = await TlsBackend(ca.issue(dns=["web.demo.svc"])).start()
    tls = UpstreamTLS(lambda: None, lambda: None, tcp_connect)
    tls.certificates.probe_after = dt.timedelta(0)  # every endpoint is due at once
    secure = route("secure.test", [("web", 100)], name="secure", tls=reencrypt(ca.pem))
    target = Target("127.0.0.1", backend.port, namespace="demo", service="web")
    prober = None
    try:
        assert await tls.probe(target, secure, 5.0) is True
        first = tls.certificates.get("demo/secure", f"127.0.0.1:{backend.port}")
        assert first is not None
        prober = asyncio.create_task(tls.probe_forever(interval=0.05))
        await until(
            lambda: (
                tls.certificates.get("demo/secure", f"127.0.0.1:{backend.port}").seen_at
                > first.seen_at
            ),
            "a probe",
        )
        # Nothing but handshakes: the backend never saw a request.
        assert backend.requests == []
        # A view without the route forgets the endpoint, its series and its probes.
        tls.keep_only([])
        assert len(tls.certificates) == 0
    finally:
        if prober is not None:
            prober.cancel()
            await asyncio.gather(prober, return_exceptions=True)
        await backend.stop()


def test_waygate_check_warns_days_before_and_fails_an_endpoint_out_of_rotation() -> None:
    book = BackendCertificates()
    book.record(served("10.0.0.1:443", NOW + 30 * DAY))
    book.record(served("10.0.0.2:443", NOW + 2 * DAY))
    book.record(served("10.0.0.3:443", NOW - DAY))
    # What /status.json carries (to_json, per service), as `waygate check` reads it.
    document = {"services": [{"service": "proxy", "sections": [section(book, NOW).to_json()]}]}
    findings = check_findings(json.loads(json.dumps(document, default=str)))
    assert [(level, title.split(":")[1].strip()) for level, title, _ in findings] == [
        ("failed", "backend 10.0.0.3"),
        ("warn", "backend 10.0.0.2"),
    ]
    assert findings[1][1].endswith("expires in 2d 0h")
    assert "expired" in findings[0][1]


def test_the_resolver_hears_endpoints_out_of_rotation_then_those_expiring_soon() -> None:
    from waygate.proxy.backendcerts import attention

    book = BackendCertificates()
    book.record(served("10.0.0.1:443", NOW + 30 * DAY))  # fine: not reported
    book.record(served("10.0.0.2:443", NOW + 2 * DAY))
    book.record(served("10.0.0.3:443", NOW + 30 * DAY, verified=False))
    book.record(served("10.0.0.4:443", NOW - DAY))
    states = attention(book, NOW)
    assert [(s.endpoint, s.verdict) for s in states] == [
        ("10.0.0.4:443", "Expired"),
        ("10.0.0.3:443", "Untrusted"),
        ("10.0.0.2:443", "ExpiringSoon"),
    ]
    assert {(s.namespace, s.route, s.names) for s in states} == {
        ("demo", "secure", ("web.demo.svc",))
    }
    assert all(s.problem() is None for s in states)  # what the resolver accepts
