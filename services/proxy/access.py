"""Who may reach a route: client address ranges, block lists and HTTP Basic or
Digest authentication (a route's `RouteAccess`: ingress-nginx's `*-source-range`,
`auth-type: basic|digest`, `satisfy` and the ConfigMap's `block-*`), sans-IO.

`compile_access(route_access)` turns a route's rules into an `AccessCheck` once
per routing table (CIDRs into integer masks, credentials into a user -> hash
map); `AccessCheck.decide(req, peer)` is the per-request part, called by the
request core's gate (`waygate.proxy.decision`) for HTTP/1.1 and HTTP/2 alike.

The client address is the peer's, or, when the peer is within
`trusted_proxies` (ingress-nginx's use-forwarded-headers with
proxy-real-ip-cidr), the one X-Forwarded-For names as nginx's real_ip module
finds it with real_ip_recursive on: from the right, the first address not
itself trusted (the leftmost when all are). A route's `client_address_header`
(ingress-nginx's forwarded-for-header, nginx's real_ip_header) names another
header to read so: its first line, as nginx's realip reads a header other
than X-Forwarded-For.

Order, as ingress-nginx's nginx: the block lists (403 whatever else holds);
then the location's `deny` ranges, its `allow` ranges (anything else denied
when there are any) and the credentials, combined by `satisfy`: `all` needs
each configured check to pass (403 for the address, else 401), `any` needs one
(401 when authentication is configured, as nginx's access phase keeps the 401).

Invariants:
- Fail closed: an address that does not parse is in no allow range; a route
  with authentication whose credentials were withheld from this proxy (the
  resolver sends them only where it sends private keys) answers 503, never 200.
- Hashes are verified exactly (waygate.core.htpasswd); the resolver refuses
  any format it cannot verify. An Authorization value, once checked, is
  remembered per table entry (bounded), so a known user pays the hash (bcrypt:
  milliseconds to a second, on the event loop) once, not per request.
- Digest (waygate.core.digest, nginx-http-auth-digest's rules): the nonces and
  the failed tries per client address live in this process's `DIGEST`
  tables, shared by every route (as the module's shared memory zone) and
  kept across routing tables; bounded by the proxy's --digest-nonces. A 401
  carries a fresh challenge; an address held off (evasion) gets none.
- The backend does not get the Authorization header of a route with
  authentication: the resolver adds its removal to the route's request
  filters (ingress-nginx's `proxy_set_header Authorization ""`).
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
import socket
import time
from collections.abc import Iterable, Sequence
from typing import Any, Final, Protocol

from waygate.core import digest
from waygate.core.htpasswd import parse_credentials, verify
from waygate.core.regex import LinearPattern, compile_linear
from waygate.proxy.http1 import RequestHead
from waygate.resolver.client import Route, RouteAccess

#: Answer kinds (the refusal metric's labels).
KIND_DENIED: Final = "access_denied"
KIND_BLOCKED: Final = "blocked"
KIND_UNAUTHORIZED: Final = "unauthorized"  # rendered by `challenge_response`
KIND_WITHHELD: Final = "credentials_withheld"
KIND_INVALID: Final = "access_invalid"

# Verified Authorization values kept per route entry (then forgotten at once).
MAX_REMEMBERED: Final = 1024


class DigestState:
    """Digest's nonces and evasion counts, for every route of this process."""

    def __init__(self, max_entries: int = digest.DEFAULT_ENTRIES) -> None:
        self.nonces = digest.NonceTable(max_entries)
        self.evasion = digest.Evasion(max_entries)


DIGEST = DigestState()


def configure_digest(max_entries: int) -> None:
    """The proxy's --digest-nonces: the bound of each digest table (set at start)."""
    global DIGEST
    DIGEST = DigestState(max_entries)


# What an unknown user's answer is checked against (the same work as a known one's).
_NO_HA1: Final = (b"0" * 32,)

_XFF: Final = b"x-forwarded-for"
_FIELD = {
    name: re.compile(rb"(?:^|\n)" + name + rb"[ \t]*:[ \t]*([^\r\n]*)", re.IGNORECASE)
    for name in (b"authorization", b"user-agent", b"referer")
}
_BASIC: Final = re.compile(rb"basic[ \t]+([A-Za-z0-9+/]+=*)[ \t]*", re.IGNORECASE)

# One range: (version, network as an int, mask as an int).
Network = tuple[int, int, int]


def networks(cidrs: Iterable[str]) -> tuple[Network, ...]:
    """CIDRs (or single addresses) as integer masks; ValueError for one that is not."""
    out = []
    for text in cidrs:
        net = ipaddress.ip_network(text.strip(), strict=False)
        out.append((net.version, int(net.network_address), int(net.netmask)))
    return tuple(out)


