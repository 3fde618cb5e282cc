"""HTTP/1.1 message rules for the proxy, sans-IO: no sockets, no event loop.

The protocol classes in `server.py` hand this module bytes and get back
decisions and bytes to write; unit tests drive it directly.

What lives here:
- `find_head_end`: where a message head ends (CRLF CRLF), with the size limits.
- `parse_request_head`: a strict gate (one compiled regex over the raw head,
  RFC 9112's grammar with no leniency); one case-insensitive regex split of
  the header block on the headers the proxy reads (every other line is
  forwarded as sent, as one block: no Python per header); the framing and
  hygiene rules; then httptools (llhttp, C) parses the head as a second,
  independent check. Any refusal raises `BadMessage` with the rule it
  enforces; nothing of a refused request is ever forwarded.
- `parse_response_head`: the gate and the split for an upstream's response
  (`BadMessage` there means 502 and the upstream connection discarded).
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
- Header names are compared lower-cased, and only those of the headers the
  proxy reads (the split finds them in any case).
- A refused message raises before any byte of it has been handed to an
  upstream; the caller answers 400 (request) or 502 (response) and closes.
- The per-request path does no logging, no f-strings and no dict copies.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any, Final, TypeVar
from urllib.parse import unquote_to_bytes

import httptools

from waygate.core import httpheaders

MAX_REQUEST_LINE: Final = 8 * 1024
MAX_HEAD_BYTES: Final = 32 * 1024
MAX_CHUNK_LINE: Final = 1024
MAX_TRAILER_BYTES: Final = 8 * 1024
MAX_CHUNK_EXTENSIONS: Final = 4 * 1024  # extension bytes of all of one body's chunks

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
# A request's Content-Length: no leading zeros (`0005` is refused: two parsers
# could disagree on it, and nothing legitimate sends it).
_LENGTH = re.compile(rb"0|[1-9][0-9]{0,17}")
# A complete first line that can still begin a valid head: a request line ending
# in HTTP/1.x (HTTP/0.9's bare `GET /path` cannot), or a response's status line.
_REQUEST_LINE_END = re.compile(rb" HTTP/1\.[01]\r?")
_STATUS_LINE_START = b"HTTP/1."
_CHUNK_SIZE = re.compile(rb"([0-9A-Fa-f]{1,15})(?:;[\t\x20-\x7e]*)?")
# A whole size line at a position (the bulk path): size, extensions, CRLF.
_CHUNK_LINE = re.compile(rb"([0-9A-Fa-f]{1,15})(;[\t\x20-\x7e]{0,1023})?\r\n")


class BadMessage(Exception):
    """A message broke a rule; `reason` names it (sent to the client for requests)."""

    def __init__(self, reason: str, status: int = 400) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status


# ---------------------------------------------------------------- header classes

# What to do with each request header the proxy reads (lower-cased name). Every
# other header is forwarded byte for byte, in one block, never looked at one by
# one in Python.
DROP: Final = 1  # hop-by-hop, `Proxy`, identity headers: never forwarded
FORWARDED_FAMILY: Final = 2  # rewritten per the route's forwarded mode
SPECIAL: Final = 3  # read by the proxy, then forwarded or dropped by rule

_REQUEST_CLASSES: Final[dict[bytes, int]] = {
    **dict.fromkeys(httpheaders.HOP_BY_HOP, DROP),
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
# The request header lines the proxy reads, found in one C pass over the
# validated head's field block (each line starts after a CRLF, so a match is a
# whole field name): split() yields [kept block, name, value, kept block, ...].
# Headers a client may not set (the one rule book, waygate.core.httpheaders:
# identity, impersonation, client certificate, `Proxy`, underscore spellings)
# are found in the same pass and, not being classified above, dropped.
_REQUEST_READ: Final = re.compile(
    rb"\r\n((?i:"
    + rb"|".join(re.escape(name) for name in _REQUEST_CLASSES)
    + rb"|"
    + httpheaders.CLIENT_FORBIDDEN_PATTERN
    + rb")):[ \t]*+([^\r]*)"
)
# The response header lines the proxy reads and drops (re-adding framing itself),
# the same way: every other line is forwarded as sliced from the upstream's head.
# The hop-by-hop ones are the rule book's (waygate.core.httpheaders.HOP_BY_HOP).
_RESPONSE_READ: Final = re.compile(
    rb"\r\n((?i:"
    + rb"|".join(re.escape(name) for name in sorted(httpheaders.HOP_BY_HOP))
    + rb"|content-length)):[ \t]*+([^\r]*)"
)
_NO_CALLBACKS: Final = object()  # httptools calls no Python code for it


def find_head_end(
    buffer: bytes | bytearray,
    limit: int = MAX_HEAD_BYTES,
    start: int = 0,
    origin: int = 0,
    *,
    response: bool = False,
) -> int:
    """Index just past the head's CRLF CRLF, or -1 while incomplete.

    `start`: where to resume the search in a growing buffer (bytes before it
    were already searched, less 3 for a terminator split across reads), so a
    head trickled in byte by byte costs linear, not quadratic, time.
    `origin`: where the head starts in `buffer` (pipelined heads are walked in
    place, never sliced off one by one); the limits count from there.
    Raises BadMessage when the head or its first line outgrows the limits,
    when it ends with a bare LF (which the strict grammar refuses anyway: this
    just refuses it now rather than at the size limit), or when its first line
    is complete and cannot begin a head (an HTTP/0.9 request line, a response
    without a status line: refused at once rather than at a timeout).
    `response`: the head is an upstream's response (reasons say so).
    """
    if start < origin:
        start = origin
    end = buffer.find(b"\r\n\r\n", start)
    if end < 0:
        size = len(buffer) - origin
        line_end = buffer.find(b"\n", origin)
        if (line_end < 0 and size > MAX_REQUEST_LINE) or line_end - origin > MAX_REQUEST_LINE:
            if response:
                raise BadMessage("upstream sent a status line longer than 8 KiB", 502)
            raise BadMessage("request line longer than 8 KiB", 414)
        if size > limit:
            if response:
                raise BadMessage("upstream sent a response head larger than 32 KiB", 502)
            raise BadMessage("header block larger than 32 KiB", 431)
        if buffer.find(b"\n\n", start) >= 0 or buffer.find(b"\n\r\n", start) >= 0:
            if response:
                raise BadMessage("upstream sent a bare LF line ending (RFC 9112 section 2.2)", 502)
            raise BadMessage("bare LF line ending (RFC 9112 section 2.2)")
        if line_end >= 0 and start <= line_end:
            _check_first_line(buffer, origin, line_end, response)
        return -1
    end += 4
    if end - origin > limit:
        raise BadMessage("header block larger than 32 KiB", 431)
    line_end = buffer.find(b"\r\n", origin)
    if line_end - origin > MAX_REQUEST_LINE:
        raise BadMessage("request line longer than 8 KiB", 414)
    return end


def _check_first_line(
    buffer: bytes | bytearray, origin: int, line_end: int, response: bool
) -> None:
    """A complete first line of a head still arriving: refuse at once what can never
    begin a valid head (only on the incomplete-head path: a complete head meets the
    grammar anyway)."""
    if response:
        if buffer[origin : origin + 7] != _STATUS_LINE_START:
            raise BadMessage("upstream answered without an HTTP/1.x status line", 502)
        return
    if _REQUEST_LINE_END.search(buffer, max(origin, line_end - 10), line_end) is None:
        raise BadMessage(
            "malformed request line: no HTTP/1.x version (HTTP/0.9 is not served; "
            "RFC 9112 section 3)"
        )


# ---------------------------------------------------------------- requests


_new_object = object.__new__


class RequestHead:
    """One parsed, validated request head.

    Slotted, every field set at construction (a parse then sets what the
    request has): the request path reads most fields at their defaults, and a
    class-level default read through an instance is a dictionary miss and a
    type lookup each time on CPython 3.11, where a slot is read directly.
    `__dict__` is kept for a field declared as a class attribute with its
    default (copied by `copy` too).
    """

    __slots__ = (
        "__dict__",
        "chunked",
        "content_length",
        "cookie",
        "expect_continue",
        "fields",
        "forwarded",
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
        # Forwarded as they came: whole lines b"Name: value\r\n", one block.
        self.fields = b""
        # X-Forwarded-* and Forwarded as the client sent them: (lname, name, value).
        self.forwarded: Sequence[tuple[bytes, bytes, bytes]] = ()
        self.host = b""  # lower-cased, port stripped
        self.content_length = -1  # -1: none
        self.chunked = False
        self.keep_alive = True
        self.upgrade = b""  # the Upgrade header's value when Connection names upgrade
        self.expect_continue = False
        self.traceparent = b""
        self.cookie: Sequence[bytes] = ()

    def copy(self) -> RequestHead:
        """A head of its own with the same fields (lists in it are shared: replaced, never
        changed, by whoever changes the copy)."""
        copy = _new_object(RequestHead)
        copy.method = self.method
        copy.target = self.target
        copy.version = self.version
        copy.fields = self.fields
        copy.forwarded = self.forwarded
        copy.host = self.host
        copy.content_length = self.content_length
        copy.chunked = self.chunked
        copy.keep_alive = self.keep_alive
        copy.upgrade = self.upgrade
        copy.expect_continue = self.expect_continue
        copy.traceparent = self.traceparent
        copy.cookie = self.cookie
        extra = self.__dict__
        if extra:
            copy.__dict__.update(extra)
        return copy

    @property
    def http10(self) -> bool:
        return self.version == b"1.0"

    @property
    def has_body(self) -> bool:
        return self.chunked or self.content_length > 0


def parse_request_head(head: bytes) -> RequestHead:
    """Validate and parse one complete request head (ending CRLF CRLF).

    The strict grammar first (one regex over the raw head); then one split of
    the field block on the headers the proxy reads, so the others are never
    touched one by one; then the framing and hygiene rules; then httptools
    (llhttp) parses the head as a second, independent check.
    """
    if _REQUEST_HEAD.fullmatch(head) is None:
        raise BadMessage(_explain_request_grammar(head))
    line_end = head.find(b"\r\n")
    space = head.find(b" ")
    method = head[:space]
    # The grammar checked the request line ends in " HTTP/1.0" or " HTTP/1.1".
    target = head[space + 1 : line_end - 9]
    version = head[line_end - 3 : line_end]
    parts = _REQUEST_READ.split(head[line_end:-4])
    if len(parts) == 4 and parts[1].lower() == b"host":
        # The common head: Host is the only header the proxy reads. Made without
        # RequestHead() (a class call runs __init__ in a frame of its own on 3.11):
        # every slot set here (_check_target sets host; a test holds the two in step).
        request = _new_object(RequestHead)
        host = parts[2].rstrip(b" \t")
        kept = parts[0] + parts[3]
        request.fields = (
            b"%s: %s\r\n%s\r\n" % (parts[1], host, kept[2:])
            if kept
            else parts[1] + b": " + host + b"\r\n"
        )
        request.method = method
        request.target = target
        request.version = version
        request.keep_alive = version != b"1.0"
        request.forwarded = request.cookie = ()
        request.content_length = -1
        request.chunked = request.expect_continue = False
        request.upgrade = request.traceparent = b""
        _check_target(request, host, method, target)
        _second_parse(head)
        return request
    request = RequestHead()
    request.method = method
    request.target = target
    request.version = version
    host = b""
    hosts = 0
    host_line = b""
    content_length = -1
    tail: list[bytes] | None = None  # forwarded after the block: Cookie, Expect
    connection: list[bytes] | None = None
    te: list[bytes] | None = None
    upgrade = b""
    for index in range(1, len(parts), 3):
        name = parts[index]
        lname = name.lower()
        kind = _REQUEST_CLASSES.get(lname, DROP)
        if kind == DROP:
            if lname == b"connection":
                tokens = [t.strip().lower() for t in parts[index + 1].split(b",")]
                if connection is None:
                    connection = tokens
                else:
                    connection += tokens
            elif lname == b"transfer-encoding":
                if te is None:
                    te = [parts[index + 1]]
                else:
                    te.append(parts[index + 1])
            elif lname == b"upgrade":
                upgrade = parts[index + 1].rstrip(b" \t")
            continue
        value = parts[index + 1].rstrip(b" \t")
        if kind == SPECIAL:
            if lname == b"host":
                hosts += 1
                host = value
                host_line = name + b": " + value + b"\r\n"
            elif lname == b"content-length":
                if content_length >= 0:
                    raise BadMessage("more than one Content-Length (RFC 9112 section 6.3)")
                if not _LENGTH.fullmatch(value):
                    raise BadMessage(
                        "malformed Content-Length (RFC 9112 section 6.3; no leading zeros)"
                    )
                content_length = int(value)
            elif lname == b"traceparent":
                request.traceparent = value
            else:  # cookie, expect: read, and forwarded
                if lname == b"expect":
                    if value.lower() != b"100-continue":
                        raise BadMessage("unsupported Expect (RFC 9110 section 10.1.1)", 417)
                    request.expect_continue = True
                else:
                    if not request.cookie:
                        request.cookie = []
                    request.cookie.append(value)  # type: ignore[attr-defined]
                line = name + b": " + value + b"\r\n"
                if tail is None:
                    tail = [line]
                else:
                    tail.append(line)
        else:  # FORWARDED_FAMILY
            if not request.forwarded:
                request.forwarded = []
            request.forwarded.append((lname, name, value))  # type: ignore[attr-defined]
    if hosts != 1:
        raise BadMessage(
            "missing Host header (RFC 9112 section 3.2)"
            if hosts == 0
            else "more than one Host header (RFC 9112 section 3.2)"
        )
    _check_target(request, host, method, target)
    if content_length >= 0:
        request.content_length = content_length
    if te is not None:
        if content_length >= 0:
            raise BadMessage(
                "Content-Length with Transfer-Encoding (RFC 9112 section 6.1: smuggling)"
            )
        if version == b"1.0":
            raise BadMessage("Transfer-Encoding in an HTTP/1.0 request (RFC 9112 section 6.1)")
        if len(te) != 1 or te[0].strip().lower() != b"chunked":
            raise BadMessage(
                "Transfer-Encoding other than a single chunked (RFC 9112 section 6.1)", 400
            )
        request.chunked = True
    # Every line the proxy does not read, as it came: Host first, the block, then
    # the read lines that are forwarded.
    block = parts[0] if len(parts) == 1 else b"".join(parts[::3])
    fields = host_line + block[2:] + b"\r\n" if block else host_line
    if tail is not None:
        fields += b"".join(tail)
    request.fields = fields
    if connection is None:
        if version == b"1.0":
            request.keep_alive = False
    else:
        _connection_rules(request, connection, upgrade)
    _second_parse(head)
    return request


# An HTTP/2 request's parts, as the strict grammar (_REQUEST_HEAD) takes them in a head.
_METHOD: Final = re.compile(_TCHAR + rb"++")
_TARGET: Final = re.compile(rb"[\x21-\x7e]++")
_VALUE_CONTROL: Final = re.compile(rb"[\x00-\x08\x0a-\x1f\x7f]")
#: A field value's control characters, the rule of requests' and responses' heads
#: (RFC 9110 section 5.5): the match, or None. For fields that come as HTTP/2 fields.
value_control: Final = _VALUE_CONTROL.search


def content_length(value: bytes) -> int:
    """A request's Content-Length value by this rule book (digits, no leading zeros,
    at most 18), or -1 when it is malformed."""
    return int(value) if _LENGTH.fullmatch(value) else -1


# Methods llhttp (the second parse) takes, learnt one by one (at most its own list).
_KNOWN_METHODS: Final[set[bytes]] = set()


def request_from_fields(
    method: bytes,
    target: bytes,
    authority: bytes,
    fields: Sequence[tuple[bytes, bytes]],
    content_length: int,
    chunked: bool,
) -> RequestHead:
    """The request head an HTTP/2 request means, by `parse_request_head`'s rules,
    without rendering it as HTTP/1.1 bytes and parsing them back.

    `fields`: the regular fields, names lower-case tokens, Host, Content-Length,
    TE and connection-specific fields already taken out or refused, cookies
    joined (`waygate.proxy.http2.read_request`); `content_length` -1 for none;
    `chunked`: a body without a length follows. What the HTTP/1.1 head would
    meet here meets it: the grammar's limits on the method, target and values;
    the same header classes (identity, impersonation, client-certificate and
    hop-by-hop fields dropped, X-Forwarded-* and Forwarded kept for the route's
    mode, Cookie, Expect and traceparent read); the Host and target rules; and
    the one verdict of llhttp's second parse on such a head the grammar lacks,
    its list of methods (asked once per method).
    """
    if _METHOD.fullmatch(method) is None:
        raise BadMessage("malformed method (RFC 9110 section 9.1)")
    if _TARGET.fullmatch(target) is None:
        raise BadMessage("control character or space in the request target (RFC 9112 section 3.2)")
    if len(method) + len(target) + 11 > MAX_REQUEST_LINE:  # as its request line would be
        raise BadMessage("request line longer than 8 KiB", 414)
    request = RequestHead()
    request.method = method
    request.target = target
    lines = [b"Host: ", authority, b"\r\n"]
    tail: list[bytes] | None = None  # forwarded after the others: Cookie, Expect
    expect = True  # every Expect field asks for 100-continue (or there is none)
    classes = _REQUEST_CLASSES.get
    forbidden = httpheaders.client_forbidden_match
    control = _VALUE_CONTROL.search
    for name, value in fields:
        if control(value) is not None:
            raise BadMessage("control character in a header value (RFC 9110 section 5.5)")
        kind = classes(name)
        if kind is None:
            if forbidden(name) is None:
                lines += (name, b": ", value, b"\r\n")
        elif kind == FORWARDED_FAMILY:
            if not request.forwarded:
                request.forwarded = []
            request.forwarded.append((name, name, value))  # type: ignore[attr-defined]
        elif kind == SPECIAL:
            if name == b"traceparent":
                request.traceparent = value
                continue
            if name == b"expect":
                # Refused after the loop: a control character in any value is a 400 first.
                expect = value.lower() == b"100-continue" if expect else False
                request.expect_continue = True
            elif name == b"cookie":
                if not request.cookie:
                    request.cookie = []
                request.cookie.append(value)  # type: ignore[attr-defined]
            else:  # host, content-length: the caller took the one allowed out
                raise BadMessage("more than one Host or Content-Length (RFC 9112 section 3.2)")
            if tail is None:
                tail = [name, b": ", value, b"\r\n"]
            else:
                tail += (name, b": ", value, b"\r\n")
        # else DROP: hop-by-hop (proxy-authorization, trailer...), never forwarded
    if not expect:
        raise BadMessage("unsupported Expect (RFC 9110 section 10.1.1)", 417)
    _check_target(request, authority, method, target)
    if content_length >= 0:
        request.content_length = content_length
    elif chunked:
        request.chunked = True
    if tail is not None:
        lines += tail
    request.fields = b"".join(lines)
    if method not in _KNOWN_METHODS:
        _second_parse(method + b" / HTTP/1.1\r\nHost: a\r\n\r\n")
        _KNOWN_METHODS.add(method)
    return request


def _check_target(request: RequestHead, host: bytes, method: bytes, target: bytes) -> None:
    """The Host header's form (sets `request.host`) and the request target's rules."""
    if not _HOST.fullmatch(host):
        raise BadMessage("malformed Host header (RFC 9112 section 3.2)")
    if host[:1] == b"[":
        request.host = host[: host.index(b"]") + 1].lower()
    else:
        request.host = host.partition(b":")[0].lower()
    if method == b"CONNECT":
        raise BadMessage("CONNECT is not served (reverse proxy)", 405)
    if method == b"TRACE":
        raise BadMessage(
            "TRACE is not served (it would echo credentials back: cross-site tracing)", 405
        )
    if target[:1] != b"/" and not (target == b"*" and method == b"OPTIONS"):
        raise BadMessage("request target must be origin-form, /path (RFC 9112 section 3.2)")
    if b"/." in target or b"%" in target:
        _check_dot_segments(target)


def _second_parse(head: bytes) -> None:
    """httptools (llhttp) parses the head too: a second, independent check."""
    try:
        httptools.HttpRequestParser(_NO_CALLBACKS).feed_data(head)
    except httptools.HttpParserUpgrade:
        pass
    except httptools.HttpParserError as exc:
        raise BadMessage("malformed request: " + str(exc).lower()) from None


def _connection_rules(request: RequestHead, tokens: list[bytes], upgrade: bytes) -> None:
    """Keep-alive, upgrade, and the headers a Connection header names (hop-by-hop)."""
    http10 = request.version == b"1.0"
    if b"close" in tokens:
        request.keep_alive = False
    elif http10:
        # HTTP/1.0 keep-alive is not offered: the answer closes (documented).
        request.keep_alive = False
    if b"upgrade" in tokens and upgrade and not http10 and b"h2c" not in upgrade.lower():
        # Upgrade: h2c is refused, not forwarded: the answer stays HTTP/1.1 (a
        # backend that switched would take later requests past the proxy's rules;
        # h2c is served with prior knowledge instead, RFC 9113 section 3.1).
        request.upgrade = upgrade
    if tokens == [b"keep-alive"]:  # the common case: nothing named
        return
    named = [t for t in tokens if t not in (b"close", b"keep-alive", b"upgrade", b"")]
    if not named:
        return
    # Headers named in Connection are hop-by-hop too (RFC 9110 section 7.6.1);
    # Host is not: dropping it would send upstream a request without one.
    if b"host" in named:
        raise BadMessage("Connection names Host, which is not hop-by-hop (RFC 9110 7.6.1)")
    drop = set(named)
    lines = request.fields.split(b"\r\n")[:-1]
    request.fields = b"".join(
        line + b"\r\n" for line in lines if line.split(b":", 1)[0].lower() not in drop
    )
    if request.forwarded:
        request.forwarded = [h for h in request.forwarded if h[0] not in drop]
    if b"cookie" in drop:
        request.cookie = ()


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

    __slots__ = (
        "access_check",
        "access_verdict",
        "client_ip",
        "cors_answer",
        "cors_fields",
        "cors_policy",
        "forwarded_for",
        "last_added",
        "last_host",
        "port",
        "proto",
    )

    def __init__(self, client_ip: str, port: int, proto: bytes = b"http") -> None:
        self.client_ip = client_ip.encode()
        # The verdict of the address-only access check this connection met last
        # (decision._access_bound): the client address is the connection's, so its
        # keep-alive requests to that route read it instead of deciding again.
        self.access_check: object = None
        self.access_verdict: tuple[int, str, str] | None = None
        # The CORS answer (cors.CorsPolicy.gate) of the route's policy this connection
        # last asked, for the request fields it asked with.
        self.cors_policy: object = None
        self.cors_fields = b""
        self.cors_answer: Any = None
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


def client_context(transport: Any, proxied: Any, port: int, secure: bool) -> ForwardedContext:
    """A client connection's forwarded context, built once when it is accepted: the
    peer's address, this listener's port and scheme; or, when the connection began
    with a PROXY protocol header (`proxied`: its `proxyproto.Addresses`), the
    header's source address and destination port, and https when the connection is
    TLS or the header's destination port is 443 (a load balancer that terminated
    TLS: ingress-nginx's `$proxy_protocol_server_port` and lua_ingress rule)."""
    if proxied is None:
        peer = transport.get_extra_info("peername")
        return ForwardedContext(
            peer[0] if peer else "unknown", port, b"https" if secure else b"http"
        )
    https = secure or proxied.destination_port == 443
    return ForwardedContext(
        proxied.source, proxied.destination_port, b"https" if https else b"http"
    )


