"""HTTP/1.1 message rules for the proxy, sans-IO: no sockets, no event loop.

The protocol classes in `server.py` hand this module bytes and get back
decisions and bytes to write; unit tests drive it directly.

What lives here:
- `find_head_end`: where a message head ends (CRLF CRLF), with the size limits.
- `parse_request_head`: a strict gate (one compiled regex over the raw head,
  RFC 9112's grammar with no leniency) followed by httptools (llhttp, C) for
  the parse itself, then the framing and hygiene rules. Any refusal raises
  `BadMessage` with the rule it enforces; nothing of a refused request is
  ever forwarded.
- `parse_response_head`: the same for an upstream's response (`BadMessage`
  there means 502 and the upstream connection discarded).
- `build_upstream_head` / `build_client_head`: the rewritten heads
  (hop-by-hop and Connection-named headers dropped, `Proxy` dropped, identity
  headers dropped, X-Forwarded-* and `Forwarded` per the route's mode).
- `ChunkedReader`: strict incremental chunked framing; re-emits the chunks
  (extensions dropped) or the bare payload, and drops trailer fields (see
  below).
- `error_response`: the precomputed bytes of every local answer.

Trailers are dropped deliberately on both sides: neither side of the proxy
negotiates `TE: trailers`, and RFC 9110 section 6.5.1 lets an intermediary
discard trailer fields it does not understand; forwarding them would let a
client smuggle fields (Host, Content-Length) past the header checks.

Invariants:
- Header names are compared lower-cased, computed once per header.
- A refused message raises before any byte of it has been handed to an
  upstream; the caller answers 400 (request) or 502 (response) and closes.
- The per-request path does no logging, no f-strings and no dict copies.
"""

from __future__ import annotations

import re
from typing import Final
from urllib.parse import unquote_to_bytes

import httptools

MAX_REQUEST_LINE: Final = 8 * 1024
MAX_HEAD_BYTES: Final = 32 * 1024
MAX_CHUNK_LINE: Final = 1024
MAX_TRAILER_BYTES: Final = 8 * 1024

FORWARDED_MODES: Final = ("append", "replace", "if-none", "never")

_TCHAR = rb"[!#$%&'*+\-.^_`|~0-9A-Za-z]"
# A header field: token, colon, value of visible ASCII, obs-text, SP and HTAB
# only. No CR or LF inside (so no bare LF and no obs-fold), no other control
# characters, no whitespace between name and colon. Possessive repeats (`++`,
# `*+`): each repeated class excludes what follows it (a token has no colon, a
# value no CR, a field starts with a token and the head's end with CR), so
# backtracking could never find another match; not recording the backtrack
# points makes the gate about a quarter cheaper.
_FIELD = _TCHAR + rb"++:[\t\x20-\x7e\x80-\xff]*+\r\n"
_REQUEST_HEAD = re.compile(
    _TCHAR + rb"++ [\x21-\x7e]++ HTTP/1\.[01]\r\n(?:" + _FIELD + rb")*+\r\n", re.DOTALL
)
_RESPONSE_HEAD = re.compile(
    rb"HTTP/1\.[01] [1-9][0-9][0-9] [\t\x20-\x7e\x80-\xff]*+\r\n(?:" + _FIELD + rb")*+\r\n",
    re.DOTALL,
)
_HOST = re.compile(rb"(?:\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-_~!$&'()*+,;=%]+)(?::[0-9]{1,5})?")
_DIGITS = re.compile(rb"[0-9]{1,18}")
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:;[\t\x20-\x7e]*)?")


