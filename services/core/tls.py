"""TLS that follows certificate rotation: gRPC servers, HTTPS listeners, clients.

The pieces a process uses to take its certificate from the certs service and
use it without ever restarting:

- `GrpcIssuer`: the `Issuer` of `waygate.core.rotation` over certs' `Certify`
  RPC (server TLS verified against the current trust bundle, bearer token read
  from a file on every call, so a rotated projected token is picked up).
- `TrustBundleWatcher`: follows `WatchTrustBundle` into a `TrustStore`,
  reconnecting with backoff; each reconnect trusts the newest bundle, so it
  survives a CA rotation.
- `dynamic_server_credentials`: grpc server credentials whose configuration
  fetcher gRPC calls before every new handshake; it hands over a new
  configuration only when the certificate or the bundle changed. Existing
  connections are untouched: nothing is dropped.
- `ServerSSLContexts`: an `ssl.SSLContext` for asyncio HTTPS listeners whose
  SNI callback (run for every ClientHello, with or without SNI) switches the
  connection to the context built from the current certificate. TLS 1.2+.
- `RotatingChannel`: grpc channel credentials are fixed when a channel opens,
  so this holder opens a new channel after every rotation and closes the old
  one after a grace period, letting calls in flight finish. Callers ask it for
  `channel()` each time they start a call or a stream (never keep the channel);
  a long-lived stream (a report, a tunnel) takes the channel with `hold()`
  instead, and the old channel stays open until the last holder lets go.
- `ProcessCertificates`: the above wired from a process's settings.

Invariants: the private key is given to TLS libraries in memory (grpc takes
bytes; OpenSSL's file API gets an anonymous memfd, never a file on disk), and
every TLS listener built here refuses anything older than TLS 1.2.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import ssl
import tempfile
from collections.abc import AsyncIterator, Callable, Coroutine, Sequence
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from google.protobuf import duration_pb2

from waygate.certs.v1 import certs_pb2, certs_pb2_grpc
from waygate.core import errors
from waygate.core.backoff import Backoff
from waygate.core.grpcclient import open_channel
from waygate.core.rotation import (
    CertificateRotator,
    HeldCertificate,
    Issued,
    TrustBundle,
    TrustStore,
)
from waygate.core.settings import ProcessSettings

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, Any], str], Any]


def domain_error(exc: grpc.aio.AioRpcError, what: str) -> errors.WaygateError:
    """An RPC failure as the domain error of the same meaning, with who said it."""
    message = f"{what}: {exc.code().name}: {exc.details()}"
    by_code: dict[grpc.StatusCode, type[errors.WaygateError]] = {
        grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
        grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
        grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
        grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
        grpc.StatusCode.NOT_FOUND: errors.NotFound,
        grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
        grpc.StatusCode.DEADLINE_EXCEEDED: errors.DeadlineExceeded,
    }
    # Anything else (UNAVAILABLE, INTERNAL, CANCELLED...) is worth retrying.
    return by_code.get(exc.code(), errors.Unavailable)(message)


def read_token(path: Path) -> str:
    try:
        token = path.read_text().strip()
    except OSError as exc:
        raise errors.Unauthenticated(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise errors.Unauthenticated(f"token file {path} is empty")
    return token


# ---------------------------------------------------------------- talking to certs


class GrpcIssuer:
    """`Issuer` over the certs service's Certify RPC."""

    def __init__(
        self,
        address: str,
        token_file: Path,
        trust: TrustStore,
        *,
        lifetime: timedelta | None = None,
        timeout: float = 10.0,
    ) -> None:
        self._address = address
        self._token_file = token_file
        self._trust = trust
        self._lifetime = lifetime
        self._timeout = timeout

    async def certify(self, csr_der: bytes, identity: str) -> Issued:
        request = certs_pb2.CertifyRequest(
            identity=identity,
            token=read_token(self._token_file),
            certificate_signing_request=csr_der,
        )
        if self._lifetime is not None:
            request.lifetime.CopyFrom(
                duration_pb2.Duration(seconds=int(self._lifetime.total_seconds()))
            )
        # A channel per call: renewals are hours apart, and each one then
        # verifies certs against the newest trust bundle.
        credentials = grpc.ssl_channel_credentials(self._trust.current.pem)
        async with open_channel(self._address, credentials=credentials) as channel:
            try:
                reply = await certs_pb2_grpc.CertsStub(channel).Certify(
                    request, timeout=self._timeout
                )
            except grpc.aio.AioRpcError as exc:
                raise domain_error(exc, f"certs at {self._address}") from None
        return Issued(
            leaf_der=reply.leaf_certificate,
            chain_der=tuple(reply.intermediate_certificates),
            valid_until=reply.valid_until.ToDatetime(tzinfo=UTC),
        )


