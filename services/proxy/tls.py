"""The proxy's HTTPS side: certificates by SNI, the default certificate, edge rules.

- `EdgeCertificates`: the listener's `ssl.SSLContext`. Its SNI callback (run
  by OpenSSL for every ClientHello, with or without SNI) switches the
  connection to the context of the route certificate for that name: exact
  hosts first, then wildcards (`*.example.com` covers one label), else the
  default certificate. `update(routes)` is called on every resolver view; a
  context is built once per distinct certificate and reused while it stays,
  so a swap costs nothing to connections in flight (they keep the context
  their handshake chose).
- A route certificate that does not cover its route's host, has expired or
  does not load is refused: the host gets the default certificate, the
  reason is logged once per certificate and counted in
  `waygate_proxy_route_certificates_refused_total{route,reason}`. The expiry
  of every served route certificate is exported
  (`waygate_proxy_route_certificate_expiry_timestamp_seconds{route,host}`),
  with a warning when under 20% of its life remains.
- `DefaultCertificate`: the proxy's own certificate, from certs through the
  rotation client (renewed in place), or `--default-certificate/--default-key`
  files checked for changes every `FILE_POLL` seconds.
- Session resumption without long-lived ticket keys: Python's `ssl` cannot
  set or rotate ticket keys, and OpenSSL encrypts tickets with the key of the
  listener's context (the one the asyncio server holds for its whole life,
  whatever context the SNI callback switches to), generated once. A ticket
  key that never rotates would undo forward secrecy for every resumed
  session, so the listener (like every context `waygate.core.tls` builds)
  sets OP_NO_TICKET: TLS 1.2 resumes by session id
  and TLS 1.3 gets OpenSSL's stateful tickets, both from the listener's
  in-memory session cache (tested for both versions). That cache is bounded
  here (`SESSION_CACHE` sessions, `SESSION_TIMEOUT` seconds, one TLS 1.3 ticket
  per handshake): OpenSSL's defaults, 20,480 sessions kept 7,200 s and two
  tickets per handshake, grew the proxy's RSS by tens of MiB in the 30-minute
  soak. That cache is shared by every SNI context, so a resumed session
  may have been verified for another host: `client_identity` re-verifies its
  client certificate against the route's CA.
- ingress-nginx's ssl-protocols and ssl-ciphers (`RouteTLS.protocols`,
  `.ciphers`): the host's context is built with its minimum version and cipher
  list (`waygate.core.tls.server_context`); OpenSSL has chosen the version
  before the SNI callback runs, so the callback refuses an older one with a
  protocol_version alert (`_held_to`). A host whose own certificate is not
  served (refused, key withheld) keeps its policy on the default certificate:
  the cipher list is set on the connection. Fail closed: what cannot be read
  or set refuses the handshake.
- `edge_rule`: what a TLS route answers on the plain HTTP port (its insecure
  edge policy: Allow, Redirect with 302, or None) and the HSTS header line
  it adds on HTTPS.

Route private keys are only ever held here in memory (given to OpenSSL
through an anonymous memfd by `waygate.core.tls`), never logged; a context
whose route went is dropped with the map that held it.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import ssl
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime, timedelta
from pathlib import Path
from types import MappingProxyType
from typing import Any, NamedTuple

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from prometheus_client import Counter, Gauge

from waygate.core.rotation import CertificateRotator
from waygate.core.tls import (
    ask_client_certificate,
    minimum_version,
    negotiated_version,
    policy_problem,
    server_context,
    set_connection_ciphers,
    set_session_cache_size,
    set_session_timeout,
)
from waygate.proxy import clientcert
from waygate.resolver.client import ClientCertificate, InsecureEdgePolicy, Route, TLSTermination

log = logging.getLogger(__name__)

# HTTP/2 first (waygate.proxy.http2), HTTP/1.1 for clients that offer only it.
ALPN = ("h2", "http/1.1")
FILE_POLL = 2.0
SELF_SIGNED_NAME = "waygate-proxy-default.invalid"
WARN_FRACTION = 0.2
#: The listener's session cache: OpenSSL's default (20,480 sessions, about 1.2 KiB
#: each with a P-256 leaf, two per TLS 1.3 handshake, kept 7,200 s) took the proxy
#: from 86 to 145 MiB over the soak's 16,000 handshakes. 4,096 sessions for 300 s
#: (nginx's default session timeout) resume a returning client; a few MiB at most.
SESSION_CACHE = 4096
SESSION_TIMEOUT = 300

ROUTE_CERT_EXPIRY = Gauge(
    "waygate_proxy_route_certificate_expiry_timestamp_seconds",
    "notAfter of each route certificate the HTTPS listener serves",
    ["route", "host"],
)
ROUTE_CERT_REFUSED = Counter(
    "waygate_proxy_route_certificates_refused_total",
    "route certificates refused (the default certificate is served for the host instead)",
    ["route", "reason"],
)


class RefusedCertificate(Exception):
    """A route certificate the proxy will not serve; `kind` is the metric label."""

    def __init__(self, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.kind = kind


def covers(pattern: str, host: str) -> bool:
    """RFC 6125 matching of one DNS SAN against a host (wildcard: one leftmost label)."""
    pattern, host = pattern.lower().rstrip("."), host.lower().rstrip(".")
    if pattern.startswith("*."):
        label, _, rest = host.partition(".")
        return bool(label) and rest == pattern[2:]
    return pattern == host


def dns_names(certificate: x509.Certificate) -> list[str]:
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName)
    except x509.ExtensionNotFound:
        return []
    return list(sans.value.get_values_for_type(x509.DNSName))


def session_id_context(rules: ClientCertificate) -> bytes:
    """The session id context of the contexts verifying clients by `rules`: a digest
    of what acts in the handshake (`clientcert.session_mark` adds the server name)."""
    digest = _digest(rules.ca_certificates, rules.revocation_lists, rules.verify, str(rules.depth))
    return digest[: clientcert.MARK_HALF]


class ServedCertificate:
    """One route certificate's context and the facts about it.

    With ingress-nginx's client-certificate rules (`client_rules`, not "off"), the
    context holds their CA bundle and revocation lists and a session id context of
    its own (`session_id`: a session made for another context is never taken for
    one of this host's), and the SNI callback asks the client for a certificate
    with their depth (`ask_depth`; 0: it asks nothing).

    With ingress-nginx's ssl-protocols and ssl-ciphers (`RouteTLS.protocols`,
    `.ciphers`) the context holds the host's cipher list (OpenSSL takes it from the
    switched-to context) and its minimum version, which the SNI callback enforces
    (`policy`, `_held_to`: the version was chosen before the callback). Such a
    context has a session id context of its own too: a session made under it is
    never resumed on another host."""

    __slots__ = (
        "ask_depth",
        "client_cas",
        "context",
        "leaf",
        "not_after",
        "not_before",
        "policy",
        "revocation",
        "session_id",
        "trusts",
    )

    def __init__(
        self,
        chain_pem: bytes,
        key_pem: bytes,
        client_ca_pem: bytes | None,
        client_rules: ClientCertificate | None = None,
        protocols: tuple[str, ...] = (),
        ciphers: str = "",
    ) -> None:
        problem = policy_problem(protocols, ciphers)
        if problem:
            raise RefusedCertificate(f"the route's TLS policy: {problem}", "invalid")
        try:
            self.leaf = x509.load_pem_x509_certificate(chain_pem)
        except ValueError:
            raise RefusedCertificate("the route's certificate does not parse", "invalid") from None
        self.not_before = self.leaf.not_valid_before_utc
        self.not_after = self.leaf.not_valid_after_utc
        self.ask_depth = 0
        self.session_id = b""
        self.revocation = False
        crl_pem = None
        if (
            client_rules is not None
            and client_rules.verify != "off"
            and not client_rules.refusal
            and not client_ca_pem
        ):
            client_ca_pem = client_rules.ca_certificates.encode()
            crl_pem = client_rules.revocation_lists.encode() or None
            self.revocation = crl_pem is not None
            self.ask_depth = client_rules.depth
            self.session_id = session_id_context(client_rules)
        # The certificate request names ca.crt's CAs (auth-tls rules), as nginx's does.
        advertise = bool(self.session_id)
        narrowed = minimum_version(protocols)
        self.policy = host_policy(protocols, ciphers)
        if self.policy is not None and not self.session_id:
            self.session_id = _digest("tls-policy", *protocols, ciphers)[:32]
        try:
            # Kept to re-verify a resumed session's client certificate (client_identity);
            # a context with CAs of its own is never given other routes' (install).
            self.client_cas = (
                x509.load_pem_x509_certificates(client_ca_pem) if client_ca_pem else []
            )
            # Other routes' client CAs this context verifies with (no identity from them).
            self.trusts: frozenset[bytes] = frozenset()
            self.context = server_context(
                chain_pem=chain_pem,
                key_pem=key_pem,
                client_ca_pem=client_ca_pem,
                # Per-route client CAs: asked for at the handshake, and verified
                # against this route's CA by this (SNI-selected) context.
                client_auth="optional" if client_ca_pem else "none",
                alpn_protocols=ALPN,
                client_crl_pem=crl_pem,
                session_id_context=self.session_id,
                advertise_client_cas=advertise,
                minimum_version=narrowed,
                ciphers=ciphers,
            )
        except (ssl.SSLError, ValueError) as exc:
            # The message names the OpenSSL failure only, never key material.
            reason = getattr(exc, "reason", None) or type(exc).__name__
            raise RefusedCertificate(
                f"the route's certificate and key do not load ({reason})", "invalid"
            ) from None


def _digest(*parts: str) -> bytes:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.digest()


class DefaultCertificate:
    """The proxy's own certificate as a context: from certs (rotating) or from files."""

    def __init__(self) -> None:
        self.context: ssl.SSLContext | None = None
        self.pem: tuple[bytes, bytes] = (b"", b"")
        self.on_change: Callable[[], None] = lambda: None
        self._unsubscribe: Callable[[], None] | None = None
        # Files only: re-read them now if they changed (the watcher calls it).
        self.check_files: Callable[[], None] = lambda: None

    @classmethod
    def from_rotator(cls, rotator: CertificateRotator) -> DefaultCertificate:
        default = cls()

        def build(_held: Any = None) -> None:
            held = rotator.current
            default.pem = (held.chain_pem(), held.key_pem())
            default.context = server_context(
                chain_pem=default.pem[0], key_pem=default.pem[1], alpn_protocols=ALPN
            )
            default.on_change()

        build()
        default._unsubscribe = rotator.subscribe(build)
        return default

    @classmethod
    def from_files(cls, certificate: Path, key: Path) -> DefaultCertificate:
        """Files read now (start-up fails when they do not load) and re-read when they change."""
        default = cls()
        seen: list[tuple[float, float]] = []

        def load() -> None:
            stamp = (certificate.stat().st_mtime, key.stat().st_mtime)
            if seen and seen[0] == stamp:
                return
            pem = (certificate.read_bytes(), key.read_bytes())
            context = server_context(chain_pem=pem[0], key_pem=pem[1], alpn_protocols=ALPN)
            seen[:] = [stamp]
            default.pem = pem
            default.context = context
            default.on_change()

        async def watch() -> None:
            while True:
                await asyncio.sleep(FILE_POLL)
                try:
                    default.check_files()
                except (OSError, ssl.SSLError, ValueError) as exc:
                    # Keep serving the last good pair; a half-written pair is retried.
                    log.warning(
                        "default certificate files do not load; keeping the last good pair",
                        extra={"certificate": str(certificate), "error": type(exc).__name__},
                    )

        load()
        default.check_files = load
        default._watch = watch  # type: ignore[attr-defined]
        return default

    @classmethod
    def self_signed(cls) -> DefaultCertificate:
        """A certificate made now, in memory, for a proxy with no other default: the
        HTTPS port is bound whenever the proxy runs, and a handshake whose SNI
        matches no route completes (as the OpenShift router's does) so that the
        client reads the proxy's 503 with its reason instead of a bare
        `unrecognized_name` alert. No client trusts it: it names no host
        (CN waygate-proxy-default.invalid) and serves only names no route has."""
        from cryptography.hazmat.primitives import hashes, serialization
        from cryptography.hazmat.primitives.asymmetric import ec
        from cryptography.x509.oid import NameOID

        key = ec.generate_private_key(ec.SECP256R1())
        name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, SELF_SIGNED_NAME)])
        now = datetime.now(UTC)
        certificate = (
            x509.CertificateBuilder()
            .subject_name(name)
            .issuer_name(name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - timedelta(hours=1))
            .not_valid_after(now + timedelta(days=365))
            .add_extension(
                x509.SubjectAlternativeName([x509.DNSName(SELF_SIGNED_NAME)]), critical=False
            )
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .sign(key, hashes.SHA256())
        )
        default = cls()
        default.pem = (
            certificate.public_bytes(serialization.Encoding.PEM),
            key.private_bytes(
                serialization.Encoding.PEM,
                serialization.PrivateFormat.PKCS8,
                serialization.NoEncryption(),
            ),
        )
        default.context = server_context(
            chain_pem=default.pem[0], key_pem=default.pem[1], alpn_protocols=ALPN
        )
        return default

    def start(self, spawn: Callable[[Any, str], Any]) -> None:
        watch = getattr(self, "_watch", None)
        if watch is not None:
            spawn(watch(), "default-certificate-files")

    def close(self) -> None:
        if self._unsubscribe is not None:
            self._unsubscribe()
            self._unsubscribe = None


