"""What each Certs RPC does, in domain terms (no grpc): authenticate, authorise, act.

`CertsService` joins the pieces: an `Authenticator` (who is calling), the
`Policy` (what that caller may get) and the `Authority` (signing, bundle,
rotation). The gRPC boundary (`server.py`) only converts messages.

Invariants:
- checks run in a fixed order: every request field within its bound
  (INVALID_ARGUMENT: identity at most 2048 characters, token at most 16 KiB),
  token authenticates (UNAUTHENTICATED, before any work is done for the
  caller), CSR parses, its key is one we sign, its SANs are within bounds,
  its signature verifies and the extended key usages it asks for (if any)
  are serverAuth and/or clientAuth (INVALID_ARGUMENT), identity and SANs are
  allowed, Service names included (PERMISSION_DENIED), lifetime within the
  maximum (INVALID_ARGUMENT), CA can sign (FAILED_PRECONDITION); nothing is
  signed, recorded or written before every check has passed;
- a leaf carries exactly the extended key usages its CSR asks for, both
  serverAuth and clientAuth when it asks for none (a tunnel agent asks for
  clientAuth only: the agent role, see `waygate.tunnel.peers`);
- the event loop never runs a slow check or signature and never waits: a
  small CSR (at most `QUICK_CSR_BYTES`) whose key is quick to verify is
  checked on the loop, and signed there by a quick CA key (ECDSA, Ed25519)
  when the authority's lock is free and nothing needs writing
  (`Authority.issue_at_once`); everything else - large CSRs, P-384 checks,
  RSA CA signatures, signing behind a rotation, a store write or a CA
  transition - runs in a bounded thread pool (`SigningExecutor`), past whose
  queue bound Certify is RESOURCE_EXHAUSTED at once. A thread hand-off costs
  more CPU than a P-256 check or signature (measured: bench/RESULTS.md);
- a caller-supplied value is repeated in a log line or an error only through
  `excerpt` (a short quoted prefix), so no caller can flood the log;
- ListIssued is paged (`page_size` default 500, at most 1,000, and at most
  about 1 MiB per page) with an opaque page token that only this replica
  (`replica`: host name / pid) accepts;
- while the CA is not loaded (start-up, or it could not be read) every call
  is FAILED_PRECONDITION with the reason, never a half answer;
- admin calls (RotateCA, ListIssued) need a token whose caller is an admin.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, TypeVar

from cryptography import x509
from prometheus_client import Counter, Gauge

from waygate.certs.auth import MAX_TOKEN_LENGTH, Authenticator, Caller
from waygate.certs.authority import Authority
from waygate.certs.bundle import TrustBundleView
from waygate.certs.csr import (
    CertificatePublicKey,
    csr_public_key,
    load_csr,
    quick_to_verify,
    requested_usages,
    verify_csr,
)
from waygate.certs.issuing import Issued, IssuedRecord, leaf_request
from waygate.certs.policy import Policy
from waygate.certs.rotation import ConsumerReport, Phase, Rotation, RotationStatus
from waygate.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    PermissionDenied,
    ResourceExhausted,
    Unauthenticated,
    Unavailable,
    excerpt,
)
from waygate.core.sans import identity_san

log = logging.getLogger(__name__)

#: Longest identity a Certify request may ask for (the SPIFFE ID maximum).
MAX_IDENTITY_LENGTH = 2048
#: ListIssued page sizes: the default, the cap, and the estimated bytes a page may hold
#: (a quarter of gRPC's default 4 MiB message limit).
PAGE_SIZE = 500
MAX_PAGE_SIZE = 1000
MAX_PAGE_BYTES = 1024 * 1024
_MAX_PAGE_TOKEN_LENGTH = 512
#: Signing thread pool defaults (settings signing_workers, signing_queue).
SIGNING_WORKERS = 2
SIGNING_QUEUE = 256
#: CSRs up to this size (DER) are parsed on the event loop, and checked and signed
#: there when that is quick (see `CertsService.certify`); a P-256 CSR is about 300
#: bytes, an RSA-4096 one about 1,300. Larger ones go to the signing pool whole.
QUICK_CSR_BYTES = 4096

_T = TypeVar("_T")

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
CONSUMER_VERSION = Gauge(
    "waygate_certs_consumer_bundle_version",
    "Trust bundle version each consumer (identity, instance) last reported it applied.",
    ["identity", "instance"],
)
CONSUMER_REPORT = Gauge(
    "waygate_certs_consumer_last_report_timestamp_seconds",
    "When each trust consumer last reported (Unix time).",
    ["identity", "instance"],
)
ROTATION_PHASE = Gauge(
    "waygate_certs_rotation_phase",
    "The CA rotation's phase: 1 for the current one (idle, prepare, activate, retire).",
    ["phase"],
)
ROTATION_WAITING = Gauge(
    "waygate_certs_rotation_waiting_consumers",
    "Live trust consumers holding the CA rotation's next step (not yet acknowledged).",
)
ROTATION_HELD_BY = Gauge(
    "waygate_certs_rotation_held_by",
    "1 for each trust consumer holding the CA rotation's next step.",
    ["identity", "instance", "step"],
)
ROTATION_STEP_READY = Gauge(
    "waygate_certs_rotation_step_clock_ready_timestamp_seconds",
    "When the rotation's next step met its clock condition (Unix time); 0 when idle "
    "or not yet: time() minus it is how long consumers have held the step.",
)
SIGNING_BACKLOG = Gauge(
    "waygate_certs_signing_backlog",
    "Certify calls being checked or signed, or waiting for a signing thread.",
)


def replica_name() -> str:
    """This process, as ListIssued names it: host name (a pod's name) and pid."""
    return f"{socket.gethostname()}/{os.getpid()}"


class SigningExecutor:
    """A thread pool for CSR checks and signing with a bounded queue.

    At most `workers` jobs run at once and at most `queue` more wait; past that
    `run` raises ResourceExhausted at once rather than letting a burst of
    expensive CSRs pile up. A job holds its slot until its thread finishes, even
    when its caller gave up, so cancelled calls cannot overfill the pool.
    """

    def __init__(self, workers: int = SIGNING_WORKERS, queue: int = SIGNING_QUEUE) -> None:
        self.workers = workers
        self.queue = queue
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=workers, thread_name_prefix="certs-sign"
        )
        self._slots = threading.BoundedSemaphore(workers + queue)
        self._backlog = 0
        self._backlog_lock = threading.Lock()

    async def run(self, function: Callable[..., _T], *args: object, **kwargs: object) -> _T:
        if not self._slots.acquire(blocking=False):
            raise ResourceExhausted(
                f"certs is already checking or signing {self.workers + self.queue} requests "
                f"(signing_workers {self.workers} + signing_queue {self.queue}); retry shortly"
            )
        self._moved(1)
        try:
            future = self._pool.submit(functools.partial(function, *args, **kwargs))
        except BaseException:
            self._release(None)
            raise
        future.add_done_callback(self._release)
        return await asyncio.wrap_future(future)

    def _release(self, _: object) -> None:
        self._moved(-1)
        self._slots.release()

    def _moved(self, delta: int) -> None:
        with self._backlog_lock:
            self._backlog += delta
            SIGNING_BACKLOG.set(self._backlog)

    def close(self) -> None:
        """Let running jobs finish; queued ones are cancelled."""
        self._pool.shutdown(wait=False, cancel_futures=True)


