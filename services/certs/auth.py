"""Who is calling `Certify`: bearer tokens -> a `Caller`.

An `Authenticator` turns the token of a request into a `Caller` or None (not
authenticated). Two exist: `StaticTokenAuthenticator` (embedded mode, a
tokens file) here, and the Kubernetes TokenReview one in
`waygate.certs.kube_auth`.

Tokens file (YAML, mode 0600, refused otherwise):

    tokens:
      - token: "<random, >= 32 characters>"
        name: "resolver"        # Caller.name, recorded as requested_by
        allowed: ["dns:resolver.waygate.local", "ip:127.0.0.1",
                  "uri:spiffe://waygate.local/ns/local/sa/resolver"]
        admin: false            # true: may call RotateCA and ListIssued

Invariants: every token is compared against every entry in constant time
(`hmac.compare_digest`), so timing reveals neither which entry nor how much
of a token matched; token values are never logged.
"""

from __future__ import annotations

import hmac
import stat
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import yaml

MIN_TOKEN_LENGTH = 32
#: Longest token a caller may present (a projected ServiceAccount token is ~1 KiB);
#: longer is INVALID_ARGUMENT before any comparison or TokenReview.
MAX_TOKEN_LENGTH = 16 * 1024
#: Group a static caller belongs to when its entry says `admin: true`.
ADMIN_GROUP = "waygate:admins"


class TokensFileError(ValueError):
    """The tokens file is missing, unsafe or malformed; the message is one line."""


@dataclass(frozen=True)
class Caller:
    name: str
    namespace: str | None = None
    service_account: str | None = None
    node: str | None = None
    groups: tuple[str, ...] = ()
    # A ServiceAccount token bound to a pod: the pod's node (TokenReview extra
    # authentication.kubernetes.io/node-name). Grants nothing by itself: see
    # Policy's `node_agents`.
    pod_node: str | None = None
    # SAN patterns this caller may get (static tokens): "dns:NAME", "uri:URI", "ip:ADDRESS".
    allowed: tuple[str, ...] = ()

    @property
    def is_admin(self) -> bool:
        return ADMIN_GROUP in self.groups


class Authenticator(Protocol):
    async def authenticate(self, token: str) -> Caller | None:
        """The caller behind `token`, or None when it does not authenticate."""
        ...


@dataclass(frozen=True)
class _Entry:
    token: bytes
    caller: Caller


class StaticTokenAuthenticator:
    """Tokens from a 0600 YAML file, each mapped to a named caller and its SAN patterns."""

    def __init__(self, entries: list[tuple[str, Caller]]) -> None:
        self._entries = tuple(_Entry(token.encode(), caller) for token, caller in entries)

    @classmethod
    def from_file(cls, path: Path) -> StaticTokenAuthenticator:
        try:
            mode = stat.S_IMODE(path.stat().st_mode)
            text = path.read_text()
        except OSError as exc:
            raise TokensFileError(f"cannot read tokens file {path}: {exc.strerror}") from None
        if mode & 0o077:
            raise TokensFileError(
                f"tokens file {path} has mode {mode:04o}: it holds secrets and must be "
                f"readable by its owner only (chmod 600 {path})"
            )
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError:
            raise TokensFileError(f"tokens file {path} is not valid YAML") from None
        return cls(parse_tokens(data, str(path)))

    async def authenticate(self, token: str) -> Caller | None:
        presented = token.encode()
        found: Caller | None = None
        # No early exit: the time taken does not depend on which entry matched.
        for entry in self._entries:
            if hmac.compare_digest(entry.token, presented):
                found = entry.caller
        return found

    @property
    def callers(self) -> tuple[Caller, ...]:
        return tuple(e.caller for e in self._entries)


def parse_tokens(data: Any, source: str) -> list[tuple[str, Caller]]:
    """Validate the parsed YAML of a tokens file; errors name the entry and field."""
    if not isinstance(data, dict) or not isinstance(data.get("tokens"), list):
        raise TokensFileError(f"tokens file {source} must hold `tokens:` with a list of entries")
    entries: list[tuple[str, Caller]] = []
    seen: set[str] = set()
    for index, item in enumerate(data["tokens"]):
        where = f"tokens file {source}, entry {index + 1}"
        if not isinstance(item, dict):
            raise TokensFileError(f"{where}: must be a mapping with token, name, allowed")
        unknown = sorted(set(item) - {"token", "name", "allowed", "admin"})
        if unknown:
            raise TokensFileError(f"{where}: unknown field {unknown[0]!r}")
        token, name = item.get("token"), item.get("name")
        if not isinstance(token, str) or len(token) < MIN_TOKEN_LENGTH:
            raise TokensFileError(
                f"{where}: token must be a string of at least {MIN_TOKEN_LENGTH} characters"
            )
        if token in seen:
            raise TokensFileError(f"{where}: token is the same as an earlier entry's")
        seen.add(token)
        if not isinstance(name, str) or not name:
            raise TokensFileError(f"{where}: name must be a non-empty string")
        allowed = item.get("allowed", [])
        if not isinstance(allowed, list) or not all(isinstance(a, str) for a in allowed):
            raise TokensFileError(f"{where} ({name}): allowed must be a list of strings")
        from waygate.certs.policy import check_pattern  # local: policy imports auth

        for pattern in allowed:
            problem = check_pattern(pattern)
            if problem:
                raise TokensFileError(f"{where} ({name}): {problem}")
        admin = item.get("admin", False)
        if not isinstance(admin, bool):
            raise TokensFileError(f"{where} ({name}): admin must be true or false")
        groups = (ADMIN_GROUP,) if admin else ()
        entries.append((token, Caller(name=name, groups=groups, allowed=tuple(allowed))))
    return entries