class SniCertificates(NamedTuple):
    """One view's edge certificates by SNI (`EdgeCertificates.build`; immutable once built)."""

    exact: Mapping[str, ServedCertificate]
    # "*.domain" certificates by "domain".
    wildcard: Mapping[str, ServedCertificate]
    # Loaded certificates by digest (the next view's build reuses them).
    cache: Mapping[bytes, ServedCertificate]
    # Route key -> the context that verifies its clients (client-CA routes only).
    client_auth: Mapping[tuple[str, str], ServedCertificate]
    # Route key -> its host's context (ingress-nginx auth-tls routes: clientcert).
    client_rules: Mapping[tuple[str, str], ServedCertificate]
    # Every route's client CA (PEM): loaded into every other context (see install).
    client_cas: frozenset[bytes]
    # Refused route certificates: (route, host, reason).
    refusals: tuple[tuple[str, str, str], ...]
    # ssl-protocols / ssl-ciphers of hosts served with the default certificate (their
    # own refused or withheld): host ("*.domain" for wildcards) -> its policy.
    policies: Mapping[str, HostPolicy] = MappingProxyType({})


class EdgeCertificates:
    """The HTTPS listener's context: a route certificate by SNI, else the default."""

    def __init__(
        self,
        default: DefaultCertificate,
        *,
        now: Callable[[], datetime] | None = None,
        extra_fields: tuple[str, ...] = (),
    ):
        self.default = default
        # Certificate fields sent as X-Remote-Extra-<Field> on auth-proxy routes.
        self.extra_fields = extra_fields
        self._now = now or (lambda: datetime.now(UTC))
        # The certificates by SNI now served (`install`: one view's, swapped whole).
        self.sni = SniCertificates({}, {}, {}, {}, {}, frozenset(), ())
        self._refused: set[tuple[str, bytes]] = set()
        # (route, certificate) pairs already warned about: once each, not per view.
        self._warned: set[tuple[str, bytes]] = set()
        self._served_labels: set[tuple[str, str]] = set()
        # Every client CA the installed contexts verify with (see install).
        self._client_cas: frozenset[bytes] = frozenset()
        assert default.context is not None
        # The listener's own context never serves a handshake past the SNI
        # callback, but it must be a complete, valid server context.
        self.context = self._listener_context()
        default.on_change = self._default_changed

    def served(self) -> list[tuple[str, ServedCertificate]]:
        """(host, certificate) pairs served by SNI, wildcards as "*.domain" (the status page)."""
        sni = self.sni
        return [*sni.exact.items(), *(("*." + host, c) for host, c in sni.wildcard.items())]

    @property
    def refusals(self) -> tuple[tuple[str, str, str], ...]:
        """The served view's refused route certificates: (route, host, reason)."""
        return self.sni.refusals

    def _listener_context(self) -> ssl.SSLContext:
        """The context the server holds: protocol versions (a host's narrower
        minimum is checked by the SNI callback), ALPN and the session cache apply
        from it to every connection; the certificate and the TLS 1.2 cipher list
        are the ones of the context the SNI callback switches to."""
        chain_pem, key_pem = self.default.pem
        context = server_context(chain_pem=chain_pem, key_pem=key_pem, alpn_protocols=ALPN)
        context.sni_callback = self._on_client_hello
        set_session_cache_size(context, SESSION_CACHE)
        set_session_timeout(context, SESSION_TIMEOUT)
        context.num_tickets = 1  # stateful tickets (OP_NO_TICKET): each one is a cached session
        return context

    def _default_changed(self) -> None:
        """Nothing to swap (the SNI callback reads `default.context` on every
        handshake), but a new default context must verify the routes' client CAs."""
        self._trust_client_cas(self.default.context, frozenset(), self._client_cas)

    @staticmethod
    def _trust_client_cas(
        context: ssl.SSLContext | None, trusted: frozenset[bytes], cas: frozenset[bytes]
    ) -> frozenset[bytes]:
        """Add the client CAs this context does not verify with yet (a store only grows:
        a CA that went stays until the context is rebuilt, which is harmless, as a
        certificate verified by a context without its own client CA gives no identity)."""
        new = cas - trusted
        if context is not None and new:
            context.load_verify_locations(cadata=b"".join(sorted(new)).decode())
        return trusted | new

    # ------------------------------------------------------------ per handshake

    def _on_client_hello(self, ssl_object: Any, server_name: str | None, _ctx: Any) -> int | None:
        served = None
        name = ""
        sni = self.sni
        if server_name:
            name = server_name.lower()
            served = sni.exact.get(name)
            if served is None:
                _, dot, parent = name.partition(".")
                if dot:
                    served = sni.wildcard.get(parent)
        if served is None:
            ssl_object.context = self.default.context
            if name and sni.policies:
                # ssl-protocols / ssl-ciphers of a host whose own certificate is not served.
                policy = sni.policies.get(name) or sni.policies.get("*." + name.partition(".")[2])
                if policy is not None:
                    return _held_to(ssl_object, policy, set_ciphers=True)
            return None
        ssl_object.context = served.context
        if served.policy is not None:  # (its cipher list is the context's own)
            refused = _held_to(ssl_object, served.policy, set_ciphers=False)
            if refused is not None:
                return refused
        if served.ask_depth:  # ingress-nginx auth-tls: this connection, this host's rules
            ask_client_certificate(
                ssl_object,
                served.ask_depth,
                clientcert.session_mark(served.session_id, name),
                revocation=served.revocation,
            )
        return None

    def context_for(self, server_name: str | None) -> ssl.SSLContext | None:
        """The context a handshake with this SNI gets (tests and diagnostics)."""

        class _Probe:
            context: ssl.SSLContext | None = None

        probe = _Probe()
        self._on_client_hello(probe, server_name, None)
        return probe.context

    # ------------------------------------------------------------ per resolver view

    def update(self, routes: Iterable[Route], *, keys_withheld: str = "") -> None:
        """Serve the routes' certificates by SNI from now on (`build`, then `install`)."""
        self.install(self.build(routes, keys_withheld=keys_withheld))

    def build(self, routes: Iterable[Route], *, keys_withheld: str = "") -> SniCertificates:
        """The SNI maps of the routes (edge and reencrypt routes with a certificate),
        loaded certificates reused from the served maps (`view.ProxyView.build`).

        `keys_withheld`: why the resolver sends this proxy no private keys (its Watch
        says so), named when a route's certificate arrives without its key."""
        routes = tuple(routes)
        exact: dict[str, ServedCertificate] = {}
        wildcard: dict[str, ServedCertificate] = {}
        cache: dict[bytes, ServedCertificate] = {}
        labels: set[tuple[str, str]] = set()
        client_auth: dict[tuple[str, str], ServedCertificate] = {}
        client_rules: dict[tuple[str, str], ServedCertificate] = {}
        refusals: list[tuple[str, str, str]] = []
        policies: dict[str, HostPolicy] = {}
        now = self._now()
        for route in routes:
            tls = route.tls
            if tls is None or tls.termination == TLSTermination.PASSTHROUGH:
                continue
            rules = route.access.client_certificate if route.access is not None else None
            if not tls.certificate and not tls.client_ca_certificate and rules is None:
                continue
            label = f"{route.namespace}/{route.name}"
            host = route.host.lower()
            key = _digest(
                tls.certificate,
                tls.key,
                tls.client_ca_certificate,
                repr(rules),
                *tls.protocols,
                tls.ciphers,
            )
            try:
                served = cache.get(key) or self.sni.cache.get(key)
                if served is None:
                    if not tls.certificate:
                        raise RefusedCertificate(
                            "client certificates need the route's own certificate", "missing"
                        )
                    if not tls.key:
                        # Redacted by the resolver: say why, not "does not load".
                        why = keys_withheld or "the resolver sent the certificate without it"
                        raise RefusedCertificate(f"private key withheld: {why}", "key_withheld")
                    served = ServedCertificate(
                        tls.certificate.encode(),
                        tls.key.encode(),
                        tls.client_ca_certificate.encode() or None,
                        rules,
                        tls.protocols,
                        tls.ciphers,
                    )
                self._check(served, host, now)
            except RefusedCertificate as exc:
                self._refuse(label, host, key, exc)
                refusals.append((label, host, exc.reason))
                policy = host_policy(tls.protocols, tls.ciphers)
                if policy is not None:
                    # The default certificate serves the host: its policy still holds.
                    policies.setdefault(host, policy)
                continue
            cache[key] = served
            if tls.client_ca_certificate:
                client_auth[(route.namespace, route.name)] = served
            elif rules is not None:
                client_rules[(route.namespace, route.name)] = served
            if host.startswith("*."):
                wildcard.setdefault(host[2:], served)
            else:
                exact.setdefault(host, served)
            ROUTE_CERT_EXPIRY.labels(label, host).set(served.not_after.timestamp())
            labels.add((label, host))
            life = (served.not_after - served.not_before).total_seconds()
            left = (served.not_after - now).total_seconds()
            if life > 0 and left < WARN_FRACTION * life and (label, key) not in self._warned:
                self._warned.add((label, key))
                log.warning(
                    "route certificate has under 20% of its life left",
                    extra={
                        "route": label,
                        "host": host,
                        "not_after": served.not_after.isoformat(),
                    },
                )
        for gone in self._served_labels - labels:
            ROUTE_CERT_EXPIRY.remove(*gone)
        self._served_labels = labels
        cas = frozenset(
            route.tls.client_ca_certificate.encode()
            for route in routes
            if route.tls is not None and route.tls.client_ca_certificate
        )
        return SniCertificates(
            exact,
            wildcard,
            cache,
            client_auth,
            client_rules,
            cas,
            tuple(refusals),
            MappingProxyType(policies),
        )

    def install(self, sni: SniCertificates) -> None:
        """Serve `sni` from the next handshake on (`server.ProxyServer.set_view`)."""
        # One assignment: a handshake sees the old maps or the new ones.
        self.sni = sni
        # The listener asks every client for a certificate while a client-CA route
        # exists, and a connection switched to another route's (or the default)
        # context verifies one against that context's store: empty, so a browser
        # that has a certificate from a route's CA could reach no other host. Every
        # context without a client CA of its own therefore verifies with all of the
        # routes' client CAs (no identity ever comes from it: `client_identity`
        # requires the route's own context). A certificate from a CA no route names
        # still fails the handshake.
        cas = sni.client_cas
        self._client_cas = cas
        for served in sni.cache.values():
            if not served.client_cas:
                served.trusts = self._trust_client_cas(served.context, served.trusts, cas)
        self._trust_client_cas(self.default.context, frozenset(), cas)
        # OpenSSL keeps the verify mode the connection started with when the SNI
        # callback switches contexts, so the listener asks for a client
        # certificate (optionally) whenever a route needs one; the switched-to
        # context's CA verifies it, and `client_identity` decides per request.
        self.context.verify_mode = ssl.CERT_OPTIONAL if sni.client_auth else ssl.CERT_NONE

    @staticmethod
    def _check(served: ServedCertificate, host: str, now: datetime) -> None:
        if served.not_after <= now:
            raise RefusedCertificate(
                f"the route's certificate expired at {served.not_after:%Y-%m-%dT%H:%M:%SZ}",
                "expired",
            )
        names = dns_names(served.leaf)
        probe = host if not host.startswith("*.") else "wildcard-probe" + host[1:]
        if not any(covers(name, probe) or name.lower() == host for name in names):
            listed = ", ".join(names[:5]) or "no DNS names"
            raise RefusedCertificate(
                f"the route's certificate is for {listed}, not {host}", "host_mismatch"
            )

    def _refuse(self, label: str, host: str, key: bytes, exc: RefusedCertificate) -> None:
        if (label, key) in self._refused:
            return
        self._refused.add((label, key))
        ROUTE_CERT_REFUSED.labels(label, exc.kind).inc()
        log.warning(
            "route %s: %s; serving the default certificate for its host",
            label,
            exc.reason,
            extra={"route": label, "host": host, "reason": exc.reason},
        )

    def client_identity(self, ssl_object: Any, route: Route) -> tuple[int, str] | bytes:
        """For a route with a client CA: the identity header lines from the verified
        client certificate, or (401|403, reason) to answer instead. For a route with
        ingress-nginx's auth-tls rules: `clientcert.decide`'s verdict."""
        rules = route.access.client_certificate if route.access is not None else None
        if rules is not None and (route.tls is None or not route.tls.client_ca_certificate):
            served = self.sni.client_rules.get((route.namespace, route.name))
            return clientcert.decide(
                clientcert.rules_for(rules),
                ssl_object,
                served.session_id if served is not None else None,
                route.host,
            )
        label = f"{route.namespace}/{route.name}"
        served = self.sni.client_auth.get((route.namespace, route.name))
        if served is None:
            return 403, f"route {label} requires a client certificate and has no usable one"
        if ssl_object is None or ssl_object.context is not served.context:
            # Verified (if at all) by another host's CA: this route's CA never saw it.
            return 403, (
                f"route {label} requires a client certificate: connect with TLS server "
                f"name {route.host}"
            )
        der = ssl_object.getpeercert(binary_form=True)
        if not der:
            return 401, f"route {label} requires a client certificate from its CA"
        leaf = x509.load_der_x509_certificate(der)
        if ssl_object.session_reused and not _issued_by(leaf, served.client_cas):
            # Every context shares the listener's session cache (and CPython's one
            # session id context), so a session verified for another host's CA can
            # be resumed under this host's name: its certificate was never checked
            # against this route's CA. Re-verify it (directly issued, in validity).
            return 403, (
                f"route {label} requires a client certificate from its CA: the resumed "
                "TLS session's certificate is not; connect without resuming"
            )
        return identity_headers(leaf, self.extra_fields)


