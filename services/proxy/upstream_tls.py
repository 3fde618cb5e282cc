"""Reencrypt: TLS from the proxy to the backend, and failures that explain themselves.

`UpstreamTLS.open` replaces the plain `upstream.start` of the upstream-
connect step (`waygate.proxy.exchange`, `h2upstream`) for reencrypt routes:
what the dialer returned (a socket, or a tunnel's data connection, whose
`start_tls` runs this TLS inside the tunnel's own) is wrapped in TLS, verified
against the route's
destination CA, or Waygate's trust bundle when the route names none, for the
name `SERVICE.NAMESPACE.svc` of the backend unless the route sets
`destinationServerName`; with `presentClientCertificate` the proxy's own
client certificate goes with it, with `backend_client_certificate` the route's
own (ingress-nginx proxy-ssl-secret; its key handed to OpenSSL through
`core.tls.load_pem_chain`, an anonymous memfd, never a named file). The
resulting connection is an ordinary `UpstreamConnection`, pooled per
(endpoint, `routing.upstream_scope`) like a plain one per endpoint.

Client contexts are built once per (destination CA, client certificate and key,
ALPN, system CAs, SAN mode) and reused by every connection and route that asks
the same (the server name is the connection's, not the context's); a new
resolver view drops those no route asks for any more (`keep_only`), so a
rotated Secret's old key is not held.

When the handshake fails the client must learn why (seed 000: a bare 503 and
`x509: certificate has expired or is not yet valid` in someone else's log).
OpenSSL reports only a code, so on a verification failure a second,
unverified handshake (bounded by the connect timeout, failures only, and
reused for the same backend and name for `FACTS_TTL`, 10 s, so a failing
backend costs one probe per 10 s, not one per request) fetches the backend's
certificate and the reason states the facts:

    upstream certificate expired at 2021-10-30T13:47:51Z
    upstream certificate is for a.demo.svc, not b.demo.svc
    upstream certificate signed by an unknown authority (issuer CN=...)

A BackendTLSPolicy route (waygate.resolver.gateway) may verify against the
system's well-known CAs (`destination_system_ca`) and name subjectAltNames
(`destination_san_hostnames` / `_uris`): then the server name is only the SNI
sent, the handshake verifies the chain alone (`check_hostname` off) and the
peer's SANs are checked right after it, before a byte of the request goes:

    upstream certificate names abc.example.com, spiffe://a/b; none is a subjectAltName the route accepts (def.example.com)

The same sentence goes to the client (502 body and X-Waygate-Error), the log
line, the request's span (error status and `waygate.upstream_tls.*`
attributes) and `waygate_proxy_upstream_tls_failures_total{route,reason}`.
A verification failure (expired, not yet valid, untrusted, wrong name) is
raised as a retryable ConnectError, as a refused connect is: the request is
redispatched to another endpoint before any of its bytes were sent.

Every handshake records the certificate the endpoint served (a verified one,
or the facts of a refused one) in `certificates`
(`waygate.proxy.backendcerts`): its expiry metric, the endpoints to take out
of rotation, the warnings before expiry, the probes of endpoints not
handshaken lately (`probe`).

Sessions are resumed: asyncio (and uvloop) transports take no `ssl.SSLSession`,
but both build their `SSLObject` through the context's `wrap_bio`, so the
client context (`_ResumingContext`) passes the session of the last connection
to the same server name there. A session the backend no longer knows (another
endpoint, a restart) just means a full handshake.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
import time
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

from cryptography import x509
from prometheus_client import Counter

from waygate.core.tls import load_pem_chain
from waygate.proxy.backendcerts import BackendCertificates, served_from
from waygate.proxy.routing import Target, upstream_scope
from waygate.proxy.upstream import ConnectError, Connection, P, start
from waygate.resolver.client import Route

log = logging.getLogger(__name__)

UPSTREAM_TLS_FAILURES = Counter(
    "waygate_proxy_upstream_tls_failures_total",
    "TLS handshakes with a backend that failed, by route and reason",
    ["route", "reason"],
)

# OpenSSL X509_V_ERR_* codes the explanations distinguish.
_EXPIRED = 10
_NOT_YET_VALID = 9
_HOSTNAME_MISMATCH = 62
_UNKNOWN_AUTHORITY = frozenset((2, 18, 19, 20, 21))
_FACTS_TIMEOUT = 5.0
# How long the facts of a failed verification (the backend's certificate, from a
# second unverified handshake) are reused for the same backend and name.
FACTS_TTL = 10.0
_FACTS_MAX = 4096
#: How often the backend-certificate prober looks for endpoints to probe.
PROBE_INTERVAL = 30.0
#: Verification failures: the endpoint's certificate is the problem, another endpoint
#: may serve a good one, so the request is redispatched (as after a refused connect).
_VERIFY_KINDS = frozenset(
    ("expired", "not_yet_valid", "name_mismatch", "unknown_authority", "rejected", "san_mismatch")
)


def server_name(route: Route, target: Target) -> str:
    """The name the backend's certificate must carry (and the SNI sent)."""
    tls = route.tls
    if tls is not None and tls.destination_server_name:
        return tls.destination_server_name
    return f"{target.service}.{target.namespace}.svc"


