"""`waygate certs serve`: the certificate authority process.

Start-up: load the CA from its store (or create it on first start) -> refuse
to start with a one-line reason if it cannot be used (a key file others can
read, a key that does not parse, ...) -> serve waygate.certs.v1.Certs ->
ready. A timer applies CA-rotation transitions when they fall due, and the
trust bundle file (if configured) is rewritten on every change.

TLS of the certs listener, in order of precedence:
- `--tls-cert-file/--tls-key-file`: served as given (static files);
- `--serving-identity` (what `waygate up` passes): certs signs its own
  serving certificate from its CA, in memory, and renews it at 70% of its
  life without a restart. Server TLS only: Certify callers authenticate with
  a token, since they do not have a certificate yet;
- neither: plaintext, allowed only on loopback (or with --insecure).

Kubernetes (cluster mode), each part switched on by its own setting:
`--ca-secret NS/NAME` keeps the CA in a Secret instead of `--ca-dir`;
`--token-audience AUD` authenticates Certify tokens by TokenReview (static
tokens, if also configured, are tried first); `--csr-controller` signs and
approves certificates.k8s.io CSRs for Waygate's signer names;
`--bundle-configmap NS/NAME` publishes the trust bundle there. The API is
reached through `--kubeconfig`, or the pod's ServiceAccount when unset. The
Kubernetes modules are imported only when one of these is set.

Replicas (cluster mode): with `--ca-secret`, replicas elect a leader over a
Lease (`waygate.certs.leader`). Every replica serves Certify and the bundle
from the Secret, which it watches (`SecretCAStore.follow`); only the leader
writes CA state — rotation steps, the leaf-expiry bound (kept far enough
ahead that Certify never writes it), the Secret, the bundle ConfigMap and the
CSR controller's decisions — and those duties run only while it leads.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import os
import sys
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from waygate.certs.auth import Authenticator, Caller, StaticTokenAuthenticator, TokensFileError
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.bundle import TrustBundleView
from waygate.certs.castate import KEY_ALGORITHMS, PrivateKey, Upstream
from waygate.certs.csr import MAX_SANS
from waygate.certs.issuing import ISSUED_RECORDS, ISSUED_RECORDS_BYTES
from waygate.certs.policy import Policy, check_pattern
from waygate.certs.selftls import serving_certificate
from waygate.certs.server import registration
from waygate.certs.service import (
    SIGNING_QUEUE,
    SIGNING_WORKERS,
    CertsService,
    SigningExecutor,
    publish_rotation,
)
from waygate.certs.store import CAStore, DirectoryCAStore
from waygate.components import by_command
from waygate.core.errors import FailedPrecondition, WaygateError
from waygate.core.files import write_file_atomically
from waygate.core.grpcserver import GrpcServer
from waygate.core.runtime import ServiceProcess
from waygate.core.sans import identity_san
from waygate.core.settings import (
    GrpcServerSettings,
    parse_duration,
    port_number,
    positive,
    setting,
)

if TYPE_CHECKING:
    from waygate.components import UpContext

log = logging.getLogger(__name__)

CERTS = by_command(("certs", "serve"))

TRUST_DOMAIN = "waygate.local"
#: Longest sleep of the CA-rotation timer; transitions are also applied on every call.
MAX_TIMER_SLEEP = 60.0
#: How often a follower's rotation timer looks whether it leads now.
FOLLOWER_TICK = 1.0
#: After a consumer's report wakes the timer: how long to gather the burst first.
REPORT_BATCH = 0.5


def _non_negative(value: float) -> str | None:
    return None if value >= 0 else f"must not be negative, not {value}"


def _namespaced_name(value: str) -> str | None:
    namespace, sep, name = value.partition("/")
    if not sep or not namespace or not name or "/" in name:
        return f"{value!r} is not a reference of the form NAMESPACE/NAME"
    return None


def _at_least_one(value: int) -> str | None:
    return None if value >= 1 else f"must be at least 1, not {value}"


def _patterns(value: tuple[str, ...]) -> str | None:
    for item in value:
        problem = check_pattern(item)
        if problem:
            return problem
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings(GrpcServerSettings):
    grpc_port: int = setting(CERTS.port("grpc_port"), help="gRPC listen port", check=port_number)
    admin_port: int = setting(
        CERTS.port("admin_port"),
        help="admin HTTP port (/metrics /healthz /readyz)",
        check=port_number,
    )
    ca_dir: Path = setting(
        Path(".waygate/certs"),
        help="directory holding the CA (created 0700 on first start; key files must be 0600)",
    )
    tokens_file: Path | None = setting(
        None,
        help="YAML file of static Certify tokens (mode 0600); unset: no static tokens",
    )
    trust_domain: str = setting(TRUST_DOMAIN, help="SPIFFE trust domain of issued identities")
    node_agents: tuple[str, ...] = setting(
        (),
        help="ServiceAccounts (NS/SA, comma-separated; e.g. the tunnel agent DaemonSet's) whose "
        "pod-bound tokens may also get dns:NODE for the pod's own node (TokenReview only)",
        check=lambda v: next(
            (f"{a!r} is not NS/SA" for a in v if a.count("/") != 1 or "" in a.split("/")), None
        ),
    )
    key_algorithm: str = setting("ecdsa-p256", help="key type of a new CA", choices=KEY_ALGORITHMS)
    ca_lifetime: float = setting(
        365 * 86400.0, help="lifetime of a new CA certificate", parse=parse_duration, check=positive
    )
    leaf_lifetime: float = setting(
        86400.0,
        help="default lifetime of issued certificates",
        parse=parse_duration,
        check=positive,
    )
    max_leaf_lifetime: float = setting(
        7 * 86400.0,
        help="longest lifetime a caller may ask for (longer: INVALID_ARGUMENT)",
        parse=parse_duration,
        check=positive,
    )
    clock_skew: float = setting(
        300.0,
        help="how far not_before is backdated, for peers with a slow clock",
        parse=parse_duration,
        check=_non_negative,
    )
    propagation_delay: float = setting(
        3600.0,
        help="least wait between publishing a new CA and signing with it (signing also "
        "waits for every live trust consumer to report the new CA)",
        parse=parse_duration,
        check=_non_negative,
    )
    consumer_ttl: float = setting(
        86400.0,
        help="a trust consumer silent this long no longer holds a CA rotation step",
        parse=parse_duration,
        check=positive,
    )
    consumer_settle: float = setting(
        90.0,
        help="a rotation resumed at start or by a new leader waits this long for the "
        "trust consumers to report before judging their acknowledgements",
        parse=parse_duration,
        check=_non_negative,
    )
    leaf_bound_step: float = setting(
        3600.0,
        help="the latest leaf expiry per CA is stored this far ahead of the truth (one "
        "store write per step, not per leaf); with replicas, an old CA retires no sooner "
        "than this after its last leaf",
        parse=parse_duration,
        check=positive,
    )
    bundle_file: Path | None = setting(
        None, help="write the trust bundle PEM here (0644), rewritten on every change"
    )
    ca_cert: Path | None = setting(
        None,
        help="upstream authority: sign with this intermediate CA certificate (PEM), "
        "issued by --trust-anchor; a new one starts a CA rotation to it",
    )
    ca_key: Path | None = setting(
        None, help="upstream authority: the intermediate's private key (PEM, mode 0600)"
    )
    trust_anchor: Path | None = setting(
        None,
        help="upstream authority: the organisation's root (PEM) that issued --ca-cert; "
        "the trust bundle publishes it",
    )
    max_sans_per_csr: int = setting(
        MAX_SANS,
        help="most subject alternative names one CSR may ask for (more: INVALID_ARGUMENT)",
        check=positive,
    )
    issued_records: int = setting(
        ISSUED_RECORDS,
        help="records of issued certificates kept in memory for ListIssued "
        "(past it, expired records go first, then the oldest)",
        check=positive,
    )
    issued_records_bytes: int = setting(
        ISSUED_RECORDS_BYTES,
        help="estimated bytes the ListIssued records may take (same dropping rule)",
        check=positive,
    )
    signing_workers: int = setting(
        SIGNING_WORKERS,
        help="threads that check and sign the slow CSRs (large, P-384, an RSA CA), off the "
        "event loop",
        check=positive,
    )
    signing_queue: int = setting(
        SIGNING_QUEUE,
        help="Certify calls that may wait for a signing thread (more: RESOURCE_EXHAUSTED)",
        check=_non_negative,
    )
    serving_identity: str | None = setting(
        None,
        help="identity of certs' own serving certificate, signed by its CA and renewed in place "
        "(e.g. spiffe://waygate.local/ns/local/sa/certs); unset: use --tls-cert-file or plaintext",
    )
    serving_sans: tuple[str, ...] = setting(
        (),
        help="extra SANs of certs' own serving certificate, comma separated (dns:NAME, ip:ADDR, uri:URI)",
        check=_patterns,
    )

    kubeconfig: Path | None = setting(
        None,
        help="kubeconfig for the Kubernetes API (Kubernetes features only); "
        "unset: the pod's ServiceAccount",
    )
    ca_secret: str | None = setting(
        None,
        help="keep the CA in this Kubernetes Secret, NAMESPACE/NAME, instead of ca_dir",
        check=_namespaced_name,
    )
    token_audience: str | None = setting(
        None,
        help="authenticate Certify tokens by Kubernetes TokenReview with this audience "
        "(projected ServiceAccount tokens)",
    )
    bundle_configmap: str | None = setting(
        None,
        help="publish the trust bundle as key ca.pem of this ConfigMap, NAMESPACE/NAME, "
        "rewritten on every change",
        check=_namespaced_name,
    )
    csr_controller: bool = setting(
        False,
        help="sign and approve certificates.k8s.io CSRs for waygate.io/workload, "
        "waygate.io/tunnel-agent and waygate.io/tunnel-server",
    )
    tunnel_server_account: str | None = setting(
        None,
        help="ServiceAccount NAMESPACE/NAME allowed to use the waygate.io/tunnel-server signer",
        check=_namespaced_name,
    )
    tunnel_server_names: tuple[str, ...] = setting(
        (),
        help="SANs the tunnel server may get through its signer, comma separated "
        "(dns:NAME, ip:ADDR, uri:URI)",
        check=_patterns,
    )
    workers: int = setting(
        1,
        help="processes serving the gRPC port together (SO_REUSEPORT); this process then "
        "writes CA state and serves the admin port for all of them",
        check=_at_least_one,
    )
    worker: bool = setting(
        False,
        help="internal: run as one worker of a --workers group (follows the CA, never "
        "writes it; metrics reported to the parent on stdout)",
    )
    writer_address: str | None = setting(
        None,
        help="internal: loopback host:port of the --workers parent, where a worker "
        "forwards RotateCA",
    )
    leader_election: bool = setting(
        True,
        help="with ca_secret: elect a leader over a coordination.k8s.io Lease so several "
        "replicas can serve (only the leader writes CA state); false: run one replica only",
    )
    leader_lease: str | None = setting(
        None,
        help="the leader-election Lease, NAMESPACE/NAME; unset: waygate-certs-leader in the "
        "CA Secret's namespace",
        check=_namespaced_name,
    )
    leader_identity: str | None = setting(
        None,
        help="this replica's holder identity in the Lease; unset: the host (pod) name and a "
        "random suffix",
    )
    lease_duration: float = setting(
        15.0,
        help="how long followers wait after the leader's last renewal before taking the Lease",
        parse=parse_duration,
        check=positive,
    )
    renew_deadline: float = setting(
        10.0,
        help="a leader that has not renewed for this long stops writing (< lease_duration)",
        parse=parse_duration,
        check=positive,
    )
    retry_period: float = setting(
        2.0,
        help="how often the leader renews and followers try to take the Lease",
        parse=parse_duration,
        check=positive,
    )

    @property
    def uses_kubernetes(self) -> bool:
        return (
            self.ca_secret is not None
            or self.token_audience is not None
            or self.bundle_configmap is not None
            or self.csr_controller
        )

    @property
    def tls_enabled(self) -> bool:
        return super().tls_enabled or self.serving_identity is not None

    def validate(self) -> str | None:
        problem = super().validate()
        if problem:
            return problem
        if self.leaf_lifetime > self.max_leaf_lifetime:
            return "invalid setting leaf_lifetime: longer than max_leaf_lifetime"
        if self.max_leaf_lifetime >= self.ca_lifetime:
            return "invalid setting max_leaf_lifetime: must be shorter than ca_lifetime"
        upstream = (self.ca_cert, self.ca_key, self.trust_anchor)
        if any(p is not None for p in upstream) and any(p is None for p in upstream):
            return "invalid setting ca_cert: give ca_cert, ca_key and trust_anchor together"
        if self.serving_identity is not None and self.tls_cert_file is not None:
            return "invalid setting serving_identity: give it or tls_cert_file, not both"
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            return (
                "invalid setting renew_deadline: leader election needs "
                "retry_period < renew_deadline < lease_duration"
            )
        if self.serving_identity is not None:
            problem = check_pattern(identity_san(self.serving_identity))
            if problem:
                return f"invalid setting serving_identity: {problem}"
        return None

    def authority_config(self) -> AuthorityConfig:
        return AuthorityConfig(
            trust_domain=self.trust_domain,
            key_algorithm=self.key_algorithm,
            ca_lifetime=timedelta(seconds=self.ca_lifetime),
            default_lifetime=timedelta(seconds=self.leaf_lifetime),
            max_lifetime=timedelta(seconds=self.max_leaf_lifetime),
            backdate=timedelta(seconds=self.clock_skew),
            propagation_delay=timedelta(seconds=self.propagation_delay),
            consumer_ttl=timedelta(seconds=self.consumer_ttl),
            consumer_settle=timedelta(seconds=self.consumer_settle),
            leaf_bound_step=timedelta(seconds=self.leaf_bound_step),
            max_sans=self.max_sans_per_csr,
            issued_records=self.issued_records,
            issued_records_bytes=self.issued_records_bytes,
        )


class _NoTokens:
    """The authenticator when no tokens file is configured: nobody authenticates."""

    async def authenticate(self, token: str) -> Caller | None:
        return None


class _FirstOf:
    """Try several authenticators in order; the first that knows the token wins."""

    def __init__(self, authenticators: list[Authenticator]) -> None:
        self._authenticators = authenticators

    async def authenticate(self, token: str) -> Caller | None:
        for authenticator in self._authenticators:
            caller = await authenticator.authenticate(token)
            if caller is not None:
                return caller
        return None


def build_authenticator(settings: Settings, kube_api: Any = None) -> Authenticator:
    authenticators: list[Authenticator] = []
    if settings.tokens_file is not None:
        try:
            authenticators.append(StaticTokenAuthenticator.from_file(settings.tokens_file))
        except TokensFileError as exc:
            raise FailedPrecondition(str(exc)) from None
    if settings.token_audience is not None:
        from waygate.certs.kube_auth import TokenReviewAuthenticator

        authenticators.append(
            TokenReviewAuthenticator(kube_api, audiences=(settings.token_audience,))
        )
    if not authenticators:
        log.warning("no tokens file and no token audience: every Certify call is UNAUTHENTICATED")
        return _NoTokens()
    return authenticators[0] if len(authenticators) == 1 else _FirstOf(authenticators)


def build_policy(settings: Settings, kube_api: Any = None) -> Policy:
    """The policy; with Kubernetes, ServiceAccounts' Service names are checked against
    the Services the API server holds (per-workload names)."""
    if kube_api is None:
        return Policy(settings.trust_domain, node_agents=settings.node_agents)
    from waygate.certs.kube_auth import KubeServiceDirectory

    return Policy(
        settings.trust_domain,
        services=KubeServiceDirectory(kube_api),
        node_agents=settings.node_agents,
    )


def build_store(settings: Settings, kube_api: Any = None, elector: Any = None) -> CAStore:
    if settings.ca_secret is None:
        return DirectoryCAStore(settings.ca_dir)
    from waygate.certs.kube_store import SecretCAStore

    namespace, _, name = settings.ca_secret.partition("/")
    return SecretCAStore(kube_api, namespace, name, writer=elector)


def build_elector(settings: Settings, kube_api: Any) -> Any:
    """The Lease elector, in cluster mode with leader election on; else None."""
    if settings.ca_secret is None or not settings.leader_election:
        return None
    from waygate.certs.leader import certs_elector
    from waygate.core.leader import LeaseTiming, default_identity

    lease = settings.leader_lease or (
        f"{settings.ca_secret.partition('/')[0]}/waygate-certs-leader"
    )
    namespace, _, name = lease.partition("/")
    return certs_elector(
        kube_api,
        namespace,
        name,
        identity=settings.leader_identity or default_identity(),
        timing=LeaseTiming(settings.lease_duration, settings.renew_deadline, settings.retry_period),
    )


def secret_upstream(settings: Settings, files: dict[str, bytes] | None) -> Upstream | None:
    """The upstream authority given in the --ca-secret Secret (keys tls.crt, tls.key,
    ca.crt, as cert-manager writes a CA Secret), when no --ca-cert is given; None when
    the Secret holds none of them. FailedPrecondition when it holds some only, or one
    that cannot be used."""
    from waygate.certs.kube_store import UPSTREAM_KEYS

    if settings.ca_cert is not None or not files:
        return None
    present = [k for k in UPSTREAM_KEYS if files.get(k)]
    if not present:
        return None
    where = f"--ca-secret {settings.ca_secret}"
    if len(present) != len(UPSTREAM_KEYS):
        missing = ", ".join(k for k in UPSTREAM_KEYS if k not in present)
        raise FailedPrecondition(
            f"{where} holds an upstream authority without {missing}: give tls.crt "
            "(the intermediate), tls.key (its key) and ca.crt (the root) together"
        )
    try:
        cert = x509.load_pem_x509_certificate(files["tls.crt"])
        anchor = x509.load_pem_x509_certificate(files["ca.crt"])
    except ValueError as exc:
        raise FailedPrecondition(
            f"{where}: tls.crt or ca.crt is not a PEM certificate: {exc}"
        ) from None
    try:
        key = serialization.load_pem_private_key(files["tls.key"], password=None)
    except (ValueError, TypeError) as exc:
        raise FailedPrecondition(f"{where}: tls.key is not a PEM private key: {exc}") from None
    if not isinstance(key, PrivateKey):
        raise FailedPrecondition(f"{where}: tls.key is of an unsupported type")
    return Upstream(key, cert, anchor, f"{where} (tls.crt)")


def load_upstream(settings: Settings) -> Upstream | None:
    """The upstream authority's intermediate, key and root from their files; None when
    not configured. FailedPrecondition naming the file that cannot be used."""
    if settings.ca_cert is None or settings.ca_key is None or settings.trust_anchor is None:
        return None

    def read(path: Path, what: str) -> bytes:
        try:
            return path.read_bytes()
        except OSError as exc:
            raise FailedPrecondition(f"cannot read {what} {path}: {exc.strerror}") from None

    mode = settings.ca_key.stat().st_mode & 0o777 if settings.ca_key.exists() else 0
    if mode & 0o077:
        raise FailedPrecondition(
            f"--ca-key {settings.ca_key} has mode {mode:04o}: it must be readable by its "
            f"owner only (chmod 600 {settings.ca_key})"
        )
    try:
        cert = x509.load_pem_x509_certificate(read(settings.ca_cert, "--ca-cert"))
        anchor = x509.load_pem_x509_certificate(read(settings.trust_anchor, "--trust-anchor"))
    except ValueError as exc:
        raise FailedPrecondition(
            f"--ca-cert or --trust-anchor is not a PEM certificate: {exc}"
        ) from None
    try:
        key = serialization.load_pem_private_key(read(settings.ca_key, "--ca-key"), password=None)
    except (ValueError, TypeError) as exc:
        raise FailedPrecondition(
            f"--ca-key {settings.ca_key} is not a PEM private key: {exc}"
        ) from None
    if not isinstance(key, PrivateKey):
        raise FailedPrecondition(f"--ca-key {settings.ca_key} is of an unsupported type")
    return Upstream(key, cert, anchor, f"--ca-cert {settings.ca_cert}")


async def open_authority(settings: Settings, store: CAStore, elector: Any) -> Authority:
    """Load the CA; with an elector, only the leader may create the first one."""
    upstream = load_upstream(settings)
    while True:
        # Loading may generate a key, touch the disk or the API: keep the loop free meanwhile.
        files = await asyncio.to_thread(store.load)
        upstream = upstream or secret_upstream(settings, getattr(store, "upstream", None))
        if files is not None or elector is None or elector.is_leader():
            return await asyncio.to_thread(
                functools.partial(
                    Authority.open, store, settings.authority_config(), upstream=upstream
                )
            )
        log.info("no CA stored yet; waiting for the leader to create it")
        await asyncio.sleep(settings.retry_period)


def kube_api_for(settings: Settings) -> Any:
    """The Kubernetes API client, when a Kubernetes feature is on; else None."""
    if not settings.uses_kubernetes:
        return None
    from waygate.certs.kube_api import KubeAPI, load_api_client

    return KubeAPI(load_api_client(settings.kubeconfig))


def csr_controller(
    settings: Settings, kube_api: Any, authority: Authority, signing: SigningExecutor | None = None
) -> Any:
    from waygate.certs.kube_csr import CSRController, SignerRules

    account = None
    if settings.tunnel_server_account is not None:
        namespace, _, name = settings.tunnel_server_account.partition("/")
        account = (namespace, name)
    rules = SignerRules(
        policy=build_policy(settings, kube_api),
        max_lifetime=timedelta(seconds=settings.max_leaf_lifetime),
        tunnel_server_account=account,
        tunnel_server_names=settings.tunnel_server_names,
        max_sans=settings.max_sans_per_csr,
    )
    return CSRController(kube_api, authority, rules, signing=signing)


def write_bundle_file(path: Path, bundle: TrustBundleView) -> None:
    """Atomically replace `path` with the bundle PEM, mode 0644 (public data)."""
    write_file_atomically(path, bundle.pem.encode(), 0o644)


async def run_transitions(
    authority: Authority, elector: Any = None, wake: asyncio.Event | None = None
) -> None:
    """Take CA-rotation steps when due, so watchers hear of them without a call,
    and (the leader, or the only replica) rotate the CA by itself before it nears
    expiry. In a worker thread: a step may write the store. `wake`: set by a
    consumer's report that may open a step waiting for consumers."""
    leading = False
    while True:
        if elector is not None and not elector.is_leader():
            # A follower takes no step (it adopts the leader's), and its timer has no
            # due moment: it looks again soon, to start the moment it leads.
            leading = False
            authority.stop_judging()
            await asyncio.sleep(FOLLOWER_TICK)
            continue
        due = authority.next_transition()
        now = datetime.now(UTC)
        wait = MAX_TIMER_SLEEP if due is None else (due - now).total_seconds()
        timeout = min(max(wait, 0.2), MAX_TIMER_SLEEP)
        if not leading:
            # Just started, or just took the lead: what was published as due was a
            # follower's (nothing); look now, which publishes this leader's schedule.
            leading = True
        elif wake is None:
            await asyncio.sleep(timeout)
        else:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(wake.wait(), timeout)
            if wake.is_set():
                # Reports come in bursts after a bundle change: one step check per burst.
                await asyncio.sleep(REPORT_BATCH)
                wake.clear()
        try:
            await asyncio.to_thread(authority.rotate_if_expiring)
            publish_rotation(await asyncio.to_thread(authority.rotation_status))
        except WaygateError as exc:
            # The store refused the new state (e.g. the API is down); the authority
            # kept the old one, so the next tick tries the transition again.
            log.warning("CA rotation step not saved, retrying: %s", exc)
            await asyncio.sleep(5.0)


