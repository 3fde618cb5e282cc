"""certs' own serving certificate, issued by its own CA and renewed in place.

The certs listener cannot take its certificate from certs over the network
(it is certs), so it signs one for itself directly with the `Authority`: a
fresh key in memory (never written to disk), the configured identity and
SANs, the CA's default leaf lifetime. gRPC asks `fetch()` before every new
handshake (dynamic server credentials), so a renewed certificate is served
from the next connection on; open connections are untouched.

Invariants: renewal happens at `renew_fraction` (70%) of the lifetime, so the
served certificate always has at least 30% of its life left while the
process runs normally; the key never leaves the process.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta

import grpc
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization

from waygate.certs.authority import Authority, generate_key, utc_now
from waygate.core.sans import parse_san

log = logging.getLogger(__name__)


class SelfServingCertificate:
    def __init__(
        self,
        authority: Authority,
        identity: str,
        sans: tuple[str, ...],
        *,
        renew_fraction: float = 0.7,
        now: Callable[[], datetime] = utc_now,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.authority = authority
        self.identity = identity
        self.sans = sans
        self.renew_fraction = renew_fraction
        self._now = now
        self._sleep = sleep
        self._config: grpc.ServerCertificateConfiguration | None = None
        self._fresh = False
        self.not_before: datetime | None = None
        self.not_after: datetime | None = None
        self.certificate: x509.Certificate | None = None

    def renew(self) -> x509.Certificate:
        key = generate_key("ecdsa-p256")
        names = [parse_san(s) for s in self.sans]
        csr = (
            x509.CertificateSigningRequestBuilder()
            .subject_name(x509.Name([]))
            .add_extension(x509.SubjectAlternativeName(names), critical=True)
            .sign(key, hashes.SHA256())
        )
        issued = self.authority.issue(csr, identity=self.identity, requested_by="certs")
        key_pem = key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
        chain_pem = b"".join(
            c.public_bytes(serialization.Encoding.PEM) for c in (issued.leaf, *issued.chain)
        )
        self._config = grpc.ssl_server_certificate_configuration([(key_pem, chain_pem)])
        self._fresh = True
        self.certificate = issued.leaf
        self.not_before = issued.leaf.not_valid_before_utc
        self.not_after = issued.valid_until
        log.info(
            "serving certificate issued",
            extra={"serial": issued.serial, "valid_until": issued.valid_until.isoformat()},
        )
        return issued.leaf

    def renew_at(self) -> datetime:
        if self.not_before is None or self.not_after is None:
            return self._now()
        return self.not_before + (self.not_after - self.not_before) * self.renew_fraction

    def credentials(self) -> grpc.ServerCredentials:
        if self._config is None:
            self.renew()
        assert self._config is not None
        self._fresh = False
        return grpc.dynamic_ssl_server_credentials(
            self._config,
            self._fetch,  # type: ignore[arg-type]  # grpc documents None as "keep the current one"
            require_client_authentication=False,
        )

    def _fetch(self) -> grpc.ServerCertificateConfiguration | None:
        # Called by gRPC before each new handshake: None keeps the current configuration.
        if not self._fresh:
            return None
        self._fresh = False
        return self._config

    async def run(self) -> None:
        """Renew at 70% of each certificate's life, for the life of the process."""
        while True:
            wait = (self.renew_at() - self._now()).total_seconds()
            await self._sleep(max(wait, 1.0))
            if self._now() >= self.renew_at():
                try:
                    self.renew()
                except Exception:
                    # The current certificate still has >= 30% of its life; retry soon.
                    log.exception("serving certificate renewal failed; retrying in 30s")
                    await self._sleep(min(30.0, _half(self.not_after, self._now())))


def _half(not_after: datetime | None, now: datetime) -> float:
    if not_after is None:
        return 1.0
    return max((not_after - now) / timedelta(seconds=2), 1.0)
