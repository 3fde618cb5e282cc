"""HTTPRoute filters on request and response heads, sans-IO (pure functions of bytes).

The exchange (`exchange.py`) calls these for routes that have filters, after
routing and before the upstream head is built (request side), and on the
upstream's response head (response side). Per the Gateway API specification:
- RequestHeaderModifier / ResponseHeaderModifier: `set` replaces every line of
  that name (names case-insensitive), `add` appends a line (a repeated field,
  which a recipient reads as the comma-joined value), `remove` drops every
  line of that name. Framing and connection headers (Host, Content-Length,
  Transfer-Encoding, Connection, Upgrade, Keep-Alive, TE, Trailer) are never
  touched: the proxy owns them, so a filter cannot desynchronise a message.
- `StatusHeaders` (ingress-nginx's add_header without `always`, for the auth
  service's Set-Cookie): lines added only to answers of ADD_HEADER_STATUSES.
- URLRewrite: the Host line (X-Forwarded-Host keeps the client's host) and the
  path: ReplaceFullPath, or ReplacePrefixMatch of the matched PathPrefix at a
  segment boundary; the query string is kept.
- RequestRedirect: Location from scheme, hostname, port and path, each the
  request's own unless given; the port is left out when it is the scheme's
  well-known one, and when only the scheme changes (the spec's rule).

Prepared forms, built once per route entry for the per-request path:
`SetFields` (a response modifier that sets fixed lines: appended as bytes, the
backend's block rewritten only when it sent one of those names) and
`PathRewrite` (a route's URLRewrite and RequestHeaderModifier, encoded once;
the head is copied with `RequestHead.copy`, the client's own left as it came).
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from waygate.resolver.client import HeaderModifier, PathModifierType, Redirect, Rewrite

if TYPE_CHECKING:
    from waygate.proxy.routing import Side

# Lines a filter may not add, set or remove (lower-case).
PROTECTED = frozenset(
    (
        b"host",
        b"content-length",
        b"transfer-encoding",
        b"connection",
        b"upgrade",
        b"keep-alive",
        b"te",
        b"trailer",
    )
)
_WELL_KNOWN = {b"http": 80, b"https": 443}
_REASONS = {
    301: b"Moved Permanently",
    302: b"Found",
    303: b"See Other",
    307: b"Temporary Redirect",
    308: b"Permanent Redirect",
}


def _modified_lines(lines: list[bytes], modifier: HeaderModifier | SetFields) -> list[bytes]:
    """`lines` (b"Name: value", no CRLF) with set, add and remove applied."""
    replaced = {n.lower().encode() for n, _ in modifier.set} - PROTECTED
    removed = {n.lower().encode() for n in modifier.remove} - PROTECTED
    dropped = replaced | removed
    out = [line for line in lines if line.partition(b":")[0].strip().lower() not in dropped]
    for name, value in modifier.set:
        if name.lower().encode() not in PROTECTED:
            out.append(name.encode() + b": " + value.encode("latin-1"))
    for name, value in modifier.add:
        if name.lower().encode() not in PROTECTED:
            out.append(name.encode() + b": " + value.encode("latin-1"))
    return out


def modify_request_fields(fields: bytes, modifier: HeaderModifier) -> bytes:
    """A request's field block (b"Name: value\\r\\n" lines) after the modifier."""
    lines = fields.split(b"\r\n")[:-1]
    return b"".join(line + b"\r\n" for line in _modified_lines(lines, modifier))


# The statuses nginx's add_header (without `always`) adds its lines to.
ADD_HEADER_STATUSES: Final = frozenset((200, 201, 204, 206, 301, 302, 303, 304, 307, 308))


_NO_CHANGE: Final = HeaderModifier()


@dataclass(frozen=True)
class StatusHeaders(HeaderModifier):
    """A response modifier (`base`'s set, add and remove) with `add_on_success` lines
    added only to answers of ADD_HEADER_STATUSES. What else the base carries (a
    `responserewrite.ResponseRules`' rewrites and error pages) is read through to
    it, so wrapping one keeps it whole."""

    base: HeaderModifier = _NO_CHANGE
    add_on_success: tuple[tuple[str, str], ...] = ()

    @classmethod
    def over(
        cls, base: HeaderModifier | SetFields | None, lines: tuple[tuple[str, str], ...]
    ) -> StatusHeaders:
        base = general(base) if base is not None else _NO_CHANGE
        return cls(base.set, base.add, base.remove, base, lines)

    def __getattr__(self, name: str) -> Any:
        # (Asked only for names this class lacks; never for `base`, which it has
        # once made: copy and pickle ask before it is set.)
        if name == "base" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.base, name)

    def at(self, status: int) -> HeaderModifier:
        """The modifier an answer of `status` gets (the base's own class)."""
        if status in ADD_HEADER_STATUSES:
            return dataclasses.replace(self.base, add=(*self.base.add, *self.add_on_success))
        return self.base


