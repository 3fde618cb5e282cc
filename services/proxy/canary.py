"""ingress-nginx's canary decided per request, sans-IO: the main backends or the canary's.

A route carrying `Route.canary` (a canary Ingress folded into its main Ingress's
route by the resolver) has the main backends first and the canary's after. Each
request goes to one side as ingress-nginx's balancer.lua
(`route_to_alternative_balancer`, controller v1.15) decides, in its order:

1. the route's sticky cookie names an endpoint of the main backends: main;
2. it names an endpoint of the canary's (not with affinity-canary-behavior
   legacy, where the canary sets no cookie): canary;
3. canary-by-header: with -value, that value exactly goes to the canary; with
   -pattern, a value the pattern is found in; else `always` canary, `never`
   main; any other value (or none) decides nothing;
4. canary-by-cookie: `always` canary, `never` main, anything else nothing;
5. canary-weight: a draw of 1..max(100, canary-weight-total) not above it.

`CanarySplit` is built once per routing table and route entry (`prepare`, the
decision rule's `applies`): the two sides are entries of their own sharing the
route's match, options and policies, so the endpoint pick, the sticky cookie
and everything after work on the chosen side unchanged. A route without a
canary pays nothing.
"""

from __future__ import annotations

import random

from waygate.core.regex import LinearPattern, compile_linear
from waygate.proxy.hashkey import HashKey
from waygate.proxy.http1 import RequestHead
from waygate.proxy.routing import Backend, RouteEntry

# What routing.RouteEntry.__init__ computes from the backends (the rest is copied).
_OWN = frozenset(("backends", "backend_picker", "single"))


def _side(entry: RouteEntry, backends: list[Backend]) -> RouteEntry:
    side = RouteEntry(
        entry.route, entry.path, entry.options, backends, [1] * len(backends), entry.policy
    )
    for name in RouteEntry.__slots__:
        if name not in _OWN:
            setattr(side, name, getattr(entry, name))
    return side


def _without_cookie(backend: Backend) -> Backend:
    """The backend as affinity-canary-behavior legacy has it: no sticky cookie."""
    copy = Backend.__new__(Backend)
    for name in Backend.__slots__:
        setattr(copy, name, getattr(backend, name))
    copy.cookies, copy.by_target, copy.set_cookie = {}, {}, {}
    return copy


class CanarySplit:
    """One route entry's two sides and the policy choosing between them."""

    __slots__ = (
        "canary",
        "canary_cookies",
        "cookie",
        "header",
        "header_value",
        "main",
        "main_cookies",
        "pattern",
        "total",
        "weight",
    )

    def __init__(self, entry: RouteEntry) -> None:
        policy = entry.route.canary
        assert policy is not None
        split = policy.main_backends
        main, canary = entry.backends[:split], entry.backends[split:]
        if policy.legacy_affinity:
            canary = [_without_cookie(b) for b in canary]
        self.main = _side(entry, main)
        self.canary = _side(entry, canary)
        self.main_cookies = frozenset(c for b in main for c in b.cookies)
        self.canary_cookies = frozenset(c for b in canary for c in b.cookies)
        self.header = HashKey("$http_" + policy.header) if policy.header else None
        self.header_value = policy.header_value.encode()
        self.pattern: LinearPattern | None = None
        if policy.header_pattern and not policy.header_value:
            # ngx.re.match: found anywhere in the value.
            self.pattern = compile_linear(f"(?s).*(?:{policy.header_pattern}).*")
        self.cookie = HashKey("$cookie_" + policy.cookie) if policy.cookie else None
        self.total = max(100, policy.weight_total)
        self.weight = policy.weight

    def to_canary(self, req: RequestHead, sticky: bytes | None) -> bool:
        """Whether the request goes to the canary (`sticky`: the route's sticky
        cookie as the client sent it, None without one)."""
        if sticky is not None:
            if sticky in self.main_cookies:
                return False
            if sticky in self.canary_cookies:
                return True
        header = self.header
        if header is not None:
            value = header.of(req)
            if value:
                if self.header_value:
                    if value == self.header_value:
                        return True
                elif self.pattern is not None:
                    if self.pattern.fullmatch(value.decode("latin-1")) is not None:
                        return True
                elif value == b"always":
                    return True
                elif value == b"never":
                    return False
        cookie = self.cookie
        if cookie is not None and req.cookie:
            value = cookie.of(req)
            if value == b"always":
                return True
            if value == b"never":
                return False
        return random.randint(1, self.total) <= self.weight

    def choose(self, req: RequestHead, sticky: bytes | None) -> RouteEntry:
        return self.canary if self.to_canary(req, sticky) else self.main

    def side_of(self, backend: Backend) -> RouteEntry:
        """The side a request picked on (the side's own backend; one of an earlier
        table by its service): a redispatch stays on it. (Main and canary may name
        one Service: service-upstream on one side only, another port.)"""
        if any(b is backend for b in self.canary.backends):
            return self.canary
        if any(b is backend for b in self.main.backends):
            return self.main
        services = {b.service for b in self.canary.backends}
        return self.canary if backend.service in services else self.main


def prepare(entry: RouteEntry) -> bool:
    """Whether the entry's route has a canary (its split built then, once per table)."""
    policy = entry.route.canary
    if policy is None or not 0 < policy.main_backends < len(entry.backends):
        return False
    entry.policies["canary"] = CanarySplit(entry)
    return True
