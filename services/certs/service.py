"""What each Certs RPC does, in domain terms (no grpc): authenticate, authorise, act.

`CertsService` joins the pieces: an `Authenticator` (who is calling), the
`Policy` (what that caller may get) and the `Authority` (signing, bundle,
rotation). The gRPC boundary (`server.py`) only converts messages.

Invariants:
- checks run in a fixed order: token authenticates (UNAUTHENTICATED, before
  any work is done for the caller), CSR parses and its signature verifies
  (INVALID_ARGUMENT), identity and SANs are allowed
  (PERMISSION_DENIED), lifetime within the maximum (INVALID_ARGUMENT), CA can
  sign (FAILED_PRECONDITION); nothing is signed, recorded or written before
  every check has passed;
- while the CA is not loaded (start-up, or it could not be read) every call
  is FAILED_PRECONDITION with the reason, never a half answer;
- admin calls (RotateCA, ListIssued) need a token whose caller is an admin.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from prometheus_client import Counter, Gauge

from waygate.certs.auth import Authenticator, Caller
from waygate.certs.authority import (
    Authority,
    Issued,
    IssuedRecord,
    Rotation,
    TrustBundleView,
    check_csr,
    load_csr,
)
from waygate.certs.policy import Policy
from waygate.core.errors import FailedPrecondition, PermissionDenied, Unauthenticated, Unavailable

log = logging.getLogger(__name__)

ISSUED = Counter(
    "waygate_certs_issued_total",
    "Leaf certificates issued by this CA.",
)
REFUSED = Counter(
    "waygate_certs_refused_total",
    "Certify calls refused, by reason (grpc status name).",
    ["reason"],
)
CA_NOT_AFTER = Gauge(
    "waygate_certs_ca_not_after_timestamp_seconds",
    "Expiry (Unix time) of each CA in the trust bundle, by fingerprint and state.",
    ["fingerprint", "state"],
)
BUNDLE_VERSION = Gauge(
    "waygate_certs_trust_bundle_version", "Version of the published trust bundle."
)


class CertsService:
    def __init__(self, authenticator: Authenticator, policy: Policy) -> None:
        self.authenticator = authenticator
        self.policy = policy
        self._authority: Authority | None = None
        self._unavailable = "the CA is not loaded yet"
        self._draining = asyncio.Event()

    # ------------------------------------------------------------ authority

    def attach(self, authority: Authority) -> None:
        """Serve with `authority` from now on; the bundle gauges follow its changes."""
        self._authority = authority
        authority.add_listener(publish_metrics)
        publish_metrics(authority.trust_bundle())

    def unavailable(self, reason: str) -> None:
        """Answer every call with FAILED_PRECONDITION(reason) (the CA could not be loaded)."""
        self._authority = None
        self._unavailable = reason

    @property
    def authority(self) -> Authority:
        if self._authority is None:
            raise FailedPrecondition(f"the CA cannot sign: {self._unavailable}")
        return self._authority

    # ------------------------------------------------------------ calls

    async def certify(
        self,
        *,
        token: str,
        identity: str,
        csr_der: bytes,
        lifetime: timedelta | None,
    ) -> Issued:
        try:
            caller = await self._authenticate(token)
            csr = load_csr(csr_der)
            public_key = check_csr(csr)
            self.policy.authorize_csr(caller, identity, csr)
            issued = self.authority.issue(
                csr,
                identity=identity,
                requested_by=caller.name,
                lifetime=lifetime,
                public_key=public_key,
            )
        except Exception as exc:
            reason = getattr(exc, "status", "INTERNAL")
            REFUSED.labels(reason).inc()
            # Refusals are rare and worth seeing (a wrong token, a forbidden name).
            log.info(
                "certify refused", extra={"identity": identity, "reason": reason, "error": str(exc)}
            )
            raise
        ISSUED.inc()
        # Per issuance only at debug: at thousands per second a log line costs a sixth of
        # the call; the issued counter and ListIssued account for every certificate.
        log.debug(
            "issued",
            extra={
                "identity": identity,
                "serial": issued.serial,
                "requested_by": caller.name,
                "valid_until": issued.valid_until.isoformat(),
            },
        )
        return issued

    def trust_bundle(self) -> TrustBundleView:
        return self.authority.trust_bundle()

    async def wait_for_change(self, version: int) -> TrustBundleView:
        """The next bundle after `version`; Unavailable once the process drains, so
        WatchTrustBundle streams end (their clients reconnect) instead of holding the
        shutdown for its whole grace period."""
        change = asyncio.ensure_future(self.authority.wait_for_change(version))
        draining = asyncio.ensure_future(self._draining.wait())
        try:
            await asyncio.wait({change, draining}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            change.cancel()
            draining.cancel()
        if change.done() and not change.cancelled():
            return change.result()
        raise Unavailable("certs is shutting down; reconnect to watch the trust bundle")

    def end_watches(self) -> None:
        """Draining: every trust-bundle watch ends now."""
        self._draining.set()

    async def rotate(
        self,
        *,
        token: str,
        propagation_delay: timedelta | None,
        ca_lifetime: timedelta | None,
    ) -> Rotation:
        caller = await self._require_admin(token, "RotateCA")
        rotation = self.authority.rotate(
            propagation_delay=propagation_delay, ca_lifetime=ca_lifetime
        )
        log.warning(
            "CA rotation started",
            extra={
                "requested_by": caller.name,
                "new_fingerprint": rotation.new_authority.fingerprint,
                "signing_switch_at": rotation.signing_switch_at.isoformat(),
            },
        )
        return rotation

    async def list_issued(
        self, *, token: str, identity: str, include_expired: bool
    ) -> list[IssuedRecord]:
        await self._require_admin(token, "ListIssued")
        return self.authority.list_issued(identity=identity, include_expired=include_expired)

    # ------------------------------------------------------------ callers

    async def _authenticate(self, token: str) -> Caller:
        if not token:
            raise Unauthenticated("a token is required")
        caller = await self.authenticator.authenticate(token)
        if caller is None:
            raise Unauthenticated("the token does not authenticate any caller")
        return caller

    async def _require_admin(self, token: str, what: str) -> Caller:
        caller = await self._authenticate(token)
        if not caller.is_admin:
            raise PermissionDenied(f"{what} is an admin call and {caller.name} is not an admin")
        return caller


def publish_metrics(bundle: TrustBundleView) -> None:
    CA_NOT_AFTER.clear()
    for authority in bundle.authorities:
        CA_NOT_AFTER.labels(authority.fingerprint, authority.state.value).set(
            authority.not_after.timestamp()
        )
    BUNDLE_VERSION.set(bundle.version)