def _when(moment: Any) -> str:
    return f"{moment:%Y-%m-%dT%H:%M:%SZ}"


def explain(exc: BaseException, name: str, leaf: x509.Certificate | None) -> tuple[str, str]:
    """(reason sentence, metric label) for a failed upstream handshake."""
    if isinstance(exc, TimeoutError):
        return "upstream TLS handshake timed out", "timeout"
    if isinstance(exc, ssl.SSLCertVerificationError):
        code = exc.verify_code
        if code == _EXPIRED:
            if leaf is not None:
                return f"upstream certificate expired at {_when(leaf.not_valid_after_utc)}", (
                    "expired"
                )
            return "upstream certificate expired", "expired"
        if code == _NOT_YET_VALID:
            if leaf is not None:
                return (
                    f"upstream certificate is not valid before {_when(leaf.not_valid_before_utc)}",
                    "not_yet_valid",
                )
            return "upstream certificate is not yet valid", "not_yet_valid"
        if code == _HOSTNAME_MISMATCH:
            names = _names(leaf) if leaf is not None else ""
            return (
                f"upstream certificate is for {names or 'other names'}, not {name}",
                "name_mismatch",
            )
        if code in _UNKNOWN_AUTHORITY:
            issuer = leaf.issuer.rfc4514_string() if leaf is not None else "unknown"
            return (
                f"upstream certificate signed by an unknown authority (issuer {issuer[:200]})",
                "unknown_authority",
            )
        return f"upstream certificate rejected: {exc.verify_message}", "rejected"
    if isinstance(exc, ssl.SSLError):
        return f"upstream TLS handshake failed: {exc.reason or type(exc).__name__}", "handshake"
    if isinstance(exc, ConnectionError | EOFError):
        return "upstream closed the connection during the TLS handshake", "closed"
    return f"upstream TLS handshake failed: {type(exc).__name__}", "handshake"


def san_problem(
    peer: dict[str, Any] | None, hostnames: tuple[str, ...], uris: tuple[str, ...]
) -> str | None:
    """None when the verified peer certificate (`SSLObject.getpeercert()`) carries one
    of the SANs; else the reason sentence. A wildcard SAN ("*.example.com") on either
    side covers one label, as RFC 6125 matching does."""
    sans = tuple(peer.get("subjectAltName", ())) if peer else ()
    dns = [value.lower() for kind, value in sans if kind == "DNS"]
    found_uris = [value for kind, value in sans if kind == "URI"]
    for wanted in hostnames:
        if any(_dns_matches(have, wanted.lower()) for have in dns):
            return None
    if any(uri in found_uris for uri in uris):
        return None
    shown = ", ".join([*dns, *found_uris][:4]) or "no DNS or URI names"
    accepted = ", ".join((*hostnames, *uris))
    return (
        f"upstream certificate names {shown}; none is a subjectAltName the route accepts "
        f"({accepted})"
    )