def build_upstream_head(
    request: RequestHead,
    context: ForwardedContext,
    mode: str,
    traceparent: bytes,
    extra: list[tuple[bytes, bytes]] | None = None,
    target: bytes | None = None,
) -> bytes:
    """The head sent upstream: always HTTP/1.1, keep-alive unless upgrading (`target`:
    a rewritten one, in place of the request's own)."""
    if (
        not request.forwarded
        and (mode == "append" or mode == "replace" or mode == "if-none")
        and not traceparent
        and request.content_length < 0
        and not request.chunked
        and not extra
        and not request.upgrade
    ):
        # The common head (no body, no client forwarded headers, no trace): one format.
        return b"%s %s HTTP/1.1\r\n%s%s\r\n" % (
            request.method,
            request.target if target is None else target,
            request.fields,
            context.added(request.host),
        )
    if target is None:
        target = request.target
    parts = [request.method, b" ", target, b" HTTP/1.1\r\n", request.fields]
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
    """One parsed, validated response head (defaults are class attributes)."""

    status = 0
    reason = b""
    # Every header line forwarded as it came, as one block: b"\r\nName: value"
    # per line (b"" when there is none), so a head is status line + block + ours.
    fields = b""
    content_length = -1
    chunked = False
    keep_alive = True
    upgrade = b""


