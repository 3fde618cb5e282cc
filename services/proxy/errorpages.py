"""ingress-nginx's custom-http-errors and default-backend: the error backend's request (sans-IO).

Learned from kubernetes/ingress-nginx (rootfs/etc/nginx/template/nginx.tmpl:
the CUSTOM_ERRORS named locations and the location block; test/e2e/annotations/
customhttperrors.go, default_backend.go, disableproxyintercepterrors.go):

- A route with custom-http-errors intercepts its backend's answers with those
  statuses (nginx `proxy_intercept_errors on` + `error_page CODE =
  @custom_...`): the backend's answer is dropped and the error backend is asked
  instead — `GET /` (HEAD for HEAD; nginx's `rewrite (.*) / break`) with the
  client's headers and `X-Code`, `X-Format` (the client's Accept),
  `X-Original-URI` (the request's target as the client sent it),
  `X-Namespace`, `X-Ingress-Name`, `X-Service-Name`, `X-Service-Port` and
  `X-Request-ID` (the client's, else one made here); the client gets the
  error backend's answer, its status included (`error_page CODE = ...`: the
  `=` takes the named location's status; the e2e tests expect the echo
  backend's 200). That answer is never intercepted again (`proxy_intercept_errors
  off` in the named location).
- The error backend is the route's default-backend Service; without one,
  ingress-nginx's controller default backend, which for Waygate is the proxy's
  own error page, with the backend's status and a reason naming it.
- The proxy's own failures with a listed status (a refused connect's or a broken
  backend's 502, an auth refusal) go there too: nginx's error_page applies to its
  own errors with or without proxy_intercept_errors. Not those its timers decide
  (`_TIMERS`), nor the refusals `decision.decide` answers before a backend is
  asked: the proxy's own pages (a named difference).
- The error backend is asked in plain HTTP (the named location's `proxy_pass
  http://`), whatever the route's backend-protocol says (HTTPS, AUTO_HTTP).
- disable-proxy-intercept-errors: the backend's answers pass unchanged.
- default-backend without an endpoint of the route's own (`decision.decide`
  sends the request there): the request as it is, with X-Code 503 and the
  route's names (the template's "custom-default-backend-" block: no
  X-Original-URI there).

Differences, reported by the resolver: the error backend gets no request
body (nginx would send the buffered one again); an answer is intercepted only
when the whole request was sent (one that comes while the body still streams
goes to the client as it is); gRPC answers are never intercepted.
The drivers: `exchange.Exchange.response_head` (an HTTP/1.1 backend for either
client protocol, an HTTP/2 one for an HTTP/1.1 client) calls `intercept`,
`h2upstream.H2Exchange.on_response` (an HTTP/2 client's stream to an HTTP/2
backend) `intercept_stream`; nothing here runs for a route without these
annotations.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from waygate.proxy import http1
from waygate.resolver.client import HeaderModifier

if TYPE_CHECKING:
    from waygate.proxy.routing import Backend, RouteEntry

# Headers the error request sets: the client's own copies are dropped first
# (nginx's proxy_set_header replaces them).
_SET = (
    b"x-code",
    b"x-format",
    b"x-original-uri",
    b"x-namespace",
    b"x-ingress-name",
    b"x-service-name",
    b"x-service-port",
)
KIND = "custom_http_error"
# The proxy's failures its timers decide (the server timeout's 504, the endpoint
# limit's 503 when waiting, a stalled or slow body's 408, grpc-timeout): its own
# pages, not the error backend's (the drivers' timers end with them).
_TIMERS = frozenset(("server_timeout", "endpoint_limit", "client_timeout", "slow_body", "deadline"))


class ErrorPages:
    """One route's error pages, prepared once per routing table."""

    __slots__ = ("backend", "codes", "intercepts", "names")

    def __init__(
        self, codes: frozenset[int], intercepts: bool, backend: Backend | None, names: bytes
    ):
        self.codes = codes
        # Whether the backend's answers are intercepted at all (codes, and not
        # disable-proxy-intercept-errors).
        self.intercepts = intercepts
        self.backend = backend  # the default-backend (None: the proxy's own page)
        self.names = names  # the X-Namespace ... X-Service-Port lines


