"""ingress-nginx's limit-rps, limit-rpm, limit-connections and limit-allowlist, per
proxy replica (sans-IO: the caller passes the clock).

What ingress-nginx configures for those annotations (internal/ingress/annotations/
ratelimit, its nginx.tmpl): `limit_req zone=... burst=RATE*MULTIPLIER nodelay` per
rate (requests per second and per minute: both apply when both are set),
`limit_conn zone=... N`, keyed by the client address, addresses of the allow-list
not limited, and the ConfigMap's limit-req-status-code / limit-conn-status-code.

nginx's limit_req, reproduced exactly: a client's `excess` (requests above the
rate) drains at the rate; a request makes it `max(0, excess - rate*elapsed + 1)`
and is refused when that passes the burst (the excess is then left as it was); a
client never seen (or forgotten) is let through and starts at 0. With nodelay nothing is delayed: a
request is let through or refused at once. So a fresh client gets burst + 1 at
once, then the rate.

Invariants:
- Memory per route is bounded: at most MAX_CLIENTS buckets, the least recently
  used forgotten first (nginx's zone expires its LRU nodes the same way: a
  forgotten client starts afresh). Connection counts exist only while requests
  are in flight (each released exactly once by the driver: `Held`).
- Limiters outlive routing tables: the same route with the same limits finds its
  buckets again (`limiter_for`), at most MAX_LIMITERS of them kept.
"""

from __future__ import annotations

import ipaddress
from collections import OrderedDict

from waygate.resolver.client import RateLimit, Route

# Clients remembered per route (nginx's 5 MiB zone holds some 40,000 on 64-bit).
MAX_CLIENTS = 40_000
# Routes with limits remembered across routing tables.
MAX_LIMITERS = 4_096
# Allow-list answers cached per route.
MAX_ALLOW_CACHE = 4_096


class RequestRate:
    """One nginx limit_req zone with `burst` and `nodelay`: the excess per client."""

    __slots__ = ("buckets", "burst", "rate")

    def __init__(self, rate_per_second: float, burst: int) -> None:
        self.rate = rate_per_second
        # (A millionth of a request's slack: float time, where nginx counts whole ms.)
        self.burst = burst + 1e-6
        # client -> [excess, when it was last updated]; oldest use first.
        self.buckets: OrderedDict[bytes, list[float]] = OrderedDict()

    def admit(self, client: bytes, now: float) -> bool:
        buckets = self.buckets
        bucket = buckets.get(client)
        if bucket is None:
            if len(buckets) >= MAX_CLIENTS:
                buckets.popitem(last=False)
            buckets[client] = [0.0, now]
            return True
        buckets.move_to_end(client)
        excess = bucket[0] - self.rate * (now - bucket[1]) + 1.0
        if excess < 0.0:
            excess = 0.0
        elif excess > self.burst:
            return False
        bucket[0] = excess
        bucket[1] = now
        return True


class Limiter:
    """A route's limits: its request rates, its connection count, its allow-list."""

    def __init__(self, spec: RateLimit) -> None:
        self.spec = spec
        multiplier = max(spec.burst_multiplier, 1)
        self.rates: tuple[RequestRate, ...] = tuple(
            RequestRate(rate, int(limit * multiplier))
            for limit, rate in ((spec.rps, float(spec.rps)), (spec.rpm, spec.rpm / 60.0))
            if limit > 0
        )
        self.connections = spec.connections
        self.in_flight: dict[bytes, int] = {}
        self.allow = tuple(ipaddress.ip_network(item, strict=False) for item in spec.allow)
        self.allowed: dict[bytes, bool] = {}
        self.request_refusal = (spec.request_status or 503, "request rate limit exceeded")
        self.connection_refusal = (spec.connection_status or 503, "connection limit exceeded")

    def is_allowed(self, client: bytes) -> bool:
        """On the allow-list (cached per client, the cache bounded)."""
        known = self.allowed.get(client)
        if known is None:
            try:
                address = ipaddress.ip_address(client.decode("ascii"))
            except ValueError:
                known = False
            else:
                known = any(address in network for network in self.allow)
            if len(self.allowed) >= MAX_ALLOW_CACHE:
                self.allowed.clear()
            self.allowed[client] = known
        return known

    def admit(self, client: bytes, now: float) -> tuple[int, str] | Held | None:
        """(status, reason) when refused; else None, or the connection slot taken
        (`Held`: released once, when the request is done)."""
        if self.allow and self.is_allowed(client):
            return None
        for rate in self.rates:
            if not rate.admit(client, now):
                return self.request_refusal
        if not self.connections:
            return None
        in_flight = self.in_flight
        count = in_flight.get(client, 0)
        if count >= self.connections:
            return self.connection_refusal
        in_flight[client] = count + 1
        return Held(self, client)

    def release(self, client: bytes) -> None:
        in_flight = self.in_flight
        count = in_flight.get(client, 0) - 1
        if count > 0:
            in_flight[client] = count
        else:
            in_flight.pop(client, None)


class Held:
    """One request's connection slot; `release` gives it back (once)."""

    __slots__ = ("client", "limiter")

    def __init__(self, limiter: Limiter, client: bytes) -> None:
        self.limiter: Limiter | None = limiter
        self.client = client

    def release(self) -> None:
        limiter = self.limiter
        if limiter is not None:
            self.limiter = None
            limiter.release(self.client)


_by_value: OrderedDict[tuple[str, str, RateLimit], Limiter] = OrderedDict()
# The fast path: the spec object a table's routes carry -> its limiter.
_by_spec: dict[int, Limiter] = {}


def limiter_for(route: Route) -> Limiter:
    """The route's limiter: the same one for the same route and limits across tables."""
    spec = route.rate_limit
    assert spec is not None  # (the gate applies to limited routes only)
    limiter = _by_spec.get(id(spec))
    if limiter is not None and limiter.spec is spec:
        return limiter
    key = (route.namespace, route.name, spec)
    limiter = _by_value.get(key)
    if limiter is None:
        if len(_by_value) >= MAX_LIMITERS:
            _by_value.popitem(last=False)
        limiter = _by_value[key] = Limiter(spec)
    else:
        _by_value.move_to_end(key)
        limiter.spec = spec
    if len(_by_spec) >= MAX_LIMITERS:
        _by_spec.clear()
    _by_spec[id(spec)] = limiter
    return limiter


def is_limited(route: Route) -> bool:
    return route.rate_limit is not None