# Response heads parsed last -> their parse (a pure function of the bytes): a
# backend sends the same head over and over (nginx's changes with its Date, once
# a second). Bounded: heads of at most _HEADS_BYTES, at most _HEADS_ENTRIES of
# them (all forgotten when full); each caller gets its own copy to change.
_HEADS: Final[dict[bytes, ResponseHead]] = {}
_HEADS_ENTRIES: Final = 256
_HEADS_BYTES: Final = 2048


def parse_response_head(head: bytes) -> ResponseHead:
    """Validate and parse one complete upstream response head; BadMessage means 502.

    The strict grammar (one regex over the raw head) is the whole syntax check:
    the status is its three digits. One split of the field block on the lines
    the proxy reads and drops finds them; the blocks between them are forwarded
    as sliced. The upstream is the operator's own, so httptools' second parse
    (kept for requests, which come from anyone) is not repeated here.

    A head parsed recently is not parsed again (see _HEADS): its parse is copied.
    """
    known = _HEADS.get(head)
    if known is not None:
        return copy_head(known)
    response = _parse_response_head(head)
    if len(head) <= _HEADS_BYTES:
        remember(_HEADS, head, copy_head(response), _HEADS_ENTRIES)
    return response


_Head = TypeVar("_Head", "RequestHead", "ResponseHead")
_Key = TypeVar("_Key")
_Value = TypeVar("_Value")


