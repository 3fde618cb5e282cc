"""ingress-nginx's external authentication (auth-url and friends): the rules, sans-IO.

What ingress-nginx renders for `auth-url` (internal/ingress/annotations/authreq,
its nginx.tmpl's auth location), reproduced: every request of the route is
first asked of the auth service (nginx `auth_request`) -- whatever its path,
encoded or with dot-segments (CVE-2026-24513: the check belongs to the route,
never to a path) -- with

- the auth URL's path and query, its host as Host; the request's own method,
  or `auth-method` (then also X-Original-URI and X-Scheme);
- the request's header lines (its body never: `proxy_pass_request_body off`;
  nor X-Forwarded-Proto), and X-Original-URL, X-Original-Method, X-Sent-From,
  X-Real-IP and X-Forwarded-For (the client address: the peer's, or with
  use-forwarded-headers nginx real_ip's; with compute-full-forwarded-for
  X-Forwarded-For is the client's list and the peer), X-Auth-Request-Redirect
  (`auth-request-redirect`, else the request's URI), X-Request-ID (the
  client's, else a new random one: ingress-nginx's $req_id), and the
  `auth-proxy-set-headers` ConfigMap's headers; the client's own copies of
  those names are dropped;

and its answer decides (`outcome`): a 2xx lets the request through with the
`auth-response-headers` copied from the answer onto it (the client's copies of
those names removed, present in the answer or not); a 401 is answered 401 with
the answer's WWW-Authenticate (nginx's auth_request passes it on), or 302 to
`auth-signin` with `rd=` (`auth-signin-redirect-param`) naming the request's
URL; a 403 is answered 403; anything else, or no answer, 500.

The answer's Set-Cookie (`auth_request_set $auth_cookie $upstream_http_set_cookie;
add_header Set-Cookie $auth_cookie`: several joined with ", " into one, as nginx's
variable joins them) goes to the client with the backend's answer when its
status is one add_header serves (2xx/3xx: `filters.StatusHeaders`) and with the
sign-in redirect; with `auth-always-set-cookie` (`add_header ... always`) with
every answer, the proxy's own 401/403/500 included.

An `https://` auth service is reached over TLS 1.2+, its certificate verified
against the system's trust store for the URL's host (SNI too); nginx's
proxy_pass does not verify it by default: a stricter difference, named in
the Ingress's verdict.

The answers' cache (auth-cache-key, auth-cache-duration) keeps what nginx's
proxy_cache would: only for GET and HEAD subrequests (proxy_cache_methods);
never an answer with Set-Cookie (so one user's cookie never reaches another)
or `Vary: *`; for as long as X-Accel-Expires, else Cache-Control (s-maxage,
max-age; no-cache, no-store, private: not kept), else Expires says, else the
auth-cache-duration of its status (`cache_seconds`).

The driver (`authcheck`) sends the subrequest and calls `outcome`; `decide`'s
gate only marks the request (`Forward.auth`).
"""

from __future__ import annotations

import base64
import binascii
import os
import re
import ssl
import time
from collections import OrderedDict
from email.utils import parsedate_to_datetime
from typing import Any, NamedTuple
from urllib.parse import quote, urlsplit

from waygate.proxy import access, filters, http1
from waygate.proxy.http1 import RequestHead, ResponseHead
from waygate.proxy.routing import Target
from waygate.resolver.client import ExternalAuth, HeaderModifier

# Names the subrequest sets itself: the client's copies never reach the service.
_SET_BY_US = (
    b"host",
    b"x-original-url",
    b"x-original-method",
    b"x-original-uri",
    b"x-scheme",
    b"x-sent-from",
    b"x-real-ip",
    b"x-forwarded-for",
    b"x-auth-request-redirect",
    b"x-forwarded-proto",  # (proxy_set_header X-Forwarded-Proto "": not sent)
    b"x-request-id",
    b"content-length",
    b"transfer-encoding",
    b"connection",
)
MAX_PLANS = 4_096


