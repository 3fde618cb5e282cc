"""Every per-request rule of the proxy, decided once for HTTP/1.1 and HTTP/2 alike (sans-IO).

`decide(view, req, facts, now)` takes a request head (an HTTP/1.1 one, or the
one an HTTP/2 stream means: `http2.request_head`), the facts of the client's
connection (`ConnectionFacts`: the HTTP/1.1 connection or the HTTP/2
connection carrying the stream) and the clock, and returns one of:

- `Answer`: the proxy answers itself: health, `OPTIONS *`, the edge's redirect
  to HTTPS (302) or refusal (503), an HTTPRoute RequestRedirect, a missing
  or refused client certificate (401/403), no route (404 on a Gateway
  listener's side, else 503), an invalid backendRef (500), no endpoint
  ready (503, unless an ingress-nginx default-backend takes the request), an
  ingress-nginx CORS preflight (204), a body over proxy-body-size (413). It carries the status, the reason (the error page's and
  X-Waygate-Error's), the kind (the refusal's metric label, or one of the
  ANSWER_* renderings) and the route's name ("" when no route matched);
- `Forward`: the request goes to a backend: the route entry, the chosen
  backend and endpoint (its in-flight count taken when `counted`: the
  driver releases it with `release_pick`), whether the backend speaks HTTP/2
  (the backend decides the upstream protocol, never the client), the
  upstream head (HTTP/1.1 bytes; the HTTP/2 upstream turns them into fields),
  the response's extras (HSTS, the sticky cookie, a ResponseHeaderModifier),
  the deadline (the route's server timeout, or a shorter `grpc-timeout`), the
  trace decision (the span, and the traceparent the backend and the tunnel's
  dial get) and the RequestMirror copies to send.

Both client protocols and both upstream protocols call it; the drivers
(`exchange`, `h2exchange`, `h2upstream`) only move bytes, timers and
connections. It makes no syscalls, creates no tasks and imports no asyncio.

Adding a rule: a route-level rule is a `Rule` in `GATES` (before the endpoint
is picked: it may answer) or `SHAPERS` (after: it shapes the forwarded
request or its answer), with `applies(route_entry)` deciding once per
routing table whether the route needs it at all (`rules_of`), so a route
without the feature pays nothing per request. A rule whose `applies` prepares a
policy may `bind` it instead of `run`: the entry's runner (e.g. the policy's bound
method) is made once per entry and called directly per request. Each rule is tested once for
every pair of client and upstream protocol (tests/unit/proxy/test_decision.py,
tests/integration/proxy/test_request_core.py).
"""

from __future__ import annotations

import random
import re
import time
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple, Protocol

from waygate.proxy import (
    access,
    bodylimit,
    canary,
    captures,
    clientcert,
    cors,
    extauth,
    filters,
    hashkey,
    http1,
    http10,
    mirror,
    nextupstream,
    ratelimit,
    records,
    responserewrite,
    tls,
)
from waygate.proxy.http1 import ForwardedContext, RequestHead
from waygate.proxy.routing import (
    TRACE_OFF,
    Backend,
    PassiveHealth,
    RouteEntry,
    RouteOptions,
    RouteTable,
    Side,
    Target,
    unavailable_reason,
)
from waygate.proxy.throttle import ResponseThrottle
from waygate.resolver.client import HeaderModifier

_new = object.__new__
_TRACEPARENT = re.compile(rb"00-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}")

# How an Answer is rendered (Answer.kind); any other kind is a refusal's
# metric label, rendered as the error page (or a gRPC status) with its reason.
ANSWER_HEALTHZ = "healthz"
ANSWER_OPTIONS = "options"  # OPTIONS *: the proxy answers for itself
ANSWER_REDIRECT = "redirect"  # the edge's redirect to HTTPS (TLS insecureEdgePolicy)
ANSWER_ROUTE_REDIRECT = "route_redirect"  # an HTTPRoute RequestRedirect: reason = Location
# A whole HTTP/1.1 response the rule built (a CORS preflight): reason = its bytes (latin-1).
ANSWER_RESPONSE = "response"


class View(Protocol):
    """What `decide` reads of the proxy's view (`waygate.proxy.view.ProxyView`)."""

    table: RouteTable
    whole_hosts: Mapping[Side, Mapping[bytes, RouteEntry]]
    health: PassiveHealth
    trace_ratio: float


class ConnectionFacts(Protocol):
    """What `decide` knows of the client's connection (an HTTP/1.1 connection, or the
    HTTP/2 connection a stream is on)."""

    client_key: bytes
    secure: Side

    @property
    def context(self) -> ForwardedContext | None:
        """Where the client came in (None only before the connection is made)."""

    def client_identity(self, route: Any) -> tuple[int, str] | bytes:
        """An auth-proxy route's identity header lines for the client certificate,
        or (status, reason) when it is missing or refused."""


