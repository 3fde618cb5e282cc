"""ingress-nginx's access annotations and ConfigMap block lists -> a route's `RouteAccess`.

Sans-IO: `plan_access(...)` reads an Ingress's valid annotation values
(`whitelist-source-range`/`allowlist-source-range`, `denylist-source-range`,
`auth-type: basic|digest` with `auth-secret`, `auth-secret-type`,
`auth-realm`, `satisfy`, client certificates: `auth-tls-*`), the controller ConfigMap (`block-cidrs`, `block-user-agents`,
`block-referers`, the source ranges' defaults `whitelist-source-range` and
`denylist-source-range`, `use-forwarded-headers`, `forwarded-for-header`,
`proxy-real-ip-cidr`, `use-proxy-protocol`) and the Secrets it names, and
gives the Ingress's plan its `access` (the proxy decides it per request:
waygate.proxy.access) and a finding per annotation, or a refusal.

Invariants (fail closed):
- What cannot be honoured exactly refuses the Ingress, naming the annotation:
  a missing Secret, or one of another namespace; an auth-file Secret without
  its `auth` key; a password hash of a format Waygate cannot verify; digest
  authentication without a realm (nginx's digest module then asks for nothing:
  the Ingress would be open) or without a usable `user:realm:HA1` line; source
  ranges while the client address would be taken from a forwarded-for-header
  that is not a header name; an auth-tls-secret without a ca.crt of PEM certificates (or
  with a ca.crl that does not parse), in another namespace or missing; an
  auth-tls-error-page that is a path (nginx's internal redirect) rather than a URL.
- The client address is the peer's, or with use-forwarded-headers the one
  X-Forwarded-For (forwarded-for-header: Route.client_address_header) names
  through proxies in proxy-real-ip-cidr (default 0.0.0.0/0, as ingress-nginx).
  With use-proxy-protocol the peer's address is the
  PROXY header's (the proxy's --proxy-protocol), so the same rules give
  ingress-nginx's real_ip_header proxy_protocol, and with use-forwarded-headers
  its X-Forwarded-For-Proxy-Protocol rule (the header's address trusted through
  proxy-real-ip-cidr, then X-Forwarded-For).
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import ipaddress
import re
from collections.abc import Callable, Mapping
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives.serialization import Encoding

from waygate.core import digest
from waygate.core.htpasswd import hash_format_problem, parse_credentials
from waygate.core.regex import refusal as regex_refusal
from waygate.resolver.ingress_nginx.catalogue import CATALOGUE, DIGEST_DIFFERENCE, Verdict
from waygate.resolver.ingress_nginx.config import ControllerConfig
from waygate.resolver.model import ClientCertificate, ExternalAuth, RouteAccess

#: auth-tls-secret and the annotations that modify it.
AUTH_TLS = (
    "auth-tls-secret",
    "auth-tls-verify-client",
    "auth-tls-verify-depth",
    "auth-tls-error-page",
    "auth-tls-pass-certificate-to-upstream",
    "auth-tls-match-cn",
)
#: ingress-nginx's defaults (internal/ingress/annotations/authtls/main.go).
DEFAULT_VERIFY = "on"
DEFAULT_DEPTH = 1
#: Beyond any real chain; OpenSSL's own default is 100.
MAX_DEPTH = 100

JSON = dict[str, Any]
Lookup = Callable[[str, str], "JSON | None"]

#: The annotations this module decides (the plan leaves their findings to it).
ANNOTATIONS = frozenset(
    (
        "whitelist-source-range",
        "allowlist-source-range",
        "denylist-source-range",
        "auth-type",
        "auth-secret",
        "auth-secret-type",
        "auth-realm",
        "satisfy",
        *AUTH_TLS,
    )
)
UNSUPPORTED = "UnsupportedAnnotation"
#: The ConfigMap keys read here that need the client address.
ADDRESS_KEYS = ("block-cidrs",)
_DEFAULT_TRUSTED = "0.0.0.0/0"


def _split(value: str) -> tuple[str, ...]:
    return tuple(item.strip() for item in value.split(",") if item.strip())


def block_lists(config: ControllerConfig) -> tuple[tuple[str, ...], ...]:
    """(block-cidrs, block-user-agents, block-referers) of the ConfigMap."""
    return tuple(_split(config.text(key, "")) for key in ("block-cidrs", *BLOCK_VALUE_KEYS))


BLOCK_VALUE_KEYS = ("block-user-agents", "block-referers")
#: The ConfigMap's defaults of the source-range annotations.
RANGE_KEYS = ("whitelist-source-range", "denylist-source-range")


def config_problem(config: ControllerConfig) -> str:
    """Why the ConfigMap's block lists or default source ranges cannot be honoured
    ("" : they can)."""
    for key in RANGE_KEYS:
        ranges = _split(config.text(key, ""))
        problem = address_problem(config) if ranges else ""
        if problem:
            return f"ConfigMap key {key}: {problem}"
        for item in ranges:
            if not _cidr(item):
                return f"ConfigMap key {key}: {item!r} is not an address or CIDR"
    cidrs, agents, referers = block_lists(config)
    if cidrs:
        problem = address_problem(config)
        if problem:
            return f"ConfigMap key block-cidrs: {problem}"
        for item in cidrs:
            if not _cidr(item):
                return f"ConfigMap key block-cidrs: {item!r} is not an address or CIDR"
    for key, patterns in zip(BLOCK_VALUE_KEYS, (agents, referers), strict=True):
        for pattern in patterns:
            if pattern.startswith("~"):
                refused = regex_refusal(pattern[2:] if pattern.startswith("~*") else pattern[1:])
                if refused:
                    return f"ConfigMap key {key}: {pattern!r}: {refused}"
    return ""


def address_problem(config: ControllerConfig) -> str:
    """Why the client address cannot be found as ingress-nginx would ("" : it can)."""
    # use-proxy-protocol: the proxy started with --proxy-protocol makes the header's
    # address the peer's, so the rules below hold as they are (config.PROXY_PROTOCOL).
    if config.flag("use-forwarded-headers", False):
        problem = config.client_address_header()[1]
        if problem:
            return problem
        for item in _split(config.text("proxy-real-ip-cidr", _DEFAULT_TRUSTED)):
            if not _cidr(item):
                return f"proxy-real-ip-cidr: {item!r} is not an address or CIDR"
    return ""


def _cidr(text: str) -> bool:
    try:
        ipaddress.ip_network(text, strict=False)
    except ValueError:
        return False
    return True


def trusted_proxies(config: ControllerConfig) -> tuple[str, ...]:
    """proxy-real-ip-cidr with use-forwarded-headers (else none)."""
    return _trusted(config)


def _trusted(config: ControllerConfig) -> tuple[str, ...]:
    if not config.flag("use-forwarded-headers", False):
        return ()
    return _split(config.text("proxy-real-ip-cidr", _DEFAULT_TRUSTED))


def auth_client_address(auth: ExternalAuth, config: ControllerConfig) -> tuple[ExternalAuth, str]:
    """An auth-url's client address as the ConfigMap defines it (nginx's real_ip
    with use-forwarded-headers; $full_x_forwarded_for with compute-full-forwarded-for),
    and the difference to report when the proxy cannot find it so ("" : none)."""
    problem = address_problem(config)
    if problem:
        return auth, (
            "ConfigMap: honoured-with-difference (the auth service is told the peer's "
            f"address as X-Real-IP and X-Forwarded-For: {problem})"
        )
    trusted = _trusted(config)
    if not trusted:
        return auth, ""
    full = config.flag("compute-full-forwarded-for", False)
    return dataclasses.replace(auth, trusted_proxies=trusted, full_forwarded_for=full), ""


def plan_access(
    namespace: str,
    values: Mapping[str, str],
    recorded: set[str],
    config: ControllerConfig,
    secrets: Lookup,
    prefix: str,
) -> tuple[RouteAccess | None, list[tuple[str, Verdict, str, bool]], str]:
    """The access of one Ingress: (RouteAccess or None, findings as (annotation,
    verdict, note, refuses) for those in `values` not yet `recorded`, the refusal
    message or "")."""
    findings: list[tuple[str, Verdict, str, bool]] = []
    refusal = ""

    def note(short: str, verdict: Verdict, text: str = "") -> None:
        nonlocal refusal
        refuses = verdict is Verdict.NOT_HONOURED
        if short in values and short not in recorded:
            findings.append((short, verdict, text, refuses))
        if refuses and not refusal:
            refusal = f"annotation {prefix}/{short}: not honoured ({text}), and it bears on access"

    # allowlist- is the current name, whitelist- the old one (ingress-nginx reads both);
    # without either the ConfigMap's whitelist-source-range is the default, as its
    # denylist-source-range is the denylist's (ipallowlist, ipdenylist: defBackend).
    allow = _split(values.get("allowlist-source-range") or values.get("whitelist-source-range", ""))
    if "allowlist-source-range" not in values and "whitelist-source-range" not in values:
        allow = _split(config.text("whitelist-source-range", ""))
    deny = _split(values.get("denylist-source-range", config.text("denylist-source-range", "")))
    address = address_problem(config) if allow or deny else ""
    for short in ("whitelist-source-range", "allowlist-source-range", "denylist-source-range"):
        if short in values and short not in recorded:
            if address:
                note(short, Verdict.NOT_HONOURED, address)
            else:
                note(short, Verdict.HONOURED, CATALOGUE[short].note)

    auth_type = ""
    realm = ""
    credentials: tuple[str, ...] = ()
    kind = values.get("auth-type", "")
    if kind and "auth-type" not in recorded:
        problem, credentials = _credentials(namespace, values, secrets, kind == "digest")
        for short in ("auth-type", "auth-secret", "auth-secret-type", "auth-realm"):
            if problem:
                note(short, Verdict.NOT_HONOURED, problem)
            elif kind == "digest" and short == "auth-type":  # (the others: exact)
                note(short, Verdict.DIFFERENT, DIGEST_DIFFERENCE)
            else:
                note(short, CATALOGUE[short].verdict, CATALOGUE[short].note)
        auth_type = "digest" if kind == "digest" else "basic"
        realm = values.get("auth-realm", "")

    satisfy_any = values.get("satisfy") == "any"
    if "satisfy" in values and "satisfy" not in recorded:
        note("satisfy", Verdict.HONOURED, CATALOGUE["satisfy"].note)

    client_certificate = None
    if "auth-tls-secret" in values:
        problem, client_certificate = _client_certificate(namespace, values, secrets)
        for short in AUTH_TLS:
            if problem:
                note(short, Verdict.NOT_HONOURED, problem)
            else:
                note(short, Verdict.HONOURED, CATALOGUE[short].note)

    cidrs, agents, referers = block_lists(config)
    if refusal or not (
        allow or deny or auth_type or cidrs or agents or referers or client_certificate
    ):
        return None, findings, refusal
    return (
        RouteAccess(
            block=cidrs,
            deny=deny,
            allow=allow,
            block_user_agents=agents,
            block_referers=referers,
            # (digest counts failed tries per client address: the same address)
            trusted_proxies=_trusted(config)
            if allow or deny or cidrs or auth_type == "digest"
            else (),
            auth_type=auth_type,
            auth_realm=realm,
            credentials=credentials,
            satisfy_any=satisfy_any and bool(auth_type) and bool(allow or deny),
            client_certificate=client_certificate,
        ),
        findings,
        "",
    )


def _credentials(
    namespace: str, values: Mapping[str, str], secrets: Lookup, is_digest: bool = False
) -> tuple[str, tuple[str, ...]]:
    """(problem, "user:hash" lines, or "user:realm:HA1" ones for digest) of
    auth-secret, read as auth-secret-type says (auth-map: a key per user, its
    value the rest of the line, as ingress-nginx writes the file)."""
    reference = values.get("auth-secret", "")
    if not reference:
        return f"auth-type {'digest' if is_digest else 'basic'} needs auth-secret", ()
    realm = values.get("auth-realm", "")
    if realm == "off" or (is_digest and not realm):
        return (
            f"auth-type {'digest' if is_digest else 'basic'} with "
            f"{'auth-realm off' if realm else 'no auth-realm'}: nginx then asks for no "
            "credentials at all, and the Ingress would be open",
            (),
        )
    problem, name, data = annotated_secret(namespace, reference, secrets)
    if data is None:
        return problem, ()
    if values.get("auth-secret-type", "auth-file") == "auth-map":
        lines = [f"{user}:{hashed.strip()}" for user, hashed in sorted(data.items())]
    else:
        if "auth" not in data:
            return f"Secret {namespace}/{name} has no key auth (auth-secret-type auth-file)", ()
        lines = data["auth"].splitlines()
    if is_digest:
        # Lines the module cannot match are skipped, as it skips them.
        usable = tuple(line.strip() for line in lines if not digest.line_problem(line.strip()))
        if not usable:
            return f"Secret {namespace}/{name} holds no user:realm:HA1 line (htdigest)", ()
        return "", usable
    users = parse_credentials(lines)
    if not users:
        return f"Secret {namespace}/{name} holds no user", ()
    for user, hashed in users.items():
        problem = hash_format_problem(hashed)
        if problem:
            return (
                f"Secret {namespace}/{name}, user {user.decode(errors='replace')!r}: {problem}",
                (),
            )
    return "", tuple(f"{user.decode()}:{hashed}" for user, hashed in users.items())


def _client_certificate(
    namespace: str, values: Mapping[str, str], secrets: Lookup
) -> tuple[str, ClientCertificate | None]:
    """(problem, the client-certificate rules) of auth-tls-secret and its options, with
    ingress-nginx's defaults (verify "on", depth 1; a depth of 0 is 1)."""
    problem, name, data = annotated_secret(namespace, values["auth-tls-secret"], secrets)
    if data is None:
        return problem, None
    bundle = data.get("ca.crt", "")
    try:
        cas = x509.load_pem_x509_certificates(bundle.encode())
    except ValueError:
        return f"Secret {namespace}/{name} has no ca.crt of PEM certificates", None
    if not any(_is_ca(ca) for ca in cas):
        return f"Secret {namespace}/{name}: ca.crt holds no CA certificate", None
    crls = data.get("ca.crl", "")
    if crls:
        blocks = _PEM_CRL.findall(crls)
        try:
            for block in blocks:
                x509.load_pem_x509_crl(block.encode())
        except ValueError:
            blocks = []
        if not blocks:
            return f"Secret {namespace}/{name}: ca.crl is not PEM revocation lists", None
        crls = "".join(block + "\n" for block in blocks)
    depth = int(values.get("auth-tls-verify-depth", "0") or 0) or DEFAULT_DEPTH
    if not 0 < depth <= MAX_DEPTH:
        return f"auth-tls-verify-depth {depth} is not between 1 and {MAX_DEPTH}", None
    error_page = values.get("auth-tls-error-page", "")
    if error_page and "://" not in error_page:
        return (
            f"auth-tls-error-page {error_page!r}: a page of the same server (nginx's "
            "internal redirect) is not honoured; give an absolute http(s) URL",
            None,
        )
    match = values.get("auth-tls-match-cn", "")
    refused = regex_refusal(match) if match else None
    if refused:
        return f"auth-tls-match-cn {match!r}: {refused}", None
    return "", ClientCertificate(
        ca_certificates="".join(ca.public_bytes(Encoding.PEM).decode() for ca in cas),
        revocation_lists=crls,
        verify=values.get("auth-tls-verify-client", DEFAULT_VERIFY),
        depth=depth,
        error_page=error_page,
        # (the grammar admits Go's strconv.ParseBool spellings only)
        pass_certificate=values.get("auth-tls-pass-certificate-to-upstream", "false")
        in ("true", "1", "t", "TRUE", "True", "T"),
        match_subject=match,
    )