def general(modifier: HeaderModifier | SetFields) -> HeaderModifier:
    """The modifier as a HeaderModifier (a prepared `SetFields` as the same set, add and
    remove: what a rule composing modifiers builds on)."""
    if type(modifier) is SetFields:
        return HeaderModifier(set=modifier.set, add=modifier.add, remove=modifier.remove)
    return modifier  # type: ignore[return-value]


def with_added(
    modifier: HeaderModifier | SetFields | None, lines: tuple[tuple[str, str], ...]
) -> HeaderModifier:
    """A response modifier with `lines` added after its own, of the same kind (a
    ResponseRules or a StatusHeaders one stays whole)."""
    if modifier is None:
        return HeaderModifier(add=lines)
    modifier = general(modifier)
    if type(modifier) is StatusHeaders:
        return StatusHeaders.over(with_added(modifier.base, lines), modifier.add_on_success)
    return dataclasses.replace(modifier, add=(*modifier.add, *lines))


def remembered(modifier: Any) -> Any:
    """A route's own ResponseHeaderModifier as the request core keeps it, prepared once
    per route entry: a SetFields of no lines of its own over it, which remembers its
    last block's result, so a response head seen again (a remembered parse's copies
    share the block) costs no rewrite. Other modifiers as they are."""
    if type(modifier) is HeaderModifier:
        return SetFields((), modifier)
    return modifier


def modify_response_fields(
    fields: bytes, modifier: HeaderModifier | SetFields, status: int = 200
) -> bytes:
    """A response's field block (b"\\r\\nName: value" lines) after the modifier
    (a `StatusHeaders` one as it applies to the answer's `status`)."""
    if type(modifier) is SetFields:
        if fields is modifier.last_fields:
            # The same block again: a remembered parse's (http1._HEADS: a head seen
            # recently is not parsed again, its copies share the block's bytes).
            return modifier.last_out
        if modifier.base is None and modifier.present.search(fields) is None:
            out = fields + modifier.block  # (the common answer: no line of those names)
        else:
            out = modifier.applied(fields)
        modifier.last_fields = fields
        modifier.last_out = out
        return out
    if type(modifier) is StatusHeaders:
        modifier = modifier.at(status)
    lines = fields.split(b"\r\n")[1:] if fields else []
    rewrite = getattr(modifier, "rewrite", None)
    if rewrite is not None:  # ingress-nginx proxy_redirect, proxy_cookie_* first (responserewrite)
        lines = rewrite(lines)
    return b"".join(b"\r\n" + line for line in _modified_lines(lines, modifier))


class SetFields:
    """A response modifier prepared once: the route's own (`base`, applied first),
    then `headers` set (they replace every line of their names). The lines are
    appended as bytes; the general rewrite runs only when there is a `base` or the
    backend sent one of the names. Duck-typed as a HeaderModifier (`set`, `add`,
    `remove`: the same result through the general rewrite)."""

    __slots__ = ("add", "base", "block", "last_fields", "last_out", "present", "remove", "set")
    # No ingress-nginx error pages ride on it (errorpages reads `errors` off any
    # response modifier: a class attribute, so that read costs no failed lookup).
    errors = None

    def __init__(
        self, headers: tuple[tuple[str, str], ...], base: HeaderModifier | None = None
    ) -> None:
        headers = tuple((n, v) for n, v in headers if n.lower().encode() not in PROTECTED)
        self.base = base
        self.set: tuple[tuple[str, str], ...] = headers
        self.add: tuple[tuple[str, str], ...] = ()
        self.remove: tuple[str, ...] = ()
        if base is not None:
            # These lines win over the route's own of the same names (set or added).
            mine = {n.lower() for n, _ in headers}
            self.set = (*((n, v) for n, v in base.set if n.lower() not in mine), *headers)
            self.add = tuple((n, v) for n, v in base.add if n.lower() not in mine)
            self.remove = base.remove
        self.block = b"".join(
            b"\r\n" + n.encode() + b": " + v.encode("latin-1") for n, v in headers
        )
        names = b"|".join(re.escape(n.encode()) for n, _ in headers) or b"(?!)"
        # A line of one of those names in a response block (each line after a CRLF).
        self.present = re.compile(rb"\n(?:" + names + rb")[ \t]*:", re.IGNORECASE)
        # The last block modified and the result (the block's bytes kept: its identity
        # stands for its content while it is held).
        self.last_fields: bytes | None = None
        self.last_out = b""

    def applied(self, fields: bytes) -> bytes:
        """`fields` (a response block) with the route's modifier and these lines set."""
        lines = fields.split(b"\r\n")[1:] if fields else []
        return b"".join(b"\r\n" + line for line in _modified_lines(lines, self))