def _address(text: bytes | str) -> tuple[int, int] | None:
    """(version, int) of an address; IPv4-mapped IPv6 as IPv4 (as nginx's access
    module reads it); None when it does not parse (inet_pton's strict forms only)."""
    try:
        plain = text.decode("ascii") if isinstance(text, bytes) else text
        return 4, int.from_bytes(socket.inet_pton(socket.AF_INET, plain), "big")
    except (OSError, UnicodeDecodeError, ValueError):
        pass
    try:
        value = int.from_bytes(socket.inet_pton(socket.AF_INET6, plain), "big")
    except (OSError, ValueError):
        return None
    if value >> 32 == 0xFFFF:
        return 4, value & 0xFFFFFFFF
    return 6, value


def _within(address: tuple[int, int], ranges: Sequence[Network]) -> bool:
    version, value = address
    for net_version, network, mask in ranges:
        if net_version == version and value & mask == network:
            return True
    return False


def header_pattern(name: str) -> re.Pattern[bytes] | None:
    """The first line of a request header (a lower-case name, as
    `Route.client_address_header`) in a field block; None for X-Forwarded-For or
    "" (the proxy reads that one itself, every line of it)."""
    if not name or name == "x-forwarded-for":
        return None
    found = _HEADERS.get(name)
    if found is None:
        if len(_HEADERS) >= 64:
            _HEADERS.clear()
        found = _HEADERS[name] = re.compile(
            rb"(?:^|\n)" + re.escape(name.encode()) + rb"[ \t]*:[ \t]*([^\r\n]*)", re.IGNORECASE
        )
    return found


_HEADERS: dict[str, re.Pattern[bytes]] = {}


def _real_ip(
    peer: bytes,
    req: RequestHead,
    trusted: Sequence[Network],
    header: re.Pattern[bytes] | None = None,
) -> tuple[bytes, tuple[int, int] | None]:
    """(text, value) of the client's address as nginx's real_ip (recursive) finds it."""
    address = _address(peer)
    if address is None or not trusted or not _within(address, trusted):
        return peer, address
    if header is None:
        values = [value for lname, _, value in req.forwarded if lname == _XFF]
    else:
        line = header.search(req.fields)
        values = [line.group(1).rstrip(b" \t")] if line is not None else []
    text = peer
    for item in reversed(b",".join(values).split(b",")) if values else ():
        item = item.strip()
        found = _address(item)
        if found is None:
            break  # nginx stops at what it cannot parse
        address, text = found, item
        if not _within(found, trusted):
            break
    return text, address


def client_address(
    peer: bytes,
    req: RequestHead,
    trusted: Sequence[Network],
    header: re.Pattern[bytes] | None = None,
) -> tuple[int, int] | None:
    """The client's address as nginx's real_ip (recursive) finds it: the peer's,
    unless the peer is trusted and X-Forwarded-For (or `header`: `header_pattern`)
    names others."""
    return _real_ip(peer, req, trusted, header)[1]


def real_ip(
    peer: bytes,
    req: RequestHead,
    trusted: Sequence[Network],
    header: re.Pattern[bytes] | None = None,
) -> bytes:
    """`client_address` as text (nginx's $remote_addr after real_ip)."""
    return _real_ip(peer, req, trusted, header)[0]


Matcher = tuple["LinearPattern | None", str]


def _value_matchers(patterns: Iterable[str]) -> tuple[Matcher, ...]:
    """nginx map keys: "~*RE" (case-insensitive), "~RE", else an exact value; the
    expressions in RE2 (waygate.core.regex: linear time, whatever the pattern)."""
    out: list[Matcher] = []
    for pattern in patterns:
        if pattern.startswith("~*"):
            out.append((compile_linear("(?i)" + pattern[2:]), ""))
        elif pattern.startswith("~"):
            out.append((compile_linear(pattern[1:]), ""))
        else:
            out.append((None, pattern))
    return tuple(out)


def _field(req: RequestHead, name: bytes) -> bytes | None:
    found = _FIELD[name].search(req.fields)
    return None if found is None else found.group(1).rstrip(b" \t")


# ---------------------------------------------------------------- the check


class _Entry(Protocol):
    route: Route
    access: AccessCheck | None


def prepare(entry: _Entry) -> bool:
    """The request core's `applies` for the access rule (once per table and route
    entry): compiles the route's rules onto the entry; False without any."""
    rules = entry.route.access
    if rules is None:
        return False
    entry.access = AccessCheck(rules, entry.route.client_address_header)
    return True