async def setup(process: ServiceProcess, settings: Settings) -> None:
    if settings.worker:
        await setup_worker(process, settings)
        return
    kube_api = kube_api_for(settings)
    elector = build_elector(settings, kube_api)
    if elector is not None:
        process.spawn(elector.run(), "leader-election")
    store = build_store(settings, kube_api, elector)
    if settings.workers > 1 and settings.ca_secret is None:
        from waygate.certs.leader import VersionedStore

        store = VersionedStore(store)
    authority = await open_authority(settings, store, elector)
    authority.deliver_changes_on(asyncio.get_running_loop())
    if elector is not None:
        # Only the leader takes rotation steps: it hears the consumers' reports.
        authority.steps_allowed = elector.is_leader
    # One bounded pool for every signature: Certify's and the CSR controller's.
    signing = SigningExecutor(settings.signing_workers, settings.signing_queue)
    # What only the writer of CA state does: the leader, or the only replica.
    duties: list[Callable[[], Coroutine[Any, Any, None]]] = []
    if settings.csr_controller:
        duties.append(csr_controller(settings, kube_api, authority, signing).run)
    if settings.bundle_configmap is not None:
        from waygate.certs.kube_bundle import BundlePublisher

        namespace, _, name = settings.bundle_configmap.partition("/")
        publisher = BundlePublisher(kube_api, namespace, name)
        authority.add_listener(lambda bundle: publisher.publish(bundle.pem))
        publisher.publish(authority.trust_bundle().pem)
        duties.append(publisher.run)
    if elector is None:
        if settings.workers > 1:
            from waygate.certs.leader import keep_leaf_bounds

            # Workers follow and never write: keep the bound ahead of their leaves.
            duties.append(functools.partial(keep_leaf_bounds, authority, store))
        for duty in duties:
            process.spawn(duty(), getattr(duty, "__qualname__", "certs-duty"))
    else:
        from waygate.certs import leader

        leading: list[Callable[[], Coroutine[Any, Any, None]]] = [
            functools.partial(leader.take_over, authority, store),
            functools.partial(leader.keep_leaf_bounds, authority, store),
            *duties,
        ]
        process.spawn(leader.while_leading(elector, leading), "leader-duties")
        # Every replica follows the Secret: the leader's rotations reach its signer.
        process.spawn(store.follow(authority.adopt), "ca-secret-watch")  # type: ignore[attr-defined]
    if settings.bundle_file is not None:
        bundle_file = settings.bundle_file
        write_bundle_file(bundle_file, authority.trust_bundle())
        authority.add_listener(lambda bundle: write_bundle_file(bundle_file, bundle))
    log_loaded(store, authority)
    service = CertsService(
        build_authenticator(settings, kube_api), build_policy(settings, kube_api), executor=signing
    )
    service.attach(authority)
    service.leader = elector
    process.spawn(run_transitions(authority, elector, service.reported), "ca-rotation-timer")
    from waygate.certs import page

    process.status.add("certs", page.provider(authority))
    process.on_drain(service.end_watches)
    process.on_stop(service.shutdown)  # the signing pool's threads end with the process
    if settings.workers > 1:
        await start_workers(process, settings, service)  # ready once every worker is
        return
    await serve(process, settings, service, authority)
    if elector is not None:
        from waygate.certs.leader import wait_for_leaf_bound

        await wait_for_leaf_bound(authority, elector)
    await process.mark_ready()


