"""What each backend endpoint's TLS certificate says, before a client finds out.

For reencrypt and BackendTLSPolicy routes the proxy records, at every upstream
handshake (`waygate.proxy.upstream_tls`), the certificate the endpoint served:
expiry, issuer, names, and whether it verified. `BackendCertificates` keeps
the latest per (route, endpoint) and answers, without I/O:

- `usable(route, endpoint, now)`: False while its certificate is expired, not
  yet valid or untrusted, so the balancer can take it out of rotation while
  other endpoints are healthy (and back in once a handshake verifies again);
- `expiring(now, warn_before)`: the endpoints whose certificate expires within
  `warn_before` (default 7 days): route status (`BackendCertificate`
  condition), `waygate check` and the status page warn days before the 503;
- `due_probes(now)`: endpoints not handshaken within `probe_after`, at most
  `probes_per_tick` per call, oldest first: the prober's bounded rate.

`waygate_proxy_upstream_certificate_expiry_timestamp_seconds{route,endpoint}`
follows every record. Sans-IO: the clock is passed in; nothing here opens a
socket or sleeps.

Invariants:
- bounded: at most `max_entries` endpoints (the least recently handshaken go
  first, their series with them); `keep_only` forgets routes and endpoints no
  longer in the resolver's view;
- a record replaces the previous one for its endpoint whole: a backend that
  fixed its certificate is usable from its first good handshake.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import enum
from collections.abc import Iterable
from datetime import UTC, datetime, timedelta
from typing import Any

from cryptography import x509
from prometheus_client import Gauge

from waygate.core.statuspage import Section, expiry_cell
from waygate.resolver.client import BackendCertificateState

EXPIRY = Gauge(
    "waygate_proxy_upstream_certificate_expiry_timestamp_seconds",
    "When the certificate a backend endpoint served at its last handshake expires "
    "(Unix time), by route and endpoint (reencrypt and BackendTLSPolicy routes).",
    ["route", "endpoint"],
)

#: Warn this long before a backend's certificate expires.
WARN_BEFORE = timedelta(days=7)
#: An endpoint not handshaken for this long is probed.
PROBE_AFTER = timedelta(minutes=5)
PROBES_PER_TICK = 4
MAX_ENTRIES = 10_000


class Verdict(enum.Enum):
    OK = "ok"
    EXPIRED = "expired"
    NOT_YET_VALID = "not_yet_valid"
    UNTRUSTED = "untrusted"


@dataclasses.dataclass(frozen=True, slots=True)
class Served:
    """The certificate one endpoint served at its last handshake."""

    route: str
    endpoint: str
    not_before: datetime
    not_after: datetime
    issuer: str
    names: tuple[str, ...]
    #: The handshake verified it (chain and name); False: it was refused as untrusted.
    verified: bool
    seen_at: datetime

    def verdict(self, now: datetime) -> Verdict:
        if now >= self.not_after:
            return Verdict.EXPIRED
        if now < self.not_before:
            return Verdict.NOT_YET_VALID
        return Verdict.OK if self.verified else Verdict.UNTRUSTED


def served_from(
    route: str, endpoint: str, leaf: x509.Certificate, *, verified: bool, now: datetime
) -> Served:
    try:
        san = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        names = tuple(
            [*san.get_values_for_type(x509.DNSName)]
            + [*san.get_values_for_type(x509.UniformResourceIdentifier)]
            + [str(ip) for ip in san.get_values_for_type(x509.IPAddress)]
        )
    except (x509.ExtensionNotFound, ValueError):
        names = ()
    return Served(
        route=route,
        endpoint=endpoint,
        not_before=leaf.not_valid_before_utc,
        not_after=leaf.not_valid_after_utc,
        issuer=leaf.issuer.rfc4514_string()[:200],
        names=names[:16],
        verified=verified,
        seen_at=now,
    )


def sections(server: Any) -> list[Section]:
    """The status page's sections for a proxy server (none without reencrypt support)."""
    upstream_tls = getattr(server, "upstream_tls", None)
    if upstream_tls is None:
        return []
    return [section(upstream_tls.certificates, datetime.now(UTC))]


def section(book: BackendCertificates, now: datetime) -> Section:
    """The status page's table: every endpoint's certificate, the soonest expiry first."""
    soon = now + book.warn_before
    rows: list[list[Any]] = [
        [
            s.route,
            s.endpoint,
            ", ".join(s.names) or "-",
            s.issuer,
            EXPIRES_SOON
            if s.verdict(now) is Verdict.OK and s.not_after <= soon
            else s.verdict(now).value,
            expiry_cell(s.not_after, s.not_before, now=now),
        ]
        for s in sorted(book.snapshot(), key=lambda s: s.not_after)
    ]
    bad = any(s.verdict(now) is not Verdict.OK for s in book.snapshot())
    warn = bool(book.expiring(now))
    return Section(
        SECTION_TITLE,
        ["route", "endpoint", "names", "issuer", "verdict", "expires in"],
        rows,
        note="what each reencrypt endpoint served at its last handshake; an endpoint "
        f"expiring within {book.warn_before.days} days is a warning",
        state="bad" if bad else ("warn" if warn else "ok"),
        empty="no reencrypt handshake yet",
    )


SECTION_TITLE = "Backend certificates"
#: The verdict column of an endpoint in use whose certificate expires within the window.
EXPIRES_SOON = "expires soon"