class AuthPlan:
    """One ExternalAuth, compiled once: where to ask and what to copy back."""

    def __init__(self, spec: ExternalAuth, client_address_header: str = "") -> None:
        self.spec = spec
        self.client_address_header = client_address_header
        # forwarded-for-header: where a trusted peer names the client (None: XFF).
        self.header = access.header_pattern(client_address_header)
        url = urlsplit(spec.url)
        host = url.hostname or ""
        self.tls = url.scheme == "https"
        port = url.port or (443 if self.tls else 80)
        self.target = Target(host, port)
        self.server_name = host
        self.host = (host if url.port is None else f"{host}:{port}").encode()
        self.path = ((url.path or "/") + (f"?{url.query}" if url.query else "")).encode()
        self.method = spec.method.encode()
        self.copied = tuple(name.encode() for name in spec.response_headers)
        self.copied_lower = tuple(name.lower() for name in self.copied)
        self.dropped = _SET_BY_US + tuple(
            name.lower().encode() for name, _ in spec.proxy_set_headers
        )
        self.set_lines = b"".join(
            b"%s: %s\r\n" % (name.encode(), value.encode())
            for name, value in spec.proxy_set_headers
        )
        # auth-cache-key's parts: literal text, or (kind, name) of a variable.
        self.cache_parts: tuple[bytes | tuple[str, bytes], ...] = tuple(
            (part[1:].split("_", 1)[0], part[1:].partition("_")[2].encode())
            if part.startswith("$")
            else part.encode()
            for part in _VARIABLE.split(spec.cache_key)
            if part
        )
        # Later entries win, as nginx's proxy_cache_valid reads them.
        self.durations = dict(spec.cache_durations)
        # use-forwarded-headers: who the client is (nginx real_ip; access.real_ip). The
        # resolver checked the ranges; should one not parse, the peer is the client.
        try:
            self.trusted = access.networks(spec.trusted_proxies)
        except ValueError:
            self.trusted = ()


_VARIABLE = re.compile(r"(\$(?:http_[a-z0-9_]+|cookie_[A-Za-z0-9_]+|remote_addr|remote_user|host))")
_plans: dict[int, AuthPlan] = {}


def plan_for(spec: ExternalAuth, client_address_header: str = "") -> AuthPlan:
    """The compiled plan of a route's ExternalAuth (kept while the spec lives) with
    the route's `client_address_header`."""
    found = _plans.get(id(spec))
    if (
        found is not None
        and found.spec is spec
        and found.client_address_header == client_address_header
    ):
        return found
    if len(_plans) >= MAX_PLANS:
        _plans.clear()
    found = _plans[id(spec)] = AuthPlan(spec, client_address_header)
    return found


def _without(fields: bytes, names: tuple[bytes, ...]) -> bytes:
    """Header lines (b"Name: value\\r\\n" each) less those named (lower-case)."""
    if not fields:
        return b""
    kept = [
        line
        for line in fields.split(b"\r\n")
        if line and line.split(b":", 1)[0].strip().lower() not in names
    ]
    return b"".join(line + b"\r\n" for line in kept)


def remote_addr(plan: AuthPlan, req: RequestHead, peer: bytes) -> bytes:
    """nginx's $remote_addr: the peer's address, or with use-forwarded-headers the
    client X-Forwarded-For (or forwarded-for-header's header) names through the
    trusted proxies."""
    return access.real_ip(peer, req, plan.trusted, plan.header) if plan.trusted else peer


