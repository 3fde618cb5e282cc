"""HTTP Digest authentication as ingress-nginx's nginx serves it (`auth-type: digest`).

ingress-nginx renders `auth_digest REALM; auth_digest_user_file FILE;` for the
module it builds in, atomx/nginx-http-auth-digest v1.0.0 (its
ngx_http_auth_digest_module.c is the reference for every rule here), with the
module's defaults: RFC 2617/7616 Digest, algorithm MD5, qop=auth, against an
htdigest file of `user:realm:HA1` lines (HA1 = MD5(user:realm:password), 32
hex digits). Reproduced:

- the challenge: `Digest algorithm="MD5", qop="auth", realm="R", nonce="N"`
  (`, stale="true"` when the nonce is no longer good), the nonce 16 hex digits;
- a response is checked only when the Authorization header is `Digest` with
  username, qop, realm, nonce (16 characters), nc, uri, cnonce and response;
  its uri is the request target, or the target's path before `?`; the line of
  the file is the one of the header's username and realm; the response is
  MD5(HA1:nonce:nc:cnonce:qop:MD5(method:uri)) in lower-case hex (with the qop
  the client names, as the module hashes it);
- a good answer gets `Authentication-Info: qop="auth", rspauth="R", cnonce="C",
  nc=N` on the response, R = MD5(HA1:nonce:nc:cnonce:qop:MD5(":" uri));
- nonces (`NonceTable`): good for `timeout` (60 s) after they are issued, then
  `expires` (10 s) after their first use; each nc value (below `replays`, 20)
  accepted once: a reused nc is refused, an expired nonce or an nc out of range
  is answered with a new challenge marked stale;
- evasion (`Evasion`): a client address with `maxtries` (5) failed answers,
  each within `evasion_time` (300 s) of the last, is answered 401 without a
  challenge until `evasion_time` after its last failure; a success clears it.

One difference, by design: a nonce this process does not hold (issued by
another worker, or forgotten because the table was full) but answered with the
right password is answered stale (a new challenge the browser answers without
asking its user), where the module answers a plain challenge.

Invariants: pure and sans-IO (the clock is passed in); comparisons constant
time; the nonce and evasion tables are bounded in entries (the oldest are
forgotten first when full, after the expired).
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Final, NamedTuple

# The module's defaults (auth_digest_timeout, _expires, _replays, _evasion_time, _maxtries).
TIMEOUT: Final = 60.0
EXPIRES: Final = 10.0
REPLAYS: Final = 20
EVASION_TIME: Final = 300.0
MAX_TRIES: Final = 5
# Entries each table keeps by default (the proxy's --digest-nonces setting).
DEFAULT_ENTRIES: Final = 16_384

_HA1: Final = re.compile(r"[0-9A-Fa-f]{32}")
_SCHEME: Final = re.compile(rb"[ \t\r\n]*digest +", re.IGNORECASE)
# One auth-param: a token name, "=", a token or a quoted string (backslash escapes).
_PARAM: Final = re.compile(
    rb"([!#$%&'*+.^_`|~0-9A-Za-z-]+)=(?:([!#$%&'*+.^_`|~0-9A-Za-z-]+)|\"((?:[^\"\\\x00-\x1f\x7f]|\\[\x00-\x7f])*)\")"
)
_SEPARATOR: Final = re.compile(rb"[ \t\r\n]*(?:,[ \t\r\n]*)*")
_WANTED: Final = frozenset(
    (b"username", b"qop", b"realm", b"nonce", b"nc", b"uri", b"cnonce", b"response", b"opaque")
)
_UNESCAPE: Final = re.compile(rb"\\(.)", re.DOTALL)


def line_problem(line: str) -> str:
    """Why an htdigest line cannot be used ("" : it can): user:realm:HA1."""
    if line.count(":") != 2:
        return "not a user:realm:HA1 line (htdigest)"
    user, realm, ha1 = line.split(":")
    if not user or not realm or not ha1:
        return "not a user:realm:HA1 line (htdigest)"
    if "#" in user or "#" in realm:
        return "a user or realm with # (nginx reads the line as a comment)"
    if not _HA1.fullmatch(ha1):
        return "its HA1 is not 32 hexadecimal digits (MD5 of user:realm:password)"
    return ""


def parse_lines(lines: Iterable[str]) -> dict[tuple[bytes, bytes], tuple[bytes, ...]]:
    """htdigest lines -> {(user, realm): HA1s} (every usable line of a user and realm
    is tried, as the module reads the file through; comments and others skipped)."""
    users: dict[tuple[bytes, bytes], tuple[bytes, ...]] = {}
    for raw in lines:
        line = raw.strip()
        if line.startswith("#") or line_problem(line):
            continue
        user, realm, ha1 = line.split(":")
        key = (user.encode("utf-8"), realm.encode("utf-8"))
        users[key] = (*users.get(key, ()), ha1.encode("ascii"))
    return users


def ha1(user: str, realm: str, password: str) -> str:
    """What htdigest stores for a user (MD5 of user:realm:password, hex)."""
    return hashlib.md5(f"{user}:{realm}:{password}".encode()).hexdigest()


class Credentials(NamedTuple):
    """The fields of a Digest Authorization header."""

    username: bytes
    realm: bytes
    nonce: bytes
    nc: bytes
    uri: bytes
    qop: bytes
    cnonce: bytes
    response: bytes


def parse_authorization(value: bytes) -> Credentials | None:
    """A `Digest` Authorization value's fields; None when it is not one, or lacks any
    the module requires (then the client is challenged)."""
    scheme = _SCHEME.match(value)
    if scheme is None:
        return None
    fields: dict[bytes, bytes] = {}
    at = _SEPARATOR.match(value, scheme.end()).end()  # type: ignore[union-attr]
    end = len(value.rstrip(b" \t\r\n"))
    while at < end:
        found = _PARAM.match(value, at)
        if found is None:
            return None
        name = found.group(1).lower()
        if name in _WANTED:
            token, quoted = found.group(2), found.group(3)
            fields[name] = token if token is not None else _UNESCAPE.sub(rb"\1", quoted)
        at = found.end()
        if at < end and value[at : at + 1] not in b" \t\r\n,":
            return None
        at = _SEPARATOR.match(value, at).end()  # type: ignore[union-attr]
    try:
        credentials = Credentials(
            fields[b"username"],
            fields[b"realm"],
            fields[b"nonce"],
            fields[b"nc"],
            fields[b"uri"],
            fields[b"qop"],
            fields[b"cnonce"],
            fields[b"response"],
        )
    except KeyError:
        return None
    if not all(credentials) or len(credentials.nonce) != 16:
        return None
    return credentials


def uri_matches(uri: bytes, target: bytes) -> bool:
    """The header's uri names the request: the target itself, or its part before `?`
    (the module's allowance for clients that leave the query out)."""
    return uri == target or (
        len(target) > len(uri) and target.startswith(uri) and target[len(uri)] == 0x3F
    )


def expected_response(ha1_hex: bytes, method: bytes, c: Credentials) -> bytes:
    """MD5(HA1:nonce:nc:cnonce:qop:MD5(method:uri)), lower-case hex (RFC 7616 3.4.1)."""
    ha2 = hashlib.md5(method + b":" + c.uri).hexdigest().encode()
    return (
        hashlib.md5(b":".join((ha1_hex, c.nonce, c.nc, c.cnonce, c.qop, ha2))).hexdigest().encode()
    )


def matching_ha1(hashes: tuple[bytes, ...], method: bytes, c: Credentials) -> bytes:
    """The user's HA1 the response was made with (b"": none); each compared in
    constant time, every one tried."""
    found = b""
    for stored in hashes:
        if hmac.compare_digest(expected_response(stored, method, c), c.response):
            found = found or stored
    return found


def password_matches(hashes: tuple[bytes, ...], method: bytes, c: Credentials) -> bool:
    """Whether the response was made with one of the user's HA1s."""
    return bool(matching_ha1(hashes, method, c))


def authentication_info(ha1_hex: bytes, c: Credentials) -> str:
    """The Authentication-Info value the module sends with a good answer (rspauth:
    the response with HA2 = MD5(":" uri), proving the server knows HA1 too)."""
    rspauth = expected_response(ha1_hex, b"", c)
    return (
        f'qop="auth", rspauth="{rspauth.decode()}", cnonce="{c.cnonce.decode("latin-1")}", '
        f"nc={c.nc.decode('latin-1')}"
    )


def challenge(realm: str, nonce: str, stale: bool) -> str:
    """The WWW-Authenticate value, as the module writes it."""
    return f'Digest algorithm="MD5", qop="auth", realm="{realm}", nonce="{nonce}"' + (
        ', stale="true"' if stale else ""
    )


# ---------------------------------------------------------------- nonces

# Verdicts of `NonceTable.use`.
NONCE_OK: Final = 0
NONCE_STALE: Final = 1  # a new challenge, marked stale
NONCE_REPLAYED: Final = 2  # refused: a plain challenge


class _Nonce:
    __slots__ = ("expires", "first_used", "used")

    def __init__(self, expires: float) -> None:
        self.expires = expires
        self.used = 0  # bit n: nc n was accepted
        self.first_used = False


class NonceTable:
    """The nonces issued, each with its expiry and the nc values used (the module's
    shared-memory tree), bounded in entries."""

    def __init__(
        self,
        max_entries: int = DEFAULT_ENTRIES,
        *,
        timeout: float = TIMEOUT,
        expires: float = EXPIRES,
        replays: int = REPLAYS,
    ) -> None:
        self.max_entries = max_entries
        self.timeout = timeout
        self.expires = expires
        self.replays = replays
        self.entries: OrderedDict[bytes, _Nonce] = OrderedDict()

    def issue(self, now: float) -> str:
        """A new nonce (16 hex digits, 64 random bits), good for `timeout`."""
        entries = self.entries
        if len(entries) >= self.max_entries:
            self._prune(now)
        while True:
            nonce = secrets.token_hex(8)
            key = nonce.encode()
            if key not in entries:
                break
        entries[key] = _Nonce(now + self.timeout)
        return nonce

    def use(self, nonce: bytes, nc: bytes, now: float) -> int:
        """Whether an answer with this nonce and nc (hex) may pass (its password
        already checked): NONCE_OK (the nc is then spent), _STALE or _REPLAYED."""
        try:
            count = int(nc, 16)
        except ValueError:
            return NONCE_STALE  # (the module's ngx_hextoi fails: stale)
        if not 0 <= count < self.replays:
            return NONCE_STALE
        found = self.entries.get(nonce)
        if found is None or found.expires <= now:
            return NONCE_STALE
        bit = 1 << count
        if found.used & bit:
            return NONCE_REPLAYED
        if not found.first_used:  # the first use: good for `expires` more
            found.first_used = True
            found.expires = now + self.expires
        found.used |= bit
        return NONCE_OK

    def _prune(self, now: float) -> None:
        _make_room(self.entries, self.max_entries, lambda value: value.expires <= now)


def _make_room(entries: OrderedDict[Any, Any], bound: int, expired: Callable[[Any], bool]) -> None:
    """Below `bound` entries: the expired go first, then the oldest."""
    for key in [key for key, value in entries.items() if expired(value)]:
        del entries[key]
    while len(entries) >= bound:
        entries.popitem(last=False)


class Evasion:
    """Failed answers per client address (the module's evasion tree), bounded."""

    def __init__(
        self,
        max_entries: int = DEFAULT_ENTRIES,
        *,
        evasion_time: float = EVASION_TIME,
        max_tries: int = MAX_TRIES,
    ) -> None:
        self.max_entries = max_entries
        self.evasion_time = evasion_time
        self.max_tries = max_tries
        # address -> [failures, until]
        self.entries: OrderedDict[Hashable, list[float]] = OrderedDict()

    def evading(self, address: Hashable, now: float) -> bool:
        """Whether the address is held off (answered 401 without a challenge)."""
        found = self.entries.get(address)
        return found is not None and found[0] >= self.max_tries and now < found[1]

    def failed(self, address: Hashable, now: float) -> None:
        entries = self.entries
        found = entries.get(address)
        if found is None:
            if len(entries) >= self.max_entries:
                _make_room(entries, self.max_entries, lambda value: value[1] <= now)
            entries[address] = [1, now + self.evasion_time]
            return
        found[0] = 1 if now > found[1] else found[0] + 1
        found[1] = now + self.evasion_time
        entries.move_to_end(address)

    def succeeded(self, address: Hashable) -> None:
        self.entries.pop(address, None)