def replaced_path(path: bytes, prefix: bytes, kind: PathModifierType, replacement: str) -> bytes:
    """The path after ReplaceFullPath / ReplacePrefixMatch (`prefix`: the matched one)."""
    if kind is PathModifierType.FULL:
        return replacement.encode()
    if kind is not PathModifierType.PREFIX:
        return path
    return _prefix_replaced(path, prefix, replacement.encode())


def _split_target(target: bytes) -> tuple[bytes, bytes]:
    mark = target.find(b"?")
    return (target, b"") if mark < 0 else (target[:mark], target[mark:])


class PathRewrite:
    """A route's URLRewrite and RequestHeaderModifier, prepared once per route entry
    (`prefix`: the matched PathPrefix); `applied(req, path)` per request."""

    __slots__ = (
        "cut",
        "full",
        "host_line",
        "hostname",
        "modifier",
        "prefix",
        "replacement",
        "response_headers",
        "slash_prefix",
        "target_only",
    )

    def __init__(
        self,
        rewrite: Rewrite | None,
        modifier: HeaderModifier | None,
        prefix: bytes,
        response_headers: HeaderModifier | None = None,
    ) -> None:
        kind = rewrite.path_type if rewrite is not None else PathModifierType.NONE
        self.prefix = prefix
        self.cut = len(prefix) if prefix != b"/" else 1  # where the rest of a path starts
        # None: the path is kept; else the replacement (full path or prefix).
        self.replacement: bytes | None = None
        if rewrite is not None and kind is not PathModifierType.NONE:
            self.replacement = rewrite.path.encode()
        self.full = kind is PathModifierType.FULL
        self.hostname = rewrite.hostname.encode() if rewrite is not None else b""
        self.host_line = b"Host: " + self.hostname if self.hostname else b""
        self.modifier = modifier
        # Only the target changes (no Host, no header modifier): the caller may keep the
        # request head and send `target(req, path)` instead of a copy of the head.
        self.target_only = not self.host_line and modifier is None
        # The commonest rewrite alone (ingress-nginx's `rewrite-target: /$2` of
        # `path: /api(/|$)(.*)`): a prefix replaced by one ending in "/"
        # (`shape_slash_prefix`).
        self.slash_prefix = (
            self.target_only
            and not self.full
            and self.replacement is not None
            and self.replacement[-1:] == b"/"
        )
        self.response_headers = response_headers  # the route's ResponseHeaderModifier

    def shape(self, forward: Any, req: Any, facts: Any) -> None:
        """The request core's rule (decision.SHAPERS "request_filters", bound to this
        route entry's rewrite: one call per request): the request as the backend gets
        it (a target alone held apart: forward.rewritten_target, no head copy), the
        rewritten Host, and the route's ResponseHeaderModifier kept for its answer."""
        if self.target_only:
            forward.rewritten_target = self.target(req, forward.path)
        else:
            forward.req = self.applied(req, forward.path)
            if self.hostname:
                forward.authority = self.hostname
        if self.response_headers is not None and forward.response_modifier is None:
            forward.response_modifier = self.response_headers  # (a CORS answer holds it)

    def shape_slash_prefix(self, forward: Any, req: Any, facts: Any) -> None:
        """`shape` for the commonest rewrite alone (`slash_prefix`): `target`'s prefix
        case inline, the replacement, then the rest of the path without its leading
        slashes, then the query (none when the request core's path is the target
        itself); the route's response modifier kept as `shape` keeps it."""
        path = forward.path
        if path[:1] == b"/":
            new = self.replacement + path[self.cut :].lstrip(b"/")  # type: ignore[operator]
            target = req.target
            forward.rewritten_target = new if path is target else new + target[len(path) :]
        else:
            forward.rewritten_target = self.target(req, path)
        if self.response_headers is not None and forward.response_modifier is None:
            forward.response_modifier = self.response_headers  # (a CORS answer holds it)

    def target(self, req: Any, path: bytes) -> bytes:
        """The request's target after the rewrite (`path`: its path, without the query)."""
        new = self.replacement
        if new is None:
            return req.target  # type: ignore[no-any-return]
        query = req.target[len(path) :]
        if self.full:
            return new + query
        if path[:1] == b"/":
            # _prefix_replaced, without the call: a matched prefix, then the rest.
            rest = path[self.cut :]
            if not rest:
                return (new or b"/") + query
            if new[-1:] == b"/":
                return new + rest.lstrip(b"/") + query
            return new + (rest if rest[:1] == b"/" else b"/" + rest) + query
        return _prefix_replaced(path, self.prefix, new) + query

    def applied(self, req: Any, path: bytes) -> Any:
        """A copy of the request head with the rewrite and the header modifier applied
        (`path`: the request's path, without the query)."""
        out = req.copy()
        if self.replacement is not None:
            out.target = self.target(req, path)
        if self.host_line or self.modifier is not None:
            fields = req.fields
            if self.host_line:
                # The Host line comes first in the block (http1.parse_request_head).
                fields = self.host_line + fields[fields.find(b"\r\n") :]
            if self.modifier is not None:
                fields = modify_request_fields(fields, self.modifier)
            out.fields = fields
        return out