def log_loaded(store: CAStore, authority: Authority) -> None:
    active = authority.active_authority()
    log.info(
        "CA loaded",
        extra={
            "store": store.description,
            "fingerprint": active.fingerprint,
            "not_after": active.not_after.isoformat(),
        },
    )


async def serve(
    process: ServiceProcess,
    settings: Settings,
    service: CertsService,
    authority: Authority,
    *,
    reuse_port: bool = False,
    writer: str | None = None,
) -> None:
    """Add the gRPC server: certs' own serving certificate, static TLS or plaintext.

    `writer`: in a --workers worker, the parent's loopback address; RotateCA is
    forwarded there, with the caller's credentials, since only it writes.
    """
    credentials: Any
    if settings.serving_identity is not None:
        rotator, credentials = await serving_certificate(
            authority, settings.serving_identity, settings.serving_sans
        )
        process.spawn(rotator.run(), "serving-certificate")
    else:
        credentials = await process.server_credentials(client_auth=False)
    served = registration(service)
    if writer is not None:
        forwarding = ForwardRotateCA(served.servicer, writer)
        process.on_stop(forwarding.close)
        served = dataclasses.replace(served, servicer=forwarding)
    process.add_grpc_server(
        GrpcServer.from_settings(settings, [served], credentials=credentials, reuse_port=reuse_port)
    )