def remember(cache: dict[_Key, _Value], key: _Key, value: _Value, entries: int) -> None:
    """Keep `value` for `key` in a bounded table of pure results (the proxy's remembered
    parses): past `entries` the whole table is forgotten, so a hit stays one dict
    look-up with no order to keep."""
    if len(cache) >= entries:
        cache.clear()
    cache[key] = value


def copy_head(head: _Head) -> _Head:
    """A head of its own for a caller of a remembered parse (what is set on it is
    copied, the class defaults stay shared; lists in it are replaced, never changed)."""
    if type(head) is RequestHead:
        return head.copy()  # type: ignore[no-any-return]
    copy = type(head).__new__(type(head))
    copy.__dict__.update(head.__dict__)
    return copy


def _parse_response_head(head: bytes) -> ResponseHead:
    if _RESPONSE_HEAD.fullmatch(head) is None:
        raise BadMessage("upstream sent a malformed response head", 502)
    response = ResponseHead()
    response.status = status = _STATUS_CODES[head[9:12]]
    line_end = head.find(b"\r\n")
    if status not in _STATUS_LINES:
        # The reason phrase is needed only for a status line not precomputed.
        response.reason = head[13:line_end]
    parts = _RESPONSE_READ.split(head[line_end:-4])
    if len(parts) == 1:
        response.fields = parts[0]
        if head[5:8] == b"1.0":
            response.keep_alive = False
        return response
    response.fields = b"".join(parts[::3])
    te: list[bytes] | None = None
    connection: list[bytes] | None = None
    for index in range(1, len(parts), 3):
        name = parts[index].lower()
        value = parts[index + 1]
        if name == b"content-length":
            value = value.rstrip(b" \t")
            if response.content_length >= 0 or not _DIGITS.fullmatch(value):
                raise BadMessage("upstream sent a malformed or repeated Content-Length", 502)
            response.content_length = int(value)
        elif name == b"connection":
            value = value.lower().rstrip(b" \t")
            if value != b"keep-alive":  # the common value says nothing new
                tokens = [t.strip() for t in value.split(b",")]
                connection = tokens if connection is None else connection + tokens
        elif name == b"transfer-encoding":
            te = [value] if te is None else [*te, value]
        elif name == b"upgrade":
            response.upgrade = value.rstrip(b" \t")
    if te is not None:
        if response.content_length >= 0:
            raise BadMessage("upstream sent Content-Length with Transfer-Encoding", 502)
        if len(te) != 1 or te[0].strip().lower() != b"chunked":
            raise BadMessage("upstream sent a Transfer-Encoding other than chunked", 502)
        response.chunked = True
    if head[5:8] == b"1.0":
        response.keep_alive = False
    elif connection is not None:
        if b"close" in connection:
            response.keep_alive = False
        named = {t for t in connection if t not in (b"close", b"keep-alive", b"upgrade", b"")}
        if named:
            _drop_named_response_headers(response, named)
    return response


