"""ingress-nginx's response-side annotations in the request core (sans-IO, pure on bytes).

One shaper rule (`decision.SHAPERS`, "responses") for the routes that carry
any of them, so a route without them pays nothing per request:

- proxy-redirect-from/-to, as nginx's `proxy_redirect FROM TO`: a Location (or
  the URL of a Refresh) of the backend's that starts with FROM
  (case-sensitive, as nginx's ngx_rstrncmp) has that prefix replaced by TO; a
  Location that then starts with "/" is made absolute as nginx's header filter
  does (`absolute_redirect on`, ingress-nginx's default): the request's scheme
  and host, and the port the client addressed only with use-port-in-redirects
  (`port_in_redirect`) and when it is not the scheme's own;
- proxy-cookie-domain / proxy-cookie-path, as nginx's proxy_cookie_domain
  ("FROM TO": a Set-Cookie Domain equal to FROM, case-insensitively, a leading
  dot ignored on both sides and kept in the answer, becomes TO) and
  proxy_cookie_path ("FROM TO": a Path starting with FROM has it replaced);
- connection-proxy-header: the Connection line an HTTP/1.1 backend gets
  (`keep-alive`, `close`); an upgrade keeps `upgrade` (the proxy owns that
  hop), an HTTP/2 backend gets none (connection-specific fields are not
  HTTP/2's);
- custom-http-errors and default-backend: `waygate.proxy.errorpages`, whose
  policy rides on the response modifier made here (`ResponseRules.errors`).

The rewriting runs where every other response-header rule runs
(`filters.modify_response_fields`, for both client protocols and both upstream
protocols), before the route's own header filters (nginx rewrites the upstream's
headers before add_header and more_set_headers run).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from waygate.proxy import errorpages
from waygate.resolver.client import HeaderModifier

if TYPE_CHECKING:
    from waygate.proxy.http1 import RequestHead
    from waygate.proxy.routing import RouteEntry

_WELL_KNOWN = {b"http": b"80", b"https": b"443"}
_CONNECTION = {"keep-alive": b"Connection: keep-alive\r\n", "close": b"Connection: close\r\n"}


@dataclasses.dataclass(frozen=True)
class ResponseRules(HeaderModifier):
    """A route's ResponseHeaderModifier (set, add, remove) with the ingress-nginx
    rewrites applied before it (`rewrite`) and its error pages (`errors`)."""

    redirect_from: bytes = b""
    redirect_to: bytes = b""
    # Where a relative Location is made absolute: b"scheme://host[:port]" (per request).
    origin: bytes = b""
    cookie_domain: tuple[bytes, bytes] | None = None
    cookie_path: tuple[bytes, bytes] | None = None
    errors: errorpages.ErrorPages | None = None

    def without_errors(self) -> ResponseRules:
        return dataclasses.replace(self, errors=None) if self.errors is not None else self

    def rewrite(self, lines: list[bytes]) -> list[bytes]:
        """The response's header lines (b"Name: value") with Location, Refresh and
        Set-Cookie rewritten."""
        out = []
        for line in lines:
            name, _, value = line.partition(b":")
            lname = name.strip().lower()
            if lname == b"location" and self.redirect_from:
                value = self._location(value.strip(b" \t"))
                line = name + b": " + value
            elif lname == b"refresh" and self.redirect_from:
                line = name + b": " + self._refresh(value.strip(b" \t"))
            elif lname == b"set-cookie" and (self.cookie_domain or self.cookie_path):
                line = name + b": " + self._cookie(value.strip(b" \t"))
            out.append(line)
        return out

    def _replaced(self, url: bytes) -> bytes | None:
        if url.startswith(self.redirect_from):
            return self.redirect_to + url[len(self.redirect_from) :]
        return None

    def _location(self, value: bytes) -> bytes:
        replaced = self._replaced(value)
        if replaced is None:
            return value  # nginx: declined, the Location as the backend sent it
        if replaced.startswith(b"/") and self.origin:
            return self.origin + replaced
        return replaced

    def _refresh(self, value: bytes) -> bytes:
        # nginx rewrites the part from "url=" on (found case-insensitively).
        at = value.lower().find(b"url=")
        if at < 0:
            return value
        start = at + 4
        replaced = self._replaced(value[start:])
        return value if replaced is None else value[:start] + replaced

    def _cookie(self, value: bytes) -> bytes:
        parts = value.split(b";")
        for index in range(1, len(parts)):
            key, eq, attribute = parts[index].partition(b"=")
            lkey = key.strip().lower()
            if not eq:
                continue
            if lkey == b"domain" and self.cookie_domain is not None:
                parts[index] = key + eq + _domain(attribute, *self.cookie_domain)
            elif lkey == b"path" and self.cookie_path is not None:
                wanted, replacement = self.cookie_path
                if attribute.startswith(wanted):
                    parts[index] = key + eq + replacement + attribute[len(wanted) :]
        return b";".join(parts)


def _domain(attribute: bytes, wanted: bytes, replacement: bytes) -> bytes:
    """nginx's proxy_cookie_domain on one Domain attribute's value."""
    dot = attribute[:1] == b"."
    bare = attribute[1:] if dot else attribute
    if bare.lower() != wanted:
        return attribute
    return (b"." if dot else b"") + replacement


def _pair(text: str) -> tuple[bytes, bytes] | None:
    """ "FROM TO" (the resolver checked its grammar) -> (from, to); "": None."""
    parts = text.split()
    if len(parts) != 2:
        return None
    return parts[0].encode("latin-1"), parts[1].encode("latin-1")


def applies(entry: RouteEntry) -> bool:
    """Whether a route needs the rule (asked once per routing table): its policy is
    prepared here, kept in `entry.policies["responses"]`."""
    route = entry.route
    errors = errorpages.prepare(entry)
    if not (
        route.redirect_from
        or route.cookie_domain
        or route.cookie_path
        or route.connection_header in _CONNECTION
        or errors is not None
    ):
        return False
    domain = _pair(route.cookie_domain)
    rules = ResponseRules(
        redirect_from=route.redirect_from.encode("latin-1"),
        redirect_to=route.redirect_to.encode("latin-1"),
        cookie_domain=(domain[0].lstrip(b".").lower(), domain[1]) if domain else None,
        cookie_path=_pair(route.cookie_path),
        errors=errors,
    )
    entry.policies["responses"] = rules
    return True


def shape(forward: Any, req: RequestHead, facts: Any) -> None:
    """The request's response rules (after the route's own filters and CORS made its
    response modifier), its Connection line and the default backend's headers.
    (`forward`: a `decision.Forward`, `facts` its `ConnectionFacts`: typed loosely, as
    decision imports this module.)"""
    entry = forward.entry
    rules: ResponseRules = entry.policies["responses"]
    route = entry.route
    errors = rules.errors
    if errors is not None:
        if forward.backend is errors.backend:
            # ingress-nginx's custom default backend taking what no endpoint can:
            # the request as it is, with X-Code 503 and the route's names; its
            # answer is the client's.
            forward.req = errorpages.fallback_request(forward.upstream_request(), req, errors)
            errors = None
        elif not errors.codes:
            errors = None  # (a default-backend alone: nothing to intercept)
    if rules.redirect_from or rules.cookie_domain or rules.cookie_path or errors is not None:
        modifier = forward.response_modifier
        changes: dict[str, Any] = {}
        if modifier is not None:
            changes.update(set=modifier.set, add=modifier.add, remove=modifier.remove)
        if errors is not rules.errors:
            changes["errors"] = errors
        if rules.redirect_to.startswith(b"/"):
            changes["origin"] = origin(req, bool(facts.secure), route.port_in_redirects)
        forward.response_modifier = dataclasses.replace(rules, **changes) if changes else rules
    line = _CONNECTION.get(route.connection_header)
    if line is not None and not forward.req.upgrade and not forward.http2 and not forward.http10:
        current = forward.upstream_request()
        out = current if current is not req else req.copy()
        out.fields = out.fields + line
        forward.req = out


def origin(req: RequestHead, secure: bool, with_port: bool) -> bytes:
    """nginx's absolute redirect prefix: scheme://host, with the port the client
    addressed only under port_in_redirect and when it is not the scheme's."""
    scheme = b"https" if secure else b"http"
    origin = scheme + b"://" + req.host
    if with_port:
        port = _host_port(req.fields)
        if port and port != _WELL_KNOWN[scheme]:
            origin += b":" + port
    return origin


def _host_port(fields: bytes) -> bytes:
    """The port of the request's Host line (the first line of the block), b"": none."""
    end = fields.find(b"\r\n")
    line = fields[:end] if end >= 0 else fields
    name, _, value = line.partition(b":")
    if name.strip().lower() != b"host":
        return b""
    value = value.strip()
    if value.startswith(b"["):  # an IPv6 literal: [addr]:port
        close = value.find(b"]")
        rest = value[close + 1 :] if close >= 0 else b""
        return rest[1:] if rest.startswith(b":") else b""
    _, colon, port = value.rpartition(b":")
    return port if colon and port.isdigit() else b""