@dataclasses.dataclass(frozen=True)
class IssuedListing:
    """One page of ListIssued."""

    records: tuple[IssuedRecord, ...]
    #: Empty on the last page.
    next_page_token: str
    replica: str


@dataclasses.dataclass(frozen=True)
class _Checked:
    csr: x509.CertificateSigningRequest
    public_key: CertificatePublicKey
    names: list[str]
    #: The extended key usages the CSR asks for; (): serverAuth and clientAuth.
    usages: tuple[x509.ObjectIdentifier, ...] = ()


class CertsService:
    def __init__(
        self,
        authenticator: Authenticator,
        policy: Policy,
        *,
        replica: str | None = None,
        executor: SigningExecutor | None = None,
    ) -> None:
        self.authenticator = authenticator
        self.policy = policy
        self.replica = replica or replica_name()
        self.executor = executor or SigningExecutor()
        self._authority: Authority | None = None
        self._unavailable = "the CA is not loaded yet"
        self._draining = asyncio.Event()
        #: Set by a report that may open a rotation step: the rotation timer waits on it.
        self.reported = asyncio.Event()
        #: The leader elector (cluster mode): only the leader takes trust reports, since
        #: only it judges them; None: this process takes them.
        self.leader: Any = None

    # ------------------------------------------------------------ authority

    def attach(self, authority: Authority) -> None:
        """Serve with `authority` from now on; the bundle gauges follow its changes."""
        self._authority = authority
        # No loop (a synchronous test): changes are delivered where they happen.
        with contextlib.suppress(RuntimeError):
            authority.deliver_changes_on(asyncio.get_running_loop())
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
            _check_length("identity", identity, MAX_IDENTITY_LENGTH)
            _check_length("token", token, MAX_TOKEN_LENGTH)
            caller = await self._authenticate(token)
            authority = self.authority
            max_sans = authority.config.max_sans
            if len(csr_der) <= QUICK_CSR_BYTES:
                # Parsing a small CSR and reading its key cost tens of microseconds:
                # here, so only a slow check (a P-384 signature) pays for a thread.
                csr = load_csr(csr_der, max_sans=max_sans)
                key = csr_public_key(csr)
                if quick_to_verify(key):
                    checked = self._check_parsed(caller, identity, csr, key, max_sans)
                else:
                    checked = await self.executor.run(
                        self._check_parsed, caller, identity, csr, key, max_sans
                    )
            else:
                checked = await self.executor.run(self._check, caller, identity, csr_der, max_sans)
            await self.policy.check_service_names(caller, checked.names)
            request = leaf_request(
                checked.csr,
                authority.config,
                identity=identity,
                requested_by=caller.name,
                lifetime=lifetime,
                public_key=checked.public_key,
                extended_usages=checked.usages,
            )
            issued = authority.issue_at_once(request)
            if issued is None:
                # A slow signature (RSA CA), a CA transition or store write due, or the
                # lock held by a rotation or a store write: wait in a signing thread.
                issued = await self.executor.run(authority.issue, request)
        except Exception as exc:
            reason = getattr(exc, "status", "INTERNAL")
            REFUSED.labels(reason).inc()
            # Refusals are rare and worth seeing (a wrong token, a forbidden name); what
            # the caller sent is repeated only as a short excerpt.
            log.info(
                "certify refused",
                extra={
                    "identity": excerpt(identity),
                    "reason": reason,
                    "error": excerpt(str(exc), 512),
                },
            )
            raise
        ISSUED.inc()
        # Per issuance only at debug: at thousands per second a log line costs a sixth of
        # the call; the issued counter and ListIssued account for every certificate. Its
        # fields are not even built otherwise.
        if log.isEnabledFor(logging.DEBUG):
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

    def _check(self, caller: Caller, identity: str, csr_der: bytes, max_sans: int) -> _Checked:
        """The CPU-bound checks of a large CSR (in a signing thread): parse, key, then
        `_check_parsed`."""
        csr = load_csr(csr_der, max_sans=max_sans)
        return self._check_parsed(caller, identity, csr, csr_public_key(csr), max_sans)

    def _check_parsed(
        self,
        caller: Caller,
        identity: str,
        csr: x509.CertificateSigningRequest,
        public_key: CertificatePublicKey,
        max_sans: int,
    ) -> _Checked:
        """SAN bounds and signature (`verify_csr`), the usages asked for, then the
        caller's policy."""
        verify_csr(csr, max_sans=max_sans)
        usages = requested_usages(csr)
        names = self.policy.authorize_csr(caller, identity, csr)
        return _Checked(csr, public_key, names, usages)

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
        # A new CA key (RSA) takes a while to make: off the event loop.
        rotation = await asyncio.to_thread(
            functools.partial(
                self.authority.rotate,
                propagation_delay=propagation_delay,
                ca_lifetime=ca_lifetime,
            )
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

    async def force_step(self, *, token: str) -> tuple[str, tuple[ConsumerReport, ...]]:
        """RotateCA with force while a rotation is under way: its next step now."""
        caller = await self._require_admin(token, "RotateCA")
        step, overridden = await asyncio.to_thread(self.authority.force_step)
        log.warning(
            "CA rotation step forced",
            extra={
                "requested_by": caller.name,
                "step": step,
                "will_break": [c.name for c in overridden],
            },
        )
        publish_rotation(await self.rotation_status_now())
        return step, overridden

    async def report_trust(
        self,
        *,
        token: str,
        identity: str,
        instance: str,
        version: int,
        fingerprints: list[str],
        leaving: bool,
    ) -> None:
        """A trust consumer's acknowledgement (ReportTrust): the caller must be allowed
        the identity it reports for, as it would be to Certify it."""
        _check_length("token", token, MAX_TOKEN_LENGTH)
        _check_length("identity", identity, MAX_IDENTITY_LENGTH)
        caller = await self._authenticate(token)
        if self.leader is not None and not self.leader.is_leader():
            raise Unavailable(
                "this certs replica is not the leader, which keeps the trust reports; "
                f"{self.leader.leader_description()} does (retry on a new connection)"
            )
        if not caller.is_admin and not self.policy.is_allowed(caller, identity_san(identity)):
            raise PermissionDenied(f"{caller.name} may not report for identity {excerpt(identity)}")
        authority = self.authority
        if authority.report_trust(
            identity=identity,
            instance=instance,
            version=version,
            fingerprints=fingerprints,
            leaving=leaving,
        ):
            self.reported.set()
        if not leaving:
            CONSUMER_VERSION.labels(identity, instance).set(version)
            CONSUMER_REPORT.labels(identity, instance).set(time.time())
        else:
            with contextlib.suppress(KeyError):
                CONSUMER_VERSION.remove(identity, instance)
                CONSUMER_REPORT.remove(identity, instance)

    async def rotation_status(self, *, token: str) -> RotationStatus:
        await self._require_admin(token, "GetRotationStatus")
        return await self.rotation_status_now()

    async def rotation_status_now(self) -> RotationStatus:
        # In a thread: the authority's lock may be held by a signing across a store write.
        return await asyncio.to_thread(self.authority.rotation_status)

    async def list_issued(
        self,
        *,
        token: str,
        identity: str,
        include_expired: bool,
        page_size: int = 0,
        page_token: str = "",
    ) -> IssuedListing:
        """One page of the records of certificates this replica issued, oldest first."""
        _check_length("token", token, MAX_TOKEN_LENGTH)
        _check_length("identity", identity, MAX_IDENTITY_LENGTH)
        _check_length("page_token", page_token, _MAX_PAGE_TOKEN_LENGTH)
        await self._require_admin(token, "ListIssued")
        query = _query_digest(identity, include_expired)
        after = self._page_start(page_token, query) if page_token else 0
        size = min(page_size, MAX_PAGE_SIZE) if page_size > 0 else PAGE_SIZE
        # In a thread: the authority's lock may be held by a signing across its store write.
        page = await asyncio.to_thread(
            self.authority.issued_page,
            identity=identity,
            include_expired=include_expired,
            after=after,
            size=size,
            max_bytes=MAX_PAGE_BYTES,
        )
        next_token = "" if page.next_after is None else self._page_token(page.next_after, query)
        return IssuedListing(page.records, next_token, self.replica)

    def _page_token(self, after: int, query: str) -> str:
        body = json.dumps({"r": self.replica, "a": after, "q": query}, separators=(",", ":"))
        return base64.urlsafe_b64encode(body.encode()).decode("ascii")

    def _page_start(self, token: str, query: str) -> int:
        try:
            body = json.loads(base64.urlsafe_b64decode(token.encode("ascii")))
            replica, after, token_query = body["r"], body["a"], body["q"]
        except (ValueError, UnicodeError, binascii.Error, KeyError, TypeError):
            raise InvalidArgument(
                "page_token is not a next_page_token this server gave out"
            ) from None
        if replica != self.replica:
            raise InvalidArgument(
                f"page_token comes from another certs replica ({excerpt(str(replica))}); "
                f"this is {self.replica}, and each replica pages its own records"
            )
        if token_query != query or not isinstance(after, int) or after < 0:
            raise InvalidArgument(
                "page_token belongs to a different query (identity or include_expired "
                "changed between pages)"
            )
        return after

    # ------------------------------------------------------------ callers

    def close(self) -> None:
        self.executor.close()

    async def shutdown(self) -> None:
        """`close` as a process cleanup (runs after the servers have stopped)."""
        self.close()

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


def _check_length(field: str, value: str, limit: int) -> None:
    if len(value) > limit:
        # Not even an excerpt: the field may be a secret (token).
        raise InvalidArgument(
            f"{field} is {len(value)} characters long; at most {limit} are allowed"
        )


def _query_digest(identity: str, include_expired: bool) -> str:
    digest = hashlib.sha256(f"{int(include_expired)}:{identity}".encode())
    return digest.hexdigest()[:16]


def publish_rotation(status: RotationStatus) -> None:
    """The rotation gauges, from `status` (the rotation timer calls it every tick)."""
    for phase in Phase:
        ROTATION_PHASE.labels(phase.value).set(1 if status.phase is phase else 0)
    ROTATION_WAITING.set(len(status.gate.waiting_for))
    ROTATION_HELD_BY.clear()
    for consumer in status.gate.waiting_for:
        ROTATION_HELD_BY.labels(consumer.identity, consumer.instance, status.gate.step).set(1)
    ready = status.clock_ready_at
    ROTATION_STEP_READY.set(0 if ready is None else ready.timestamp())


def publish_metrics(bundle: TrustBundleView) -> None:
    CA_NOT_AFTER.clear()
    for authority in bundle.authorities:
        CA_NOT_AFTER.labels(authority.fingerprint, authority.state.value).set(
            authority.not_after.timestamp()
        )
    BUNDLE_VERSION.set(bundle.version)