def subrequest_head(plan: AuthPlan, req: RequestHead, secure: bool, peer: bytes) -> bytes:
    """The auth subrequest's head (no body; the connection closes after its answer)."""
    client_ip = remote_addr(plan, req, peer)
    forwarded_for = client_ip
    if plan.spec.full_forwarded_for:  # $full_x_forwarded_for: the client's list, the peer
        given = b", ".join(v for lname, _, v in req.forwarded if lname == b"x-forwarded-for")
        forwarded_for = given + b", " + peer if given else peer
    scheme = b"https" if secure else b"http"
    uri = req.target
    method = plan.method or req.method
    spec = plan.spec
    redirect = spec.request_redirect.encode() if spec.request_redirect else uri
    parts = [
        method + b" " + plan.path + b" HTTP/1.1\r\nHost: " + plan.host + b"\r\n",
        _without(req.fields, plan.dropped),
        b"X-Original-URL: %s://%s%s\r\n" % (scheme, req.host, uri),
        b"X-Original-Method: %s\r\n" % req.method,
        b"X-Sent-From: nginx-ingress-controller\r\n",
        b"X-Real-IP: %s\r\nX-Forwarded-For: %s\r\n" % (client_ip, forwarded_for),
        b"X-Auth-Request-Redirect: %s\r\n" % redirect,
        # ingress-nginx's $req_id: the client's X-Request-ID, else a new one.
        b"X-Request-ID: %s\r\n"
        % (_field(req.fields, b"x-request-id") or os.urandom(16).hex().encode()),
    ]
    if plan.method:
        parts.append(b"X-Original-URI: %s\r\nX-Scheme: %s\r\n" % (uri, scheme))
    parts.append(plan.set_lines)
    parts.append(b"Connection: close\r\n\r\n")
    return b"".join(parts)


class Refused(NamedTuple):
    """The client's answer: a status and reason, or a redirect (`location`), with the
    header lines the auth service's answer adds to it (`lines`)."""

    status: int
    reason: str
    location: bytes = b""
    lines: bytes = b""


def _values(response: ResponseHead, name: bytes) -> list[bytes]:
    """Every value of a field of the answer (lower-case `name`), in order."""
    out = []
    for line in response.fields.split(b"\r\n"):
        key, colon, value = line.partition(b":")
        if colon and key.strip().lower() == name:
            out.append(value.strip())
    return out


def auth_cookie(response: ResponseHead | None) -> bytes:
    """nginx's $upstream_http_set_cookie: the answer's Set-Cookie values joined with
    ", " (b"": none)."""
    if response is None:
        return b""
    return b", ".join(value for value in _values(response, b"set-cookie") if value)


def with_cookie(modifier: HeaderModifier | None, cookie: bytes, always: bool) -> HeaderModifier:
    """The request's response modifier with the auth service's Set-Cookie added: to
    every answer (always) or to those of add_header's statuses."""
    line = (("Set-Cookie", cookie.decode("latin-1")),)
    if always:
        return filters.with_added(modifier, line)
    return filters.StatusHeaders.over(modifier, line)


def response_fields(response: ResponseHead) -> dict[bytes, bytes]:
    """The answer's header fields by lower-case name (the first of each)."""
    found: dict[bytes, bytes] = {}
    for line in response.fields.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if colon:
            found.setdefault(name.strip().lower(), value.strip())
    return found


def outcome(
    plan: AuthPlan,
    response: ResponseHead | None,
    req: RequestHead,
    secure: bool,
    forward: Any = None,
) -> bytes | Refused:
    """The header lines to add to the request (a 2xx: the answer's Set-Cookie is
    then added to `forward`'s response modifier), or the client's answer (on a CORS
    route with the CORS headers: ingress-nginx's more_set_headers reach it too)."""
    result = _outcome(plan, response, req, secure, forward)
    cors = forward.cors if forward is not None and isinstance(result, Refused) else None
    if cors:
        lines = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in cors)
        return result._replace(lines=result.lines + lines)  # type: ignore[union-attr]
    return result


def _outcome(
    plan: AuthPlan,
    response: ResponseHead | None,
    req: RequestHead,
    secure: bool,
    forward: Any,
) -> bytes | Refused:
    status = response.status if response is not None else 0
    cookie = auth_cookie(response)
    always = plan.spec.always_set_cookie
    if 200 <= status < 300:
        assert response is not None
        if cookie and forward is not None:
            forward.response_modifier = with_cookie(forward.response_modifier, cookie, always)
        if not plan.copied:
            return b""
        fields = response_fields(response)
        lines = []
        for name, lower in zip(plan.copied, plan.copied_lower, strict=True):
            value = fields.get(lower)
            if value:
                lines.append(b"%s: %s\r\n" % (name, value))
        return b"".join(lines)
    set_cookie = b"Set-Cookie: %s\r\n" % cookie if cookie else b""
    if status == 401:
        assert response is not None
        signin = plan.spec.signin
        if signin:  # (a 302: add_header's own statuses, `always` or not)
            location = signin_location(plan, req, secure)
            return Refused(302, "sign in first", location, set_cookie)
        challenges = b"".join(
            b"WWW-Authenticate: %s\r\n" % value for value in _values(response, b"www-authenticate")
        )
        return Refused(
            401, "authentication required", lines=challenges + (set_cookie if always else b"")
        )
    extra = set_cookie if always else b""
    if status == 403:
        return Refused(403, "forbidden by the authentication service", lines=extra)
    if response is None:
        return Refused(500, "the authentication service did not answer")
    return Refused(500, f"the authentication service answered {status}", lines=extra)