def _dns_matches(have: str, wanted: str) -> bool:
    if have == wanted:
        return True
    for pattern, name in ((have, wanted), (wanted, have)):
        if pattern.startswith("*.") and "." in name and name.split(".", 1)[1] == pattern[2:]:
            return True
    return False


def _names(leaf: x509.Certificate) -> str:
    try:
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return ""
    names = [*sans.get_values_for_type(x509.DNSName)]
    names += [str(ip) for ip in sans.get_values_for_type(x509.IPAddress)]
    shown = ", ".join(names[:4])
    return shown + (f" (+{len(names) - 4} more)" if len(names) > 4 else "")


class _ResumingContext(ssl.SSLContext):
    """A client context that offers the last session it saw for a server name.

    `last` holds the session itself; only a TLS 1.3 connection is held as its
    SSLObject until its ticket (which follows the handshake) has arrived, and
    is replaced by the session as soon as it is read (`settle`): the next
    connection to the name or the next resolver view. Names no route uses any
    more are dropped on each view (`UpstreamTLS.keep_only`).
    """

    last: dict[str, ssl.SSLObject | ssl.SSLSession]

    def wrap_bio(  # type: ignore[override]
        self,
        incoming: ssl.MemoryBIO,
        outgoing: ssl.MemoryBIO,
        server_side: bool = False,
        server_hostname: str | None = None,
        session: ssl.SSLSession | None = None,
    ) -> ssl.SSLObject:
        if session is None and server_hostname is not None:
            session = self.settle(server_hostname)
        return super().wrap_bio(incoming, outgoing, server_side, server_hostname, session)

    def settle(self, name: str) -> ssl.SSLSession | None:
        """The session to offer `name`, held from now on instead of its connection."""
        previous = self.last.get(name)
        if not isinstance(previous, ssl.SSLObject):
            return previous
        session = None
        with contextlib.suppress(ValueError, AttributeError):
            session = previous.session
        if session is not None and session.has_ticket:
            self.last[name] = session
        return session

    def remember(self, name: str, ssl_object: ssl.SSLObject) -> None:
        if ssl_object.version() == "TLSv1.3":
            self.last[name] = ssl_object  # its ticket is still to come: settle() later
            return
        session = ssl_object.session
        if session is not None:
            self.last[name] = session

    def keep_only(self, names: set[str]) -> None:
        for name in [name for name in self.last if name not in names]:
            del self.last[name]
        for name in list(self.last):
            self.settle(name)