class ForwardRotateCA:
    """A worker's Certs servicer: every call its own, but RotateCA, ReportTrust and
    GetRotationStatus forwarded to the --workers parent (the writer, which takes the
    rotation's steps and so keeps the consumers' reports) with the caller's
    authorization metadata; the parent's refusal comes back as the same kind of
    error."""

    def __init__(self, servicer: Any, writer: str) -> None:
        import grpc

        from waygate.certs.v1 import certs_pb2_grpc

        self._servicer = servicer
        self._channel = grpc.aio.insecure_channel(writer)
        self._stub = certs_pb2_grpc.CertsStub(self._channel)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._servicer, name)

    async def RotateCA(self, request: Any, context: Any) -> Any:
        return await self._forward("RotateCA", request, context)

    async def ReportTrust(self, request: Any, context: Any) -> Any:
        return await self._forward("ReportTrust", request, context)

    async def GetRotationStatus(self, request: Any, context: Any) -> Any:
        return await self._forward("GetRotationStatus", request, context)

    async def _forward(self, method: str, request: Any, context: Any) -> Any:
        import grpc

        from waygate.core import errors

        metadata = [(k, v) for k, v in context.invocation_metadata() if k == "authorization"]
        remaining = context.time_remaining()
        try:
            return await getattr(self._stub, method)(
                request, metadata=metadata, timeout=remaining if remaining else 60.0
            )
        except grpc.aio.AioRpcError as exc:
            kinds: dict[Any, type[errors.WaygateError]] = {
                grpc.StatusCode.INVALID_ARGUMENT: errors.InvalidArgument,
                grpc.StatusCode.FAILED_PRECONDITION: errors.FailedPrecondition,
                grpc.StatusCode.UNAUTHENTICATED: errors.Unauthenticated,
                grpc.StatusCode.PERMISSION_DENIED: errors.PermissionDenied,
                grpc.StatusCode.RESOURCE_EXHAUSTED: errors.ResourceExhausted,
            }
            kind = kinds.get(exc.code(), errors.Unavailable)
            raise kind(exc.details() or f"the writer process answered {exc.code().name}") from None

    async def close(self) -> None:
        await self._channel.close()