def refusal_page(result: Refused, *, close: bool, head_only: bool) -> bytes:
    """The client's whole HTTP/1.1 answer for a refusal (a redirect, or the error
    page), with the auth service's lines."""
    if result.location:
        page = filters.redirect_head(result.status, result.location, close=close)
    else:
        page = http1.error_response(result.status, result.reason, close=close, head_only=head_only)
    if not result.lines:
        return page
    end = page.index(b"\r\n") + 2
    return page[:end] + result.lines + page[end:]


def field_pairs(lines: bytes) -> list[tuple[bytes, bytes]]:
    """Header lines as HTTP/2 fields (lower-case names)."""
    out = []
    for line in lines.split(b"\r\n"):
        name, colon, value = line.partition(b":")
        if colon:
            out.append((name.strip().lower(), value.strip()))
    return out


_tls_context: ssl.SSLContext | None = None


def tls_context() -> ssl.SSLContext:
    """The client context for https:// auth services: the system's trust store,
    the host name checked, TLS 1.2 or later, HTTP/1.1 by ALPN (made once)."""
    global _tls_context
    if _tls_context is None:
        context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        context.set_alpn_protocols(["http/1.1"])
        _tls_context = context
    return _tls_context


def signin_location(plan: AuthPlan, req: RequestHead, secure: bool) -> bytes:
    """auth-signin (its `$host` and `$escaped_request_uri` filled in) with
    `rd=SCHEME://HOST` + the escaped request URI, unless it names the parameter
    already (ingress-nginx's buildAuthSignURL)."""
    spec = plan.spec
    host = req.host.decode("latin-1")
    escaped = quote(req.target.decode("latin-1"), safe="")
    signin = spec.signin.replace("$host", host).replace("$escaped_request_uri", escaped)
    param = spec.signin_redirect_param or "rd"
    if f"{param}=" in signin.partition("?")[2]:
        return signin.encode()
    scheme = "https" if secure else "http"
    joiner = "&" if "?" in signin else "?"
    return f"{signin}{joiner}{param}={scheme}://{host}{escaped}".encode()


# ---------------------------------------------------------------- the answers' cache

# Answers kept (across routes), and their bytes: the least recently used go first.
MAX_CACHED = 10_000
MAX_CACHED_BYTES = 8 << 20


def _field(fields: bytes, name: bytes) -> bytes:
    for line in fields.split(b"\r\n"):
        key, colon, value = line.partition(b":")
        if colon and key.strip().lower() == name:
            return value.strip()
    return b""


_CACHED_METHODS = (b"GET", b"HEAD")  # nginx's proxy_cache_methods
_MAX_AGE = re.compile(rb"(?:^|[,\s])(s-maxage|max-age)=(\d{1,10})", re.IGNORECASE)
_NO_CACHE = re.compile(rb"(?:^|[,\s])(no-cache|no-store|private)(?:$|[,\s=])", re.IGNORECASE)


