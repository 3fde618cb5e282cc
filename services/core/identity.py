"""Allowed-identity patterns and how a peer's identity matches them.

Identities are what a client certificate names: URI SANs (SPIFFE IDs) and DNS
SANs. An allowed identity is written as
- a SPIFFE ID, `spiffe://DOMAIN/ns/NS/sa/SA`, matched exactly, or with one
  trailing `*` matching any rest (`spiffe://waygate.local/ns/local/sa/tunnel-*`);
- a DNS name, matched exactly and case-insensitively (no wildcards).

One rule for every service that keeps allow lists (the resolver's writers and
route readers, the tunnel's dialers).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_SPIFFE = re.compile(r"spiffe://[a-z0-9._-]+(/[A-Za-z0-9._~%!$&'()+,;=:@-]+)*/?")
_DNS_LABEL = re.compile(r"(?!-)[a-z0-9-]{1,63}(?<!-)")


def pattern_problem(pattern: str) -> str | None:
    """Why `pattern` is not a valid allowed identity, or None when it is."""
    if pattern.startswith("spiffe://"):
        body = pattern[:-1] if pattern.endswith("*") else pattern
        if "*" in body:
            return f"{pattern!r}: '*' is allowed only at the end"
        if not _SPIFFE.fullmatch(body) and not (pattern.endswith("*") and body == "spiffe://"):
            return f"{pattern!r} is not a SPIFFE ID (spiffe://DOMAIN/ns/NS/sa/SA)"
        return None
    if "://" in pattern or ":" in pattern:
        return f"{pattern!r}: only spiffe:// URIs or DNS names are identities"
    name = pattern.lower().rstrip(".")
    if not name or len(name) > 253 or not all(_DNS_LABEL.fullmatch(p) for p in name.split(".")):
        return f"{pattern!r} is neither a SPIFFE ID (spiffe://...) nor a DNS name"
    return None


def patterns_problem(patterns: Iterable[str]) -> str | None:
    """Settings check for a list of allowed identities."""
    for pattern in patterns:
        problem = pattern_problem(pattern)
        if problem:
            return problem
    return None


def matches(pattern: str, identity: str) -> bool:
    if pattern.startswith("spiffe://"):
        if pattern.endswith("*"):
            return identity.startswith(pattern[:-1])
        return identity == pattern
    if identity.startswith("spiffe://"):
        return False
    return identity.lower().rstrip(".") == pattern.lower().rstrip(".")