def prepare(entry: RouteEntry) -> ErrorPages | None:
    """The route's error pages (None: neither custom-http-errors nor default-backend)."""
    route = entry.route
    backend = entry.policies.get("default_backend")
    codes = frozenset(route.custom_http_errors)
    if not codes and backend is None:
        return None
    namespace, _, name = route.origin.partition(" ")[2].rpartition("/")
    service = route.backends[0].service if route.backends else ""
    port = (route.backends[0].port if route.backends else "") or route.target_port
    names = (
        b"X-Namespace: %s\r\nX-Ingress-Name: %s\r\nX-Service-Name: %s\r\nX-Service-Port: %s\r\n"
        % (
            (namespace or route.namespace).encode("latin-1"),
            (name or route.name).encode("latin-1"),
            service.encode("latin-1"),
            str(port).encode("latin-1"),
        )
    )
    return ErrorPages(codes, bool(codes) and not route.intercept_errors_disabled, backend, names)


def _client_fields(fields: bytes) -> tuple[bytes, bytes, bool]:
    """The client's field block without the names the error request sets, its
    Accept value, and whether it carries an X-Request-ID."""
    kept = []
    accept = b""
    request_id = False
    for line in fields.split(b"\r\n"):
        if not line:
            continue
        lname = line.partition(b":")[0].strip().lower()
        if lname in _SET:
            continue
        if lname == b"accept":
            accept = line.partition(b":")[2].strip()
        elif lname == b"x-request-id":
            request_id = True
        kept.append(line + b"\r\n")
    return b"".join(kept), accept, request_id


def _added(
    errors: ErrorPages, code: int, accept: bytes, original: bytes, request_id: bool
) -> bytes:
    lines = b"X-Code: %d\r\n" % code
    if accept:  # (nginx sends no header whose value is empty)
        lines += b"X-Format: " + accept + b"\r\n"
    if original:
        lines += b"X-Original-URI: " + original + b"\r\n"
    lines += errors.names
    if not request_id:
        # ingress-nginx's $req_id: the client's X-Request-ID, else a new one.
        lines += b"X-Request-ID: " + os.urandom(16).hex().encode() + b"\r\n"
    return lines


def fallback_request(out: Any, client: Any, errors: ErrorPages) -> Any:
    """The request as the default backend gets it when no endpoint of the route's
    own can take it: as it is, with X-Code 503 and the route's names."""
    fields, accept, request_id = _client_fields(out.fields)
    head = out.copy() if out is client else out
    head.fields = fields + _added(errors, 503, accept, b"", request_id)
    return head


def error_head(client: Any, errors: ErrorPages, code: int, context: Any, mode: str) -> bytes:
    """The whole head of the error backend's request for the backend's `code`."""
    req = client.copy()
    req.method = b"HEAD" if client.method == b"HEAD" else b"GET"
    req.target = b"/"
    req.content_length = -1
    req.chunked = False
    req.upgrade = b""
    req.expect_continue = False
    fields, accept, request_id = _client_fields(client.fields)
    req.fields = fields + _added(errors, code, accept, client.target, request_id)
    return http1.build_upstream_head(req, context, mode, b"")


def answered_by_proxy(code: int) -> str:
    """The reason of the proxy's own error page standing in for the backend's answer."""
    return f"the backend answered {code} (custom-http-errors; no default-backend)"


def _errors_for(modifier: Any, status: int, failure: str) -> ErrorPages | None:
    """The route's error pages when `status` is one they take: the backend's answer
    when they intercept; the proxy's own failure (`failure`: its kind) whenever it
    is listed (nginx's error_page applies to its own errors with or without
    proxy_intercept_errors), except the timers' (`_TIMERS`). None: the status goes
    on as it is."""
    errors: ErrorPages | None = getattr(modifier, "errors", None)
    if errors is None or status not in errors.codes:
        return None
    if not (errors.intercepts if not failure else failure not in _TIMERS):
        return None
    return errors