def _bundle_of(message: certs_pb2.TrustBundle) -> TrustBundle:
    if message.pem:
        return TrustBundle.from_pem(message.pem.encode(), message.version)
    try:
        certificates = tuple(
            x509.load_der_x509_certificate(a.certificate) for a in message.authorities
        )
    except ValueError:
        raise errors.InvalidArgument("certs sent a CA certificate that does not parse") from None
    if not certificates:
        raise errors.InvalidArgument("certs sent an empty trust bundle")
    return TrustBundle(version=message.version, certificates=certificates)


class TrustBundleWatcher:
    """Keep a TrustStore equal to certs' bundle: WatchTrustBundle, reconnecting with backoff."""

    def __init__(
        self,
        address: str,
        trust: TrustStore,
        *,
        backoff: Backoff | None = None,
        sleep: Callable[[float], Any] = asyncio.sleep,
    ) -> None:
        self._address = address
        self._trust = trust
        self._backoff = backoff or Backoff(initial=0.5, maximum=30.0)
        self._sleep = sleep
        self.received = 0  # bundles received, for tests and logs

    async def run(self) -> None:
        while True:
            await self.watch_once()
            delay = self._backoff.next_delay()
            log.info("trust bundle stream ended; reconnecting", extra={"retry_in": round(delay, 2)})
            await self._sleep(delay)

    async def watch_once(self) -> None:
        """One stream, until it ends or fails (errors are logged, never raised)."""
        credentials = grpc.ssl_channel_credentials(self._trust.current.pem)
        try:
            async with open_channel(self._address, credentials=credentials, retry=False) as channel:
                stream = certs_pb2_grpc.CertsStub(channel).WatchTrustBundle(
                    certs_pb2.WatchTrustBundleRequest()
                )
                async for message in stream:
                    self.received += 1
                    self._trust.update(_bundle_of(message))
                    self._backoff.reset()
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "trust bundle watch failed",
                extra={"certs": self._address, "error": f"{exc.code().name}: {exc.details()}"},
            )
        except errors.WaygateError as exc:
            log.warning("certs sent an unusable trust bundle", extra={"error": str(exc)})


# ---------------------------------------------------------------- gRPC servers


def dynamic_server_credentials(
    rotator: CertificateRotator, trust: TrustStore | None, *, client_auth: bool
) -> grpc.ServerCredentials:
    """Server credentials that present the current certificate and, with client_auth,
    require a client certificate chaining to the current trust bundle."""
    if client_auth and trust is None:
        raise ValueError("client_auth needs a trust store")
    served: list[tuple[HeldCertificate, TrustBundle | None]] = []

    def configuration() -> grpc.ServerCertificateConfiguration:
        held = rotator.current
        bundle = trust.current if (trust is not None and client_auth) else None
        served[:] = [(held, bundle)]
        return grpc.ssl_server_certificate_configuration(
            [(held.key_pem(), held.chain_pem())],
            root_certificates=bundle.pem if bundle is not None else None,
        )

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        # gRPC calls this before each new handshake: None keeps what it has.
        held, bundle = served[0]
        current_bundle = trust.current if (trust is not None and client_auth) else None
        if rotator.current is held and current_bundle is bundle:
            return None
        return configuration()

    return grpc.dynamic_ssl_server_credentials(
        configuration(),
        fetch,  # type: ignore[arg-type]  # grpc documents None as "keep the current one"
        require_client_authentication=client_auth,
    )


# ---------------------------------------------------------------- HTTPS listeners


def load_certificate_chain(context: ssl.SSLContext, held: HeldCertificate) -> None:
    """Give OpenSSL the key through an anonymous in-memory file (it only reads paths)."""
    data = held.chain_pem() + held.key_pem()
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("waygate-tls", os.MFD_CLOEXEC)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            context.load_cert_chain(f"/proc/self/fd/{fd}")
        finally:
            os.close(fd)
        return
    with tempfile.TemporaryDirectory() as directory:  # mode 0700; the file is 0600
        path = Path(directory) / "tls.pem"
        descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(data)
        context.load_cert_chain(path)