class HostPolicy(NamedTuple):
    """A host's ssl-protocols and ssl-ciphers, as the SNI callback holds a connection
    to them (`_held_to`)."""

    # The oldest version allowed (an `ssl.TLSVersion` value); 0: the listener's TLS 1.2.
    minimum: int
    # The TLS 1.2 cipher list ("": the proxy's).
    ciphers: str


def host_policy(protocols: tuple[str, ...], ciphers: str) -> HostPolicy | None:
    """The policy of a route's `RouteTLS.protocols` and `.ciphers`: None when they
    narrow nothing, or do not pass `policy_problem` (the resolver checked them)."""
    if not (protocols or ciphers) or policy_problem(protocols, ciphers):
        return None
    narrowed = minimum_version(protocols)
    return HostPolicy(0 if narrowed == ssl.TLSVersion.TLSv1_2 else int(narrowed), ciphers)


def _held_to(ssl_object: Any, policy: HostPolicy, *, set_ciphers: bool) -> int | None:
    """From the SNI callback: hold this connection to a host's ssl-protocols and
    ssl-ciphers (None), or the alert that ends its handshake. OpenSSL chose the
    version before the callback, from the listener's range: older than the host
    allows is refused with protocol_version, as nginx's would refuse it.
    `set_ciphers`: the list goes onto the connection (a host served with the
    default context; a host's own context holds it). Fail closed: what cannot be
    read or set refuses the handshake. (A TLS 1.2 session resumed by id names the
    server name it was made for, and OpenSSL gives this callback that name: such a
    connection is that host's, with its policy, as a connection whose Host is not
    its server name is, in nginx too.)"""
    if policy.minimum:
        version = negotiated_version(ssl_object)
        if version is None or version < policy.minimum:
            return ssl.ALERT_DESCRIPTION_PROTOCOL_VERSION
    if set_ciphers and policy.ciphers and not set_connection_ciphers(ssl_object, policy.ciphers):
        return ssl.ALERT_DESCRIPTION_HANDSHAKE_FAILURE
    return None