_PEM_CRL = re.compile(r"-----BEGIN X509 CRL-----[A-Za-z0-9+/=\s]+?-----END X509 CRL-----")


def _is_ca(certificate: x509.Certificate) -> bool:
    try:
        return certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return certificate.issuer == certificate.subject  # a v1 root


def annotated_secret(
    namespace: str, reference: str, secrets: Lookup
) -> tuple[str, str, dict[str, str] | None]:
    """The Secret an annotation names (NAME or NAMESPACE/NAME, of the Ingress's own
    namespace, as ingress-nginx's): ("", its name, its data decoded), or (why not,
    its name, None)."""
    secret_namespace, _, name = reference.rpartition("/")
    if secret_namespace and secret_namespace != namespace:
        return f"Secret {reference} is in another namespace than the Ingress", name, None
    secret = secrets(namespace, name)
    if secret is None:
        return f"Secret {namespace}/{name} not found", name, None
    data = secret_data(secret)
    if data is None:
        return f"Secret {namespace}/{name}: its data is not valid base64", name, None
    return "", name, data


def secret_data(secret: JSON) -> dict[str, str] | None:
    out: dict[str, str] = {}
    data = secret.get("data") or {}
    try:
        for key, value in data.items():
            out[str(key)] = base64.b64decode(str(value), validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError):
        return None
    for key, value in (secret.get("stringData") or {}).items():
        out[str(key)] = str(value)
    return out