def server_ssl_context(
    held: HeldCertificate,
    trust: TrustBundle | None = None,
    *,
    client_auth: bool = False,
    alpn_protocols: tuple[str, ...] = (),
) -> ssl.SSLContext:
    """A server context for one certificate: TLS 1.2+, optional required client certs."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    load_certificate_chain(context, held)
    if client_auth:
        if trust is None:
            raise ValueError("client_auth needs a trust bundle")
        context.load_verify_locations(cadata=trust.pem.decode())
        context.verify_mode = ssl.CERT_REQUIRED
    if alpn_protocols:
        context.set_alpn_protocols(list(alpn_protocols))
    return context


class ServerSSLContexts:
    """`context` for an asyncio TLS listener that always serves the current certificate.

    A new per-certificate context is built once per rotation (or bundle
    change), not per handshake; the listener's context only dispatches to it
    from its SNI callback, which OpenSSL runs for every ClientHello.
    """

    def __init__(
        self,
        rotator: CertificateRotator,
        trust: TrustStore | None = None,
        *,
        client_auth: bool = False,
        alpn_protocols: tuple[str, ...] = (),
    ) -> None:
        if client_auth and trust is None:
            raise ValueError("client_auth needs a trust store")
        self._rotator = rotator
        self._trust = trust
        self._client_auth = client_auth
        self._alpn = alpn_protocols
        self._current = self._build()
        self.context = self._build()
        self.context.sni_callback = self._on_client_hello
        self._unsubscribe = [rotator.subscribe(lambda _held: self._rebuild())]
        if trust is not None:
            self._unsubscribe.append(trust.subscribe(lambda _bundle: self._rebuild()))

    @property
    def current(self) -> ssl.SSLContext:
        return self._current

    def close(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()

    def _build(self) -> ssl.SSLContext:
        return server_ssl_context(
            self._rotator.current,
            self._trust.current if self._trust is not None else None,
            client_auth=self._client_auth,
            alpn_protocols=self._alpn,
        )

    def _rebuild(self) -> None:
        self._current = self._build()

    def _on_client_hello(
        self, ssl_object: ssl.SSLObject | ssl.SSLSocket, _server_name: str | None, _ctx: Any
    ) -> None:
        ssl_object.context = self._current


# ---------------------------------------------------------------- clients


class RotatingChannel:
    """A grpc.aio channel to `address` that presents the current client certificate.

    Call `channel()` for every call or stream. After a rotation it returns a
    new channel; the previous one gets `close_grace` seconds for its calls in
    flight, then is closed. A stream that lives longer than that takes its
    channel with `async with rotating.hold() as channel:`; a held channel is
    closed only after the grace and once every holder has let go, so a
    rotation never cuts a long-lived stream (the connection keeps the
    certificate it was authenticated with; the next stream uses the new one).
    """

    def __init__(
        self,
        address: str,
        credentials: Callable[[], grpc.ChannelCredentials | None],
        subscribe: tuple[Callable[[Callable[[Any], None]], Callable[[], None]], ...] = (),
        *,
        server_name: str | None = None,
        close_grace: float = 30.0,
        options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.address = address
        self._options = tuple(options)
        self._credentials = credentials
        self._server_name = server_name
        self._close_grace = close_grace
        self._channel: grpc.aio.Channel | None = None
        self._closing: set[asyncio.Task[None]] = set()
        # Holders per channel, and the event a stale channel waits on to close.
        self._holders: dict[grpc.aio.Channel, int] = {}
        self._released: dict[grpc.aio.Channel, asyncio.Event] = {}
        self._unsubscribe = [add(self._stale) for add in subscribe]
        self.opened = 0  # channels opened so far

    def _stale(self, _changed: Any) -> None:
        old, self._channel = self._channel, None
        if old is not None:
            task = asyncio.get_running_loop().create_task(self._close_when_released(old))
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    async def _close_when_released(self, old: grpc.aio.Channel) -> None:
        try:
            await asyncio.sleep(self._close_grace)
            while self._holders.get(old):
                released = self._released.setdefault(old, asyncio.Event())
                released.clear()
                await released.wait()
        finally:  # also when `close()` cancels the wait: the old channel is closed either way
            self._released.pop(old, None)
            await old.close()

    @contextlib.asynccontextmanager
    async def hold(self) -> AsyncIterator[grpc.aio.Channel]:
        """The current channel, kept open across rotations until this block exits."""
        channel = self.channel()
        self._holders[channel] = self._holders.get(channel, 0) + 1
        try:
            yield channel
        finally:
            left = self._holders[channel] - 1
            if left:
                self._holders[channel] = left
            else:
                del self._holders[channel]
                released = self._released.get(channel)
                if released is not None:
                    released.set()

    def channel(self) -> grpc.aio.Channel:
        if self._channel is None:
            self._channel = open_channel(
                self.address,
                credentials=self._credentials(),
                server_name=self._server_name,
                options=self._options,
            )
            self.opened += 1
        return self._channel

    async def close(self) -> None:
        for unsubscribe in self._unsubscribe:
            unsubscribe()
        if self._channel is not None:
            await self._channel.close()
            self._channel = None
        for task in list(self._closing):
            task.cancel()
        await asyncio.gather(*self._closing, return_exceptions=True)

    async def __aenter__(self) -> RotatingChannel:
        return self

    async def __aexit__(self, *_exc: object) -> None:
        await self.close()


def client_credentials(rotator: CertificateRotator, trust: TrustStore) -> grpc.ChannelCredentials:
    held = rotator.current
    return grpc.ssl_channel_credentials(
        root_certificates=trust.current.pem,
        private_key=held.key_pem(),
        certificate_chain=held.chain_pem(),
    )


# ---------------------------------------------------------------- wired from settings


class ProcessCertificates:
    """A process's certificate from certs, its trust bundle, and the TLS built on them."""

    def __init__(
        self, rotator: CertificateRotator, trust: TrustStore, watcher: TrustBundleWatcher | None
    ) -> None:
        self.rotator = rotator
        self.trust = trust
        self.watcher = watcher

    @classmethod
    async def start(cls, settings: ProcessSettings, spawn: Spawn) -> ProcessCertificates:
        """Obtain the first certificate (start-up fails with certs' message if refused),
        then keep it and the trust bundle fresh in background tasks."""
        address, token_file, ca_file, identity = (
            settings.certs_address,
            settings.certs_token_file,
            settings.certs_ca_file,
            settings.cert_identity,
        )
        if address is None or token_file is None or ca_file is None or identity is None:
            raise errors.FailedPrecondition(
                "certs_address, certs_token_file, certs_ca_file and cert_identity are all needed"
            )
        try:
            bundle = TrustBundle.from_pem(ca_file.read_bytes())
        except OSError as exc:
            raise errors.FailedPrecondition(
                f"cannot read certs_ca_file {ca_file}: {exc.strerror}"
            ) from None
        trust = TrustStore(bundle)
        rotator = CertificateRotator(
            GrpcIssuer(address, token_file, trust),
            identity,
            settings.cert_sans,
            renew_fraction=settings.cert_renew_fraction,
        )
        await rotator.obtain()
        watcher = TrustBundleWatcher(address, trust)
        spawn(rotator.run(), "certificate-rotation")
        spawn(watcher.run(), "trust-bundle-watch")
        return cls(rotator, trust, watcher)

    def server_credentials(self, *, client_auth: bool) -> grpc.ServerCredentials:
        return dynamic_server_credentials(self.rotator, self.trust, client_auth=client_auth)

    def ssl_contexts(
        self, *, client_auth: bool = False, alpn_protocols: tuple[str, ...] = ()
    ) -> ServerSSLContexts:
        return ServerSSLContexts(
            self.rotator, self.trust, client_auth=client_auth, alpn_protocols=alpn_protocols
        )

    def client_channel(self, address: str, *, server_name: str | None = None) -> RotatingChannel:
        return RotatingChannel(
            address,
            lambda: client_credentials(self.rotator, self.trust),
            (self.rotator.subscribe, self.trust.subscribe),
            server_name=server_name,
        )


def static_client_channel(
    address: str, credentials: grpc.ChannelCredentials | None, server_name: str | None = None
) -> RotatingChannel:
    """A RotatingChannel that never rotates: fixed credentials (or plaintext)."""
    return RotatingChannel(address, lambda: credentials, server_name=server_name)


__all__ = [
    "GrpcIssuer",
    "ProcessCertificates",
    "RotatingChannel",
    "ServerSSLContexts",
    "TrustBundleWatcher",
    "client_credentials",
    "domain_error",
    "dynamic_server_credentials",
    "load_certificate_chain",
    "server_ssl_context",
    "static_client_channel",
]
