"""The resolver's side of backend certificates: proxies' reports merged, bounded and
lapsing (waygate.resolver.backendcerts), and the BackendCertificate route condition
the store publishes from them (ResolvedRefs untouched)."""

from __future__ import annotations

import datetime as dt

from waygate.resolver.backendcerts import (
    BackendCertificateReports,
    BackendCertificateState,
    condition,
)
from waygate.resolver.model import Endpoint, EndpointPort, Route, RouteBackend, Service, ServicePort
from waygate.resolver.store import Store

NOW = dt.datetime(2026, 12, 7, 12, 0, tzinfo=dt.UTC)
DAY = dt.timedelta(days=1)


def state(endpoint: str, verdict: str = "ExpiringSoon", days: float = 3) -> BackendCertificateState:
    return BackendCertificateState(
        "demo", "secure", endpoint, ("web.demo.svc",), NOW - DAY, NOW + days * DAY, verdict
    )


def test_reports_merge_the_newest_per_endpoint_and_lapse_after_the_ttl() -> None:
    reports = BackendCertificateReports(ttl=10.0, max_reporters=2)
    assert reports.report("proxy-a", [state("10.0.0.1:443", days=3)], now=0.0)
    assert reports.report("proxy-b", [state("10.0.0.1:443", "Expired", days=-1)], now=1.0)
    found = reports.findings()[("demo", "secure")]
    assert [s.verdict for s in found] == ["Expired"]  # b's report is the newer
    # A third proxy is refused while two hold a state...
    assert not reports.report("proxy-c", [], now=2.0)
    # ...a proxy reporting again replaces its own state whole (a fixed endpoint goes)...
    assert reports.report("proxy-b", [], now=3.0)
    assert [s.verdict for s in reports.findings()[("demo", "secure")]] == ["ExpiringSoon"]
    # ...and a state nothing refreshed within the TTL lapses.
    assert reports.next_lapse() == 10.0
    assert reports.expire(10.0)
    assert reports.findings() == {}
    assert reports.report("proxy-c", [], now=11.0)  # room again


def test_a_malformed_state_says_what_is_wrong() -> None:
    assert state("10.0.0.1:443").problem() is None
    assert "verdict" in (state("10.0.0.1:443", "Fine").problem() or "")
    long = BackendCertificateState("demo", "secure", "x" * 400, (), NOW, NOW, "Expired")
    assert "endpoint" in (long.problem() or "")


def test_the_condition_names_the_endpoint_the_names_and_when_worst_first() -> None:
    reports = BackendCertificateReports()
    reports.report(
        "p", [state("10.0.0.1:443", days=3), state("10.0.0.2:443", "Untrusted", days=90)], 0.0
    )
    made = condition(reports.findings()[("demo", "secure")])
    assert (made.type, made.status, made.reason) == ("BackendCertificate", "False", "Untrusted")
    assert made.message.startswith("backend 10.0.0.2:443 serves a certificate for web.demo.svc")
    assert (
        "backend 10.0.0.1:443 serves a certificate for web.demo.svc that expires at "
        "2026-12-10T12:00:00Z" in made.message
    )


def store_with_route() -> Store:
    store = Store(clock=lambda: NOW)
    store.upsert_service(
        Service("demo", "web", ports=(ServicePort("https", 443, "8443"),)), source="file"
    )
    store.set_endpoints(
        "demo",
        "web",
        [Endpoint("demo", "web", "10.0.0.1", (EndpointPort("https", 8443),))],
        source="file",
    )
    store.upsert_route(
        Route("demo", "secure", "secure.test", backends=(RouteBackend("web", 100),)),
        source="file",
    )
    return store


def test_the_store_publishes_the_condition_and_resolved_refs_stays_true() -> None:
    store = store_with_route()
    before = store.version
    reports = BackendCertificateReports()
    reports.report("p", [state("10.0.0.1:8443")], 0.0)
    store.set_backend_certificates(reports.findings())
    assert store.version == before + 1  # one version, the route with its new status
    route = store.get_route("demo", "secure")
    assert route is not None and route.status is not None
    assert route.status.condition("ResolvedRefs").status == "True"
    found = route.status.condition("BackendCertificate")
    assert found is not None and found.reason == "ExpiringSoon"
    assert "10.0.0.1:8443" in found.message and "2026-12-10T12:00:00Z" in found.message
    # The same findings again change nothing (no version, no Watch event).
    store.set_backend_certificates(reports.findings())
    assert store.version == before + 1
    # Lapsed (or fixed): the condition goes.
    store.set_backend_certificates({})
    route = store.get_route("demo", "secure")
    assert route is not None and route.status is not None
    assert route.status.condition("BackendCertificate") is None
    assert store.version == before + 2