class BadMessage(Exception):
    """A message broke a rule; `reason` names it (sent to the client for requests)."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


# ---------------------------------------------------------------- header classes

# What to do with each request header name (lower-cased); absent: forward.
DROP: Final = 1  # hop-by-hop, `Proxy`, identity headers: never forwarded
FORWARDED_FAMILY: Final = 2  # rewritten per the route's forwarded mode
SPECIAL: Final = 3  # read by the proxy, then forwarded or dropped by rule

_REQUEST_CLASSES: Final[dict[bytes, int]] = {
    b"connection": DROP,
    b"keep-alive": DROP,
    b"proxy-connection": DROP,
    b"proxy-authenticate": DROP,
    b"proxy-authorization": DROP,
    b"te": DROP,
    b"trailer": DROP,
    b"transfer-encoding": DROP,
    b"upgrade": DROP,
    b"proxy": DROP,  # httpoxy: never forwarded (CVE-2016-5385)
    b"x-remote-user": DROP,
    b"x-remote-group": DROP,
    b"x-forwarded-for": FORWARDED_FAMILY,
    b"x-forwarded-host": FORWARDED_FAMILY,
    b"x-forwarded-port": FORWARDED_FAMILY,
    b"x-forwarded-proto": FORWARDED_FAMILY,
    b"forwarded": FORWARDED_FAMILY,
    b"host": SPECIAL,
    b"content-length": SPECIAL,
    b"expect": SPECIAL,
    b"traceparent": SPECIAL,
    b"cookie": SPECIAL,
}
# The response headers the proxy reads and drops (re-adding framing itself),
# found at a line start of the lower-cased, already-validated head (every LF
# there ends a line): no IGNORECASE, no MULTILINE, one pass instead of a
# findall and a sub (about 3 us less per response, measured).
_RESPONSE_HOP_NAME: Final = re.compile(
    rb"\n(connection|keep-alive|proxy-connection|te|trailer|transfer-encoding|upgrade"
    rb"|content-length):"
)
_NO_CALLBACKS: Final = object()  # httptools calls no Python code for it


def _is_identity_header(lname: bytes) -> bool:
    """Client-sent identity headers: stripped on every route (front-proxy rule).

    Compared with '_' read as '-': WSGI/CGI backends map X_Remote_User and
    X-Remote_User to the same HTTP_X_REMOTE_USER as X-Remote-User.
    """
    if b"_" in lname:
        lname = lname.replace(b"_", b"-")
        if lname == b"x-remote-user" or lname == b"x-remote-group":
            return True
    return lname.startswith(b"x-ssl-") or lname.startswith(b"x-remote-extra-")


def find_head_end(
    buffer: bytes | bytearray, limit: int = MAX_HEAD_BYTES, start: int = 0, origin: int = 0
) -> int:
    """Index just past the head's CRLF CRLF, or -1 while incomplete.

    `start`: where to resume the search in a growing buffer (bytes before it
    were already searched, less 3 for a terminator split across reads), so a
    head trickled in byte by byte costs linear, not quadratic, time.
    `origin`: where the head starts in `buffer` (pipelined heads are walked in
    place, never sliced off one by one); the limits count from there.
    Raises BadMessage when the head or its first line outgrows the limits, or
    when it ends with a bare LF (which the strict grammar refuses anyway: this
    just refuses it now rather than at the size limit).
    """
    if start < origin:
        start = origin
    end = buffer.find(b"\r\n\r\n", start)
    if end < 0:
        size = len(buffer) - origin
        line_end = buffer.find(b"\n", origin)
        if (line_end < 0 and size > MAX_REQUEST_LINE) or line_end - origin > MAX_REQUEST_LINE:
            raise BadMessage("request line longer than 8 KiB", 414)
        if size > limit:
            raise BadMessage("header block larger than 32 KiB", 431)
        if buffer.find(b"\n\n", start) >= 0 or buffer.find(b"\n\r\n", start) >= 0:
            raise BadMessage("bare LF line ending (RFC 9112 section 2.2)")
        return -1
    end += 4
    if end - origin > limit:
        raise BadMessage("header block larger than 32 KiB", 431)
    line_end = buffer.find(b"\r\n", origin)
    if line_end - origin > MAX_REQUEST_LINE:
        raise BadMessage("request line longer than 8 KiB", 414)
    return end


# ---------------------------------------------------------------- requests


class RequestHead:
    """One parsed, validated request head (also httptools' callback target)."""

    __slots__ = (
        "_connection_tokens",
        "_hosts",
        "_te",
        "chunked",
        "content_length",
        "cookie",
        "expect_continue",
        "forwarded",
        "headers",
        "host",
        "keep_alive",
        "method",
        "target",
        "traceparent",
        "upgrade",
        "version",
    )

    def __init__(self) -> None:
        self.method = b""
        self.target = b""
        self.version = b"1.1"
        # Forwarded as they came, in order: whole lines b"Name: value\r\n".
        self.headers: list[bytes] = []
        # X-Forwarded-* and Forwarded as the client sent them: (lname, name, value).
        self.forwarded: list[tuple[bytes, bytes, bytes]] = []
        self.host = b""  # lower-cased, port stripped
        self.content_length = -1  # -1: none
        self.chunked = False
        self.keep_alive = True
        self.upgrade = b""  # the Upgrade header's value when Connection names upgrade
        self.expect_continue = False
        self.traceparent = b""
        self.cookie: list[bytes] = []
        self._connection_tokens: list[bytes] | None = None
        self._te: list[bytes] = []
        self._hosts = 0

    # httptools callbacks -----------------------------------------------

    def on_url(self, url: bytes) -> None:
        self.target += url

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        kind = _REQUEST_CLASSES.get(lname)
        if kind is None:
            if (lname[:2] == b"x-" or lname[:2] == b"x_") and _is_identity_header(lname):
                return
            self.headers.append(name + b": " + value + b"\r\n")
        elif kind == SPECIAL:
            if lname == b"host":
                self._hosts += 1
                self.host = value
                self.headers.append(name + b": " + value + b"\r\n")
            elif lname == b"content-length":
                if self.content_length >= 0:
                    raise BadMessage("more than one Content-Length (RFC 9112 section 6.3)")
                if not _DIGITS.fullmatch(value):
                    raise BadMessage("malformed Content-Length (RFC 9112 section 6.3)")
                self.content_length = int(value)
            elif lname == b"expect":
                if value.lower() != b"100-continue":
                    raise BadMessage("unsupported Expect (RFC 9110 section 10.1.1)", 417)
                self.expect_continue = True
                self.headers.append(name + b": " + value + b"\r\n")
            elif lname == b"traceparent":
                self.traceparent = value
            else:  # cookie
                self.cookie.append(value)
                self.headers.append(name + b": " + value + b"\r\n")
        elif kind == FORWARDED_FAMILY:
            self.forwarded.append((lname, name, value))
        elif lname == b"connection":
            tokens = [t.strip().lower() for t in value.split(b",")]
            if self._connection_tokens is None:
                self._connection_tokens = tokens
            else:
                self._connection_tokens.extend(tokens)
        elif lname == b"transfer-encoding":
            self._te.append(value)
        elif lname == b"upgrade":
            self.upgrade = value

    # helpers --------------------------------------------------------------

    @property
    def http10(self) -> bool:
        return self.version == b"1.0"

    @property
    def has_body(self) -> bool:
        return self.chunked or self.content_length > 0


def parse_request_head(head: bytes) -> RequestHead:
    """Validate and parse one complete request head (ending CRLF CRLF)."""
    if _REQUEST_HEAD.fullmatch(head) is None:
        raise BadMessage(_explain_request_grammar(head))
    request = RequestHead()
    parser = httptools.HttpRequestParser(request)
    try:
        parser.feed_data(head)
    except httptools.HttpParserUpgrade:
        pass
    except BadMessage:
        raise
    except httptools.HttpParserError as exc:
        raise BadMessage("malformed request: " + str(exc).lower()) from None
    request.method = parser.get_method()
    # The grammar checked the request line ends in "HTTP/1.0" or "HTTP/1.1".
    line_end = head.find(b"\r\n")
    request.version = head[line_end - 3 : line_end]
    _check_request(request)
    return request


def _check_request(request: RequestHead) -> None:
    if request._hosts != 1:
        raise BadMessage(
            "missing Host header (RFC 9112 section 3.2)"
            if request._hosts == 0
            else "more than one Host header (RFC 9112 section 3.2)"
        )
    host = request.host
    if not _HOST.fullmatch(host):
        raise BadMessage("malformed Host header (RFC 9112 section 3.2)")
    if host[:1] == b"[":
        request.host = host[: host.index(b"]") + 1].lower()
    else:
        request.host = host.partition(b":")[0].lower()
    target = request.target
    if target[:1] != b"/" and not (target == b"*" and request.method == b"OPTIONS"):
        raise BadMessage("request target must be origin-form, /path (RFC 9112 section 3.2)")
    if b"/." in target or b"%" in target:
        _check_dot_segments(target)
    if request.method == b"CONNECT":
        raise BadMessage("CONNECT is not served (reverse proxy)", 405)
    if request._te:
        if request.content_length >= 0:
            raise BadMessage(
                "Content-Length with Transfer-Encoding (RFC 9112 section 6.1: smuggling)"
            )
        if request.version == b"1.0":
            raise BadMessage("Transfer-Encoding in an HTTP/1.0 request (RFC 9112 section 6.1)")
        if len(request._te) != 1 or request._te[0].strip().lower() != b"chunked":
            raise BadMessage(
                "Transfer-Encoding other than a single chunked (RFC 9112 section 6.1)", 400
            )
        request.chunked = True
    tokens = request._connection_tokens
    keep_alive = not request.http10
    if tokens is not None:
        if b"close" in tokens:
            keep_alive = False
        elif request.http10 and b"keep-alive" in tokens:
            # HTTP/1.0 keep-alive is not offered: the answer closes (documented).
            keep_alive = False
        if b"upgrade" in tokens and request.upgrade and not request.http10:
            pass
        else:
            request.upgrade = b""
        named = (
            None
            if tokens == [b"keep-alive"]  # the common case: nothing named
            else [t for t in tokens if t not in (b"close", b"keep-alive", b"upgrade", b"")]
        )
        if named:
            # Headers named in Connection are hop-by-hop too (RFC 9110 section 7.6.1);
            # Host is not: dropping it would send upstream a request without one.
            if b"host" in named:
                raise BadMessage("Connection names Host, which is not hop-by-hop (RFC 9110 7.6.1)")
            drop = set(named)
            request.headers = [
                line for line in request.headers if line.split(b":", 1)[0].lower() not in drop
            ]
            request.forwarded = [h for h in request.forwarded if h[0] not in drop]
            if b"cookie" in drop:
                request.cookie = []
    else:
        request.upgrade = b""
    request.keep_alive = keep_alive


def _check_dot_segments(target: bytes) -> None:
    """Refuse a path with a '.' or '..' segment once percent-decoded (';' ends a
    segment's name, as Tomcat and Jetty read /..;/): /public/../admin, /%2e%2e/admin
    and /public/..;/admin would match a "/" or "/public" route here and reach /admin
    once the backend resolves them. Stricter than HAProxy (which forwards them)."""
    path = unquote_to_bytes(target.partition(b"?")[0])
    for segment in path.split(b"/"):
        name = segment.partition(b";")[0]
        if name == b"." or name == b"..":
            raise BadMessage("dot segment in the request path (RFC 3986 section 3.3)")


def _explain_request_grammar(head: bytes) -> str:
    """Which rule a head the strict grammar refused broke (only on the error path)."""
    first, _, rest = head.partition(b"\r\n")
    if b"\n" in first or re.search(rb"[^\r]\n", head):
        return "bare LF line ending (RFC 9112 section 2.2)"
    parts = first.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
        return "malformed request line (RFC 9112 section 3)"
    if parts[2] not in (b"HTTP/1.1", b"HTTP/1.0"):
        return "unsupported HTTP version (RFC 9112 section 2.3)"
    if not re.fullmatch(_TCHAR + rb"+", parts[0]):
        return "malformed method (RFC 9110 section 9.1)"
    if re.search(rb"[\x00-\x20\x7f]", parts[1]):
        return "control character or space in the request target (RFC 9112 section 3.2)"
    for line in rest[:-4].split(b"\r\n") if rest != b"\r\n" else ():
        if line[:1] in (b" ", b"\t"):
            return "obs-fold line folding (RFC 9112 section 5.2)"
        name, colon, value = line.partition(b":")
        if not colon:
            return "header line without a colon (RFC 9112 section 5)"
        if name[-1:] in (b" ", b"\t"):
            return "whitespace between header name and colon (RFC 9112 section 5.1)"
        if not re.fullmatch(_TCHAR + rb"+", name):
            return "malformed header name (RFC 9110 section 5.1)"
        if re.search(rb"[\x00-\x08\x0a-\x1f\x7f]", value):
            return "control character in a header value (RFC 9110 section 5.5)"
    return "malformed request head (RFC 9112)"


# ---------------------------------------------------------------- rewriting


class ForwardedContext:
    """Per client connection: the bytes the forwarded headers add (built once)."""

    __slots__ = ("client_ip", "forwarded_for", "last_added", "last_host", "port", "proto")

    def __init__(self, client_ip: str, port: int, proto: bytes = b"http") -> None:
        self.client_ip = client_ip.encode()
        self.proto = proto
        self.port = str(port).encode()
        node = self.client_ip
        if b":" in node:
            node = b'"[' + node + b']"'
        self.forwarded_for = b"for=" + node
        # The five added headers for the last Host seen (keep-alive reuses it).
        self.last_host = b""
        self.last_added = b""

    def added(self, host: bytes) -> bytes:
        if host != self.last_host:
            self.last_host = host
            self.last_added = (
                b"X-Forwarded-Host: %s\r\nX-Forwarded-Port: %s\r\nX-Forwarded-Proto: %s\r\n"
                b"X-Forwarded-For: %s\r\nForwarded: %s;host=%s;proto=%s\r\n"
                % (
                    host,
                    self.port,
                    self.proto,
                    self.client_ip,
                    self.forwarded_for,
                    _quote(host),
                    self.proto,
                )
            )
        return self.last_added


def build_upstream_head(
    request: RequestHead,
    context: ForwardedContext,
    mode: str,
    traceparent: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
) -> bytes:
    """The head sent upstream: always HTTP/1.1, keep-alive unless upgrading."""
    parts = [request.method, b" ", request.target, b" HTTP/1.1\r\n", *request.headers]
    append = parts.append
    if not request.forwarded and (mode == "append" or mode == "replace" or mode == "if-none"):
        append(context.added(request.host))  # the common case, without a call more
    elif request.forwarded or mode != "never":
        _forwarded_headers(parts, request, context, mode)
    if traceparent:
        append(b"traceparent: ")
        append(traceparent)
        append(b"\r\n")
    if request.chunked:
        append(b"Transfer-Encoding: chunked\r\n")
    elif request.content_length >= 0:
        append(b"Content-Length: ")
        append(b"%d" % request.content_length)
        append(b"\r\n")
    if extra:
        for name, value in extra:
            parts += (name, b": ", value, b"\r\n")
    if request.upgrade:
        append(b"Connection: upgrade\r\nUpgrade: ")
        append(request.upgrade)
        append(b"\r\n\r\n")
    else:
        append(b"\r\n")
    return b"".join(parts)


_ADDED_NAMES: Final = (
    (b"x-forwarded-host", b"X-Forwarded-Host: "),
    (b"x-forwarded-port", b"X-Forwarded-Port: "),
    (b"x-forwarded-proto", b"X-Forwarded-Proto: "),
    (b"x-forwarded-for", b"X-Forwarded-For: "),
    (b"forwarded", b"Forwarded: "),
)


def _forwarded_headers(
    parts: list[bytes], request: RequestHead, context: ForwardedContext, mode: str
) -> None:
    """X-Forwarded-* and Forwarded per mode (OpenShift's set-forwarded-headers)."""
    sent = request.forwarded
    if mode == "never":
        for _, name, value in sent:
            parts += (name, b": ", value, b"\r\n")
        return
    if mode == "append":
        for _, name, value in sent:
            parts += (name, b": ", value, b"\r\n")
    if mode != "if-none" or not sent:
        parts.append(context.added(request.host))
        return
    present = {lname for lname, _, _ in sent}
    for _, name, value in sent:
        parts += (name, b": ", value, b"\r\n")
    host = request.host
    values = (
        host,
        context.port,
        context.proto,
        context.client_ip,
        context.forwarded_for + b";host=" + _quote(host) + b";proto=" + context.proto,
    )
    for (lname, prefix), value in zip(_ADDED_NAMES, values, strict=True):
        if lname in present:
            continue
        parts += (prefix, value, b"\r\n")


def _quote(host: bytes) -> bytes:
    return b'"' + host + b'"' if b":" in host or b"[" in host else host


# ---------------------------------------------------------------- responses


class ResponseHead:
    """One parsed, validated response head.

    httptools validates it and gives the status; it has no header callbacks
    (none per header per response): the few headers the proxy must read or
    drop are found by one regex pass over the raw block, and every other line
    is forwarded byte for byte as one block.
    """

    __slots__ = (
        "_connection",
        "_te",
        "chunked",
        "content_length",
        "headers",
        "keep_alive",
        "reason",
        "status",
        "upgrade",
    )

    def __init__(self) -> None:
        self.status = 0
        self.reason = b""
        # Forwarded as they came: whole lines b"Name: value\r\n".
        self.headers: list[bytes] = []
        self.content_length = -1
        self.chunked = False
        self.keep_alive = True
        self.upgrade = b""
        self._te: list[bytes] = []
        self._connection: list[bytes] = []

    def hop(self, lname: bytes, value: bytes) -> None:
        """One header the proxy reads and does not forward as is (see _RESPONSE_HOP_NAME)."""
        if lname == b"content-length":
            if self.content_length >= 0 or not _DIGITS.fullmatch(value):
                raise BadMessage("upstream sent a malformed or repeated Content-Length", 502)
            self.content_length = int(value)
        elif lname == b"transfer-encoding":
            self._te.append(value)
        elif lname == b"connection":
            lowered = value.lower()
            if b"," in lowered:
                self._connection += [t.strip() for t in lowered.split(b",")]
            else:
                self._connection.append(lowered.strip())
        elif lname == b"upgrade":
            self.upgrade = value


def parse_response_head(head: bytes, http10_upstream_ok: bool = True) -> ResponseHead:
    """Validate and parse one complete upstream response head; BadMessage means 502."""
    if _RESPONSE_HEAD.fullmatch(head) is None:
        raise BadMessage("upstream sent a malformed response head", 502)
    response = ResponseHead()
    parser = httptools.HttpResponseParser(_NO_CALLBACKS)
    try:
        parser.feed_data(head)
    except httptools.HttpParserUpgrade:
        pass
    except BadMessage:
        raise
    except httptools.HttpParserError as exc:
        raise BadMessage("upstream sent a malformed response: " + str(exc).lower(), 502) from None
    line_end = head.find(b"\r\n")
    # Every other header line is forwarded byte for byte: the blocks between
    # the hop lines, sliced from the original head (lower() keeps positions).
    kept: list[bytes] = []
    keep_from = line_end + 2
    for match in _RESPONSE_HOP_NAME.finditer(head.lower(), line_end):
        name_end = match.end()
        value_end = head.find(b"\r\n", name_end)
        kept.append(head[keep_from : match.start() + 1])
        keep_from = value_end + 2
        response.hop(match.group(1), head[name_end:value_end].strip(b" \t"))
    if kept:
        kept.append(head[keep_from:-2])
        response.headers = [b"".join(kept)]
    else:
        response.headers = [head[keep_from:-2]]
    response.status = status = parser.get_status_code()
    if status not in _STATUS_LINES:
        # The reason phrase is needed only for a status line not precomputed
        # (no httptools callback per response for it).
        response.reason = head[13:line_end]
    if response._te:
        if response.content_length >= 0:
            raise BadMessage("upstream sent Content-Length with Transfer-Encoding", 502)
        if len(response._te) != 1 or response._te[0].strip().lower() != b"chunked":
            raise BadMessage("upstream sent a Transfer-Encoding other than chunked", 502)
        response.chunked = True
    if b"close" in response._connection or head[5:8] == b"1.0":
        response.keep_alive = b"keep-alive" in response._connection and head[5:8] != b"1.0"
    if response._connection and response._connection != [b"keep-alive"]:
        named = {
            t for t in response._connection if t not in (b"close", b"keep-alive", b"upgrade", b"")
        }
        if named:
            _drop_named_response_headers(response, named)
    return response


def _drop_named_response_headers(response: ResponseHead, named: set[bytes]) -> None:
    """Headers the upstream's Connection names are hop-by-hop (RFC 9110 section 7.6.1)."""
    lines = b"".join(response.headers).split(b"\r\n")
    kept = [line for line in lines[:-1] if line.split(b":", 1)[0].lower() not in named]
    response.headers = [b"".join(line + b"\r\n" for line in kept)]


def build_client_head(
    response: ResponseHead, framing: int, length: int, keep_alive: bool, extra: bytes = b""
) -> bytes:
    """The head sent to the client. `framing`: one of the FRAMING_* constants."""
    parts = [_STATUS_LINES.get(response.status) or _status_line(response), *response.headers]
    append = parts.append
    if framing == FRAMING_LENGTH:
        append(b"Content-Length: ")
        append(b"%d" % length)
        append(b"\r\n")
    elif framing == FRAMING_CHUNKED:
        append(b"Transfer-Encoding: chunked\r\n")
    if extra:
        append(extra)
    append(b"\r\n" if keep_alive else b"Connection: close\r\n\r\n")
    return b"".join(parts)


def _status_line(response: ResponseHead) -> bytes:
    return b"HTTP/1.1 %d %s\r\n" % (response.status, response.reason)


_STATUS_LINES: Final[dict[int, bytes]] = {
    200: b"HTTP/1.1 200 OK\r\n",
    204: b"HTTP/1.1 204 No Content\r\n",
    301: b"HTTP/1.1 301 Moved Permanently\r\n",
    302: b"HTTP/1.1 302 Found\r\n",
    304: b"HTTP/1.1 304 Not Modified\r\n",
    404: b"HTTP/1.1 404 Not Found\r\n",
}

FRAMING_NONE: Final = 0  # no body (HEAD, 1xx, 204, 304)
FRAMING_LENGTH: Final = 1
FRAMING_CHUNKED: Final = 2
FRAMING_CLOSE: Final = 3  # the body runs until the connection closes


def response_framing(method: bytes, response: ResponseHead) -> int:
    """How the upstream's response body is delimited (RFC 9112 section 6.3)."""
    status = response.status
    if method == b"HEAD" or status < 200 or status == 204 or status == 304:
        return FRAMING_NONE
    if response.chunked:
        return FRAMING_CHUNKED
    if response.content_length >= 0:
        return FRAMING_LENGTH
    return FRAMING_CLOSE


# ---------------------------------------------------------------- chunked bodies


class ChunkedReader:
    """Strict incremental chunked decoding (RFC 9112 section 7.1).

    `feed(data)` returns (output pieces, bytes of `data` consumed); after the
    last chunk and the (dropped) trailer section, `done` is True and the rest
    of `data` belongs to the next message. With `rechunk`, the output is the
    chunked body again (extensions and trailers dropped); without it, the bare
    payload. Raises BadMessage for a malformed size line, a missing CRLF after
    a chunk, or oversized size lines and trailer sections.
    """

    __slots__ = ("_line", "_remaining", "_state", "_status", "done", "rechunk")

    _SIZE, _DATA, _DATA_CRLF, _TRAILER = range(4)

    def __init__(self, *, rechunk: bool = True, status: int = 400) -> None:
        self.rechunk = rechunk
        self.done = False
        self._state = self._SIZE
        self._remaining = 0
        self._line = b""
        self._status = status

    def feed(self, data: bytes) -> tuple[list[bytes], int]:
        out: list[bytes] = []
        pos = 0
        size = len(data)
        while pos < size and not self.done:
            state = self._state
            if state == self._DATA:
                take = min(self._remaining, size - pos)
                out.append(data[pos : pos + take] if take != size else data)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = self._DATA_CRLF
                    if self.rechunk:
                        out.append(b"\r\n")
            elif state == self._SIZE or state == self._TRAILER:
                pending = self._line
                if pending:
                    # A line split across reads (possibly between CR and LF).
                    joined = pending + data[pos:]
                    end = joined.find(b"\r\n")
                    if end >= 0:
                        line = joined[:end]
                        pos += end + 2 - len(pending)
                        self._line = b""
                else:
                    end = data.find(b"\r\n", pos)
                    if end >= 0:
                        line = data[pos:end]
                        pos = end + 2
                if end < 0:
                    self._line = pending + data[pos:]
                    pos = size
                    limit = MAX_CHUNK_LINE if state == self._SIZE else MAX_TRAILER_BYTES
                    if len(self._line) > limit:
                        raise BadMessage("chunk size line or trailer too long", self._status)
                    if b"\n" in self._line:
                        raise BadMessage(
                            "bare LF in chunked framing (RFC 9112 section 7.1)", self._status
                        )
                    break
                if state == self._SIZE:
                    match = _CHUNK_SIZE.fullmatch(line)
                    if match is None or b"\n" in line or b"\r" in line:
                        raise BadMessage(
                            "malformed chunk size (RFC 9112 section 7.1)", self._status
                        )
                    chunk = int(match.group(1), 16)
                    if chunk == 0:
                        self._state = self._TRAILER
                    else:
                        self._remaining = chunk
                        self._state = self._DATA
                        if self.rechunk:
                            out.append(b"%x\r\n" % chunk)
                else:
                    self._remaining += len(line) + 2
                    if self._remaining > MAX_TRAILER_BYTES:
                        raise BadMessage("trailer section too large", self._status)
                    if line == b"":
                        self.done = True
                        if self.rechunk:
                            out.append(b"0\r\n\r\n")
                    elif b"\n" in line or b":" not in line:
                        raise BadMessage("malformed trailer field", self._status)
            else:  # _DATA_CRLF
                need = 2 - len(self._line)
                piece = data[pos : pos + need]
                self._line += piece
                pos += len(piece)
                if len(self._line) == 2:
                    if self._line != b"\r\n":
                        raise BadMessage(
                            "chunk data not followed by CRLF (RFC 9112 section 7.1)",
                            self._status,
                        )
                    self._line = b""
                    self._state = self._SIZE
                elif self._line != b"\r":
                    raise BadMessage(
                        "chunk data not followed by CRLF (RFC 9112 section 7.1)", self._status
                    )
        return out, pos


# ---------------------------------------------------------------- local answers

_REASONS: Final = {
    100: b"Continue",
    400: b"Bad Request",
    401: b"Unauthorized",
    403: b"Forbidden",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    417: b"Expectation Failed",
    431: b"Request Header Fields Too Large",
    500: b"Internal Server Error",
    502: b"Bad Gateway",
    503: b"Service Unavailable",
    504: b"Gateway Timeout",
}


def error_response(
    status: int, reason: str, *, close: bool = True, head_only: bool = False, body: bytes = b""
) -> bytes:
    """A complete local answer with the reason in the body and X-Waygate-Error."""
    text = reason.encode("ascii", "replace")
    payload = body or (text + b"\n")
    head = (
        b"HTTP/1.1 %d %s\r\nContent-Type: text/%s; charset=utf-8\r\nContent-Length: %d\r\n"
        b"Cache-Control: no-store\r\nX-Waygate-Error: %s\r\n%s\r\n"
        % (
            status,
            _REASONS.get(status, b"Error"),
            b"html" if body else b"plain",
            len(payload),
            text,
            b"Connection: close\r\n" if close else b"",
        )
    )
    return head if head_only else head + payload


CONTINUE_100: Final = b"HTTP/1.1 100 Continue\r\n\r\n"
HEALTHZ_PATH: Final = b"/_waygate/healthz"
HEALTHZ_RESPONSE: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n"
    b"Cache-Control: no-store\r\n\r\nok\n"
)
