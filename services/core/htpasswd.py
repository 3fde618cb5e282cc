"""htpasswd credentials as nginx's auth_basic reads them, verified exactly.

The formats verified are those nginx (ngx_http_auth_basic, through crypt(3) and
its own `{SCHEME}` hashes) accepts that Python computes exactly: bcrypt
(`$2a$`, `$2b$`, `$2y$`, through pyca/bcrypt), MD5-crypt (`$apr1$`, `$1$`),
`{SHA}`, `{SSHA}` and `{PLAIN}`. Others (DES crypt, `$5$`, `$6$`) are named by
`hash_format_problem` so whoever configures them is refused (fail closed),
never silently let through or locked out.

Invariants: comparisons are constant time; an empty hash matches no password
(nginx's behaviour for `user:`); pure, no I/O.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import re
from collections.abc import Iterable
from typing import Final

import bcrypt

FORMATS: Final = "bcrypt ($2a$, $2b$, $2y$), apr1/MD5 ($apr1$, $1$), {SHA}, {SSHA}, {PLAIN}"
_BCRYPT: Final = re.compile(r"\$2[aby]\$\d\d\$[./A-Za-z0-9]{53}")


def hash_format_problem(hashed: str) -> str:
    """Why a htpasswd hash cannot be verified exactly here ("" : it can). An empty
    hash is valid: nginx lets no password match it."""
    if not hashed or hashed.startswith(("{PLAIN}", "{SHA}", "{SSHA}", "$apr1$", "$1$")):
        return ""
    if _BCRYPT.fullmatch(hashed):
        return ""
    return f"a password hash of a format Waygate cannot verify exactly (it verifies {FORMATS})"


def verify(password: bytes, hashed: str) -> bool:
    """Whether `password` matches a htpasswd hash (False for any other format)."""
    if not hashed:
        return False
    if hashed.startswith("$2"):
        try:
            return bcrypt.checkpw(password, hashed.encode("ascii"))
        except ValueError:
            return False
    if hashed.startswith(("$apr1$", "$1$")):
        magic, _, rest = hashed[1:].partition("$")
        salt = rest.split("$", 1)[0]
        computed = md5_crypt(password, salt.encode(), magic.encode())
        return hmac.compare_digest(computed.encode(), hashed.encode())
    if hashed.startswith("{SHA}"):
        expected = base64.b64encode(hashlib.sha1(password).digest())
        return hmac.compare_digest(expected, hashed[5:].encode())
    if hashed.startswith("{SSHA}"):
        try:
            raw = base64.b64decode(hashed[6:], validate=True)
        except binascii.Error:
            return False
        found, salted = raw[:20], raw[20:]
        return len(found) == 20 and hmac.compare_digest(
            hashlib.sha1(password + salted).digest(), found
        )
    if hashed.startswith("{PLAIN}"):
        return hmac.compare_digest(password, hashed[7:].encode("utf-8"))
    return False


_CRYPT64: Final = "./0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz"


def md5_crypt(password: bytes, salt: bytes, magic: bytes = b"apr1") -> str:
    """MD5-crypt (FreeBSD's `$1$`, Apache's `$apr1$`: the same algorithm, another
    magic), as nginx's ngx_crypt_apr1 and glibc compute it."""
    salt = salt[:8]
    prefix = b"$" + magic + b"$"
    alternate = hashlib.md5(password + salt + password).digest()
    ctx = hashlib.md5(password + prefix + salt)
    length = len(password)
    while length > 0:
        ctx.update(alternate[: min(16, length)])
        length -= 16
    length = len(password)
    while length:
        ctx.update(b"\0" if length & 1 else password[:1])
        length >>= 1
    final = ctx.digest()
    for i in range(1000):
        step = hashlib.md5()
        step.update(password if i & 1 else final)
        if i % 3:
            step.update(salt)
        if i % 7:
            step.update(password)
        step.update(final if i & 1 else password)
        final = step.digest()
    out = []
    for a, b, c in ((0, 6, 12), (1, 7, 13), (2, 8, 14), (3, 9, 15), (4, 10, 5)):
        value = (final[a] << 16) | (final[b] << 8) | final[c]
        for _ in range(4):
            out.append(_CRYPT64[value & 0x3F])
            value >>= 6
    value = final[11]
    for _ in range(2):
        out.append(_CRYPT64[value & 0x3F])
        value >>= 6
    return (prefix + salt).decode("ascii") + "$" + "".join(out)


def parse_credentials(lines: Iterable[str]) -> dict[bytes, str]:
    """ "user:hash" lines -> {user: hash} (the first line of a user wins, as nginx
    reads an htpasswd file top down)."""
    users: dict[bytes, str] = {}
    for line in lines:
        user, colon, hashed = line.partition(":")
        if colon and user:
            users.setdefault(user.encode("utf-8"), hashed.strip())
    return users