def _drop_named_response_headers(response: ResponseHead, named: set[bytes]) -> None:
    """Headers the upstream's Connection names are hop-by-hop (RFC 9110 section 7.6.1)."""
    lines = response.fields.split(b"\r\n")[1:]
    response.fields = b"".join(
        b"\r\n" + line for line in lines if line.split(b":", 1)[0].lower() not in named
    )


def build_client_head(
    response: ResponseHead, framing: int, length: int, keep_alive: bool, extra: bytes = b""
) -> bytes:
    """The head sent to the client. `framing`: one of the FRAMING_* constants;
    `extra`: whole lines to add (b"Name: value\\r\\n" each)."""
    status_line = _STATUS_LINES.get(response.status) or _status_line(response)
    if framing == FRAMING_LENGTH:
        return b"%s%s\r\nContent-Length: %d\r\n%s%s" % (
            status_line,
            response.fields,
            length,
            extra,
            b"\r\n" if keep_alive else b"Connection: close\r\n\r\n",
        )
    return b"".join(
        (
            status_line,
            response.fields,
            b"\r\nTransfer-Encoding: chunked\r\n" if framing == FRAMING_CHUNKED else b"\r\n",
            extra,
            b"\r\n" if keep_alive else b"Connection: close\r\n\r\n",
        )
    )