def _pick(errors: ErrorPages) -> Any:
    """An endpoint of the error backend (None: none, or no default-backend)."""
    backend = errors.backend
    return backend.picker.pick(None) if backend is not None else None


def _retarget(forward: Any, modifier: Any, errors: ErrorPages, target: Any) -> None:
    """The decided request moved to the error backend's `target` (its count taken),
    never intercepted again. The original pick was given back by the caller."""
    forward.response_modifier = passed_on(modifier)
    forward.error_request = True
    # The template's `proxy_pass http://upstream_balancer`: plain HTTP whatever the
    # route's backend-protocol (never the route's TLS or proxy-ssl-secret certificate).
    forward.upstream_scope = None
    if target is None:
        return
    backend = errors.backend
    assert backend is not None
    backend.picker.acquire(target)
    forward.counted = True
    forward.target = target
    forward.backend = backend
    forward.http2 = backend.http2


def intercept(exchange: Any, modifier: Any, status: int, failure: str = "") -> bool:
    """The backend's answer `status` (its head only read so far), or the proxy's own
    failure with it (`failure`), is replaced by the error backend's answer
    (`exchange.Exchange`: an HTTP/1.1 backend, or an HTTP/2 one through `h2bridge`);
    False: it goes on as it is (not a listed status, already an error request, the
    request still streaming its body, or a failure without an error backend)."""
    errors = _errors_for(modifier, status, failure)
    forward = exchange.forward
    client = exchange.req
    if errors is None or not exchange.req_complete or forward is None or client is None:
        return False
    target = _pick(errors)
    if target is None and failure:
        return False  # the proxy's own page, with its own reason
    exchange.abandon_upstream()  # the backend's answer is not read further
    exchange._drop_buffer()
    exchange.response_started = False
    exchange.status = 0
    if forward.counted:
        forward.counted = False
        forward.backend.picker.release(forward.target)
    _retarget(forward, modifier, errors, target)
    if target is None:
        exchange.fail(status, answered_by_proxy(status), KIND)
        return True
    exchange.target = target
    context = exchange.down.context
    head = error_head(client, errors, status, context, forward.entry.options.forwarded_mode)
    forward.upstream_head = exchange.upstream_head = head
    exchange.last_up = exchange.loop.time()
    exchange.dispatch()
    return True


def intercept_stream(upstream: Any, modifier: Any, status: int, failure: str = "") -> bool:
    """The same for an HTTP/2 client's stream to an HTTP/2 backend
    (`h2upstream.H2Exchange`: its answer's head, or its own failure): the backend's
    stream is cancelled and the client's stream goes on as a new exchange to the
    error backend (an `exchange.Exchange` driven by `h2exchange.StreamDownstream`,
    or another HTTP/2 stream), which records the request; False: it goes on."""
    errors = _errors_for(modifier, status, failure)
    serve = upstream.upstreams.serve
    if (
        errors is None
        or serve is None
        or not upstream.request_done
        or upstream.buffering
        or upstream.request.grpc
    ):
        return False
    target = _pick(errors)
    if target is None:
        if failure:
            return False  # the proxy's own page, with its own reason
        upstream._cancel_upstream()
        upstream.response_modifier = passed_on(modifier)
        upstream.local(status, answered_by_proxy(status), KIND)
        return True
    forward = upstream.forward
    client = upstream.req
    upstream._cancel_upstream()
    held, forward.held = forward.held, None  # a limit-connections slot stays the request's
    upstream._finish(status, record=False)  # gives back the pick; the span goes on
    forward.held = held
    _retarget(forward, modifier, errors, target)
    mode = forward.entry.options.forwarded_mode
    forward.upstream_head = error_head(client, errors, status, upstream.conn.context, mode)
    req = client.copy()  # the error request has no body: nothing more to take in
    req.content_length = -1
    req.chunked = False
    now = upstream.ctx.loop.time()
    serve(upstream.conn, upstream.stream, upstream.request, req, forward, True, now)
    return True


def passed_on(modifier: Any) -> HeaderModifier | None:
    """The response modifier without its error pages."""
    rewrite = getattr(modifier, "without_errors", None)
    return rewrite() if rewrite is not None else modifier
