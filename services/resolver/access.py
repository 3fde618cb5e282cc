"""Who may call the resolver's write RPCs (ReportTunnels, ApplyRoute, DeleteRoute,
ReportListeners: the route readers), and who may read route private keys.

Reads (Resolve, Watch, ListRoutes) are open to every client the listener
accepts. Writes change where traffic goes, so each is limited to a list of
client identities, taken from the client certificate by the gRPC boundary:
its URI SANs (SPIFFE IDs) and DNS SANs. Route private keys (tls.key) go out
over Watch only to route readers (the proxy): everyone else, and every client
of a listener without client certificates, gets them redacted.

An allowed identity is a pattern of `waygate.core.identity` (a SPIFFE ID,
exact or with one trailing `*`, or a DNS name).

Invariants:
- On a listener that asks for client certificates (mTLS), a write is allowed
  only when one of the peer's identities matches the list for that RPC; an
  empty list refuses everyone (fail closed), a peer without identities too.
- On a listener without client certificates (plaintext loopback development,
  or TLS without a client CA) there is no identity to check: writes are
  allowed, and `WriteAccess.unauthenticated_warning` says so for the start log.
  Route keys, on the contrary, are never sent there: without an identity
  nobody is a route reader (fail closed for secrets).
"""

from __future__ import annotations

from dataclasses import dataclass

from waygate.core.errors import PermissionDenied, excerpt
from waygate.core.identity import matches


@dataclass(frozen=True)
class WriteAccess:
    """The write RPCs' allow lists, and whether the listener has identities at all."""

    tunnel_reporters: tuple[str, ...] = ()
    route_admins: tuple[str, ...] = ()
    # Identities that receive route private keys over Watch.
    route_readers: tuple[str, ...] = ()
    # False: the listener takes no client certificates, so nobody can be checked.
    authenticated: bool = False

    @property
    def unauthenticated_warning(self) -> str | None:
        if self.authenticated:
            return None
        return (
            "the gRPC listener takes no client certificates: ReportTunnels, ApplyRoute "
            "and DeleteRoute are open to every client (tunnel_reporters and route_admins "
            "apply only with mTLS); route private keys go to no Watch client"
        )

    def may_read_route_keys(self, identities: tuple[str, ...]) -> bool:
        """True when a peer with these identities gets routes' tls.key over Watch."""
        return self.authenticated and any(
            matches(p, identity) for p in self.route_readers for identity in identities
        )

    def route_keys_withheld(self, identities: tuple[str, ...]) -> str:
        """Why a peer with these identities gets no route private keys; "" when it does.
        Sent to the Watch client, so a proxy says this instead of "the key does not load"."""
        if self.may_read_route_keys(identities):
            return ""
        if not self.authenticated:
            return "this connection to the resolver is not mTLS"
        if not identities:
            return "the client certificate names no identity"
        who = excerpt(", ".join(identities), 200)
        return f"identity {who} is not in --route-readers"

    def keys_withheld_from_everyone(self) -> tuple[str, str]:
        """(reason, message) when no Watch client at all can get route private keys
        (written into such a route's status by ListRoutes); ("", "") otherwise."""
        if not self.authenticated:
            return "NotMTLS", (
                "private key withheld: the resolver's gRPC listener takes no client "
                "certificates (not mTLS), so no Watch client (no proxy) receives it"
            )
        if not self.route_readers:
            return "NoRouteReaders", (
                "private key withheld: --route-readers is empty, so no Watch client "
                "(no proxy) receives it"
            )
        return "", ""

    def check_tunnel_reporter(self, identities: tuple[str, ...]) -> None:
        self._check("ReportTunnels", "tunnel_reporters", self.tunnel_reporters, identities)

    def check_listener_reporter(self, identities: tuple[str, ...]) -> None:
        """ReportListeners: the proxies, which are the route readers; a report changes
        only what status says, never where traffic goes."""
        self._check("ReportListeners", "route_readers", self.route_readers, identities)

    def check_backend_certificate_reporter(self, identities: tuple[str, ...]) -> None:
        """ReportBackendCertificates: the proxies (route readers), as ReportListeners;
        a report changes only what status says, never where traffic goes."""
        self._check("ReportBackendCertificates", "route_readers", self.route_readers, identities)

    def check_route_admin(self, method: str, identities: tuple[str, ...]) -> None:
        self._check(method, "route_admins", self.route_admins, identities)

    def _check(
        self, method: str, setting: str, allowed: tuple[str, ...], identities: tuple[str, ...]
    ) -> None:
        if not self.authenticated:
            return
        if any(matches(p, identity) for p in allowed for identity in identities):
            return
        # Identities come from the peer's certificate: repeated only as an excerpt
        # (a certificate may hold thousands of SANs).
        who = (
            excerpt(", ".join(identities))
            if identities
            else "a client certificate without identities"
        )
        flag = "--" + setting.replace("_", "-")
        raise PermissionDenied(
            f"{method}: {who} may not call it; allowed identities are set with {flag}"
        )