class AccessCheck:
    """One route's access rules, compiled once per routing table."""

    __slots__ = (
        "address_only",
        "agents",
        "allow",
        "auth",
        "block",
        "broken",
        "challenge",
        "deny",
        "digest_realm",
        "digest_users",
        "header",
        "info",
        "is_digest",
        "last_address",
        "last_peer",
        "last_verdict",
        "referers",
        "remembered",
        "satisfy_any",
        "trusted",
        "users",
    )

    def __init__(self, access: RouteAccess, client_address_header: str = "") -> None:
        # Where a trusted peer names the client (None: X-Forwarded-For).
        self.header = header_pattern(client_address_header)
        # The resolver validated the rules; should they still not compile, nothing
        # passes (fail closed) rather than the table build failing.
        try:
            self._compile(access)
        except ValueError as exc:  # (RegexRefused is one)
            self._compile(RouteAccess())
            self.broken = f"the route's access rules do not compile: {exc}"
            self.address_only = False

    def _compile(self, access: RouteAccess) -> None:
        self.broken = ""
        self.block = networks(access.block)
        self.deny = networks(access.deny)
        self.allow = networks(access.allow)
        self.trusted = networks(access.trusted_proxies)
        self.agents = _value_matchers(access.block_user_agents)
        self.referers = _value_matchers(access.block_referers)
        self.auth = access.auth_type in ("basic", "digest")
        self.challenge = 'Basic realm="' + access.auth_realm + '"'
        self.is_digest = access.auth_type == "digest"
        self.info = ""  # the last good digest answer's Authentication-Info (the shaper takes it)
        self.digest_realm = ""
        self.digest_users: dict[tuple[bytes, bytes], tuple[bytes, ...]] = {}
        if self.is_digest:
            self.digest_realm = access.auth_realm
            self.digest_users = digest.parse_lines(access.credentials)
            self.users: dict[bytes, str] = {}
        else:
            self.users = parse_credentials(access.credentials)
        self.satisfy_any = access.satisfy_any
        self.remembered: dict[bytes, bool] = {}
        # The last peer address parsed (a connection's bytes object) and its value.
        self.last_peer: bytes | None = None
        self.last_address: tuple[int, int] | None = None
        # Rules on the peer's address alone (no forwarded address, User-Agent, Referer
        # or credentials): the verdict is the peer's, kept for the last peer (a
        # keep-alive connection's next request pays one comparison).
        self.address_only = not (
            self.trusted or self.agents or self.referers or self.auth or self.broken
        )
        self.last_verdict: tuple[int, str, str] | None = None

    def decide(self, req: RequestHead, peer: bytes) -> tuple[int, str, str] | None:
        """None when the request may go on, else (status, reason, kind)."""
        if peer is self.last_peer and self.address_only:
            return self.last_verdict
        verdict = self._decide(req, peer)
        if self.address_only:
            self.last_verdict = verdict
        return verdict

    def _decide(self, req: RequestHead, peer: bytes) -> tuple[int, str, str] | None:
        if self.broken:
            return 503, self.broken, KIND_INVALID
        address = None
        if self.block or self.deny or self.allow:
            if self.trusted:
                address = client_address(peer, req, self.trusted, self.header)
            elif peer is self.last_peer:  # a keep-alive connection's next request
                address = self.last_address
            else:
                address = self.last_address = _address(peer)
                self.last_peer = peer
        if self.block and (address is None or _within(address, self.block)):
            return 403, "the client address is blocked", KIND_BLOCKED
        if self.agents and _blocked(self.agents, _field(req, b"user-agent")):
            return 403, "the User-Agent is blocked", KIND_BLOCKED
        if self.referers and _blocked(self.referers, _field(req, b"referer")):
            return 403, "the Referer is blocked", KIND_BLOCKED
        address_ok = True
        if self.deny or self.allow:
            address_ok = address is not None and not _within(address, self.deny)
            if address_ok and self.allow:
                address_ok = _within(address, self.allow)  # type: ignore[arg-type]
        if not self.auth:
            return None if address_ok else (403, "the client address is not allowed", KIND_DENIED)
        if self.satisfy_any and address_ok and (self.deny or self.allow):
            return None
        if not address_ok and not self.satisfy_any:
            return 403, "the client address is not allowed", KIND_DENIED
        if self.is_digest:
            self.info = ""
            if not self.digest_users:
                return 503, "the route's credentials are withheld from this proxy", KIND_WITHHELD
            challenge = self._digest(req, peer)
            return None if challenge is None else (401, challenge, KIND_UNAUTHORIZED)
        if not self.users:
            return 503, "the route's credentials are withheld from this proxy", KIND_WITHHELD
        if self._authenticated(req):
            return None
        return 401, self.challenge, KIND_UNAUTHORIZED

    def _digest(self, req: RequestHead, peer: bytes) -> str | None:
        """None when the Digest answer is good, else the 401's WWW-Authenticate (a
        new challenge; "" for an address held off). The evasion count is kept per
        client address as `client_address` finds it."""
        state = DIGEST
        now = time.monotonic()
        client = client_address(peer, req, self.trusted, self.header) if self.trusted else peer
        if state.evasion.evading(client, now):
            return ""
        header = _field(req, b"authorization")
        answer = digest.parse_authorization(header) if header is not None else None
        if answer is None:
            return digest.challenge(self.digest_realm, state.nonces.issue(now), False)
        stale = False
        hashes = self.digest_users.get((answer.username, answer.realm))
        ha1 = digest.matching_ha1(hashes or _NO_HA1, req.method, answer)
        if ha1 and hashes is not None and digest.uri_matches(answer.uri, req.target):
            verdict = state.nonces.use(answer.nonce, answer.nc, now)
            if verdict == digest.NONCE_OK:
                state.evasion.succeeded(client)
                self.info = digest.authentication_info(ha1, answer)
                return None
            stale = verdict == digest.NONCE_STALE
        state.evasion.failed(client, now)
        return digest.challenge(self.digest_realm, state.nonces.issue(now), stale)

    def _authenticated(self, req: RequestHead) -> bool:
        header = _field(req, b"authorization")
        if header is None:
            return False
        basic = _BASIC.fullmatch(header)
        if basic is None:
            return False
        token = basic.group(1)
        known = self.remembered.get(token)
        if known is not None:
            return known
        try:
            user, colon, password = base64.b64decode(token, validate=True).partition(b":")
        except binascii.Error:
            return False
        hashed = self.users.get(user) if colon else None
        ok = hashed is not None and verify(password, hashed)
        if len(self.remembered) >= MAX_REMEMBERED:
            self.remembered.clear()
        self.remembered[token] = ok
        return ok


