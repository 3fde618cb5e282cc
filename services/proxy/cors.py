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
route entry (`policy`), and each origin's answer once per entry (`CorsAnswer`: the
response's lines as bytes, the preflight as a whole answer), remembered by the
Origin's bytes (bounded: `MAX_REMEMBERED`, then forgotten at once). Per request
the Origin is found (one search) and looked up (one dictionary read), or, when the
client's connection sent these very fields to this route last time, the answer it got
then is taken (`http1.ForwardedContext.cors_*`: a keep-alive client repeating its
head costs one comparison); the answer's
lines are appended to the response head, and the backend's own fields are
rewritten only when it sent one of those names (`filters.SetFields`, which keeps
its last block's result: a remembered response parse's copies share the block).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any, Final

from waygate.proxy.filters import SetFields
from waygate.proxy.http1 import RequestHead
from waygate.resolver.client import Cors, HeaderModifier

# Origins remembered per route entry (allowed or not), then forgotten at once: a
# wildcard origin lets a client name many, and each allowed one holds its answer's
# lines (about 2 KiB), so a route's bound stays near half a MiB.
MAX_REMEMBERED: Final = 256
# The first Origin field's value, blanks around it kept. A request's field block starts
# with its Host line (http1.parse_request_head, request_from_fields), so every other
# field follows a line feed; a value holds no CR (the parse refuses one).
_ORIGIN_FIELD: Final = re.compile(rb"\norigin[ \t]*:[ \t]*([^\r]*)", re.IGNORECASE)
# A subdomain wildcard: one DNS label, as ingress-nginx's buildOriginRegex.
_LABEL = r"[A-Za-z0-9\-]+"
_PREFLIGHT_TAIL = b"Content-Type: text/plain charset=UTF-8\r\nContent-Length: 0\r\n\r\n"


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


class CorsAnswer:
    """What an allowed request gets, prepared once per route entry and origin:
    `headers` (name, value) pairs, `fields` the response modifier (the route's own
    ResponseHeaderModifier, then these set), `preflight` the whole 204 for an
    OPTIONS (HTTP/1.1 bytes as latin-1 text, as decision.ANSWER_RESPONSE carries)."""

    __slots__ = ("fields", "headers", "preflight")

    def __init__(self, headers: tuple[tuple[str, str], ...], base: HeaderModifier | None) -> None:
        self.headers = headers
        self.fields = SetFields(headers, base)
        self.preflight = preflight_response(headers).decode("latin-1")


class CorsPolicy:
    """One route's CORS, prepared: `answer(req)` per request.

    `base`: the route's own ResponseHeaderModifier (HTTPRoute filters), applied
    before the CORS headers are set (they win, as more_set_headers after the
    route's own)."""

    __slots__ = (
        "any_answer",
        "base",
        "common",
        "known",
        "origins",
        "preflight",
    )

    def __init__(
        self,
        cors: Cors,
        base: HeaderModifier | None = None,
        preflight: Callable[[CorsAnswer], Any] | None = None,
    ) -> None:
        origins = tuple(o.strip() for o in cors.allow_origins if o.strip()) or ("*",)
        self.origins = None if "*" in origins else origin_pattern(origins)
        common: list[tuple[str, str]] = []
        if cors.allow_credentials:
            common.append(("Access-Control-Allow-Credentials", "true"))
        common.append(("Access-Control-Allow-Methods", cors.allow_methods))
        common.append(("Access-Control-Allow-Headers", cors.allow_headers))
        if cors.expose_headers:
            common.append(("Access-Control-Expose-Headers", cors.expose_headers))
        common.append(("Access-Control-Max-Age", str(cors.max_age)))
        self.common = tuple(common)
        self.base = base
        # With `*` every request gets the one answer (an Origin or not).
        self.any_answer = None if self.origins is not None else self._prepared("*")
        # Origin bytes -> its answer (None: not allowed).
        self.known: dict[bytes, CorsAnswer | None] = {}
        # The request core's answer to an allowed OPTIONS (`gate`: decision.Answer).
        self.preflight = preflight

    def _prepared(self, origin: str) -> CorsAnswer:
        return CorsAnswer((("Access-Control-Allow-Origin", origin), *self.common), self.base)

    def answer(self, req: RequestHead) -> CorsAnswer | None:
        """The CORS answer for `req` (None: not a CORS request here)."""
        if self.origins is None:
            return self.any_answer
        found = _ORIGIN_FIELD.search(req.fields)
        if found is None:
            return None
        origin = found.group(1)
        known = self.known
        answer = known.get(origin, False)
        if answer is False:
            answer = self._learn(origin)
        return answer  # type: ignore[return-value]

    def gate(self, forward: Any, req: RequestHead, facts: Any) -> Any:
        """The request core's rule (decision.GATES "cors", bound to this route entry's
        policy: one call per request): an allowed OPTIONS gets `preflight(answer)`,
        any other allowed request its answer's lines (forward.cors and the response
        modifier). `answer`, inline."""
        answer = self.any_answer
        if answer is None:
            fields = req.fields
            context = facts.context
            if context.cors_policy is self and fields == context.cors_fields:
                # The connection's last request here had these very fields (a
                # keep-alive client repeating its head): its answer, no search.
                answer = context.cors_answer
            else:
                found = _ORIGIN_FIELD.search(fields)
                if found is None:
                    answer = None
                else:
                    answer = self.known.get(found[1], False)  # type: ignore[arg-type]
                    if answer is False:
                        answer = self._learn(found[1])
                context.cors_policy = self
                context.cors_fields = fields
                context.cors_answer = answer
            if answer is None:
                return None
        if req.method == b"OPTIONS":
            assert self.preflight is not None
            return self.preflight(answer)
        forward.cors = answer.headers
        forward.response_modifier = answer.fields
        return None

    def _learn(self, origin: bytes) -> CorsAnswer | None:
        text = origin.strip(b" \t").decode("latin-1")
        assert self.origins is not None
        answer = self._prepared(text) if self.origins.fullmatch(text) is not None else None
        if len(self.known) >= MAX_REMEMBERED:
            self.known.clear()
        self.known[origin] = answer
        return answer


def preflight_response(headers: tuple[tuple[str, str], ...]) -> bytes:
    """The 204 the proxy answers an allowed OPTIONS with (HTTP/1.1 bytes)."""
    lines = b"".join(b"%s: %s\r\n" % (k.encode(), v.encode("latin-1")) for k, v in headers)
    return b"HTTP/1.1 204 No Content\r\n" + lines + _PREFLIGHT_TAIL
