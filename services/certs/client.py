"""The certs API's client: `GrpcIssuer` (Certify) and `TrustBundleWatcher`.

Beside certs' server, as every API's client is; consumers (the process runtime,
`waygate up`, the tunnel agent) import this surface, never certs' internals.

- `GrpcIssuer`: the `Issuer` of `waygate.core.rotation` over certs' `Certify`
  RPC (server TLS verified against the current trust bundle, bearer token read
  from a file on every call, so a rotated projected token is picked up).
- `TrustBundleWatcher`: follows `WatchTrustBundle` into a `TrustStore`,
  reconnecting with backoff; each reconnect trusts the newest bundle, so it
  survives a CA rotation.
- `TrustReporter`: acknowledges to certs (ReportTrust) each bundle the
  TrustStore applies, and reports again every interval while the process runs
  and once more (`leaving`) when it stops, so certs' CA rotation waits for
  this process to hold a new CA before signing with it. A certs that does not
  know ReportTrust (older) is told nothing more: trust keeps working.
- `start_process_certificates`: a process's certificate from its settings, kept
  renewed, with the trust bundle followed and acknowledged: the
  `certificate_source` that `waygate.core.runtime.ServiceProcess` is given by
  the CLI.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
from collections.abc import Callable, Coroutine
from datetime import UTC, timedelta
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from google.protobuf import duration_pb2

from waygate.certs.v1 import certs_pb2, certs_pb2_grpc
from waygate.core import errors
from waygate.core.backoff import Backoff
from waygate.core.grpcclient import open_channel
from waygate.core.grpctls import ProcessCertificates
from waygate.core.rotation import CertificateRotator, Issued, TrustBundle, TrustStore
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
        received = self.received
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
            error = f"{exc.code().name}: {exc.details()}"
            if exc.code() == grpc.StatusCode.UNAVAILABLE and self.received > received:
                # A stream that worked and was cut: the server's connection age (GOAWAY,
                # every 30 minutes by default) or a restart. Reconnecting is routine.
                log.info("trust bundle stream cut", extra={"certs": self._address, "error": error})
            else:
                log.warning(
                    "trust bundle watch failed", extra={"certs": self._address, "error": error}
                )
        except errors.WaygateError as exc:
            log.warning("certs sent an unusable trust bundle", extra={"error": str(exc)})


#: How often a consumer reports while nothing changes, unless certs says otherwise.
REPORT_INTERVAL = 30.0
#: Attempts per report when certs replicas that are not the leader refuse it.
LEADER_ATTEMPTS = 6
#: The leaving report on shutdown gets this long: a stop never waits on certs for more.
LEAVING_TIMEOUT = 1.0


def instance_name() -> str:
    """This process, as certs lists it: the pod (POD_NAME) or host name, and pid."""
    return f"{os.environ.get('POD_NAME') or socket.gethostname()}/{os.getpid()}"


def bundle_fingerprints(bundle: TrustBundle) -> list[str]:
    return [
        hashlib.sha256(c.public_bytes(serialization.Encoding.DER)).hexdigest()
        for c in bundle.certificates
    ]


class TrustReporter:
    """Tell certs which trust bundle this process applied (ReportTrust): at once
    after each change, every interval otherwise, and `leaving` when stopped."""

    def __init__(
        self,
        address: str,
        token_file: Path,
        trust: TrustStore,
        identity: str,
        *,
        instance: str | None = None,
        interval: float = REPORT_INTERVAL,
        timeout: float = 10.0,
    ) -> None:
        self._address = address
        self._token_file = token_file
        self._trust = trust
        self.identity = identity
        self.instance = instance or instance_name()
        self._interval = interval
        self._timeout = timeout
        self._changed = asyncio.Event()
        self.reported = 0  # reports certs accepted, for tests and logs
        #: False once certs said it does not know ReportTrust (an older certs).
        self.supported = True
        trust.subscribe(lambda _bundle: self._changed.set())

    async def run(self) -> None:
        try:
            while self.supported:
                self._changed.clear()
                await self.report()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), self._interval)
        except asyncio.CancelledError:
            if self.supported and self.reported:
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(self.report(leaving=True), LEAVING_TIMEOUT)
            raise

    async def report(self, *, leaving: bool = False) -> bool:
        """One report; True when certs accepted it (failures are logged, never raised).
        A certs replica that is not the leader refuses it (only the leader judges the
        rotation): each attempt is a new connection, which the Service may send to
        another replica, so a few are made at once."""
        for _ in range(LEADER_ATTEMPTS - 1):
            outcome = await self._report_once(leaving=leaving)
            if outcome is not None:
                return outcome
        return bool(await self._report_once(leaving=leaving, last=True))

    async def _report_once(self, *, leaving: bool, last: bool = False) -> bool | None:
        """True or False as `report`; None when a follower refused it (try again)."""
        bundle = self._trust.current
        request = certs_pb2.ReportTrustRequest(
            identity=self.identity,
            instance=self.instance,
            bundle_version=bundle.version,
            fingerprints_sha256=bundle_fingerprints(bundle),
            leaving=leaving,
        )
        try:
            metadata = (("authorization", f"Bearer {read_token(self._token_file)}"),)
            credentials = grpc.ssl_channel_credentials(bundle.pem)
            async with open_channel(self._address, credentials=credentials) as channel:
                reply = await certs_pb2_grpc.CertsStub(channel).ReportTrust(
                    request, timeout=self._timeout, metadata=metadata
                )
        except grpc.aio.AioRpcError as exc:
            if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                log.info("certs does not take trust reports (older certs); not reporting")
                self.supported = False
            elif (
                not last
                and exc.code() == grpc.StatusCode.UNAVAILABLE
                and "not the leader" in (exc.details() or "")
            ):
                return None
            else:
                log.warning(
                    "trust report failed",
                    extra={"certs": self._address, "error": f"{exc.code().name}: {exc.details()}"},
                )
            return False
        except errors.WaygateError as exc:
            log.warning("trust report failed", extra={"error": str(exc)})
            return False
        if reply.HasField("report_interval") and reply.report_interval.seconds > 0:
            self._interval = float(reply.report_interval.seconds)
        self.reported += 1
        return True


async def start_process_certificates(
    settings: ProcessSettings, spawn: Spawn
) -> ProcessCertificates:
    """Obtain the process's first certificate (start-up fails with certs' message if
    refused), then keep it and the trust bundle fresh in background tasks."""
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
        client_only=settings.client_certificate_only,
    )
    await rotator.obtain()
    watcher = TrustBundleWatcher(address, trust)
    reporter = TrustReporter(address, token_file, trust, identity)
    spawn(rotator.run(), "certificate-rotation")
    spawn(watcher.run(), "trust-bundle-watch")
    spawn(reporter.run(), "trust-report")
    return ProcessCertificates(rotator, trust, watcher)


__all__ = [
    "GrpcIssuer",
    "TrustBundleWatcher",
    "TrustReporter",
    "domain_error",
    "read_token",
    "start_process_certificates",
]