class UpstreamTLS:
    """Client contexts per (destination CA, client certificate), rebuilt when either source changes.

    `trust_pem()` is Waygate's current trust bundle (None: no bundle, so a route
    without its own destination CA cannot be verified and fails with that reason);
    `client_pem()` is the proxy's current (chain, key) or None.
    """

    def __init__(
        self,
        trust_pem: Callable[[], bytes | None],
        client_pem: Callable[[], tuple[bytes, bytes] | None],
        connect: Callable[..., Any],
        on_untrusted: Callable[[Target], None] | None = None,
    ) -> None:
        self._trust_pem = trust_pem
        # Told when a probe finds an endpoint's certificate unverifiable (expired, not
        # yet valid, untrusted): the proxy's passive health skips it, so it leaves
        # rotation before a client's request would have failed its handshake.
        self._on_untrusted = on_untrusted
        self._client_pem = client_pem
        self._connect = connect  # the dialer's connect, for the facts handshake
        self._contexts: dict[tuple[Any, ...], ssl.SSLContext] = {}
        # (address, port, server name) -> (valid until, the backend's leaf): a backend
        # that keeps failing verification is probed once per FACTS_TTL, not per request.
        self._facts: dict[tuple[str, int, str], tuple[float, x509.Certificate | None]] = {}
        #: What each endpoint served at its last handshake (waygate.proxy.backendcerts).
        self.certificates = BackendCertificates()
        # (route label, endpoint) -> the route and target last handshaken: what a probe
        # of that endpoint needs (bounded with `certificates`, pruned by keep_only).
        self._probe_targets: dict[tuple[str, str], tuple[Route, Target]] = {}

    def invalidate(self, *_changed: Any) -> None:
        """The bundle or the proxy's certificate changed: build contexts anew."""
        self._contexts = {}

    def keep_only(self, routes: Iterable[Route]) -> None:
        """A new resolver view: forget the sessions of server names no reencrypt route
        uses any more (and of probes), so neither map grows with route churn."""
        routes = list(routes)
        names: set[str] = set()
        for route in routes:
            if not self.applies(route):
                continue
            assert route.tls is not None
            if route.tls.destination_server_name:
                names.add(route.tls.destination_server_name)
            else:
                names.update(f"{b.service}.{route.namespace}.svc" for b in route.backends)
        for context in self._contexts.values():
            if isinstance(context, _ResumingContext):
                context.keep_only(names)
        now = time.monotonic()
        self._facts = {key: fact for key, fact in self._facts.items() if fact[0] > now}
        # Contexts no route asks for (a replaced CA or client certificate) go.
        asked = {self._route_key(r) for r in routes if self.applies(r)}
        self._contexts = {k: c for k, c in self._contexts.items() if k[:-1] in asked}
        # Backend certificates of routes (and endpoints) the view no longer has go too.
        wanted = {f"{r.namespace}/{r.name}" for r in routes if self.applies(r)}
        self._probe_targets = {k: v for k, v in self._probe_targets.items() if k[0] in wanted}
        self.certificates.keep_only(self._probe_targets)

    @staticmethod
    def _route_key(route: Route) -> tuple[Any, ...]:
        """What a route's client context depends on (with ALPN last: `context`)."""
        tls = route.tls
        assert tls is not None
        # An auth-proxy route (client CA) presents the proxy's front-proxy certificate.
        present = tls.present_client_certificate or bool(tls.client_ca_certificate)
        by_san = bool(tls.destination_san_hostnames or tls.destination_san_uris)
        return (
            tls.destination_ca_certificate,
            present,
            tls.destination_system_ca,
            by_san,
            tls.backend_client_certificate,
            tls.backend_client_key,
        )

    def context(self, route: Route, http2: bool = False) -> ssl.SSLContext:
        key = (*self._route_key(route), http2)
        context = self._contexts.get(key)
        if context is None:
            context = self._build(*key)
            self._contexts[key] = context
        return context

    def _build(
        self,
        destination_ca: str,
        present_client: bool,
        system_ca: bool,
        by_san: bool,
        client_certificate: str,
        client_key: str,
        http2: bool,
    ) -> ssl.SSLContext:
        context = _ResumingContext(ssl.PROTOCOL_TLS_CLIENT)
        context.last = {}
        context.minimum_version = ssl.TLSVersion.TLSv1_2
        # HTTP/2 backends (waygate.proxy.h2upstream) get ALPN h2 only.
        context.set_alpn_protocols(["h2"] if http2 else ["http/1.1"])
        if by_san:
            # The chain is still verified (CERT_REQUIRED); the name is checked
            # against the route's subjectAltNames after the handshake (san_problem).
            context.check_hostname = False
        if system_ca and not destination_ca:
            context.load_default_certs(ssl.Purpose.SERVER_AUTH)
            cadata = ""
        else:
            cadata = destination_ca or (self._trust_pem() or b"").decode()
        if cadata:
            try:
                context.load_verify_locations(cadata=cadata)
            except ssl.SSLError:
                raise ConnectError(
                    "the route's destination CA does not parse", "tls_config", retryable=False
                ) from None
        if client_certificate:
            # The route's own (proxy-ssl-secret), in place of the proxy's.
            if not client_key:
                # Redacted by the resolver (this proxy is not a route reader): never
                # a handshake without the certificate the backend may require.
                raise ConnectError(
                    "the route's backend client key is withheld from this proxy "
                    "(its resolver connection is not a route reader's)",
                    "tls_key_withheld",
                    retryable=False,
                )
            try:
                load_pem_chain(context, client_certificate.encode(), client_key.encode())
            except ssl.SSLError:
                raise ConnectError(
                    "the route's backend client certificate does not load",
                    "tls_config",
                    retryable=False,
                ) from None
        elif present_client:
            pem = self._client_pem()
            if pem is not None:
                load_pem_chain(context, *pem)
        return context

    @staticmethod
    def applies(route: Route) -> bool:
        return upstream_scope(route) is not None

    async def open(
        self,
        factory: Callable[[], P],
        connection: Connection,
        route: Route,
        target: Target,
        timeout: float,
        span: Any = None,
        *,
        http2: bool = False,
    ) -> P:
        """`factory`'s protocol over TLS on `connection` (a socket, or a tunnel's data
        connection: TLS inside its TLS), or ConnectError with the explained reason."""
        name = server_name(route, target)
        try:
            context = self.context(route, http2)
        except BaseException:
            connection.close()
            raise
        try:
            transport, protocol = await start(
                connection, factory, tls=context, server_hostname=name, timeout=timeout
            )
        except (OSError, EOFError, TimeoutError) as exc:
            leaf = None
            if isinstance(exc, ssl.SSLCertVerificationError):
                leaf = await self._cached_peer_certificate(target, name, timeout)
                if leaf is not None:
                    self._record(route, target, leaf, verified=False)
            reason, kind = explain(exc, name, leaf)
            raise self._failed(route, target, name, reason, kind, span) from None
        ssl_object = transport.get_extra_info("ssl_object")
        if ssl_object is not None:
            der = ssl_object.getpeercert(binary_form=True)
            if der:
                with contextlib.suppress(ValueError):
                    self._record(route, target, x509.load_der_x509_certificate(der), verified=True)
        tls = route.tls
        if tls is not None and (tls.destination_san_hostnames or tls.destination_san_uris):
            problem = san_problem(
                ssl_object.getpeercert() if ssl_object is not None else None,
                tls.destination_san_hostnames,
                tls.destination_san_uris,
            )
            if problem is not None:
                transport.abort()
                raise self._failed(route, target, name, problem, "san_mismatch", span)
        if isinstance(context, _ResumingContext) and ssl_object is not None:
            # Its session (TLS 1.3: the ticket that follows the handshake) is
            # offered to the next connection to this name.
            context.remember(name, ssl_object)
        return protocol

    @staticmethod
    def _failed(
        route: Route, target: Target, name: str, reason: str, kind: str, span: Any
    ) -> ConnectError:
        """The explained failure: counted, logged, on the span, and for the client."""
        label = f"{route.namespace}/{route.name}"
        UPSTREAM_TLS_FAILURES.labels(label, kind).inc()
        log.warning(
            "upstream TLS handshake failed",
            extra={
                "route": label,
                "upstream": f"{target.address}:{target.port}",
                "server_name": name,
                "reason": reason,
            },
        )
        if span is not None:
            span.set_attribute("waygate.upstream_tls.reason", kind)
            span.set_attribute("waygate.upstream_tls.error", reason)
            span.set_attribute("waygate.upstream_tls.server_name", name)
        return ConnectError(reason, "tls_" + kind, retryable=kind in _VERIFY_KINDS)

    def _record(
        self, route: Route, target: Target, leaf: x509.Certificate, *, verified: bool
    ) -> None:
        key = (f"{route.namespace}/{route.name}", f"{target.address}:{target.port}")
        self.certificates.record(served_from(*key, leaf, verified=verified, now=datetime.now(UTC)))
        self._probe_targets[key] = (route, target)
        if len(self._probe_targets) > len(self.certificates):
            known = {(s.route, s.endpoint) for s in self.certificates.snapshot()}
            self._probe_targets = {k: v for k, v in self._probe_targets.items() if k in known}

    async def probe_forever(self, interval: float = PROBE_INTERVAL, timeout: float = 5.0) -> None:
        """Every `interval`, probe the endpoints no request has handshaken with for
        `BackendCertificates.probe_after`, at most `probes_per_tick` of them: a
        backend's expiring certificate is seen even when no client asks for it."""
        while True:
            await asyncio.sleep(interval)
            for key in self.certificates.due_probes(datetime.now(UTC)):
                found = self._probe_targets.get(key)
                if found is None:
                    continue
                route, target = found
                try:
                    await self.probe(target, route, timeout)
                except (OSError, EOFError, TimeoutError, ConnectError) as exc:
                    log.info(
                        "backend certificate probe failed",
                        extra={"route": key[0], "upstream": key[1], "error": str(exc)[:200]},
                    )

    async def probe(self, target: Target, route: Route, timeout: float) -> bool:
        """Handshake with an endpoint no request has lately (`BackendCertificates.
        due_probes`, at a bounded rate) and record what it served; True when it
        verified. Nothing is sent after the handshake."""
        name = server_name(route, target)
        connection = await self._connect(target, timeout, None)
        try:
            transport, _ = await start(
                connection,
                asyncio.Protocol,
                tls=self.context(route),
                server_hostname=name,
                timeout=timeout,
            )
        except (OSError, EOFError, TimeoutError) as exc:
            if isinstance(exc, ssl.SSLCertVerificationError):
                leaf = await self._cached_peer_certificate(target, name, timeout)
                if leaf is not None:
                    self._record(route, target, leaf, verified=False)
                if self._on_untrusted is not None:
                    self._on_untrusted(target)
            return False
        try:
            der = transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
            if der:
                self._record(route, target, x509.load_der_x509_certificate(der), verified=True)
            return True
        finally:
            transport.abort()

    async def _cached_peer_certificate(
        self, target: Target, name: str, timeout: float
    ) -> x509.Certificate | None:
        key = (target.address, target.port, name)
        now = time.monotonic()
        fact = self._facts.get(key)
        if fact is not None and fact[0] > now:
            return fact[1]
        leaf = await self._peer_certificate(target, name, timeout)
        if len(self._facts) >= _FACTS_MAX:
            self._facts = {k: f for k, f in self._facts.items() if f[0] > now}
            if len(self._facts) >= _FACTS_MAX:
                self._facts.clear()
        self._facts[key] = (time.monotonic() + FACTS_TTL, leaf)
        return leaf

    async def _peer_certificate(
        self, target: Target, name: str, timeout: float
    ) -> x509.Certificate | None:
        """The backend's leaf certificate, from an unverified handshake (failures only)."""
        probe = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        probe.check_hostname = False
        probe.verify_mode = ssl.CERT_NONE
        transport: Any = None
        try:
            async with asyncio.timeout(min(timeout, _FACTS_TIMEOUT)):
                connection = await self._connect(target, timeout, None)
                transport, _ = await start(
                    connection, asyncio.Protocol, tls=probe, server_hostname=name, timeout=timeout
                )
                der = transport.get_extra_info("ssl_object").getpeercert(binary_form=True)
            return x509.load_der_x509_certificate(der) if der else None
        except (OSError, EOFError, TimeoutError, ValueError, ConnectError):
            return None
        finally:
            if transport is not None:
                transport.abort()
