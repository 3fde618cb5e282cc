"""Backend certificates the proxies report, and the route condition they make.

Proxies record what each reencrypt and BackendTLSPolicy endpoint served at its
last handshake (`waygate.proxy.backendcerts`) and stream the ones that need
attention to every resolver replica (`ReportBackendCertificates`): expiring
within the proxy's warning window, or out of rotation (expired, not yet
valid, untrusted). `BackendCertificateReports` keeps each proxy's latest full
state and merges them into findings per route; the route status book turns a
route's findings into a `BackendCertificate` condition (`condition`), so
`waygate routes get`, `waygate check` and the Kubernetes status warn days
before a client would get a 502. ResolvedRefs is not touched: the references
resolve, the certificate is a separate matter.

Sans-IO: the clock is passed in; the server arms the lapse timer.

Invariants:
- bounded: at most `max_reporters` proxies, `MAX_STATES` states per report,
  `MAX_NAMES` names per state and short strings (the server refuses more);
- stale reports expire: a proxy's state lapses `ttl` seconds after the report
  that carried it (a stream that ends keeps it until then, so a restarting
  proxy does not make a true warning flap), and a proxy that reports again
  replaces its state whole;
- per (route, endpoint) the most recent report among the proxies wins;
- the condition's message says which endpoint, which names, and when, in
  absolute time, so it changes only when a finding changes.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from datetime import datetime

from waygate.resolver.model import FALSE, RouteCondition, RouteKey

BACKEND_CERTIFICATE = "BackendCertificate"
#: Verdicts, as reasons: in rotation, expiring within the proxy's warning window...
EXPIRING_SOON = "ExpiringSoon"
#: ...and out of rotation (the proxy sends no request there while another endpoint serves).
OUT_OF_ROTATION = ("Expired", "NotYetValid", "Untrusted")
VERDICTS = (EXPIRING_SOON, *OUT_OF_ROTATION)

MAX_STATES = 1000
MAX_NAMES = 16
MAX_NAME_CHARS = 253
MAX_ENDPOINT_CHARS = 300
#: A proxy reports at least every minute; its state lapses after five without a report.
DEFAULT_TTL = 300.0
DEFAULT_MAX_REPORTERS = 256
#: Endpoints named in one condition's message (the rest are counted).
SHOWN = 4


@dataclasses.dataclass(frozen=True, slots=True)
class BackendCertificateState:
    """One endpoint's certificate that needs attention, as a proxy saw it."""

    namespace: str
    route: str
    endpoint: str  # "ADDRESS:PORT"
    names: tuple[str, ...]
    not_before: datetime
    not_after: datetime
    verdict: str  # one of VERDICTS

    def problem(self) -> str | None:
        """Why a report carrying this state is refused; None when it is well-formed."""
        if not self.namespace or not self.route or not self.endpoint:
            return "namespace, route and endpoint are required"
        if len(self.endpoint) > MAX_ENDPOINT_CHARS or len(self.route) > MAX_NAME_CHARS:
            return f"endpoint and route: at most {MAX_ENDPOINT_CHARS} characters"
        if len(self.namespace) > MAX_NAME_CHARS:
            return f"namespace: at most {MAX_NAME_CHARS} characters"
        if len(self.names) > MAX_NAMES or any(len(n) > MAX_NAME_CHARS for n in self.names):
            return f"names: at most {MAX_NAMES}, each at most {MAX_NAME_CHARS} characters"
        if self.verdict not in VERDICTS:
            return f"verdict: one of {', '.join(VERDICTS)}"
        return None


class BackendCertificateReports:
    """Each proxy's latest report, merged into findings per route."""

    def __init__(
        self, *, ttl: float = DEFAULT_TTL, max_reporters: int = DEFAULT_MAX_REPORTERS
    ) -> None:
        self.ttl = ttl
        self.max_reporters = max_reporters
        # proxy -> (lapses at, its states)
        self._reports: dict[str, tuple[float, tuple[BackendCertificateState, ...]]] = {}
        # proxy -> when its report arrived (the newest wins per endpoint).
        self._arrived: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._reports)

    def report(self, proxy: str, states: Iterable[BackendCertificateState], now: float) -> bool:
        """Make `proxy`'s state exactly `states` until `now + ttl`. False: refused,
        `max_reporters` other proxies already hold a state."""
        if proxy not in self._reports and len(self._reports) >= self.max_reporters:
            self.expire(now)
            if len(self._reports) >= self.max_reporters:
                return False
        self._reports[proxy] = (now + self.ttl, tuple(states))
        self._arrived[proxy] = now
        return True

    def expire(self, now: float) -> bool:
        """Drop the states no report refreshed within `ttl`; whether any went."""
        lapsed = [proxy for proxy, (until, _) in self._reports.items() if until <= now]
        for proxy in lapsed:
            del self._reports[proxy]
            del self._arrived[proxy]
        return bool(lapsed)

    def next_lapse(self) -> float | None:
        """When the next state lapses (None: none held)."""
        return min((until for until, _ in self._reports.values()), default=None)

    def findings(self) -> dict[RouteKey, tuple[BackendCertificateState, ...]]:
        """Per route, its endpoints' states (the most recent report per endpoint),
        out of rotation first, then the soonest expiry."""
        newest: dict[tuple[str, str, str], tuple[float, BackendCertificateState]] = {}
        for proxy, (_, states) in self._reports.items():
            arrived = self._arrived[proxy]
            for state in states:
                key = (state.namespace, state.route, state.endpoint)
                seen = newest.get(key)
                if seen is None or seen[0] < arrived:
                    newest[key] = (arrived, state)
        by_route: dict[RouteKey, list[BackendCertificateState]] = {}
        for _, state in newest.values():
            by_route.setdefault((state.namespace, state.route), []).append(state)
        return {
            key: tuple(
                sorted(
                    states,
                    key=lambda s: (s.verdict == EXPIRING_SOON, s.not_after, s.endpoint),
                )
            )
            for key, states in by_route.items()
        }


def condition(states: tuple[BackendCertificateState, ...]) -> RouteCondition:
    """The BackendCertificate condition of a route with these findings (not empty):
    False, the reason the worst verdict (an endpoint out of rotation before one
    expiring soon), the message which endpoint, which names, and when."""
    worst = states[0]
    parts = [_sentence(state) for state in states[:SHOWN]]
    if len(states) > SHOWN:
        parts.append(f"and {len(states) - SHOWN} more endpoints")
    return RouteCondition(BACKEND_CERTIFICATE, FALSE, worst.verdict, "; ".join(parts))


def _sentence(state: BackendCertificateState) -> str:
    names = ", ".join(state.names[:4]) or "no names"
    if len(state.names) > 4:
        names += f" (+{len(state.names) - 4} more)"
    after = f"{state.not_after:%Y-%m-%dT%H:%M:%SZ}"
    if state.verdict == EXPIRING_SOON:
        return f"backend {state.endpoint} serves a certificate for {names} that expires at {after}"
    if state.verdict == "Expired":
        return (
            f"backend {state.endpoint} serves a certificate for {names} that expired at {after}; "
            "the proxy skips it while another endpoint serves"
        )
    if state.verdict == "NotYetValid":
        return (
            f"backend {state.endpoint} serves a certificate for {names} not valid before "
            f"{state.not_before:%Y-%m-%dT%H:%M:%SZ}; the proxy skips it while another "
            "endpoint serves"
        )
    return (
        f"backend {state.endpoint} serves a certificate for {names} that does not verify; "
        "the proxy skips it while another endpoint serves"
    )
