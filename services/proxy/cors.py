"""ingress-nginx's CORS (enable-cors, cors-*), decided once per route (sans-IO).

What ingress-nginx's `CORS` template does, and only that: a request whose Origin
is allowed gets Access-Control-Allow-Origin (the Origin itself, or `*` when
cors-allow-origin is `*`), -Allow-Credentials (when true), -Allow-Methods,
-Allow-Headers, -Expose-Headers (when set) and -Max-Age set on its answer
(replacing the backend's, as more_set_headers does); an allowed OPTIONS request
is a preflight the proxy answers itself: 204 with those headers and
`Content-Type: text/plain charset=UTF-8`, the backend never asked. With `*`
every request is allowed, an Origin or not; otherwise a request without an
allowed Origin passes untouched (its OPTIONS goes to the backend).

Origins are compared case-insensitively, as nginx's `~*`; `*.` in an origin is
one subdomain label (`[A-Za-z0-9-]+`). Difference (safer): ingress-nginx's
origin regex is anchored only at its end, so `https://evil.example/https://ok.example`
is allowed there; here the whole Origin must match.

Invariants: the policy (regex, header lines, the `*` answers) is built once per
route entry (`policy`); per request only the Origin is looked up and, for a
listed origin, one modifier tuple built.
"""

from __future__ import annotations

import re
from typing import Any

from waygate.proxy.http1 import RequestHead
from waygate.resolver.client import Cors, HeaderModifier

_ORIGIN_FIELD = re.compile(rb"(?:^|\n)origin:[ \t]*([^\r\n]*?)[ \t]*\r", re.IGNORECASE)
# A subdomain wildcard: one DNS label, as ingress-nginx's buildOriginRegex.
_LABEL = r"[A-Za-z0-9\-]+"


def compile_pattern(pattern: str) -> re.Pattern[str]:
    """The one place this module compiles a route-derived regular expression
    (case-insensitive, as nginx's `~*`); the patterns are escaped literals and
    label classes, so they run in linear time whichever engine compiles them."""
    return re.compile(pattern, re.IGNORECASE)


def origin_pattern(origins: tuple[str, ...]) -> re.Pattern[str]:
    """The allowed origins as one pattern matched against the whole Origin."""
    parts = []
    for origin in origins:
        escaped = re.escape(origin.strip())
        parts.append(escaped.replace(r"\*", _LABEL, 1))
    return compile_pattern("(?:" + "|".join(parts) + ")")


def request_origin(req: RequestHead) -> bytes:
    """The request's Origin header (b"": none)."""
    fields = req.fields
    if b"rigin" not in fields and b"RIGIN" not in fields:
        return b""
    found = _ORIGIN_FIELD.search(fields)
    return found.group(1) if found else b""


class CorsPolicy:
    """One route's CORS, prepared: `answer_headers(req)` per request."""

    __slots__ = ("any_origin", "common", "origins", "preflight_any", "response_any")

    def __init__(self, cors: Cors) -> None:
        origins = tuple(o.strip() for o in cors.allow_origins if o.strip()) or ("*",)
        self.any_origin = "*" in origins
        self.origins = None if self.any_origin else origin_pattern(origins)
        common: list[tuple[str, str]] = []
        if cors.allow_credentials:
            common.append(("Access-Control-Allow-Credentials", "true"))
        common.append(("Access-Control-Allow-Methods", cors.allow_methods))
        common.append(("Access-Control-Allow-Headers", cors.allow_headers))
        if cors.expose_headers:
            common.append(("Access-Control-Expose-Headers", cors.expose_headers))
        common.append(("Access-Control-Max-Age", str(cors.max_age)))
        self.common = tuple(common)
        self.response_any = self.headers("*")
        self.preflight_any = preflight_response(self.response_any)

    def headers(self, origin: str) -> tuple[tuple[str, str], ...]:
        return (("Access-Control-Allow-Origin", origin), *self.common)

    def allowed(self, req: RequestHead) -> tuple[tuple[str, str], ...] | None:
        """The CORS headers the answer to `req` gets (None: not a CORS request here)."""
        if self.any_origin:
            return self.response_any
        origin = request_origin(req)
        if not origin:
            return None
        text = origin.decode("latin-1")
        assert self.origins is not None
        if self.origins.fullmatch(text) is None:
            return None
        return self.headers(text)

    def preflight(self, allowed: tuple[tuple[str, str], ...]) -> bytes:
        """The 204 the proxy answers an allowed OPTIONS with (HTTP/1.1 bytes)."""
        return self.preflight_any if allowed is self.response_any else preflight_response(allowed)


def preflight_response(headers: tuple[tuple[str, str], ...]) -> bytes:
    lines = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in headers)
    return (
        b"HTTP/1.1 204 No Content\r\n" + lines + b"Content-Type: text/plain charset=UTF-8\r\n"
        b"Content-Length: 0\r\n\r\n"
    )


def with_headers(modifier: HeaderModifier | None, headers: Any) -> HeaderModifier:
    """The route's response modifier with the CORS headers set last (they win, as
    more_set_headers after the route's own)."""
    if modifier is None:
        return HeaderModifier(set=headers)
    return HeaderModifier(set=(*modifier.set, *headers), add=modifier.add, remove=modifier.remove)