def _status_line(response: ResponseHead) -> bytes:
    return b"HTTP/1.1 %d %s" % (response.status, response.reason)


# A status line's three digits (checked by the grammar) -> the status.
_STATUS_CODES: Final = {b"%d" % code: code for code in range(100, 1000)}
# Status lines without their CRLF (the header block starts with one).
_STATUS_LINES: Final[dict[int, bytes]] = {
    200: b"HTTP/1.1 200 OK",
    204: b"HTTP/1.1 204 No Content",
    301: b"HTTP/1.1 301 Moved Permanently",
    302: b"HTTP/1.1 302 Found",
    304: b"HTTP/1.1 304 Not Modified",
    404: b"HTTP/1.1 404 Not Found",
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

    Bulk parsing: a chunk whose size line, data and CRLF are all in `data` is
    taken in one step (one regex match, no state change), and a run of such
    chunks with canonical size lines is forwarded as one slice when
    re-chunking, so many small chunks cost one loop turn each, not three and
    not one output piece each. Bounds against pathological chunking:
    extension bytes per message (`MAX_CHUNK_EXTENSIONS`), and with
    `chunk_budget` (requests: `Limits.max_small_chunks`) a body may have at
    most that many chunks beyond one per 256 bytes of payload (1-byte chunks
    cost microseconds each in Python: a body of them is refused early, 400).
    """

    __slots__ = (
        "_budget",
        "_chunks",
        "_extensions",
        "_line",
        "_payload",
        "_remaining",
        "_state",
        "_status",
        "done",
        "rechunk",
    )

    _SIZE, _DATA, _DATA_CRLF, _TRAILER = range(4)

    def __init__(self, *, rechunk: bool = True, status: int = 400, chunk_budget: int = 0) -> None:
        self.rechunk = rechunk
        self.done = False
        self._state = self._SIZE
        self._remaining = 0
        self._line = b""
        self._status = status
        self._budget = chunk_budget  # 0: unbounded (an upstream's response)
        self._chunks = 0
        self._payload = 0
        self._extensions = 0

    def _count(self, chunk: int, extension: int) -> None:
        """Account one chunk's size line (the last chunk included)."""
        if extension:
            self._extensions += extension
            if self._extensions > MAX_CHUNK_EXTENSIONS:
                raise BadMessage("chunk extensions larger than 4 KiB in one body", self._status)
        self._payload += chunk
        if self._budget:
            self._chunks += 1
            if self._chunks > self._budget + (self._payload >> 8):
                raise BadMessage(
                    f"too many small chunks: a chunked body may have {self._budget} chunks "
                    "beyond one per 256 bytes of payload",
                    self._status,
                )

    @property
    def payload(self) -> int:
        """The body's size so far, by the chunk sizes announced."""
        return self._payload

    def feed(self, data: bytes) -> tuple[list[bytes], int]:
        out: list[bytes] = []
        pos = 0
        size = len(data)
        rechunk = self.rechunk
        while pos < size and not self.done:
            state = self._state
            if state == self._SIZE and not self._line:
                # Whole chunks at once while they are all here (the bulk path).
                run = -1  # where a run of chunks forwarded as they came starts
                while True:
                    match = _CHUNK_LINE.match(data, pos)
                    if match is None:
                        break
                    digits = match.group(1)
                    chunk = int(digits, 16)
                    extension = match.end(2) - match.start(2) if match.group(2) else 0
                    if chunk == 0:
                        break  # the last chunk: the general path below
                    end = match.end() + chunk
                    if end + 2 > size or data[end : end + 2] != b"\r\n":
                        break  # not all here (or malformed): the general path
                    self._count(chunk, extension)
                    if rechunk:
                        if extension or digits[:1] == b"0":
                            # Not canonical: re-emit the size line ours.
                            if run >= 0:
                                out.append(data[run:pos])
                                run = -1
                            out.append(b"%x\r\n" % chunk)
                            out.append(data[match.end() : end + 2])
                        elif run < 0:
                            run = pos
                    else:
                        out.append(data[match.end() : end])
                    pos = end + 2
                if run >= 0:
                    out.append(data[run:pos])
                if pos >= size:
                    break
            if state == self._DATA:
                take = min(self._remaining, size - pos)
                out.append(data[pos : pos + take] if take != size else data)
                pos += take
                self._remaining -= take
                if self._remaining == 0:
                    self._state = self._DATA_CRLF
                    if rechunk:
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
                    self._count(chunk, len(line) - match.end(1))
                    if chunk == 0:
                        self._state = self._TRAILER
                    else:
                        self._remaining = chunk
                        self._state = self._DATA
                        if rechunk:
                            out.append(b"%x\r\n" % chunk)
                else:
                    self._remaining += len(line) + 2
                    if self._remaining > MAX_TRAILER_BYTES:
                        raise BadMessage("trailer section too large", self._status)
                    if line == b"":
                        self.done = True
                        if rechunk:
                            out.append(b"0\r\n\r\n")
                    elif b"\n" in line or b":" not in line:
                        raise BadMessage("malformed trailer field", self._status)
            elif state == self._DATA_CRLF:
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
    404: b"Not Found",
    405: b"Method Not Allowed",
    408: b"Request Timeout",
    413: b"Content Too Large",
    414: b"URI Too Long",
    417: b"Expectation Failed",
    421: b"Misdirected Request",
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
# `OPTIONS *` asks about the server, not a resource: the proxy is that server and
# answers itself (no route would know which backend to ask).
OPTIONS_ANY_RESPONSE: Final = (
    b"HTTP/1.1 200 OK\r\nAllow: GET, HEAD, POST, PUT, DELETE, PATCH, OPTIONS\r\n"
    b"Content-Length: 0\r\nCache-Control: no-store\r\n\r\n"
)
HEALTHZ_PATH: Final = b"/_waygate/healthz"
HEALTHZ_RESPONSE: Final = (
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n"
    b"Cache-Control: no-store\r\n\r\nok\n"
)