def cache_seconds(plan: AuthPlan, response: ResponseHead, now: float) -> float:
    """How long nginx's proxy_cache keeps this answer (0: not at all); `now` is the
    wall clock (for Expires and X-Accel-Expires: @TIME)."""
    if _values(response, b"set-cookie") or any(
        v.strip() == b"*" for v in _values(response, b"vary")
    ):
        return 0.0
    accel = _values(response, b"x-accel-expires")
    if accel:
        value = accel[0]
        try:
            return max(0.0, int(value[1:]) - now) if value.startswith(b"@") else float(int(value))
        except ValueError:
            return 0.0
    control = b", ".join(_values(response, b"cache-control"))
    if control:
        if _NO_CACHE.search(control):
            return 0.0
        ages = dict((name.lower(), int(n)) for name, n in _MAX_AGE.findall(control))
        age = ages.get(b"s-maxage", ages.get(b"max-age"))
        if age is not None:
            return float(age)
    expires = _values(response, b"expires")
    if expires:
        try:
            when = parsedate_to_datetime(expires[0].decode("latin-1")).timestamp()
        except (TypeError, ValueError, IndexError, OverflowError):
            return 0.0
        return max(0.0, when - now)
    return plan.durations.get(response.status, 0.0)


_BASIC = re.compile(rb"basic[ \t]+([A-Za-z0-9+/]+=*)[ \t]*", re.IGNORECASE)


def remote_user(req: RequestHead) -> bytes:
    """nginx's $remote_user: the user name of a Basic Authorization header (b"":
    none, or not Basic)."""
    found = _BASIC.fullmatch(_field(req.fields, b"authorization"))
    if found is None:
        return b""
    try:
        user, colon, _ = base64.b64decode(found.group(1), validate=True).partition(b":")
    except binascii.Error:
        return b""
    return user if colon else b""


def cache_key(plan: AuthPlan, route: str, req: RequestHead, peer: bytes) -> bytes | None:
    """The answer's key in the cache: the route (ingress-nginx caches per location)
    and auth-cache-key filled in; None without auth-cache-key."""
    if not plan.cache_parts or (plan.method or req.method) not in _CACHED_METHODS:
        return None
    parts = [route.encode(), b"\0"]
    for part in plan.cache_parts:
        if isinstance(part, bytes):
            parts.append(part)
            continue
        kind, name = part
        if kind == "http":
            parts.append(_field(req.fields, name.replace(b"_", b"-")))
        elif kind == "cookie":
            prefix = name + b"="
            for value in req.cookie:
                for item in value.split(b";"):
                    item = item.strip()
                    if item.startswith(prefix):
                        parts.append(item[len(prefix) :])
        elif kind == "remote" and name == b"user":
            parts.append(remote_user(req))
        elif kind == "remote":
            parts.append(remote_addr(plan, req, peer))
        else:  # host
            parts.append(req.host)
    return b"".join(parts)


class AnswerCache:
    """The auth service's answers by key, each for its status's duration; bounded in
    entries and in bytes (key and head), the least recently used forgotten first."""

    def __init__(self) -> None:
        self.entries: OrderedDict[bytes, tuple[float, ResponseHead, int]] = OrderedDict()
        self.size = 0

    def get(self, key: bytes, now: float) -> ResponseHead | None:
        found = self.entries.get(key)
        if found is None:
            return None
        if found[0] <= now:
            self._drop(key)
            return None
        self.entries.move_to_end(key)
        return found[1]

    def put(self, plan: AuthPlan, key: bytes, response: ResponseHead, now: float) -> None:
        seconds = cache_seconds(plan, response, time.time())
        if not seconds:
            return
        size = len(key) + len(response.fields) + 64
        if size > MAX_CACHED_BYTES // 16:
            return  # too large to keep
        if key in self.entries:
            self._drop(key)
        while self.entries and (
            len(self.entries) >= MAX_CACHED or self.size + size > MAX_CACHED_BYTES
        ):
            self._drop(next(iter(self.entries)))
        self.entries[key] = (now + seconds, response, size)
        self.size += size

    def _drop(self, key: bytes) -> None:
        self.size -= self.entries.pop(key)[2]


CACHE = AnswerCache()


def with_auth_headers(head: bytes, plan: AuthPlan, lines: bytes) -> bytes:
    """The upstream head with the auth service's header lines, the client's copies of
    every copied name removed (present in the answer or not)."""
    if not plan.copied:
        return head
    request_line, _, rest = head.partition(b"\r\n")
    fields = _without(rest[:-2] if rest.endswith(b"\r\n") else rest, plan.copied_lower)
    return request_line + b"\r\n" + fields + lines + b"\r\n"