def _issued_by(leaf: x509.Certificate, cas: list[x509.Certificate]) -> bool:
    now = datetime.now(UTC)
    if not leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
        return False
    for ca in cas:
        try:
            leaf.verify_directly_issued_by(ca)
        except (ValueError, TypeError, InvalidSignature):
            continue
        return True
    return False


# Certificate fields an auth-proxy route can pass on as X-Remote-Extra-<Header>.
EXTRA_FIELDS: dict[str, tuple[bytes, Callable[[x509.Certificate], list[str]]]] = {
    "ou": (
        b"Ou",
        lambda c: [
            str(a.value)
            for a in c.subject.get_attributes_for_oid(x509.NameOID.ORGANIZATIONAL_UNIT_NAME)
        ],
    ),
    "email": (b"Email", lambda c: _sans(c, x509.RFC822Name)),
    "dns": (b"Dns", lambda c: _sans(c, x509.DNSName)),
    "uri": (b"Uri", lambda c: _sans(c, x509.UniformResourceIdentifier)),
    "serial": (b"Serial", lambda c: [format(c.serial_number, "x")]),
}


def _sans(certificate: x509.Certificate, kind: Any) -> list[str]:
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return []
    return [str(v) for v in sans.get_values_for_type(kind)]


def identity_headers(certificate: x509.Certificate, extra_fields: tuple[str, ...] = ()) -> bytes:
    """X-Remote-User (the SPIFFE ID, else the CN), X-Remote-Group (each O), and one
    X-Remote-Extra-<Field> line per value of each configured extra field."""
    user = ""
    try:
        sans = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        spiffe = [u for u in sans.get_values_for_type(x509.UniformResourceIdentifier)]
        user = next((u for u in spiffe if u.startswith("spiffe://")), "")
    except x509.ExtensionNotFound:
        pass
    subject = certificate.subject
    if not user:
        names = subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)
        user = str(names[0].value) if names else ""
    lines = b""
    if user:
        lines += b"X-Remote-User: " + _header_value(user) + b"\r\n"
    for org in subject.get_attributes_for_oid(x509.NameOID.ORGANIZATION_NAME):
        lines += b"X-Remote-Group: " + _header_value(str(org.value)) + b"\r\n"
    for field in extra_fields:
        header, values = EXTRA_FIELDS[field]
        for value in values(certificate)[:16]:
            lines += b"X-Remote-Extra-" + header + b": " + _header_value(value) + b"\r\n"
    return lines