class Answer(NamedTuple):
    """The proxy answers the request itself."""

    status: int
    reason: str
    kind: str
    # The matched route's "namespace/name" ("" when none matched: unrouted).
    route: str = ""
    # Whether it counts among the proxy's refusals (waygate_proxy_refused_total).
    refused: bool = True


HEALTHZ = Answer(200, "ok", ANSWER_HEALTHZ, refused=False)
OPTIONS_ANY = Answer(200, "", ANSWER_OPTIONS, refused=False)


class Forward:
    """The request goes upstream: everything the drivers need, decided once.

    Slotted, every field set by `decide` (made without an __init__ call: a
    Python frame less per request): a slot is read at the cost of a local,
    where a class-level default read through an instance is a dictionary miss
    and a type lookup on every read (CPython 3.11). `__dict__` is kept for a
    rule's own fields (declared as class attributes with their default)."""

    __slots__ = (
        "__dict__",
        "auth",
        "authority",
        "backend",
        "buffer_body",
        "cookie",
        "cors",
        "counted",
        "deadline",
        "entry",
        "extra",
        "held",
        "hsts",
        "http2",
        "identity",
        "mirrors",
        "path",
        "req",
        "response_modifier",
        "rewritten_target",
        "span",
        "target",
        "traceparent",
        "upstream_head",
        "upstream_scope",
    )

    # Whether the endpoint's in-flight count was taken (release_pick gives it back).
    counted: bool
    http2: bool  # the backend speaks HTTP/2
    cookie: bytes | None  # the client's sticky cookie
    hsts: bytes  # the Strict-Transport-Security line (HTTPS only)
    # The header lines an HTTP/1.1 answer gets (`response_extra` for the chosen
    # endpoint: the sticky cookie's Set-Cookie, HSTS), set with the pick.
    extra: bytes
    identity: bytes  # auth-proxy identity lines from the client certificate
    # A ResponseHeaderModifier, or a prepared one (a CORS answer: filters.SetFields).
    response_modifier: HeaderModifier | filters.SetFields | None
    authority: bytes | None  # a rewritten host (None: the request's)
    upstream_head: bytes
    # What the upstream connection must be beyond its endpoint (`routing.upstream_scope`:
    # None plain, else the TLS it opens): the route entry's, but plain for a plain
    # client's request on a route whose scheme follows the client's (AUTO_HTTP). The
    # drivers open, pool and reuse connections by it.
    upstream_scope: Any
    span: Any
    # The traceparent the tunnel's dial continues (None: not sampled here).
    traceparent: str | None
    # When a grpc-timeout shorter than the route's server timeout ends the wait for
    # the answer (0.0: no such deadline; the server timeout applies).
    deadline: float
    mirrors: list[tuple[Target, bytes]] | None
    # The body is taken in whole before an upstream is used (bodybuffer): the
    # route's requestBuffering, for a request with a body, not gRPC.
    buffer_body: bool
    # A limit-connections slot the request holds (release_pick gives it back).
    # (A slot, not a class default: the drivers read it for every request.)
    held: ratelimit.Held | None
    # ingress-nginx auth-url: the driver asks the auth service first (authcheck).
    auth: extauth.AuthPlan | None
    # The CORS headers of the route's answer to this origin ((name, value) pairs): the
    # proxy's own 401s and the auth service's refusals carry them too. (A slot: set on
    # every CORS request, where a class default would make the instance a dict.)
    cors: Any
    # proxy-body-size for a body counted as it streams (0: none to count; bodylimit).
    body_limit = 0
    # upstream-hash-by's key (None: the client address, the source policy's own).
    hash_key: bytes | None = None
    # Sent to ingress-nginx's error backend (errorpages): never redispatched to the route's.
    error_request = False
    # ingress-nginx limit-rate: the response's pacing (waygate.proxy.throttle).
    throttle: ResponseThrottle | None = None
    # ingress-nginx proxy-next-upstream http_*/invalid_header (waygate.proxy.nextupstream)
    # and the upstreams tried so far for it.
    next_upstream: nextupstream.NextUpstream | None = None
    tries = 1
    body_copy: bytes | None = None  # the buffered body kept for a resend (nextupstream)
    # ingress-nginx mirror-target of a request with a buffered body: (target, head),
    # sent with the body once it is all in (waygate.proxy.mirror.send_with_body).
    body_mirror: tuple[Any, bytes] | None = None
    # ingress-nginx proxy-http-version 1.0 to an HTTP/1.1 backend (waygate.proxy.http10).
    http10 = False
    target: Target
    backend: Backend
    entry: RouteEntry
    # The request as the backend gets it (after a route's rewrite; but see
    # rewritten_target: `upstream_request()` is the whole of it).
    req: RequestHead
    # A rewritten target (a route's URLRewrite that changes only the target) held
    # apart from `req`, which stays the client's head: no copy of it is made for the
    # upstream head (http1.build_upstream_head takes the target). None: req's own.
    rewritten_target: bytes | None
    path: bytes  # the request's path (routing's; no query)

    def upstream_request(self) -> RequestHead:
        """The request as the backend gets it, as a head (a rewritten target held
        apart is made a head of its own here, for a rule that reads or changes it)."""
        target = self.rewritten_target
        if target is not None:
            out = self.req.copy()
            out.target = target
            self.req = out
            self.rewritten_target = None
        return self.req

    def set_cookie_line(self, target: Target) -> bytes:
        """The sticky cookie's Set-Cookie line for `target` when the client does not
        hold it yet (b"": none)."""
        backend = self.backend
        if backend.set_cookie and self.cookie != backend.by_target.get(target):
            return backend.set_cookie.get(target, b"")
        return b""

    def response_extra(self, target: Target) -> bytes:
        """Header lines the proxy adds to the response from `target`: Set-Cookie, HSTS
        (kept in `extra` for the chosen endpoint)."""
        backend = self.backend
        if backend.set_cookie and self.cookie != backend.by_target.get(target):
            return backend.set_cookie.get(target, b"") + self.hsts
        return self.hsts