def reads_header(entry: _Entry) -> bool:
    """The request core's `applies` for `forwarded_client` (after `prepare`): the
    route reads the client address from a header other than X-Forwarded-For."""
    return entry.access is not None and entry.access.header is not None


_ORIGINAL: Final = re.compile(rb"(?im)^x-original-forwarded-for[ \t]*:[^\r\n]*\r\n")


def forwarded_client(forward: Any, req: RequestHead, facts: Any) -> None:
    """A shaper (forwarded-for-header, a trusted peer that sent the header): the
    backend gets ingress-nginx's `X-Forwarded-For: $remote_addr` (unless the route
    appends, compute-full-forwarded-for's `$http_x_forwarded_for, $realip_remote_addr`)
    and `X-Original-Forwarded-For: $http_<header>` (the client's own copy dropped)."""
    check = forward.entry.access
    line = check.header.search(req.fields)
    peer = facts.context.client_ip
    address = _address(peer)
    if line is None or address is None or not _within(address, check.trusted):
        return
    head = forward.req.copy()
    fields = head.fields
    if b"original-forwarded-for" in fields.lower():
        fields = _ORIGINAL.sub(b"", fields)
    head.fields = fields + b"X-Original-Forwarded-For: " + line.group(1).rstrip(b" \t") + b"\r\n"
    if forward.entry.options.forwarded_mode != "append":
        client = _real_ip(peer, req, check.trusted, check.header)[0]
        kept = [h for h in head.forwarded if h[0] != _XFF]
        head.forwarded = [*kept, (_XFF, b"X-Forwarded-For", client)]
    forward.req = head


def has_digest(entry: _Entry) -> bool:
    """The request core's `applies` for its digest_info shaper (after `prepare`)."""
    return entry.access is not None and entry.access.is_digest


def _blocked(matchers: Sequence[Matcher], value: bytes | None) -> bool:
    text = value.decode("latin-1") if value else ""
    for pattern, exact in matchers:
        if pattern is None:
            if text == exact:
                return True
        elif pattern.search(text):
            return True
    return False


def challenge_lines(challenge: str, cors: Any = None) -> str:
    """The 401's header lines: its WWW-Authenticate challenge (none when `challenge`
    is empty: a digest client held off) and, on a CORS route, the CORS headers
    (ingress-nginx's more_set_headers reach its 401 too)."""
    lines = "WWW-Authenticate: " + challenge + "\r\n" if challenge else ""
    if cors:
        lines += "".join(f"{name}: {value}\r\n" for name, value in cors)
    return lines


def challenge_response(lines: str, *, close: bool, head_only: bool) -> bytes:
    """The 401 answer with its header lines (`challenge_lines`), nginx's page title
    as body."""
    body = b"401 Authorization Required\n"
    line = lines.encode("latin-1", "replace")
    return (
        b"HTTP/1.1 401 Unauthorized\r\n%s"
        b"Content-Type: text/plain; charset=utf-8\r\nContent-Length: %d\r\n"
        b"Cache-Control: no-store\r\nX-Waygate-Error: authentication required\r\n%s\r\n%s"
        % (
            line,
            len(body),
            b"Connection: close\r\n" if close else b"",
            b"" if head_only else body,
        )
    )
