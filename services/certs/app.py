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
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import TYPE_CHECKING

from waygate.certs.auth import Authenticator, Caller, StaticTokenAuthenticator, TokensFileError
from waygate.certs.authority import KEY_ALGORITHMS, Authority, AuthorityConfig, TrustBundleView
from waygate.certs.policy import Policy, check_pattern, identity_name
from waygate.certs.selftls import SelfServingCertificate
from waygate.certs.server import registration
from waygate.certs.service import CertsService
from waygate.certs.store import DirectoryCAStore
from waygate.core.errors import FailedPrecondition
from waygate.core.grpcserver import GrpcServer
from waygate.core.runtime import ServiceProcess
from waygate.core.settings import (
    GrpcServerSettings,
    parse_duration,
    port_number,
    positive,
    setting,
)

if TYPE_CHECKING:
    from waygate.supervisor import UpContext

log = logging.getLogger(__name__)

TRUST_DOMAIN = "waygate.local"
#: Longest sleep of the CA-rotation timer; transitions are also applied on every call.
MAX_TIMER_SLEEP = 60.0


def _non_negative(value: float) -> str | None:
    return None if value >= 0 else f"must not be negative, not {value}"


def _patterns(value: tuple[str, ...]) -> str | None:
    for item in value:
        problem = check_pattern(item)
        if problem:
            return problem
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings(GrpcServerSettings):
    grpc_port: int = setting(7002, help="gRPC listen port", check=port_number)
    admin_port: int = setting(
        9002, help="admin HTTP port (/metrics /healthz /readyz)", check=port_number
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
        help="RotateCA's default wait between publishing a new CA and signing with it",
        parse=parse_duration,
        check=_non_negative,
    )
    bundle_file: Path | None = setting(
        None, help="write the trust bundle PEM here (0644), rewritten on every change"
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
        if self.serving_identity is not None and self.tls_cert_file is not None:
            return "invalid setting serving_identity: give it or tls_cert_file, not both"
        if self.serving_identity is not None:
            problem = check_pattern(identity_name(self.serving_identity))
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
        )

    def serving_names(self) -> tuple[str, ...]:
        assert self.serving_identity is not None
        names = [identity_name(self.serving_identity)]
        names += [n for n in self.serving_sans if n not in names]
        return tuple(names)


class _NoTokens:
    """The authenticator when no tokens file is configured: nobody authenticates."""

    async def authenticate(self, token: str) -> Caller | None:
        return None


def build_authenticator(settings: Settings) -> Authenticator:
    if settings.tokens_file is None:
        log.warning("no tokens file: every Certify call will be UNAUTHENTICATED")
        return _NoTokens()
    try:
        return StaticTokenAuthenticator.from_file(settings.tokens_file)
    except TokensFileError as exc:
        raise FailedPrecondition(str(exc)) from None


def write_bundle_file(path: Path, bundle: TrustBundleView) -> None:
    """Atomically replace `path` with the bundle PEM, mode 0644 (public data)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temp = path.with_name(f".{path.name}.tmp")
    fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    with os.fdopen(fd, "w") as handle:
        os.fchmod(handle.fileno(), 0o644)
        handle.write(bundle.pem)
        handle.flush()
        os.fsync(handle.fileno())
    os.replace(temp, path)


async def run_transitions(authority: Authority) -> None:
    """Apply CA-rotation transitions when due, so watchers hear of them without a call."""
    while True:
        due = authority.next_transition()
        now = datetime.now(UTC)
        wait = MAX_TIMER_SLEEP if due is None else (due - now).total_seconds()
        await asyncio.sleep(min(max(wait, 0.2), MAX_TIMER_SLEEP))
        authority.advance()


async def setup(process: ServiceProcess, settings: Settings) -> None:
    service = CertsService(build_authenticator(settings), Policy(settings.trust_domain))
    store = DirectoryCAStore(settings.ca_dir)
    # Loading may generate an RSA key or touch the disk: keep the loop free meanwhile.
    authority = await asyncio.to_thread(Authority.open, store, settings.authority_config())
    service.attach(authority)
    if settings.bundle_file is not None:
        bundle_file = settings.bundle_file
        write_bundle_file(bundle_file, authority.trust_bundle())
        authority.add_listener(lambda bundle: write_bundle_file(bundle_file, bundle))

    credentials = None
    if settings.serving_identity is not None:
        serving = SelfServingCertificate(
            authority, settings.serving_identity, settings.serving_names()
        )
        credentials = serving.credentials()
        process.spawn(serving.run(), "serving-certificate")
    else:
        credentials = await process.server_credentials(client_auth=False)

    process.add_grpc_server(
        GrpcServer.from_settings(settings, [registration(service)], credentials=credentials)
    )
    process.spawn(run_transitions(authority), "ca-rotation-timer")
    active = authority.active_authority()
    log.info(
        "CA loaded",
        extra={
            "store": store.description,
            "fingerprint": active.fingerprint,
            "not_after": active.not_after.isoformat(),
        },
    )
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