def release_pick(forward: Forward) -> None:
    """Give back the in-flight count `decide` (or `repick`) took on the endpoint."""
    if forward.counted:
        forward.counted = False
        forward.backend.picker.release(forward.target)
    if forward.held is not None:
        forward.held.release()


# Connects tried per request: the first and two redispatches.
MAX_CONNECT_ATTEMPTS = 3


def may_redispatch(retryable: bool, kind: str, attempts: int, route: Any = None) -> bool:
    """Whether a failed connect (`upstream.ConnectError`'s retryable and kind) after
    `attempts` connects may go to another endpoint: nothing was sent; a refused or
    unreachable endpoint, or one whose certificate failed verification (another
    endpoint may hold a good one), while attempts are left. A route with
    ingress-nginx's proxy-next-upstream says which (`error`: the connect failed,
    `timeout`: it timed out; `off`: neither) and how many connects (-tries)."""
    if not (retryable or kind[:4] == "tls_"):
        return False
    if route is None or not (route.next_upstream or route.next_upstream_tries):
        return attempts < MAX_CONNECT_ATTEMPTS
    if route.next_upstream:
        wanted = "timeout" if kind == "timeout" else "error"
        if wanted not in route.next_upstream.split():
            return False
    return attempts < (route.next_upstream_tries or MAX_CONNECT_ATTEMPTS)


def repick(view: View, forward: Forward, facts: ConnectionFacts, failed: Target) -> bool:
    """Another endpoint after a connect to `failed` failed (redispatch): from the
    current table's entry (an endpoint removed meanwhile is not picked). True when
    one was taken (the old count given back, the new one taken)."""
    if forward.error_request:
        return False
    req = forward.req
    current = view.table.lookup(req.host, forward.path, req, facts.secure)
    entry = current if current is not None else forward.entry
    split = entry.policies.get("canary") if rules_of(entry) else None
    if split is not None:  # a canary's route: the same side again
        entry = split.side_of(forward.backend)
    key = facts.client_key if forward.hash_key is None else forward.hash_key
    target, backend = entry.pick(key, None, view.health, failed)
    if target is None or backend is None or backend.invalid or backend.http2 != forward.http2:
        return False
    if forward.counted:  # the old endpoint's count given back (the request goes on)
        forward.backend.picker.release(forward.target)
    forward.target = target
    forward.backend = backend
    backend.picker.acquire(target)
    forward.counted = True
    forward.extra = forward.response_extra(target)
    return True


# ---------------------------------------------------------------- rules


# (forward, req, facts) -> an Answer, or None to go on.
Runner = Callable[[Forward, RequestHead, ConnectionFacts], Answer | None]


class Rule(NamedTuple):
    """One route-level rule: `applies` is asked once per routing table and route."""

    name: str
    applies: Callable[[RouteEntry], bool]
    # Run per request. Gates run before the endpoint pick, shapers after it
    # (forward.target is set).
    run: Runner | None
    # Or: the entry's runner, made once per entry (`rules_of`) from what `applies`
    # prepared, e.g. a policy's bound method: called directly, one call per request.
    bind: Callable[[RouteEntry], Runner] | None = None

    def runner(self, entry: RouteEntry) -> Runner:
        return self.bind(entry) if self.bind is not None else self.run  # type: ignore[return-value]