async def start_workers(process: ServiceProcess, settings: Settings, service: Any) -> None:
    """The parent of a --workers group: N workers serve the gRPC port, it writes CA state.

    It also serves Certs on a loopback port of its own (plaintext, never the
    service port), where workers forward RotateCA: the one call only the
    writer can answer.
    """
    from waygate.core.workers import WorkerGroup, reserve_port

    reservation = reserve_port(settings.host, settings.grpc_port)
    port = reservation.getsockname()[1]
    writer_reservation = reserve_port("127.0.0.1", 0)
    writer_port = writer_reservation.getsockname()[1]

    async def release() -> None:
        reservation.close()
        writer_reservation.close()

    process.on_stop(release)
    process.add_grpc_server(
        GrpcServer(
            host="127.0.0.1",
            port=writer_port,
            registrations=[registration(service)],
            reuse_port=True,
        )
    )
    argv = [
        *sys.argv[1:],
        "--worker",
        "--workers",
        "1",
        "--grpc-port",
        str(port),
        "--admin-port",
        "0",
        "--writer-address",
        f"127.0.0.1:{writer_port}",
    ]
    group = WorkerGroup(
        process,
        name="certs",
        count=settings.workers,
        argv=lambda index: argv,
        shutdown_grace=settings.shutdown_grace,
    )
    await group.start()
    log.info("certs workers listening", extra={"grpc_port": port, "workers": settings.workers})