#: The resolver's reasons (the BackendCertificate condition) for each verdict.
_REASONS = {
    Verdict.EXPIRED: "Expired",
    Verdict.NOT_YET_VALID: "NotYetValid",
    Verdict.UNTRUSTED: "Untrusted",
}
#: The most the proxy reports (the resolver refuses more than 1,000), the worst first.
MAX_REPORTED = 1000


def attention(book: BackendCertificates, now: datetime) -> tuple[BackendCertificateState, ...]:
    """What the resolver hears (ReportBackendCertificates, waygate.proxy.backendreport):
    every endpoint out of rotation, then every one expiring within the warning window,
    soonest first, at most MAX_REPORTED."""
    horizon = now + book.warn_before
    states = []
    for served in book.snapshot():
        verdict = served.verdict(now)
        if verdict is Verdict.OK and served.not_after > horizon:
            continue
        namespace, _, name = served.route.partition("/")
        states.append(
            BackendCertificateState(
                namespace=namespace,
                route=name,
                endpoint=served.endpoint[:300],
                names=tuple(n[:253] for n in served.names),
                not_before=served.not_before,
                not_after=served.not_after,
                verdict=_REASONS.get(verdict, "ExpiringSoon"),
            )
        )
    states.sort(key=lambda s: (s.verdict == "ExpiringSoon", s.not_after, s.route, s.endpoint))
    return tuple(states[:MAX_REPORTED])


def check_findings(document: dict[str, Any]) -> list[tuple[str, str, str]]:
    """What `waygate check` says of a proxy's status document (/status.json): a
    warning per endpoint whose certificate expires within the warning window, a
    failure per endpoint out of rotation (expired, not yet valid, untrusted)."""
    findings: list[tuple[str, str, str]] = []
    # A process's document holds its sections per service ({"services": [{"sections"}]}).
    sections_json = [*document.get("sections", [])]
    for service in document.get("services", []):
        sections_json += service.get("sections", []) if isinstance(service, dict) else []
    for section_json in sections_json:
        if section_json.get("title") != SECTION_TITLE:
            continue
        for row in section_json.get("rows", []):
            if len(row) < 6:
                continue
            route, endpoint, names, _issuer, verdict, expiry = row[:6]
            left = expiry.get("text", "") if isinstance(expiry, dict) else str(expiry)
            if verdict == EXPIRES_SOON:
                findings.append(
                    (
                        "warn",
                        f"route {route}: backend {endpoint} certificate for {names} expires "
                        f"in {left}",
                        "replace it before it expires: the proxy stops using it then",
                    )
                )
            elif verdict != Verdict.OK.value:
                findings.append(
                    (
                        "failed",
                        f"route {route}: backend {endpoint} serves a certificate that is "
                        f"{verdict.replace('_', ' ')} ({names})",
                        "the proxy sends no request there while another endpoint is "
                        "healthy; replace the backend's certificate",
                    )
                )
    return findings


class BackendCertificates:
    """The latest certificate each (route, endpoint) served, least recently seen first."""

    def __init__(
        self,
        *,
        warn_before: timedelta = WARN_BEFORE,
        probe_after: timedelta = PROBE_AFTER,
        probes_per_tick: int = PROBES_PER_TICK,
        max_entries: int = MAX_ENTRIES,
    ) -> None:
        self.warn_before = warn_before
        self.probe_after = probe_after
        self.probes_per_tick = probes_per_tick
        self.max_entries = max_entries
        self._served: collections.OrderedDict[tuple[str, str], Served] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._served)

    def record(self, served: Served) -> None:
        key = (served.route, served.endpoint)
        self._served.pop(key, None)
        self._served[key] = served
        EXPIRY.labels(served.route, served.endpoint).set(served.not_after.timestamp())
        while len(self._served) > self.max_entries:
            (route, endpoint), _ = self._served.popitem(last=False)
            self._forget_series(route, endpoint)

    def snapshot(self) -> list[Served]:
        return list(self._served.values())

    def get(self, route: str, endpoint: str) -> Served | None:
        return self._served.get((route, endpoint))

    def usable(self, route: str, endpoint: str, now: datetime) -> bool:
        """Not known to serve an expired, not yet valid or untrusted certificate."""
        served = self._served.get((route, endpoint))
        return served is None or served.verdict(now) is Verdict.OK

    def expiring(self, now: datetime) -> list[Served]:
        """Endpoints whose certificate expires within `warn_before` (or has), soonest first."""
        horizon = now + self.warn_before
        return sorted(
            (s for s in self._served.values() if s.not_after <= horizon),
            key=lambda s: s.not_after,
        )

    def due_probes(self, now: datetime) -> list[tuple[str, str]]:
        """At most `probes_per_tick` endpoints not handshaken within `probe_after`."""
        due: list[tuple[str, str]] = []
        for key, served in self._served.items():  # least recently seen first
            if now - served.seen_at < self.probe_after:
                break
            due.append(key)
            if len(due) >= self.probes_per_tick:
                break
        return due

    def keep_only(self, endpoints: Iterable[tuple[str, str]]) -> None:
        """Forget every (route, endpoint) not in `endpoints` (a new resolver view)."""
        keep = set(endpoints)
        for key in [k for k in self._served if k not in keep]:
            del self._served[key]
            self._forget_series(*key)

    @staticmethod
    def _forget_series(route: str, endpoint: str) -> None:
        with contextlib.suppress(KeyError):
            EXPIRY.remove(route, endpoint)