def _edge_tls(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """A TLS route: HSTS and the client certificate on HTTPS; on plain HTTP its
    insecureEdgePolicy (Allow, Redirect: 302 to HTTPS, else refused)."""
    entry = forward.entry
    route = entry.route
    if facts.secure:
        forward.hsts = entry.hsts
        assert route.tls is not None  # (the rule applies to TLS routes only)
        if route.tls.client_ca_certificate:
            checked = facts.client_identity(route)
            if isinstance(checked, tuple):
                return Answer(checked[0], checked[1], "client_certificate", entry.options.name)
            forward.identity = checked
        return None
    rule = tls.edge_rule(route)
    if rule == tls.EDGE_ALLOW:
        return None
    if rule == tls.EDGE_REDIRECT:
        return Answer(302, "", ANSWER_REDIRECT, entry.options.name, refused=False)
    name = entry.options.name
    return Answer(503, "route " + name + " is served on HTTPS only", "https_only", name)


def _client_certificate(
    forward: Forward, req: RequestHead, facts: ConnectionFacts
) -> Answer | None:
    """ingress-nginx auth-tls-*: the connection's certificate (`clientcert`: 400, 421,
    403, or a 302 to the error page; else the ssl-client-* lines for the backend)."""
    route = forward.entry.route
    checked = facts.client_identity(route) if facts.secure else clientcert.on_plain_http(route)
    if isinstance(checked, tuple):
        status, reason = checked
        name = forward.entry.options.name
        if status == 302:
            return Answer(302, reason, ANSWER_ROUTE_REDIRECT, name, refused=False)
        return Answer(status, reason, clientcert.KIND, name)
    forward.identity = checked
    return None


def _route_redirect(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """An HTTPRoute RequestRedirect: answered here, the backend never asked."""
    entry = forward.entry
    assert entry.route.filters is not None and entry.route.filters.redirect is not None
    redirect = entry.route.filters.redirect
    location = filters.redirect_location(
        req, redirect, entry.path, secure=facts.secure, listener_port=entry.route.listener_port
    )
    return Answer(
        redirect.status,
        location.decode("latin-1"),
        ANSWER_ROUTE_REDIRECT,
        entry.options.name,
        refused=False,
    )


def _literal_redirect(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """ingress-nginx's permanent-redirect / temporal-redirect, nginx's `return CODE URL`:
    the target exactly as written, never the request's path or query (a path made
    absolute as nginx's absolute_redirect); a status that is not a redirect answers
    the target as its body (`filters.text_response`)."""
    entry = forward.entry
    route = entry.route
    assert route.filters is not None and route.filters.redirect is not None
    status = route.filters.redirect.status
    location = route.redirect_location
    if status not in filters.REDIRECT_STATUSES:
        # nginx's `return 300 TEXT` (300, 304, 305, 306): the text is the body.
        response = filters.text_response(status, location.encode("latin-1"), req.method == b"HEAD")
        return Answer(
            status, response.decode("latin-1"), ANSWER_RESPONSE, entry.options.name, refused=False
        )
    if location.startswith("/"):  # nginx's absolute_redirect: the request's scheme and host
        origin = responserewrite.origin(req, bool(facts.secure), route.port_in_redirects)
        location = origin.decode("latin-1") + location
    return Answer(status, location, ANSWER_ROUTE_REDIRECT, entry.options.name, refused=False)


def _route_redirect_bound(entry: RouteEntry) -> Runner:
    return _literal_redirect if entry.route.redirect_location else _route_redirect


def _http10_upgrade(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """proxy-http-version 1.0: HTTP/1.0 has no upgrade (waygate.proxy.http10)."""
    if req.upgrade:
        return Answer(
            502, http10.upgrade_refused(req.upgrade), http10.KIND, forward.entry.options.name
        )
    return None


def _request_filters_bound(entry: RouteEntry) -> Runner:
    """HTTPRoute filters: a URLRewrite or RequestHeaderModifier is the entry's
    filters.PathRewrite (its `shape` bound); without them, the ResponseHeaderModifier
    (filters.remembered, once per entry) is kept for the answer."""
    rewrite = entry.policies["rewrite"]  # (prepared by _has_filters)
    if rewrite is None:
        modifier = entry.policies["response_headers"]

        def keep_response_headers(
            forward: Forward, req: RequestHead, facts: ConnectionFacts
        ) -> Answer | None:
            if forward.response_modifier is None:  # (a CORS answer holds the route's own)
                forward.response_modifier = modifier
            return None

        return keep_response_headers
    if rewrite.slash_prefix:
        return rewrite.shape_slash_prefix  # type: ignore[no-any-return]
    return rewrite.shape  # type: ignore[no-any-return]


def _access_bound(entry: RouteEntry) -> Runner:
    """ingress-nginx's access annotations (waygate.proxy.access: 403, 401, 503), bound
    to the entry's compiled check: a keep-alive connection's next request on an
    address-only check reads the verdict its connection keeps (ForwardedContext
    .access_check: the client address is the connection's), without a call."""
    check = entry.access
    assert check is not None  # (compiled by access.prepare)
    name = entry.options.name
    decide_access = check.decide
    address_only = check.address_only

    def gate(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
        context = facts.context
        assert context is not None
        if context.access_check is check:
            refused = context.access_verdict
        else:
            refused = decide_access(req, context.client_ip)
            if address_only:
                context.access_check = check
                context.access_verdict = refused
        if refused is None:
            return None
        if refused[2] is access.KIND_UNAUTHORIZED:  # the 401's header lines (CORS's too)
            refused = (401, access.challenge_lines(refused[1], forward.cors), refused[2])
        return Answer(*refused, name)

    return gate


def _rate_limit(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """ingress-nginx limit-rps/-rpm/-connections per client address (`ratelimit`)."""
    limiter = ratelimit.limiter_for(forward.entry.route)
    admitted = limiter.admit(facts.client_key, time.monotonic())
    if admitted is None:
        return None
    if isinstance(admitted, tuple):
        return Answer(admitted[0], admitted[1], "rate_limited", forward.entry.options.name)
    forward.held = admitted
    return None


def _external_auth(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """ingress-nginx auth-url: every request of the route, whatever its path, is
    marked "authorize first"; the driver sends the subrequest (`authcheck`)."""
    route = forward.entry.route
    spec = route.external_auth
    assert spec is not None
    forward.auth = extauth.plan_for(spec, route.client_address_header)
    return None


def _has_filters(entry: RouteEntry) -> bool:
    route_filters = entry.route.filters
    if route_filters is None:
        return False
    response_headers = entry.policies["response_headers"] = filters.remembered(
        route_filters.response_headers
    )
    entry.policies["rewrite"] = (
        filters.PathRewrite(
            route_filters.rewrite,
            route_filters.request_headers,
            entry.path,
            response_headers,
        )
        if route_filters.rewrite is not None or route_filters.request_headers is not None
        else None
    )
    return True


def _has_cors(entry: RouteEntry) -> bool:
    if entry.route.cors is None:
        return False
    route_filters = entry.route.filters
    base = route_filters.response_headers if route_filters is not None else None
    name = entry.options.name

    def preflight(answer: cors.CorsAnswer) -> Answer:
        return Answer(204, answer.preflight, ANSWER_RESPONSE, name, refused=False)

    entry.policies["cors"] = cors.CorsPolicy(entry.route.cors, base, preflight)
    return True


def _cors_bound(entry: RouteEntry) -> Runner:
    """ingress-nginx CORS (cors.CorsPolicy.gate): an allowed OPTIONS is a preflight
    answered here (204); any other allowed request gets the origin's prepared
    response lines."""
    return entry.policies["cors"].gate  # type: ignore[no-any-return]


def _body_size(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """proxy-body-size: a larger Content-Length is 413 here; a body without one is
    counted as it streams (the drivers check `forward.body_limit`)."""
    limit = forward.entry.route.max_request_body
    if req.content_length > limit:
        name = forward.entry.options.name
        return Answer(413, bodylimit.reason(limit), bodylimit.KIND, name)
    if req.chunked:
        forward.body_limit = limit
    return None


def _capture_rewrite(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """ingress-nginx rewrite-target with capture groups: the path from the route's
    regex match (after the route's header filters, which keep the path)."""
    entry = forward.entry
    assert entry.regex is not None
    upstream = forward.upstream_request()
    out = captures.rewritten(upstream, entry.regex, entry.route.rewrite_target, forward.path)
    if out is not None:
        forward.req = out
    return None


def _has_hash_by(entry: RouteEntry) -> bool:
    if not entry.route.hash_by:
        return False
    entry.policies["hash_by"] = hashkey.HashKey(entry.route.hash_by)
    return True


def _hash_by(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """upstream-hash-by: the nginx variable's value is the endpoint's hash key."""
    forward.hash_key = forward.entry.policies["hash_by"].of(req)
    return None


def _canary(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """ingress-nginx canary: the request goes on with the main or the canary side of
    its route (`waygate.proxy.canary`); the endpoint is picked from that side."""
    entry = forward.entry
    sticky = _sticky_cookie(req, entry) if req.cookie else None
    forward.entry = entry.policies["canary"].choose(req, sticky)
    return None


def _has_url_mirror(entry: RouteEntry) -> bool:
    spec = entry.route.url_mirror
    if spec is None:
        return False
    entry.policies["url_mirror"] = mirror.UrlMirror(spec.target, spec.host, spec.request_body)
    return True


def _url_mirror(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """ingress-nginx mirror-target: a copy of the request as the backend gets it, to
    the URL (`waygate.proxy.mirror`: fire and forget, bounded)."""
    policy = forward.entry.policies["url_mirror"]
    assert facts.context is not None
    head = policy.head(
        forward.upstream_request(), facts.context, forward.entry.options.forwarded_mode
    )
    if head is None:
        return None
    if req.has_body and policy.request_body:
        if forward.buffer_body:  # (set by decide after the gates, before the shapers)
            forward.body_mirror = (policy.target, head)
    else:
        forward.mirrors = [(policy.target, head)]
    return None


def _has_next_upstream(entry: RouteEntry) -> bool:
    policy = nextupstream.policy_of(entry.route, MAX_CONNECT_ATTEMPTS, repick)
    if policy is None:
        return False
    entry.policies["next_upstream"] = policy
    return True


def _next_upstream(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """proxy-next-upstream http_*/invalid_header: the drivers may send the request on."""
    forward.next_upstream = forward.entry.policies["next_upstream"]
    return None


def _scheme_from_client(
    forward: Forward, req: RequestHead, facts: ConnectionFacts
) -> Answer | None:
    """ingress-nginx backend-protocol AUTO_HTTP (nginx's `$scheme://`): the backend is
    reached over TLS only when the client came over TLS; a plain client's request
    goes in plain HTTP (a connection of its own in the pool: `upstream_scope`)."""
    if not facts.secure:
        forward.upstream_scope = None
    return None


def _digest_info(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """The good digest answer's Authentication-Info on the response (the route's
    AccessCheck set it in this same synchronous pass; the route's filters and CORS
    made the modifier it is added to)."""
    check = forward.entry.access
    assert check is not None  # (access.has_digest)
    if check.info:
        line = (("Authentication-Info", check.info),)
        forward.response_modifier = filters.with_added(forward.response_modifier, line)
        check.info = ""
    return None


def _limit_rate(forward: Forward, req: RequestHead, facts: ConnectionFacts) -> Answer | None:
    """ingress-nginx limit-rate/-after: the response is paced (`waygate.proxy.throttle`)."""
    route = forward.entry.route
    forward.throttle = ResponseThrottle(route.limit_rate, route.limit_rate_after)
    return None


GATES: tuple[Rule, ...] = (
    Rule("edge_tls", lambda entry: entry.route.tls is not None, _edge_tls),
    # nginx decides the certificate before any phase, auth-tls-match-cn in the
    # server's rewrite phase: before the location's redirects.
    Rule("client_certificate", clientcert.applies, _client_certificate),
    Rule("body_size", lambda entry: entry.route.max_request_body > 0, _body_size),
    Rule(
        "route_redirect",
        lambda entry: entry.route.filters is not None and entry.route.filters.redirect is not None,
        None,
        _route_redirect_bound,
    ),
    # The CORS preflight is answered in nginx's rewrite phase (ingress-nginx's cors
    # template returns 204 there), before the limits and the access checks: a browser
    # sends no credentials with a preflight.
    Rule("cors", _has_cors, None, _cors_bound),
    Rule("rate_limit", lambda entry: entry.route.rate_limit is not None, _rate_limit),
    # After the redirects (nginx's rewrite phase comes before its access phase).
    Rule("access", access.prepare, None, _access_bound),
    Rule("external_auth", lambda entry: entry.route.external_auth is not None, _external_auth),
    Rule("http10_upgrade", http10.applies, _http10_upgrade),
    Rule("hash_by", _has_hash_by, _hash_by),
    # Last: ingress-nginx's balancer decides the canary after every access check.
    Rule("canary", canary.prepare, _canary),
)
SHAPERS: tuple[Rule, ...] = (
    # First: it decides whether the body is buffered (url_mirror reads that).
    Rule("http10", http10.applies, http10.shape),
    Rule(
        "scheme_from_client",
        lambda entry: entry.route.upstream_scheme_from_client,
        _scheme_from_client,
    ),
    Rule("request_filters", _has_filters, None, _request_filters_bound),
    Rule(
        "capture_rewrite",
        lambda entry: bool(entry.route.rewrite_target) and entry.regex is not None,
        _capture_rewrite,
    ),
    Rule("digest_info", access.has_digest, _digest_info),
    # After the filters and the rewrite (their copy is the one changed).
    Rule("forwarded_client", access.reads_header, access.forwarded_client),
    Rule("limit_rate", lambda entry: entry.route.limit_rate > 0, _limit_rate),
    Rule("next_upstream", _has_next_upstream, _next_upstream),
    # After the request filters and the rewrite: the copy is the request as sent.
    Rule("url_mirror", _has_url_mirror, _url_mirror),
    # ingress-nginx's response-side annotations, after the modifiers above (the route's
    # own and a CORS answer's, set by the cors gate).
    Rule("responses", responserewrite.applies, responserewrite.shape),
)


def rules_of(entry: RouteEntry) -> tuple[tuple[Runner, ...], tuple[Runner, ...], Any] | bool:
    """The runners of the gates and shapers that apply to a route entry (and, third,
    their names: `rule_names`), chosen once per table and kept on the entry: False
    when none applies (the common route: no loop runs)."""
    rules = entry.rules
    if rules is None:
        gates = tuple(rule for rule in GATES if rule.applies(entry))
        shapers = tuple(rule for rule in SHAPERS if rule.applies(entry))
        rules = entry.rules = (
            (
                tuple(rule.runner(entry) for rule in gates),
                tuple(rule.runner(entry) for rule in shapers),
                ([rule.name for rule in gates], [rule.name for rule in shapers]),
            )
            if gates or shapers
            else False
        )
    return rules  # type: ignore[no-any-return]


def rule_names(entry: RouteEntry) -> tuple[list[str], list[str]]:
    """The names of the gates and shapers that apply to a route entry (`rules_of`)."""
    rules = rules_of(entry)
    return rules[2] if rules else ([], [])  # type: ignore[index]


def _sticky_cookie(req: RequestHead, entry: RouteEntry) -> bytes | None:
    name = entry.options.cookie_name
    if not name:
        return None
    prefix = name + b"="
    for value in req.cookie:
        for part in value.split(b";"):
            part = part.strip()
            if part.startswith(prefix):
                return part[len(prefix) :]
    return None


# ---------------------------------------------------------------- decide


def _span(
    forward: Forward,
    options: RouteOptions,
    req: RequestHead,
    facts: ConnectionFacts,
    http_version: str,
    trusted: bool,
) -> bytes:
    """The request's SERVER span (records.start_span), kept on `forward`; returns the
    traceparent the backend gets."""
    scheme = b"https" if facts.secure else b"http"
    forward.span, traceparent = records.start_span(
        req, options.name, http_version, options.span_name, scheme, trusted
    )
    forward.traceparent = traceparent.decode("ascii")
    return traceparent


def _traced_apart(
    forward: Forward,
    options: RouteOptions,
    view: View,
    req: RequestHead,
    facts: ConnectionFacts,
    traceparent: bytes,
    http_version: str,
) -> bytes:
    """A client's trace context on a route with ingress-nginx's OpenTelemetry
    annotations: enable-opentelemetry "false" starts no span and passes it on as
    it came; opentelemetry-trust-incoming-span "false" neither continues nor passes
    it on (sampled as a request without one). Returns the traceparent the backend
    gets (b"": none)."""
    if options.trace == TRACE_OFF:
        return traceparent
    if view.trace_ratio and random.random() < view.trace_ratio:
        return _span(forward, options, req, facts, http_version, False)
    return b""


def decide(
    view: View,
    req: RequestHead,
    facts: ConnectionFacts,
    now: float,
    grpc_timeout: float = 0.0,
    http_version: str = "1.1",
    grpc: bool = False,
) -> Answer | Forward:
    """Every per-request rule, in order: the proxy's own answers, routing, the route's
    gates, the endpoint pick, the trace decision, the route's shapers, the upstream
    head. `grpc_timeout`: the request's grpc-timeout in seconds (0: none); `grpc`:
    a gRPC request (its body is never buffered whole)."""
    target = req.target
    if target == http1.HEALTHZ_PATH:
        return HEALTHZ
    if target == b"*":  # OPTIONS * (the only request with this target): about us
        return OPTIONS_ANY
    query = target.find(b"?")
    path = target if query < 0 else target[:query]
    secure = facts.secure
    # A host one route takes whatever the path and headers: no lookup (ProxyView.whole_hosts).
    hosts = view.whole_hosts.get(secure)
    entry = hosts.get(req.host) if hosts is not None else None
    if entry is None:
        entry = view.table.lookup(req.host, path, req, secure)
    if entry is None:
        # A Gateway listener answers what no route takes with 404 (the spec).
        return Answer(
            404 if view.table.serves_listeners(secure) else 503,
            "no route for host " + req.host.decode("ascii", "replace"),
            "no_route",
        )
    forward = _new(Forward)
    forward.entry = entry
    forward.req = req
    forward.path = path
    # Every field set (see Forward): the defaults, then what this request has.
    forward.counted = forward.http2 = forward.buffer_body = False
    forward.cookie = forward.response_modifier = forward.authority = forward.span = None
    forward.traceparent = forward.mirrors = forward.held = forward.auth = forward.cors = None
    forward.rewritten_target = None
    forward.hsts = forward.identity = b""
    forward.deadline = 0.0
    rules = entry.rules
    if rules is None:
        rules = rules_of(entry)
    if rules:
        for run in rules[0]:  # type: ignore[index]
            answer = run(forward, req, facts)
            if answer is not None:
                release_pick(forward)  # what an earlier gate held
                return answer
        entry = forward.entry  # a gate may narrow it (the canary's side)
    # The endpoint: one backend with one endpoint and no cookie takes it without a call.
    cookie = None
    if req.cookie:
        cookie = forward.cookie = _sticky_cookie(req, entry)
    single = entry.single
    if single is not None and cookie is None:
        picked, backend = single
    else:
        key = forward.hash_key
        pick, chosen = entry.pick(
            facts.client_key if key is None else key, cookie, view.health, None
        )
        if chosen is not None and chosen.invalid:
            # A Gateway API backendRef that cannot be used: 500, as the spec says.
            release_pick(forward)
            return Answer(500, chosen.invalid, "invalid_backend", entry.options.name)
        if pick is None or chosen is None:
            # ingress-nginx's default-backend takes what no endpoint can.
            chosen = entry.policies.get("default_backend")
            pick = chosen.picker.pick(None) if chosen is not None else None
            if pick is None or chosen is None:
                release_pick(forward)
                return Answer(503, unavailable_reason(entry), "no_endpoint", entry.options.name)
        picked = pick
        backend = chosen
        backend.picker.acquire(picked)
        forward.counted = True
    forward.target = picked
    forward.backend = backend
    # The answer's extra lines (response_extra, inline: no call per request).
    set_cookie = backend.set_cookie
    if set_cookie and (cookie is None or cookie != backend.by_target.get(picked)):
        # (No cookie: a first visit's Set-Cookie without the endpoint's cookie looked up.)
        forward.extra = set_cookie.get(picked, b"") + forward.hsts
    else:
        forward.extra = forward.hsts
    if backend.http2:
        forward.http2 = True
    if (req.content_length > 0 or req.chunked) and entry.options.request_buffering and not grpc:
        # (A gRPC client stream is a stream: never held back whole.)
        forward.buffer_body = True
    if grpc_timeout:
        # The answer's deadline: grpc-timeout when shorter than the route's server
        # timeout (0.0, the default: the server timeout from now).
        allowed = entry.options.server_timeout
        if grpc_timeout < allowed:
            forward.deadline = now + grpc_timeout
    # Tracing: parent-based when the client sent a trace context; otherwise this
    # proxy starts a trace for its configured share of requests.
    traceparent = req.traceparent
    if traceparent:
        options = entry.options
        if options.trace:  # (ingress-nginx's OpenTelemetry annotations)
            traceparent = _traced_apart(
                forward, options, view, req, facts, traceparent, http_version
            )
        elif traceparent[-3:] == b"-01" and _TRACEPARENT.fullmatch(traceparent):
            traceparent = _span(forward, options, req, facts, http_version, True)
    elif (
        view.trace_ratio and random.random() < view.trace_ratio and entry.options.trace != TRACE_OFF
    ):
        traceparent = _span(forward, entry.options, req, facts, http_version, True)
    forward.upstream_scope = entry.upstream_scope
    if rules:
        for run in rules[1]:  # type: ignore[index]
            run(forward, req, facts)
    upstream_req = forward.req
    context = facts.context
    assert context is not None
    rewritten = forward.rewritten_target
    if rewritten is None:
        head = http1.build_upstream_head(
            upstream_req, context, entry.options.forwarded_mode, traceparent
        )
    else:  # (a rewritten target held apart: _request_filters)
        head = http1.build_upstream_head(
            upstream_req, context, entry.options.forwarded_mode, traceparent, None, rewritten
        )
    if entry.mirrors and not upstream_req.has_body:
        # RequestMirror copies (never waited for): the head the backend gets.
        mirrors = []
        for picker, percent in entry.mirrors:
            if percent < 100 and random.randrange(100) >= percent:
                continue
            mirror = picker.pick(None)
            if mirror is not None:
                mirrors.append((mirror, head))
        forward.mirrors = mirrors
    if rules and forward.http10:
        head = http10.request_head(head, upstream_req.chunked)
    if rules and forward.identity:
        # Set from the verified certificate; the client's own copies were stripped.
        head = head[:-2] + forward.identity + b"\r\n"
    forward.upstream_head = head
    return forward