async def setup_worker(process: ServiceProcess, settings: Settings) -> None:
    """One worker of a --workers group: serves Certify and the bundle, follows the
    parent's CA state (the directory or the Secret), never writes it."""
    from waygate.certs.leader import FollowingStore, ParentWrites, wait_for_leaf_bound
    from waygate.core.workers import report_forever

    kube_api = kube_api_for(settings)
    writer = ParentWrites(os.getppid(), os.getpid())
    store: Any
    if settings.ca_secret is not None:
        from waygate.certs.kube_store import SecretCAStore

        namespace, _, name = settings.ca_secret.partition("/")
        store = SecretCAStore(kube_api, namespace, name, writer=writer)
    else:
        store = FollowingStore(DirectoryCAStore(settings.ca_dir), writer)
    authority = await asyncio.to_thread(Authority.open, store, settings.authority_config())
    # The parent takes rotation steps (reports are forwarded to it); a worker adopts them.
    authority.steps_allowed = lambda: False
    service = CertsService(
        build_authenticator(settings, kube_api),
        build_policy(settings, kube_api),
        executor=SigningExecutor(settings.signing_workers, settings.signing_queue),
    )
    service.attach(authority)
    process.on_drain(service.end_watches)
    process.on_stop(service.shutdown)  # the signing pool's threads end with the process
    process.spawn(store.follow(authority.adopt), "ca-follow")
    process.spawn(run_transitions(authority, writer), "ca-rotation-timer")
    await serve(
        process, settings, service, authority, reuse_port=True, writer=settings.writer_address
    )
    process.spawn(report_forever(lambda: process.readiness.ready), "worker-report")
    await wait_for_leaf_bound(authority, writer)
    await process.mark_ready()


def up_arguments(context: UpContext) -> list[str]:
    """Flags `waygate up` gives certs: file-backed CA, static tokens, bundle, its own TLS."""
    state = context.state_dir
    return [
        "--ca-dir",
        str(state / "certs"),
        "--tokens-file",
        str(state / "tokens.yaml"),
        "--bundle-file",
        str(state / "ca.pem"),
        "--serving-identity",
        f"spiffe://{TRUST_DOMAIN}/ns/local/sa/certs",
        "--serving-sans",
        f"dns:certs.{TRUST_DOMAIN},ip:{context.host}",
    ]
