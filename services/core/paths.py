"""URL path normalisation (RFC 3986 section 6.2.2), sans-IO.

One normaliser for both sides of route matching: the resolver stores a route's
path prefix in this form, and the proxy puts a request path in the same form
before matching it, so `/%61dmin` and `/admin` are one path to both. Only
percent-escapes change: an escape of an unreserved character (letters, digits,
`-._~`) is decoded, every other escape is upper-cased; a `%` not followed by two
hex digits is left as it is (the resolver refuses such route paths itself).
"""

from __future__ import annotations

import re

UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")

_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")
_ESCAPE_BYTES = re.compile(rb"%([0-9A-Fa-f]{2})")


def _normalized_escape(match: re.Match[str]) -> str:
    char = chr(int(match[1], 16))
    return char if char in UNRESERVED else "%" + match[1].upper()


def _normalized_escape_bytes(match: re.Match[bytes]) -> bytes:
    char = chr(int(match[1], 16))
    return char.encode("ascii") if char in UNRESERVED else b"%" + match[1].upper()


def normalize_escapes(path: str) -> str:
    """`path` with its percent-escapes in normal form (see the module docstring)."""
    return _ESCAPE.sub(_normalized_escape, path)


def normalize_request_path(path: bytes) -> bytes:
    """`normalize_escapes` for a raw request path (callers skip paths without '%')."""
    return _ESCAPE_BYTES.sub(_normalized_escape_bytes, path)