def _prefix_replaced(path: bytes, prefix: bytes, new: bytes) -> bytes:
    """ReplacePrefixMatch of `prefix` (matched at a segment boundary) with `new`."""
    rest = path[len(prefix) :] if prefix != b"/" else path[1:] if path.startswith(b"/") else path
    if not rest:
        return new or b"/"
    if new.endswith(b"/"):
        return new + rest.lstrip(b"/")
    return new + (rest if rest.startswith(b"/") else b"/" + rest)


def rewritten_request(
    req: Any, rewrite: Rewrite | None, modifier: HeaderModifier | None, prefix: bytes
) -> Any:
    """A copy of the request head with the rewrite and the header modifier applied
    (unprepared: `PathRewrite` is the per-route form)."""
    path, _ = _split_target(req.target)
    return PathRewrite(rewrite, modifier, prefix).applied(req, path)


def redirect_location(
    req: Any, redirect: Redirect, prefix: bytes, *, secure: Side, listener_port: int
) -> bytes:
    """The Location for a request that matched a RequestRedirect rule."""
    scheme = redirect.scheme.encode() if redirect.scheme else (b"https" if secure else b"http")
    host = redirect.hostname.encode() if redirect.hostname else req.host
    if redirect.port:
        port = redirect.port
    elif redirect.scheme:
        port = _WELL_KNOWN[scheme]
    else:
        port = listener_port or _WELL_KNOWN[scheme]
    authority = host if _WELL_KNOWN.get(scheme) == port else host + b":%d" % port
    path, query = _split_target(req.target)
    path = replaced_path(path, prefix, redirect.path_type, redirect.path)
    uri = path + query
    if redirect.strip_trailing_slash and uri != b"/" and uri.endswith(b"/"):
        uri = uri[:-1]  # ingress-nginx's HTTPS redirect without preserve-trailing-slash
    return scheme + b"://" + authority + uri


REDIRECT_STATUSES = frozenset(_REASONS)
# nginx's `return CODE TEXT` for a code that is not a redirect: the text, as
# ingress-nginx's default_type (text/html).
_TEXT_REASONS = {300: b"Multiple Choices", 304: b"Not Modified", 305: b"Use Proxy", 306: b"Unused"}


def text_response(status: int, text: bytes, head_only: bool) -> bytes:
    """nginx's `return CODE TEXT` (a status that is not a redirect): the text as the
    body (none for HEAD or a 304, its length still given, as nginx), no Location."""
    head = b"HTTP/1.1 %d %s\r\nContent-Type: text/html\r\nContent-Length: %d\r\n\r\n" % (
        status,
        _TEXT_REASONS.get(status, b""),
        len(text),
    )
    return head if head_only or status == 304 else head + text


def redirect_head(status: int, location: bytes, *, close: bool) -> bytes:
    """The whole redirect answer (no body)."""
    return b"HTTP/1.1 %d %s\r\nLocation: %s\r\nContent-Length: 0\r\n%s\r\n" % (
        status,
        _REASONS.get(status, b"Found"),
        location,
        b"Connection: close\r\n" if close else b"",
    )