def _header_value(text: str) -> bytes:
    """Printable ASCII only: a certificate field never injects a header line."""
    return "".join(c if " " <= c <= "~" else "?" for c in text[:512]).encode()


# ---------------------------------------------------------------- plain HTTP and HSTS


def hsts_line(route: Route) -> bytes:
    """The Strict-Transport-Security header line a route adds on HTTPS (b"": none)."""
    tls = route.tls
    if tls is None or tls.hsts is None:
        return b""
    value = b"max-age=%d" % int(tls.hsts.max_age)
    if tls.hsts.include_subdomains:
        value += b"; includeSubDomains"
    if tls.hsts.preload:
        value += b"; preload"
    return b"Strict-Transport-Security: " + value + b"\r\n"


def redirect_response(host: bytes, target: bytes, https_port: int, *, close: bool) -> bytes:
    """302 to the same URL over HTTPS, as OpenShift's router answers."""
    authority = host if https_port == 443 else host + b":%d" % https_port
    location = b"https://" + authority + target
    return (
        b"HTTP/1.1 302 Found\r\nLocation: %s\r\nContent-Length: 0\r\n"
        b"Cache-Control: no-store\r\n%s\r\n"
        % (location, b"Connection: close\r\n" if close else b"")
    )


# What a TLS route answers on the plain HTTP port.
EDGE_ALLOW, EDGE_REDIRECT, EDGE_REFUSE = range(3)


def edge_rule(route: Route) -> int:
    tls = route.tls
    if tls is None:
        return EDGE_ALLOW
    if tls.termination == TLSTermination.PASSTHROUGH:
        return EDGE_REFUSE
    policy = tls.insecure_edge_termination_policy
    if policy == InsecureEdgePolicy.ALLOW:
        return EDGE_ALLOW
    if policy == InsecureEdgePolicy.REDIRECT:
        return EDGE_REDIRECT
    return EDGE_REFUSE
