"""The Kubernetes CSR signer and approver for Waygate's signer names.

Watches `certificates.k8s.io/v1` CertificateSigningRequests and handles those
whose `spec.signerName` is one of:

    waygate.io/workload       a ServiceAccount's own identity: SANs by the policy
                              module's ServiceAccount rules (spiffe://TD/ns/NS/sa/SA,
                              NAME.NS.svc, NAME.NS.svc.cluster.local)
    waygate.io/tunnel-agent   a node's tunnel agent: only user system:node:NODE in
                              group system:nodes, only the SAN dns:NODE
    waygate.io/tunnel-server  the tunnel server: only its configured ServiceAccount,
                              only its configured names

Each is judged against the REQUESTING USER (spec.username and spec.groups, set
by the API server from the creator's credentials), never against what the
request claims about itself (its subject), and against its usages: only
digital signature, key encipherment, server auth and client auth.

`review` is the sans-IO judgement of one CSR object. The controller applies it:

    pending, allowed      -> Approved condition (/approval), then signed:
                             status.certificate = leaf + chain, PEM (/status)
    pending, not allowed  -> Denied condition naming what is not allowed
    approved, unsigned    -> signed if the policy allows it (a restart between
                             approving and signing ends here), else Failed
    request unparsable or
    its signature invalid -> Failed condition
    denied, failed, issued, other signers -> left alone

Invariants:
- Idempotent: the decision depends only on the object, and every write
  carries the resourceVersion it was decided on, so a stale decision loses
  with 409 and the newer object is judged again; after a restart the list
  brings every unfinished CSR back.
- A certificate is issued only right before it is written, and never twice
  for one CSR within a process (finished CSRs are remembered by uid).
- Lifetime honours spec.expirationSeconds, clamped to [600 s, the CA's maximum].
- The event loop never waits on the API: every request runs in a worker
  thread. List+watch is the shared `waygate.core.kube.Reflector` (resume
  from the last resourceVersion, list again on 410 Gone, back off with
  jitter); one CSR that fails transiently is retried with its own backoff
  without holding up the others.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import dataclasses
import enum
import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from cryptography.x509.oid import ExtendedKeyUsageOID
from prometheus_client import Counter

from waygate.certs.auth import Caller
from waygate.certs.authority import Authority
from waygate.certs.castate import utc_now
from waygate.certs.csr import MAX_SANS, check_csr, load_csr
from waygate.certs.issuing import Issued, leaf_request
from waygate.certs.kube_auth import NODES_GROUP, caller_for_user
from waygate.certs.policy import Policy, requested_names
from waygate.core.backoff import Backoff
from waygate.core.errors import InvalidArgument, PermissionDenied, WaygateError
from waygate.core.kube import JSON, KubeAPI, KubeError, Reflector

if TYPE_CHECKING:
    from waygate.certs.service import SigningExecutor

log = logging.getLogger(__name__)

CSR_COLLECTION = "/apis/certificates.k8s.io/v1/certificatesigningrequests"
CSR_API_VERSION = "certificates.k8s.io/v1"
CSR_KIND = "CertificateSigningRequest"

SIGNER_WORKLOAD = "waygate.io/workload"
SIGNER_TUNNEL_AGENT = "waygate.io/tunnel-agent"
SIGNER_TUNNEL_SERVER = "waygate.io/tunnel-server"
SIGNERS = (SIGNER_WORKLOAD, SIGNER_TUNNEL_AGENT, SIGNER_TUNNEL_SERVER)

#: What each signer may put in a certificate: an agent only dials out (client), a
#: tunnel server serves agents and reports to the resolver, a workload may do both.
SIGNER_USAGES = {
    SIGNER_WORKLOAD: ("digital signature", "key encipherment", "server auth", "client auth"),
    SIGNER_TUNNEL_AGENT: ("digital signature", "key encipherment", "client auth"),
    SIGNER_TUNNEL_SERVER: ("digital signature", "key encipherment", "server auth", "client auth"),
}
#: Kubernetes usage names -> the extended key usages the leaf carries.
EXTENDED_USAGES = {
    "server auth": ExtendedKeyUsageOID.SERVER_AUTH,
    "client auth": ExtendedKeyUsageOID.CLIENT_AUTH,
}
#: The API server refuses a shorter spec.expirationSeconds; never issue below it.
MIN_LIFETIME = timedelta(seconds=600)

DECISIONS = Counter(
    "waygate_certs_csr_decisions_total",
    "Kubernetes CSRs for Waygate signers, by signer and what the controller did.",
    ["signer", "decision"],
)


class Action(enum.Enum):
    SKIP = "skip"  # not ours, or already finished
    APPROVE = "approve"  # pending and allowed: approve, then sign
    SIGN = "sign"  # approved (by us before a restart, or by a person) and allowed
    DENY = "deny"  # pending and not allowed
    FAIL = "fail"  # cannot be signed: unparsable, bad signature, or approved but not allowed


@dataclasses.dataclass(frozen=True)
class Verdict:
    action: Action
    reason: str = ""  # the condition's reason (CamelCase)
    message: str = ""  # the condition's message: what is (not) allowed and why
    csr: x509.CertificateSigningRequest | None = None
    identity: str = ""
    lifetime: timedelta | None = None
    #: The leaf's extended key usages: exactly the requested server/client auth.
    extended_usages: tuple[x509.ObjectIdentifier, ...] = ()


@dataclasses.dataclass(frozen=True)
class SignerRules:
    """What the three signers allow, beyond the shared policy."""

    policy: Policy
    #: Lifetimes asked for by expirationSeconds are clamped to this.
    max_lifetime: timedelta
    #: (namespace, name) of the tunnel server's ServiceAccount; None: nobody.
    tunnel_server_account: tuple[str, str] | None = None
    #: SAN patterns the tunnel server may get ("dns:NAME", "ip:ADDRESS", ...).
    tunnel_server_names: tuple[str, ...] = ()
    #: Most SANs one CSR may ask for: the same cap as Certify (max_sans_per_csr).
    max_sans: int = MAX_SANS


@dataclasses.dataclass(frozen=True)
class _Refusal:
    reason: str
    message: str


# ---------------------------------------------------------------- judgement (sans-IO)


def _true_conditions(obj: JSON) -> set[str]:
    conditions = (obj.get("status") or {}).get("conditions") or ()
    return {
        str(c.get("type"))
        for c in conditions
        if isinstance(c, dict) and str(c.get("status", "True")) == "True"
    }


def review(obj: JSON, rules: SignerRules) -> Verdict:
    """What to do with one CSR object, from its contents alone."""
    spec = obj.get("spec") or {}
    signer = spec.get("signerName")
    if signer not in SIGNERS:
        return Verdict(Action.SKIP, message=f"signer {signer!r} is not Waygate's")
    conditions = _true_conditions(obj)
    if conditions & {"Denied", "Failed"}:
        return Verdict(Action.SKIP, message="already denied or failed")
    if (obj.get("status") or {}).get("certificate"):
        return Verdict(Action.SKIP, message="already issued")
    approved = "Approved" in conditions

    csr = _parse_request(spec.get("request"), rules.max_sans)
    if isinstance(csr, _Refusal):
        return Verdict(Action.FAIL, csr.reason, csr.message)
    try:
        check_csr(csr, max_sans=rules.max_sans)
        # Extensions that do not parse make a malformed request, not a policy question.
        requested_names(csr)
    except InvalidArgument as exc:
        return Verdict(Action.FAIL, "InvalidRequest", str(exc))

    judged = _judge(signer, spec, csr, rules)
    if isinstance(judged, _Refusal):
        if approved:
            # Approved by someone else, yet this signer's policy does not allow
            # it: the signer still refuses to sign, and says why.
            return Verdict(
                Action.FAIL,
                "SignerPolicy",
                f"approved, but {signer} will not sign: {judged.message}",
            )
        return Verdict(Action.DENY, judged.reason, judged.message)
    return Verdict(
        Action.SIGN if approved else Action.APPROVE,
        "WaygatePolicy",
        f"{spec.get('username')} may get {', '.join(requested_names(csr))} from {signer}",
        csr=csr,
        identity=judged,
        lifetime=_lifetime(spec.get("expirationSeconds"), rules.max_lifetime),
        extended_usages=tuple(
            oid for usage, oid in EXTENDED_USAGES.items() if usage in (spec.get("usages") or ())
        ),
    )


async def confirm_service_names(verdict: Verdict, obj: JSON, rules: SignerRules) -> Verdict:
    """`review`'s verdict, with a workload's Service names checked against the Services
    themselves (the policy's per-workload rule reads the API, so it is not in `review`)."""
    spec = obj.get("spec") or {}
    allowed = verdict.action in (Action.APPROVE, Action.SIGN)
    if not allowed or verdict.csr is None or spec.get("signerName") != SIGNER_WORKLOAD:
        return verdict
    groups = [g for g in spec.get("groups") or () if isinstance(g, str)]
    caller = caller_for_user(str(spec.get("username") or ""), groups)
    try:
        await rules.policy.check_service_names(caller, requested_names(verdict.csr))
    except (PermissionDenied, InvalidArgument) as exc:
        if verdict.action is Action.SIGN:
            message = f"approved, but {SIGNER_WORKLOAD} will not sign: {exc}"
            return Verdict(Action.FAIL, "SignerPolicy", message)
        return Verdict(Action.DENY, "ForbiddenName", f"{exc} from {SIGNER_WORKLOAD}")
    return verdict


def _parse_request(request: Any, max_sans: int) -> x509.CertificateSigningRequest | _Refusal:
    if not isinstance(request, str) or not request:
        return _Refusal("InvalidRequest", "spec.request is empty")
    try:
        pem = base64.b64decode(request, validate=True)
    except (binascii.Error, ValueError):
        return _Refusal("InvalidRequest", "spec.request is not base64")
    if b"-----BEGIN CERTIFICATE REQUEST-----" not in pem:
        return _Refusal(
            "InvalidRequest", "spec.request is not a PEM block of type CERTIFICATE REQUEST"
        )
    try:
        # SANs past the cap are refused from the DER headers, before a full parse
        # (this runs on the event loop; a 60,000-SAN CSR would take most of a second).
        return load_csr(pem, max_sans=max_sans)
    except InvalidArgument as exc:
        return _Refusal("InvalidRequest", f"spec.request: {exc}")


def _judge(
    signer: str, spec: JSON, csr: x509.CertificateSigningRequest, rules: SignerRules
) -> str | _Refusal:
    """The identity to issue for, or why not."""
    usages = spec.get("usages") or []
    allowed_usages = SIGNER_USAGES[signer]
    for usage in usages:
        if usage not in allowed_usages:
            return _Refusal(
                "ForbiddenUsage",
                f"usage {usage!r} is not allowed by {signer} "
                f"(allowed: {', '.join(allowed_usages)})",
            )
    if not any(usage in EXTENDED_USAGES for usage in usages):
        return _Refusal(
            "ForbiddenUsage", "the CSR asks for neither 'server auth' nor 'client auth'"
        )
    username = spec.get("username")
    if not isinstance(username, str) or not username:
        return _Refusal("UnknownRequester", "spec.username is empty: the requester is unknown")
    groups = [g for g in spec.get("groups") or () if isinstance(g, str)]
    caller = caller_for_user(username, groups)
    try:
        names = requested_names(csr)
    except InvalidArgument as exc:
        return _Refusal("InvalidRequest", str(exc))
    if not names:
        return _Refusal("NoNames", "the CSR asks for no subject alternative names")

    if signer == SIGNER_TUNNEL_AGENT:
        if caller.node is None:
            return _Refusal(
                "RequesterNotANode",
                f"{signer} signs only for nodes (user system:node:NAME in group "
                f"{NODES_GROUP}), not for {username}",
            )
        identity = caller.node
    elif signer == SIGNER_TUNNEL_SERVER:
        account = rules.tunnel_server_account
        if account is None or (caller.namespace, caller.service_account) != account:
            expected = (
                f"system:serviceaccount:{account[0]}:{account[1]}"
                if account
                else "no ServiceAccount (none configured)"
            )
            return _Refusal(
                "RequesterNotTunnelServer",
                f"{signer} signs only for {expected}, not for {username}",
            )
        # The tunnel server gets its configured names, not a ServiceAccount's.
        caller = Caller(name=username, groups=caller.groups, allowed=rules.tunnel_server_names)
        identity = names[0].partition(":")[2]
    else:
        if caller.namespace is None or caller.service_account is None:
            return _Refusal(
                "RequesterNotServiceAccount",
                f"{signer} signs only for ServiceAccounts "
                f"(user system:serviceaccount:NS:SA), not for {username}",
            )
        uris = [n for n in names if n.startswith("uri:")]
        identity = (uris or names)[0].partition(":")[2]
    # Every name first: a name the requester may not have is the refusal that
    # explains most, even when the identity derived above is missing too.
    for name in names:
        if not rules.policy.is_allowed(caller, name):
            allowed = ", ".join(rules.policy.allowed_patterns(caller)) or "nothing"
            return _Refusal(
                "ForbiddenName",
                f"{username} may not get a certificate for {name} from {signer} "
                f"(allowed: {allowed})",
            )
    try:
        rules.policy.authorize(caller, identity, names)
    except PermissionDenied as exc:
        return _Refusal("ForbiddenName", f"{exc} from {signer}")
    except InvalidArgument as exc:
        return _Refusal("InvalidRequest", str(exc))
    return identity


def _lifetime(expiration_seconds: Any, maximum: timedelta) -> timedelta | None:
    if expiration_seconds is None:
        return None
    try:
        asked = timedelta(seconds=int(expiration_seconds))
    except (TypeError, ValueError, OverflowError):
        return None
    return max(MIN_LIFETIME, min(asked, maximum))


# ---------------------------------------------------------------- object edits


def _timestamp(moment: datetime) -> str:
    return moment.strftime("%Y-%m-%dT%H:%M:%SZ")


def _for_update(obj: JSON) -> JSON:
    """A shallow copy fit to send back: list items come without apiVersion and kind."""
    return {"apiVersion": CSR_API_VERSION, "kind": CSR_KIND, **obj}


def with_condition(obj: JSON, kind: str, reason: str, message: str, now: datetime) -> JSON:
    """A copy of `obj` with one more status condition."""
    updated = _for_update(obj)
    status = dict(obj.get("status") or {})
    stamp = _timestamp(now)
    status["conditions"] = [
        *(status.get("conditions") or ()),
        {
            "type": kind,
            "status": "True",
            "reason": reason,
            "message": message,
            "lastUpdateTime": stamp,
            "lastTransitionTime": stamp,
        },
    ]
    updated["status"] = status
    return updated


def with_certificate(obj: JSON, pem: bytes) -> JSON:
    updated = _for_update(obj)
    updated["status"] = {
        **(obj.get("status") or {}),
        "certificate": base64.b64encode(pem).decode("ascii"),
    }
    return updated


# ---------------------------------------------------------------- the controller


class CSRController:
    """List+watch CSRs and approve, deny, fail and sign Waygate's, one at a time."""

    def __init__(
        self,
        api: KubeAPI,
        authority: Authority,
        rules: SignerRules,
        *,
        watch_timeout: int = 300,
        now: Callable[[], datetime] = utc_now,
        list_backoff: Callable[[], Backoff] = lambda: Backoff(0.5, 30.0),
        retry_backoff: Callable[[], Backoff] = lambda: Backoff(1.0, 300.0),
        signing: SigningExecutor | None = None,
    ) -> None:
        self._api = api
        self._authority = authority
        # Signing shares certs' bounded pool with Certify (one bound for all
        # signatures); a full pool is ResourceExhausted, and the CSR is retried.
        self._sign: Callable[..., Awaitable[Issued]] = (
            signing.run if signing is not None else asyncio.to_thread
        )
        self._rules = rules
        self._watch_timeout = watch_timeout
        self._now = now
        self._list_backoff = list_backoff
        self._retry_backoff = retry_backoff
        # Latest seen state of each CSR for one of our signers, by name.
        self._objects: dict[str, JSON] = {}
        # CSRs this process finished (signed, denied, failed), by name -> uid:
        # stale events for them must not lead to a second certificate.
        self._finished: dict[str, str] = {}
        self._queue: asyncio.Queue[str] = asyncio.Queue()
        self._queued: set[str] = set()
        self._retries: dict[str, tuple[Backoff, asyncio.TimerHandle]] = {}
        self.synced = asyncio.Event()  # set after the first complete list

    async def run(self) -> None:
        """Watch and act until cancelled."""
        reflector = Reflector(
            self._api,
            CSR_COLLECTION,
            name="certificatesigningrequests",
            on_list=self._relisted,
            on_event=self._observed,
            watch_timeout=self._watch_timeout,
            backoff=self._list_backoff,
        )
        try:
            async with asyncio.TaskGroup() as group:
                group.create_task(reflector.run(), name="csr-watch")
                group.create_task(self._work_loop(), name="csr-work")
        finally:
            for _, handle in self._retries.values():
                handle.cancel()
            self._retries.clear()

    # ------------------------------------------------------------ watching

    def _relisted(self, items: list[JSON]) -> None:
        ours = {_name(i): i for i in items if _ours(i)}
        log.info("CSRs listed", extra={"count": len(ours)})
        for name in set(self._objects) - set(ours):
            self._forget(name)
        self._objects = ours
        for name in ours:
            self._enqueue(name)
        self.synced.set()

    def _observed(self, kind: str, obj: JSON) -> None:
        if not _ours(obj):
            return
        name = _name(obj)
        if kind == "DELETED":
            self._objects.pop(name, None)
            self._forget(name)
            return
        finished = self._finished.get(name)
        if finished is not None and finished != _uid(obj):
            self._finished.pop(name)  # deleted and created again under the same name
        self._objects[name] = obj
        self._enqueue(name)

    def _forget(self, name: str) -> None:
        self._finished.pop(name, None)
        retry = self._retries.pop(name, None)
        if retry is not None:
            retry[1].cancel()

    def _enqueue(self, name: str) -> None:
        if name not in self._queued:
            self._queued.add(name)
            self._queue.put_nowait(name)

    # ------------------------------------------------------------ acting

    async def _work_loop(self) -> None:
        while True:
            name = await self._queue.get()
            self._queued.discard(name)
            obj = self._objects.get(name)
            if obj is None or self._finished.get(name) == _uid(obj):
                continue
            try:
                await self._reconcile(obj)
            except KubeError as exc:
                if exc.conflict:
                    # Changed since it was read: the watch brings the new version.
                    log.debug("CSR %s changed while being handled; waiting for it", name)
                elif exc.not_found:
                    log.debug("CSR %s was deleted while being handled", name)
                else:
                    self._retry_later(name, f"Kubernetes API: {exc.message}")
                continue
            except WaygateError as exc:
                # Nothing refused the CSR itself (those become conditions);
                # the CA cannot sign right now (unreadable, store unreachable).
                self._retry_later(name, str(exc))
                continue
            except Exception:
                log.exception("handling CSR %s failed unexpectedly", name)
                self._retry_later(name, "unexpected error")
                continue
            retry = self._retries.pop(name, None)
            if retry is not None:
                retry[1].cancel()

    def _retry_later(self, name: str, why: str) -> None:
        backoff = self._retries[name][0] if name in self._retries else self._retry_backoff()
        delay = backoff.next_delay()
        log.warning("CSR %s not handled (%s); retrying in %.1fs", name, why, delay)
        handle = asyncio.get_running_loop().call_later(delay, self._enqueue, name)
        self._retries[name] = (backoff, handle)

    async def _reconcile(self, obj: JSON) -> None:
        name, signer = _name(obj), (obj.get("spec") or {}).get("signerName", "")
        verdict = await confirm_service_names(review(obj, self._rules), obj, self._rules)
        if verdict.action is Action.SKIP:
            if _uid(obj):
                self._finished[name] = _uid(obj)
            return
        path = f"{CSR_COLLECTION}/{name}"
        extra = {"csr": name, "signer": signer, "reason": verdict.reason}
        if verdict.action is Action.DENY:
            body = with_condition(obj, "Denied", verdict.reason, verdict.message, self._now())
            await asyncio.to_thread(self._api.replace, f"{path}/approval", body)
            self._done(name, obj, signer, "denied")
            log.info("CSR denied: %s", verdict.message, extra=extra)
            return
        if verdict.action is Action.FAIL:
            body = with_condition(obj, "Failed", verdict.reason, verdict.message, self._now())
            await asyncio.to_thread(self._api.replace, f"{path}/status", body)
            self._done(name, obj, signer, "failed")
            log.info("CSR failed: %s", verdict.message, extra=extra)
            return
        if verdict.action is Action.APPROVE:
            body = with_condition(obj, "Approved", verdict.reason, verdict.message, self._now())
            obj = await asyncio.to_thread(self._api.replace, f"{path}/approval", body)
            self._objects[name] = obj
            DECISIONS.labels(signer, "approved").inc()
            log.info("CSR approved: %s", verdict.message, extra=extra)
        assert verdict.csr is not None
        try:
            # Signing (and, rarely, a store write) in a worker thread: never on the loop.
            request = leaf_request(
                verdict.csr,
                self._authority.config,
                identity=verdict.identity,
                requested_by=f"{(obj.get('spec') or {}).get('username')} (CSR {name})",
                lifetime=verdict.lifetime,
                extended_usages=verdict.extended_usages,
            )
            issued = await self._sign(functools.partial(self._authority.issue, request))
        except (InvalidArgument, PermissionDenied) as exc:
            # The CA refuses this request for good; retrying cannot help.
            body = with_condition(obj, "Failed", "SigningFailed", str(exc), self._now())
            await asyncio.to_thread(self._api.replace, f"{path}/status", body)
            self._done(name, obj, signer, "failed")
            log.info("CSR failed: the CA refused it: %s", exc, extra=extra)
            return
        pem = b"".join(
            c.public_bytes(serialization.Encoding.PEM) for c in (issued.leaf, *issued.chain)
        )
        await asyncio.to_thread(self._api.replace, f"{path}/status", with_certificate(obj, pem))
        self._done(name, obj, signer, "issued")
        log.info(
            "CSR signed",
            extra={**extra, "serial": issued.serial, "valid_until": issued.valid_until.isoformat()},
        )

    def _done(self, name: str, obj: JSON, signer: str, decision: str) -> None:
        self._finished[name] = _uid(obj)
        DECISIONS.labels(signer, decision).inc()


def _ours(obj: JSON) -> bool:
    return (obj.get("spec") or {}).get("signerName") in SIGNERS


def _name(obj: JSON) -> str:
    return str((obj.get("metadata") or {}).get("name") or "")


def _uid(obj: JSON) -> str:
    return str((obj.get("metadata") or {}).get("uid") or "")
