"""Kubernetes mode of `waygate certs serve`: the pieces `app.setup` wires in when asked.

Settings (declared in `waygate.certs.app.Settings`) choose each piece on its own:

    ca_secret NS/NAME      the CA lives in that Secret instead of ca_dir
    token_audience AUD     Certify callers may authenticate with a projected
                           ServiceAccount token for AUD (TokenReview), besides
                           any static tokens
    csr_controller         sign and approve certificates.k8s.io CSRs for the
                           waygate.io signers
    kubeconfig FILE        how to reach the API server; unset: the pod's
                           ServiceAccount (in-cluster)

The functions here only build objects; checks of setting values are
`settings`-style `check=` functions returning a reason or None.
"""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from waygate.certs.auth import Authenticator, Caller
from waygate.certs.authority import Authority
from waygate.certs.kube_api import KubeAPI, load_api_client
from waygate.certs.kube_auth import TokenReviewAuthenticator
from waygate.certs.kube_csr import CSRController, SignerRules
from waygate.certs.kube_store import SecretCAStore, parse_secret_reference
from waygate.certs.policy import Policy, check_pattern
from waygate.certs.store import CAStore, DirectoryCAStore


def secret_reference_problem(value: str) -> str | None:
    """Settings check for `ca_secret`."""
    try:
        parse_secret_reference(value)
    except ValueError as exc:
        return str(exc)
    return None


def parse_service_account(text: str) -> tuple[str, str]:
    """ "NAMESPACE/NAME" -> (namespace, name); ValueError with a reason otherwise."""
    namespace, sep, name = text.strip().partition("/")
    if not sep or not namespace or not name or "/" in name or ":" in text:
        raise ValueError(f"not a ServiceAccount: {text!r} (use NAMESPACE/NAME)")
    return namespace, name


def service_account_problem(value: str) -> str | None:
    """Settings check for `tunnel_server_service_account`."""
    try:
        parse_service_account(value)
    except ValueError as exc:
        return str(exc)
    return None


def as_san_pattern(name: str) -> str:
    """A bare name is a DNS name: "tunnel.example.com" -> "dns:tunnel.example.com"."""
    return name if ":" in name else f"dns:{name}"


def san_patterns_problem(value: tuple[str, ...]) -> str | None:
    """Settings check for `tunnel_server_names`."""
    for item in value:
        problem = check_pattern(as_san_pattern(item))
        if problem:
            return problem
    return None


def open_kube_api(kubeconfig: Path | None) -> KubeAPI:
    """The API client; FailedPrecondition with a one-line reason when it cannot be set up."""
    return KubeAPI(load_api_client(kubeconfig))


def ca_store(api: KubeAPI | None, ca_secret: str | None, ca_dir: Path) -> CAStore:
    """The Secret store when `ca_secret` is set (needs `api`), else the directory store."""
    if ca_secret is None:
        return DirectoryCAStore(ca_dir)
    if api is None:
        raise ValueError("a Secret CA store needs the Kubernetes API")
    namespace, name = parse_secret_reference(ca_secret)
    return SecretCAStore(api, namespace, name)


class FirstAuthenticated:
    """An Authenticator trying several in order; the first Caller found wins.

    Static tokens go first: they are checked locally in constant time, and a
    projected token never matches one, so it costs one comparison per entry.
    """

    def __init__(self, *authenticators: Authenticator) -> None:
        self._authenticators = authenticators

    async def authenticate(self, token: str) -> Caller | None:
        for authenticator in self._authenticators:
            caller = await authenticator.authenticate(token)
            if caller is not None:
                return caller
        return None


def with_token_review(static: Authenticator, api: KubeAPI, audience: str) -> Authenticator:
    return FirstAuthenticated(static, TokenReviewAuthenticator(api, audiences=(audience,)))


def csr_controller(
    api: KubeAPI,
    authority: Authority,
    *,
    trust_domain: str,
    max_lifetime: timedelta,
    tunnel_server_service_account: str,
    tunnel_server_names: tuple[str, ...],
) -> CSRController:
    rules = SignerRules(
        policy=Policy(trust_domain),
        max_lifetime=max_lifetime,
        tunnel_server_account=parse_service_account(tunnel_server_service_account),
        tunnel_server_names=tuple(as_san_pattern(name) for name in tunnel_server_names),
    )
    return CSRController(api, authority, rules)
