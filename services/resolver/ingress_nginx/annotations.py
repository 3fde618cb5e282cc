"""One ingress-nginx Ingress -> a verdict per annotation, and route fields (or a refusal).

Sans-IO and pure: `judge(obj, ...)` reads an Ingress of the nginx class, its
annotations and the controller ConfigMap (`plan`) and its rules; `shape(plan,
routes, ...)` turns the plain routes `gateway.translate` made from its rules into
what ingress-nginx would serve, with the same route fields every other source
uses (matches, filters, sticky, balance, timeouts, TLS): one route model and one
routing engine. Across Ingresses, once all are shaped: `merge_canaries` folds
canary Ingresses into their main Ingress's routes, and `regex_hosts` makes every
Prefix path of a host with a regular-expression path one (ingress-nginx's rule).
The resolver, `waygate ingress-nginx check` and the admission webhook all judge
through `judge`.

Invariants:
- Every annotation of the prefix gets one Finding (honoured, honoured with a
  difference, no-op, not honoured), from the catalogue's entry.
- A value outside its grammar, a path outside its pathType (regular expressions
  only with use-regex), a not-honoured
  annotation that bears on access, or a snippet the ConfigMap does not allow or
  that is not the literal subset, makes the Ingress refused: its routes are
  kept with a refusal (Admitted False), their backends invalid, so nothing of
  it is served even if a status were lost. Other Ingresses are untouched.
- Snippets are parsed, never rendered: only more_set_headers,
  more_clear_headers, add_header, proxy_set_header and return with literal
  values (no `$`, no blocks, no comments) become header filters or a redirect.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final

from waygate.core import regex as linear_regex
from waygate.core.tls import policy_problem
from waygate.resolver.gateway import spec as specs
from waygate.resolver.ingress_nginx import access as nginx_access
from waygate.resolver.ingress_nginx import catalogue, proxyssl
from waygate.resolver.ingress_nginx.catalogue import CATALOGUE, SNIPPETS, Verdict
from waygate.resolver.ingress_nginx.config import (
    ANNOTATION_DEFAULT_KEYS,
    GLOBAL_AUTH,
    HEADER_KEYS,
    ControllerConfig,
    IngressNginx,
    KeyVerdict,
    config_from,
    with_plain_paths,
)
from waygate.resolver.model import (
    HSTS,
    BalancePolicy,
    Canary,
    ClientCertificate,
    Cors,
    ExternalAuth,
    ForwardedHeadersMode,
    HeaderModifier,
    InsecureEdgePolicy,
    PathMatchType,
    PathModifierType,
    RateLimit,
    Redirect,
    Rewrite,
    Route,
    RouteAccess,
    RouteFilters,
    RouteMatch,
    RouteTimeouts,
    RouteTLS,
    SameSite,
    StickySessions,
    TLSTermination,
    UrlMirror,
)

JSON = dict[str, Any]

UNSUPPORTED = "UnsupportedAnnotation"
INVALID = "InvalidAnnotation"
INVALID_PATH = "InvalidPath"
SNIPPETS_NOT_ALLOWED = "SnippetsNotAllowed"
UNSUPPORTED_CONFIG = "UnsupportedConfiguration"

_TRUE = frozenset(("true", "1", "t", "True", "TRUE", "T"))
_PROTECTED = frozenset(
    (
        "host",
        "content-length",
        "transfer-encoding",
        "connection",
        "upgrade",
        "keep-alive",
        "te",
        "trailer",
    )
)
# ingress-nginx's IsValidRegex character set for regex paths (no quotes, `;`, `#`, spaces).
_REGEX_PATH = re.compile(r"/[A-Za-z0-9\-._~/^$\[\](){}*+?|&=\\]*")
_HEADER_NAME = re.compile(r"[A-Za-z0-9_.-]{1,256}")
_HEADER_VALUE = re.compile(r"[\x20-\x7e]{0,4096}")
# ingress-nginx's customheaders.ValidHeader, which global-allowed-response-headers' names pass.
_ALLOWED_HEADER = re.compile(r"[A-Za-z0-9_-]+")
# `P(/|$)(.*)` -> `X$2`, `P/(.*)` -> `X$1`, `P(.*)` -> `X$1`: a prefix replacement.
_PREFIX_IDIOM = re.compile(r"(?P<prefix>/[A-Za-z0-9\-._~/]*?)(?P<sep>\(/\|\$\)|/)?\(\.[*+]\)")
_REDIRECT_CODES = frozenset((301, 302, 303, 307, 308))


@dataclass(frozen=True)
class Finding:
    annotation: str  # the short name ("rewrite-target")
    value: str
    verdict: Verdict
    note: str = ""
    # This finding alone keeps the Ingress from being served.
    refuses: bool = False


@dataclass
class Plan:
    """What one Ingress amounts to under ingress-nginx's rules."""

    namespace: str
    name: str
    findings: list[Finding] = field(default_factory=list)
    # "" when served; else a CamelCase reason and the message for people.
    refusal_reason: str = ""
    refusal: str = ""
    canary: bool = False
    canary_weight: int = 0
    canary_total: int = 100
    canary_header: str = ""
    canary_header_value: str = ""
    canary_header_pattern: str = ""
    canary_cookie: str = ""
    canary_legacy_affinity: bool = False  # affinity-canary-behavior: legacy
    # Flattened rule paths, then the default backend: (pathType, path), by rule_index.
    paths: list[tuple[str, str]] = field(default_factory=list)
    use_regex: bool = False
    rewrite_target: str = ""
    upstream_vhost: str = ""
    aliases: tuple[str, ...] = ()
    app_root: str = ""
    redirect: Redirect | None = None
    # permanent-redirect / temporal-redirect / a snippet's return: the target as
    # written (nginx's `return CODE URL`), the status in `redirect`.
    redirect_location: str = ""
    ssl_redirect: bool = True
    force_ssl_redirect: bool = False
    redirect_code: int = 308
    www_redirect: bool = False
    preserve_trailing_slash: bool = False
    request_set: list[tuple[str, str]] = field(default_factory=list)
    request_remove: list[str] = field(default_factory=list)
    response_set: list[tuple[str, str]] = field(default_factory=list)
    response_add: list[tuple[str, str]] = field(default_factory=list)
    response_remove: list[str] = field(default_factory=list)
    sticky: StickySessions = field(default_factory=lambda: StickySessions(disable_cookies=True))
    balance: BalancePolicy = BalancePolicy.ROUND_ROBIN
    timeouts: RouteTimeouts = field(default_factory=RouteTimeouts)
    upstream_protocol: str = ""
    request_buffering: bool = True
    backend_tls: bool = False
    # backend-protocol AUTO_HTTP: TLS to the backend only for clients that came over TLS.
    scheme_from_client: bool = False
    # proxy-ssl-secret's client certificate and CAs for the backend's TLS (None: none).
    backend_secret: proxyssl.BackendTLS | None = None
    ssl_passthrough: bool = False
    forwarded: ForwardedHeadersMode = ForwardedHeadersMode.REPLACE
    backend_server_name: str = ""
    hsts: HSTS | None = None
    access: RouteAccess | None = None  # waygate.resolver.ingress_nginx.access
    # limit-rps, limit-rpm, limit-connections, limit-burst-multiplier, limit-allowlist.
    limits: dict[str, int] = field(default_factory=dict)
    limit_allow: tuple[str, ...] = ()
    rate_limit: RateLimit | None = None
    # limit-rate / limit-rate-after in bytes (nginx's `limit_rate Nk`; 0: not paced).
    limit_rate: int = 0
    limit_rate_after: int = 0
    url_mirror: UrlMirror | None = None  # mirror-target
    external_auth: ExternalAuth | None = None
    cors: Cors | None = None
    max_request_body: int = 0
    next_upstream: str = ""
    next_upstream_tries: int = 0
    next_upstream_timeout: float = 0.0
    default_backend: str = ""
    hash_by: str = ""
    hash_subset_size: int = 0
    # service-upstream: the backends' Services' cluster IPs, not their endpoints.
    service_upstream: bool = False
    # The response-side annotations (waygate.proxy.responserewrite, .errorpages), with
    # the ConfigMap's defaults: `_responses`.
    redirect_from: str = ""
    redirect_to: str = ""
    cookie_domain: str = ""
    cookie_path: str = ""
    custom_http_errors: tuple[int, ...] = ()
    intercept_errors_disabled: bool = False
    port_in_redirects: bool = False
    connection_header: str = ""
    access_log_disabled: bool = False
    client_proxy_protocol: bool = False  # the ConfigMap's use-proxy-protocol
    # enable-opentelemetry, opentelemetry-trust-incoming-span, -operation-name (each
    # the annotation, else the ConfigMap's key): `_tracing`.
    tracing: bool = False
    trust_incoming_span: bool = True
    span_name: str = ""
    upstream_http10: bool = False  # proxy-http-version 1.0
    # The ConfigMap's ssl-protocols / ssl-ciphers (RouteTLS.protocols, .ciphers) and
    # forwarded-for-header (Route.client_address_header).
    tls_protocols: tuple[str, ...] = ()
    tls_ciphers: str = ""
    client_address_header: str = ""
    # The ConfigMap's no-tls-redirect-locations: paths never redirected to HTTPS.
    no_tls_redirect: tuple[str, ...] = ("/.well-known/acme-challenge",)
    # The ConfigMap's no-auth-locations: paths never asked of an external auth service.
    no_auth: tuple[str, ...] = ("/.well-known/acme-challenge",)
    # The ConfigMap's global-allowed-response-headers: the only custom-headers allowed.
    allowed_response_headers: tuple[str, ...] = ()
    # The controller ConfigMap's keys not honoured: "ConfigMap NS/NAME key K: not-honoured".
    config_notes: list[str] = field(default_factory=list)

    @property
    def what(self) -> str:
        return f"Ingress {self.namespace}/{self.name}"

    def refuse(self, reason: str, message: str) -> None:
        if not self.refusal_reason:
            self.refusal_reason, self.refusal = reason, f"{self.what}: {message}"

    def note(self, finding: Finding) -> None:
        self.findings.append(finding)

    @property
    def exact(self) -> bool:
        """Every annotation honoured exactly (or a no-op) and the Ingress served."""
        return not self.refusal_reason and all(
            f.verdict in (Verdict.HONOURED, Verdict.NOOP) for f in self.findings
        )

    def verdict_lines(self) -> tuple[str, ...]:
        """What is not honoured exactly, for people: "annotation: verdict (why)"."""
        return tuple(
            f"{f.annotation}: {f.verdict.value}" + (f" ({f.note})" if f.note else "")
            for f in self.findings
            if f.verdict in (Verdict.DIFFERENT, Verdict.NOT_HONOURED)
        ) + tuple(self.config_notes)


def _flag(value: str) -> bool:
    return value in _TRUE


# ---------------------------------------------------------------- judge


def judge(
    obj: JSON,
    settings: IngressNginx,
    config_maps: Mapping[tuple[str, str], JSON],
    secrets: Mapping[tuple[str, str], JSON] | None = None,
) -> tuple[Plan, specs.IngressSpec | None]:
    """One Ingress of the class under the controller ConfigMap found in `config_maps`
    (and the Secrets its annotations name, in `secrets`): its plan (refused when its
    rules do not read) and its rules (None then). The one judgement the resolver,
    the report and the admission webhook all give."""
    config = config_from(config_maps.get(settings.configmap or ("", "")))
    found = secrets or {}
    result = plan(
        obj,
        settings,
        config,
        lambda ns, n: config_maps.get((ns, n)),
        lambda ns, n: found.get((ns, n)),
    )
    rules: specs.IngressSpec | None = None
    try:
        # Paths are the plan's (checked against their pathType there).
        rules = specs.ingress(with_plain_paths(obj))
    except specs.SpecError as exc:
        result.refuse(INVALID, f"{specs.dotted(exc.where)}: {exc.reason}")
    refine(result)
    return result, rules


# ---------------------------------------------------------------- plan


def plan(
    obj: JSON,
    settings: IngressNginx,
    config: ControllerConfig,
    config_maps: Callable[[str, str], JSON | None] = lambda ns, name: None,
    secrets: Callable[[str, str], JSON | None] = lambda ns, name: None,
) -> Plan:
    """The verdicts and route fields of one Ingress of the nginx class."""
    metadata = obj.get("metadata") or {}
    result = Plan(str(metadata.get("namespace") or ""), str(metadata.get("name") or ""))
    problem = config.refusal() or nginx_access.config_problem(config)
    if problem:
        result.refuse(UNSUPPORTED_CONFIG, problem)
    where = "/".join(settings.configmap or ())
    result.config_notes = [
        f"ConfigMap {where} key {key.key}: {key.verdict.value}"
        for key in config_verdicts(config, config_maps)
        if key.verdict is Verdict.NOT_HONOURED
    ]
    raw = metadata.get("annotations") or {}
    annotations: dict[str, str] = {}
    if isinstance(raw, dict):
        for key, value in raw.items():
            short = settings.annotation(str(key))
            if short is not None:
                annotations[short] = "" if value is None else str(value)
    # Defaults from the ConfigMap, as ingress-nginx's.
    result.ssl_redirect = config.flag("ssl-redirect", True)
    result.force_ssl_redirect = config.flag("force-ssl-redirect", False)
    try:
        code = int(config.text("http-redirect-code", "308"))
    except ValueError:
        code = 308
    result.redirect_code = code if code in _REDIRECT_CODES else 308
    # (an ACME HTTP-01 challenge is answered over plain HTTP, without external
    # authentication: cert-manager's solver Ingress)
    result.no_tls_redirect, result.no_auth = (
        tuple(
            item.strip()
            for item in config.text(key, "/.well-known/acme-challenge").split(",")
            if item.strip()
        )
        for key in ("no-tls-redirect-locations", "no-auth-locations")
    )
    # ingress-nginx's X-Forwarded-*: its own values (the client's replaced) unless
    # use-forwarded-headers trusts the client's, compute-full-forwarded-for appends.
    if config.flag("use-forwarded-headers", False):
        result.forwarded = (
            ForwardedHeadersMode.APPEND
            if config.flag("compute-full-forwarded-for", False)
            else ForwardedHeadersMode.IF_NONE
        )
    result.service_upstream = config.flag("service-upstream", False)
    # server-tokens (default off: ingress-nginx's `more_clear_headers Server`), before
    # any snippet's more_set_headers, which comes after it as in nginx.
    server_set, server_remove, _ = config.server_header()
    result.response_set.extend(server_set)
    result.response_remove.extend(server_remove)
    result.tls_protocols, result.tls_ciphers, _ = config.tls_policy()
    result.client_address_header = config.client_address_header()[0]
    # configmap.go: the valid names of the list (others dropped with a warning).
    result.allowed_response_headers = tuple(
        name
        for name in (
            n.strip() for n in config.text("global-allowed-response-headers", "").split(",")
        )
        if _ALLOWED_HEADER.fullmatch(name)
    )
    if config.text("load-balance", "round_robin") == "ewma":
        result.balance = BalancePolicy.LEAST_CONN
    if config.flag("hsts", True):
        try:
            max_age = float(config.text("hsts-max-age", "31536000"))
        except ValueError:
            max_age = 31536000.0
        result.hsts = HSTS(
            max_age,
            include_subdomains=config.flag("hsts-include-subdomains", True),
            preload=config.flag("hsts-preload", False),
        )
    # limit-rate/-after: the ConfigMap's are the annotations' defaults, in KB as they
    # are rendered (`limit_rate {N}k`).
    result.limit_rate = _kilobytes(config.text("limit-rate", "0"))
    result.limit_rate_after = _kilobytes(config.text("limit-rate-after", "0"))
    # nginx's client_max_body_size as ingress-nginx sets it (1m unless the ConfigMap says).
    configured = parse_size(config.text("proxy-body-size", "1m"))
    result.max_request_body = 1024**2 if configured is None else configured
    timeouts = {
        "connect": config.seconds("proxy-connect-timeout", 5),
        "server": max(
            config.seconds("proxy-read-timeout", 60), config.seconds("proxy-send-timeout", 60)
        ),
    }
    valid: dict[str, str] = {}
    for short in sorted(annotations):
        value = annotations[short]
        entry = CATALOGUE.get(short)
        if entry is None:
            access = catalogue.is_access(short)
            result.note(
                Finding(
                    short,
                    value,
                    Verdict.NOT_HONOURED,
                    "not an ingress-nginx annotation Waygate knows",
                    refuses=access,
                )
            )
            if access:
                result.refuse(
                    UNSUPPORTED,
                    f"annotation {settings.prefix}/{short}: unknown, and it bears on access",
                )
            continue
        invalid = entry.grammar(value.strip() if entry.grammar is not catalogue.any_text else value)
        if invalid is not None:
            result.note(Finding(short, value, Verdict.NOT_HONOURED, f"invalid: {invalid}", True))
            result.refuse(INVALID, f"annotation {settings.prefix}/{short}: {invalid}")
            continue
        valid[short] = value.strip() if entry.grammar is not catalogue.any_text else value
    _response_defaults(result, config, where)
    # The ConfigMap's annotation defaults go through the annotations' own handlers
    # (an annotation of the Ingress wins); their verdicts are the ConfigMap's, not
    # the Ingress's (`config_verdicts`).
    defaults = {k: v for k, v in config_defaults(config)[0].items() if k not in annotations}
    _apply(result, {**defaults, **valid}, settings, config, config_maps, timeouts)
    result.findings = [f for f in result.findings if f.annotation not in defaults]
    _proxy_ssl_secret(result, valid, secrets, settings.prefix)
    recorded = {f.annotation for f in result.findings}
    result.access, findings, refusal = nginx_access.plan_access(
        result.namespace, valid, recorded, config, secrets, settings.prefix
    )
    for short, verdict, text, refuses in findings:
        result.note(Finding(short, valid[short], verdict, text, refuses))
    if refusal:
        result.refuse(UNSUPPORTED, refusal)
    if result.client_address_header:
        # forwarded-for-header: the proxy reads the client address from it for the
        # backend's X-Forwarded-For too, so every route carries the trusted ranges.
        trusted = nginx_access.trusted_proxies(config)
        result.access = (
            RouteAccess(trusted_proxies=trusted)
            if result.access is None
            else dataclasses.replace(result.access, trusted_proxies=trusted)
        )
    if result.access is not None and result.access.auth_type:
        # ingress-nginx's `proxy_set_header Authorization ""`: the backend never
        # sees the credentials (the auth-url service, asked first, still does).
        result.request_remove.append("Authorization")
    _rate_limit(result, config)
    _global_auth(result, valid, config)
    if result.external_auth is not None:
        result.external_auth, note = nginx_access.auth_client_address(result.external_auth, config)
        if note:
            result.config_notes.append(note)
    _responses(result, valid)
    if config.flag("retry-non-idempotent", False) and result.next_upstream != "off":
        # ingress-nginx's buildNextUpstream: non_idempotent added to every location's.
        words = (result.next_upstream or "error timeout").split()
        result.next_upstream = " ".join(dict.fromkeys((*words, "non_idempotent")))
    _config_headers(result, config, config_maps)
    # nginx's read/send timeouts also bound an upgraded (WebSocket) connection's silence.
    result.timeouts = RouteTimeouts(
        connect=timeouts["connect"], server=timeouts["server"], tunnel=timeouts["server"]
    )
    _paths(result, obj)
    return result


# ---------------------------------------------------------------- the ConfigMap's defaults


def config_defaults(config: ControllerConfig) -> tuple[dict[str, str], dict[str, str]]:
    """The ConfigMap's keys that are annotations' defaults (ANNOTATION_DEFAULT_KEYS):
    those whose value passes the annotation's grammar, and why each other does not."""
    valid: dict[str, str] = {}
    invalid: dict[str, str] = {}
    for key in sorted(ANNOTATION_DEFAULT_KEYS & config.data.keys()):
        value = str(config.data[key]).strip()
        if value == "":
            continue  # ingress-nginx's default, as an empty annotation
        problem = CATALOGUE[key].grammar(value)
        if problem is None:
            valid[key] = value
        else:
            invalid[key] = problem
    return valid, invalid


def config_verdicts(
    config: ControllerConfig, config_maps: Callable[[str, str], JSON | None]
) -> list[KeyVerdict]:
    """Every ConfigMap key's verdict: an annotation default's is the annotation's for
    that value (judged by its handler), a header key's follows the ConfigMap it names."""
    defaults, invalid = config_defaults(config)
    scratch = Plan("", "")
    _apply(scratch, defaults, IngressNginx(), config, config_maps, {"connect": 5, "server": 60})
    judged = {f.annotation: f for f in scratch.findings}
    out = []
    for item in config.verdicts():
        if item.key in invalid:
            note = f"invalid: {invalid[item.key]}; ingress-nginx's default applies"
            item = dataclasses.replace(item, verdict=Verdict.NOT_HONOURED, note=note)
        elif item.key in judged:
            found = judged[item.key]
            item = dataclasses.replace(item, verdict=found.verdict, note=found.note)
        elif item.key in HEADER_KEYS:
            item = _header_key_verdict(item, config_maps)
        elif item.key == "retry-non-idempotent" and catalogue.boolean(item.value.strip()):
            note = "invalid: must be true or false; ingress-nginx's default (false) applies"
            item = dataclasses.replace(item, verdict=Verdict.NOT_HONOURED, note=note)
        elif item.key == "retry-non-idempotent" and _flag(item.value.strip()):
            note = _NEXT_ANSWERS_NOTE.format("non_idempotent (added to every proxy-next-upstream)")
            item = dataclasses.replace(item, verdict=Verdict.DIFFERENT, note=note)
        out.append(item)
    return out


_HEADER_KEY_NOTES = {
    "add-headers": (
        "its ConfigMap's entries set on the backends' responses of every Ingress of the "
        "class, an Ingress's custom-headers and snippet headers winning; the proxy's own "
        "answers (its redirects, 404 for no route, 5xx failures) do not carry them "
        "(nginx's http-level more_set_headers is on every response)"
    ),
    "proxy-set-headers": (
        "its ConfigMap's entries set on every request to the backends of every Ingress of "
        "the class (proxy_set_header), an Ingress's own request headers winning"
    ),
}


def _header_key_headers(
    key: str, config: ControllerConfig, config_maps: Callable[[str, str], JSON | None]
) -> tuple[list[tuple[str, str]], str]:
    """add-headers / proxy-set-headers: the headers of the ConfigMap the key names
    ("NS/NAME", as ingress-nginx's store takes it), and why some are not honoured."""
    value = config.text(key, "").strip()
    if not value:
        return [], ""
    namespace = value.rpartition("/")[0]
    if not namespace or catalogue.name(value):
        return [], f"ConfigMap {value!r} not found (the value must be NAMESPACE/NAME)"
    return _configmap_headers(namespace, value, config_maps)


def _header_key_verdict(
    item: KeyVerdict, config_maps: Callable[[str, str], JSON | None]
) -> KeyVerdict:
    _, problem = _header_key_headers(
        item.key, ControllerConfig({item.key: item.value}), config_maps
    )
    if " not found" in problem:
        # ingress-nginx logs a warning and sets nothing: so does Waygate.
        note = f"{problem}: no headers, as ingress-nginx"
        return dataclasses.replace(item, verdict=Verdict.NOOP, note=note)
    if problem:
        note = f"{problem}; the ConfigMap's other headers are set"
        return dataclasses.replace(item, verdict=Verdict.NOT_HONOURED, note=note)
    verdict = Verdict.DIFFERENT if item.key == "add-headers" else Verdict.HONOURED
    return dataclasses.replace(item, verdict=verdict, note=_HEADER_KEY_NOTES[item.key])


def _config_headers(
    p: Plan, config: ControllerConfig, config_maps: Callable[[str, str], JSON | None]
) -> None:
    """add-headers and proxy-set-headers onto the route's header filters, once the
    Ingress's own are known: nginx runs the http-level more_set_headers before a
    location's (headers-more merges the parent's first), so a custom-headers or
    snippet header of the same name wins, and a cleared one stays cleared; a
    location's proxy_set_header of a name replaces the ConfigMap's."""
    response, _ = _header_key_headers("add-headers", config, config_maps)
    taken = {n.lower() for n, _ in p.response_set} | {n.lower() for n in p.response_remove}
    p.response_set = [(n, v) for n, v in response if n.lower() not in taken] + p.response_set
    request, _ = _header_key_headers("proxy-set-headers", config, config_maps)
    taken = {n.lower() for n, _ in p.request_set} | {n.lower() for n in p.request_remove}
    p.request_set = [(n, v) for n, v in request if n.lower() not in taken] + p.request_set


def _apply(
    result: Plan,
    values: Mapping[str, str],
    settings: IngressNginx,
    config: ControllerConfig,
    config_maps: Callable[[str, str], JSON | None],
    timeouts: dict[str, float],
) -> None:
    prefix = settings.prefix

    def found(short: str, verdict: Verdict | None = None, note: str | None = None) -> None:
        entry = CATALOGUE[short]
        verdict = verdict or entry.verdict
        note = entry.note if note is None else note
        refuses = verdict is Verdict.NOT_HONOURED and entry.access
        result.note(Finding(short, values[short], verdict, note, refuses))
        if refuses:
            result.refuse(
                UNSUPPORTED,
                f"annotation {prefix}/{short}: not honoured ({note}), and it bears on access",
            )

    canary = _flag(values.get("canary", "false"))
    for short, value in values.items():
        if short in SNIPPETS:
            _snippet(result, short, value, config, prefix)
            continue
        if short.startswith("canary") and short != "canary" and not canary:
            found(short, Verdict.NOOP, 'ignored without canary: "true"')
            continue
        if _is_off(short, value):
            found(short, Verdict.HONOURED, "ingress-nginx's default: nothing to do")
            continue
        primary = _DEPENDS.get(short)
        if primary is not None and not any(_in_force(p, values) for p in primary):
            found(short, Verdict.NOOP, f"without {' or '.join(primary)} it does nothing")
            continue
        if short in nginx_access.ANNOTATIONS:
            continue  # decided by nginx_access.plan_access, after the others
        if short == "proxy-ssl-secret":
            continue  # decided by _proxy_ssl_secret, once backend-protocol is known
        handler = _HANDLERS.get(short)
        if handler is None:
            found(short)
            continue
        handler(result, short, value, values, found, timeouts, config_maps)
    result.canary = canary


# Values that ask for nothing (ingress-nginx's defaults for these): honoured exactly.
_OFF: dict[str, str] = {
    "enable-modsecurity": "false",
    "enable-owasp-core-rules": "false",
    "enable-cors": "false",
    "enable-global-auth": "true",  # the ConfigMap's global-auth-url applies (if any)
    "use-port-in-redirects": "false",
    "session-cookie-secure": "false",
    "session-cookie-conditional-samesite-none": "false",
    "session-cookie-path": "/",
    "satisfy": "all",
    "auth-tls-pass-certificate-to-upstream": "false",
    "auth-always-set-cookie": "false",
    "limit-rps": "0",
    "limit-rpm": "0",
    "limit-connections": "0",
    "upstream-hash-by-subset": "false",
    "proxy-buffering": "off",
    "enable-access-log": "true",
    "proxy-redirect-from": "off",
    "proxy-cookie-domain": "off",
    "proxy-cookie-path": "off",
    "disable-proxy-intercept-errors": "false",
}
# Annotations that only modify another: without it in force they do nothing
# (ingress-nginx reads them only with it).
_EXTERNAL_AUTH = ("auth-url",)
_DEPENDS: dict[str, tuple[str, ...]] = {
    **dict.fromkeys(("auth-realm", "auth-secret", "auth-secret-type"), ("auth-type",)),
    **dict.fromkeys(
        (
            "auth-method",
            "auth-signin",
            "auth-signin-redirect-param",
            "auth-response-headers",
            "auth-request-redirect",
            "auth-proxy-set-headers",
            "auth-cache-key",
            "auth-cache-duration",
            "auth-always-set-cookie",
            "auth-keepalive",
            "auth-keepalive-share-vars",
            "auth-keepalive-requests",
            "auth-keepalive-timeout",
        ),
        _EXTERNAL_AUTH,
    ),
    **dict.fromkeys(
        (
            "auth-tls-verify-client",
            "auth-tls-verify-depth",
            "auth-tls-error-page",
            "auth-tls-pass-certificate-to-upstream",
            "auth-tls-match-cn",
        ),
        ("auth-tls-secret",),
    ),
    "limit-burst-multiplier": ("limit-rps", "limit-rpm"),
    **dict.fromkeys(
        ("limit-whitelist", "limit-allowlist"),
        ("limit-rps", "limit-rpm", "limit-connections", "limit-rate"),
    ),
    **dict.fromkeys(
        (
            "cors-allow-origin",
            "cors-allow-methods",
            "cors-allow-headers",
            "cors-expose-headers",
            "cors-allow-credentials",
            "cors-max-age",
        ),
        ("enable-cors",),
    ),
    **dict.fromkeys(
        (
            "session-cookie-path",
            "session-cookie-domain",
            "session-cookie-expires",
            "session-cookie-max-age",
            "session-cookie-secure",
            "session-cookie-conditional-samesite-none",
            "session-cookie-change-on-failure",
            "affinity-mode",
        ),
        ("affinity",),
    ),
    **dict.fromkeys(("mirror-host", "mirror-request-body"), ("mirror-target",)),
    **dict.fromkeys(
        ("upstream-hash-by-subset", "upstream-hash-by-subset-size"), ("upstream-hash-by",)
    ),
}


def _is_off(short: str, value: str) -> bool:
    off = _OFF.get(short)
    if off is None:
        return False
    if off in ("true", "false"):
        return value in _TRUE if off == "true" else value not in _TRUE
    return value == off


def _in_force(short: str, values: Mapping[str, str]) -> bool:
    value = values.get(short)
    return value is not None and value != "" and not _is_off(short, value) and value != "false"


Found = Callable[..., None]
Handler = Callable[
    [Plan, str, str, Mapping[str, str], Found, dict[str, float], Callable[[str, str], JSON | None]],
    None,
]
_HANDLERS: dict[str, Handler] = {}


def _handles(*names: str) -> Callable[[Handler], Handler]:
    def register(handler: Handler) -> Handler:
        for name in names:
            _HANDLERS[name] = handler
        return handler

    return register


@_handles("use-regex")
def _use_regex(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.use_regex = _flag(value)
    found("use-regex", None if p.use_regex else Verdict.HONOURED, None if p.use_regex else "")


@_handles("ssl-ciphers")
def _ssl_ciphers(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    problem = policy_problem((), value)
    if problem:
        found(short, Verdict.NOT_HONOURED, f"{problem}: the ConfigMap's (or the proxy's) apply")
        return
    p.tls_ciphers = value
    found(short)


@_handles("rewrite-target")
def _rewrite(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.rewrite_target = value
    found("rewrite-target")  # refined per path in `shape` (capture groups)


@_handles("app-root")
def _app_root(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.app_root = value
    found("app-root")


@_handles("x-forwarded-prefix")
def _forwarded_prefix(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if not value:
        found(short, Verdict.NOOP, "empty: no header, as ingress-nginx")
        return
    p.request_set.append(("X-Forwarded-Prefix", value))
    found(short)


@_handles("preserve-trailing-slash")
def _trailing(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.preserve_trailing_slash = _flag(value)
    found("preserve-trailing-slash", Verdict.HONOURED, "")


@_handles("server-alias")
def _alias(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.aliases = tuple(dict.fromkeys(h.strip().lower() for h in value.split(",") if h.strip()))
    found("server-alias")


@_handles("upstream-vhost")
def _vhost(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.upstream_vhost = value
    found("upstream-vhost")


@_handles("permanent-redirect", "temporal-redirect")
def _redirect(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if short == "permanent-redirect" and values.get("temporal-redirect"):
        found(short, Verdict.NOOP, "temporal-redirect takes precedence, as in ingress-nginx")
        return
    # ingress-nginx renders `return CODE URL;`: the Location is the target as written,
    # the request's own path and query not added (nginx's return appends no $args).
    p.redirect_location = value
    p.redirect = Redirect(status=_redirect_status(short, values.get(short + "-code", "")))
    found(short)


def _redirect_status(short: str, code_text: str) -> int:
    """ingress-nginx's redirect.go: the code when within 300-308 (temporal: 300-307),
    else the default (301 permanent, 302 temporal)."""
    default, highest = (302, 307) if short == "temporal-redirect" else (301, 308)
    code = int(code_text) if code_text.isdigit() else default
    return code if 300 <= code <= highest else default


@_handles("permanent-redirect-code", "temporal-redirect-code")
def _redirect_code(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    redirect = short[: -len("-code")]
    if not values.get(redirect):
        found(short, Verdict.NOOP, "without its redirect annotation it does nothing")
    elif redirect == "permanent-redirect" and values.get("temporal-redirect"):
        found(short, Verdict.NOOP, "temporal-redirect takes precedence, as in ingress-nginx")
    elif _redirect_status(redirect, value) != int(value):
        found(
            short,
            Verdict.NOOP,
            "outside 300-"
            + ("307" if redirect == "temporal-redirect" else "308")
            + ": the default code applies, as in ingress-nginx",
        )
    else:
        found(short)


@_handles("ssl-redirect", "force-ssl-redirect")
def _https_redirect(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    on = _flag(value)
    if short == "ssl-redirect":
        p.ssl_redirect = on
    else:
        p.force_ssl_redirect = on
    found(short)


@_handles("from-to-www-redirect")
def _www(p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any) -> None:
    p.www_redirect = _flag(value)
    found("from-to-www-redirect")


@_handles("affinity")
def _affinity(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    same_site = {"None": SameSite.NONE, "Strict": SameSite.STRICT, "Lax": SameSite.LAX}.get(
        values.get("session-cookie-samesite", ""), SameSite.LAX
    )
    lifetime = values.get("session-cookie-max-age") or values.get("session-cookie-expires") or "0"
    p.sticky = StickySessions(
        disable_cookies=False,
        cookie_name=values.get("session-cookie-name", "") or "INGRESSCOOKIE",
        same_site=same_site,
        cookie_path=values.get("session-cookie-path", ""),
        cookie_domain=values.get("session-cookie-domain", ""),
        cookie_max_age=min(int(lifetime), 2**31 - 1),
        cookie_secure=_flag(values.get("session-cookie-secure", "false")),
    )
    found("affinity")


@_handles(
    "session-cookie-path",
    "session-cookie-domain",
    "session-cookie-expires",
    "session-cookie-max-age",
    "session-cookie-secure",
    "session-cookie-conditional-samesite-none",
)
def _cookie_attributes(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    """Attributes of the sticky cookie (`_affinity` puts them on it)."""
    if values.get("affinity") != "cookie":
        found(short, Verdict.NOOP, "without affinity: cookie it does nothing")
    elif short == "session-cookie-expires":
        found(short, Verdict.DIFFERENT, "sent as Max-Age (the same lifetime), not a date")
    elif short == "session-cookie-conditional-samesite-none":
        found(
            short,
            Verdict.DIFFERENT,
            "SameSite=None is sent to every client (ingress-nginx leaves it out for "
            "user agents known to reject it)",
        )
    else:
        found(short, Verdict.HONOURED, "")


@_handles("session-cookie-name", "session-cookie-samesite")
def _cookie(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if values.get("affinity") != "cookie":
        found(short, Verdict.NOOP, "without affinity: cookie it does nothing")
    else:
        found(short)


@_handles("affinity-canary-behavior")
def _affinity_canary(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    """Read on the canary Ingress (ingress-nginx's mergeAlternativeBackend): `sticky`
    (the default) gives the canary the main Ingress's sticky cookie, `legacy` none."""
    if not _flag(values.get("canary", "false")):
        found(short, Verdict.NOOP, 'read on a canary Ingress only (canary: "true")')
        return
    p.canary_legacy_affinity = value == "legacy"
    found(short)


@_handles("affinity-mode")
def _affinity_mode(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if value == "persistent":
        found(short, Verdict.HONOURED, "the cookie's endpoint wins while it is live")
    else:
        found(short)


@_handles(
    "auth-url",
    "auth-method",
    "auth-signin",
    "auth-signin-redirect-param",
    "auth-response-headers",
    "auth-request-redirect",
    "auth-proxy-set-headers",
    "auth-cache-key",
    "auth-cache-duration",
    "auth-keepalive",
    "auth-keepalive-share-vars",
    "auth-keepalive-requests",
    "auth-keepalive-timeout",
    "auth-always-set-cookie",
)
def _external_auth(
    p: Plan,
    short: str,
    value: str,
    values: Mapping[str, str],
    found: Found,
    timeouts: dict[str, float],
    config_maps: Callable[[str, str], JSON | None],
) -> None:
    """internal/ingress/annotations/authreq: the auth subrequest's settings, gathered
    on the auth-url's turn (the others only modify it)."""
    if short.startswith("auth-keepalive"):
        found(short, Verdict.NOOP, "the subrequest's connection is the proxy's own")
        return
    if short != "auth-url":
        found(short, Verdict.HONOURED, "")
        return
    set_headers: list[tuple[str, str]] = []
    source = values.get("auth-proxy-set-headers", "")
    if source:
        set_headers, problem = _configmap_headers(p.namespace, source, config_maps)
        if problem:
            found(short, Verdict.NOT_HONOURED, f"auth-proxy-set-headers: {problem}")
            return
    p.external_auth = ExternalAuth(
        url=value,
        method=values.get("auth-method", "").upper(),
        signin=values.get("auth-signin", ""),
        signin_redirect_param=values.get("auth-signin-redirect-param", "") or "rd",
        response_headers=tuple(
            item.strip()
            for item in values.get("auth-response-headers", "").split(",")
            if item.strip()
        ),
        request_redirect=values.get("auth-request-redirect", ""),
        proxy_set_headers=tuple(set_headers),
        cache_key=values.get("auth-cache-key", ""),
        cache_durations=_cache_durations(values.get("auth-cache-duration", "") or "200 202 401 5m")
        if values.get("auth-cache-key")
        else (),
        always_set_cookie=_flag(values.get("auth-always-set-cookie", "false")),
    )
    if value.startswith("https://"):
        found(short, Verdict.DIFFERENT, catalogue.AUTH_URL_TLS)
    else:
        found(short)


def _global_auth(p: Plan, values: Mapping[str, str], config: ControllerConfig) -> None:
    """The ConfigMap's global-auth-url (and friends) for an Ingress without auth-url
    of its own, unless `enable-global-auth: "false"` (ingress-nginx's rule)."""
    url = config.text("global-auth-url", "").strip()
    if not url or p.external_auth is not None or "auth-url" in values:
        return
    if not _flag(values.get("enable-global-auth", "true")):
        return
    given: dict[str, str] = {}
    for key in GLOBAL_AUTH:
        value = config.text(f"global-auth-{key}", "").strip()
        if not value:
            continue
        problem = CATALOGUE[f"auth-{key}"].grammar(value)
        if problem is not None:
            p.refuse(UNSUPPORTED_CONFIG, f"ConfigMap key global-auth-{key}: {problem}")
            return
        given[key] = value
    if url.startswith("https://"):
        p.config_notes.append(
            f"ConfigMap key global-auth-url: honoured-with-difference ({catalogue.AUTH_URL_TLS})"
        )
    p.external_auth = ExternalAuth(
        url=url,
        method=given.get("method", "").upper(),
        signin=given.get("signin", ""),
        signin_redirect_param=given.get("signin-redirect-param", "") or "rd",
        response_headers=tuple(
            item.strip() for item in given.get("response-headers", "").split(",") if item.strip()
        ),
        request_redirect=given.get("request-redirect", ""),
        cache_key=given.get("cache-key", ""),
        cache_durations=_cache_durations(given.get("cache-duration", "") or "200 202 401 5m")
        if given.get("cache-key")
        else (),
        always_set_cookie=_flag(given.get("always-set-cookie", "false")),
    )


_NGINX_TIME = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _cache_durations(value: str) -> tuple[tuple[int, float], ...]:
    """auth-cache-duration as nginx's proxy_cache_valid reads each entry: status
    codes then a time; a time alone is for 200, 301 and 302."""
    found: list[tuple[int, float]] = []
    for item in value.split(","):
        words = item.split()
        if not words:
            continue
        time = words[-1]
        unit = time[-1] if time[-1] in _NGINX_TIME else "s"
        seconds = float(time.rstrip("smhd")) * _NGINX_TIME[unit]
        codes = [int(w) for w in words[:-1]] or [200, 301, 302]
        found += [(code, seconds) for code in codes]
    return tuple(found)


@_handles(
    "limit-rps",
    "limit-rpm",
    "limit-connections",
    "limit-burst-multiplier",
    "limit-whitelist",
    "limit-allowlist",
)
def _limits(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if short in ("limit-whitelist", "limit-allowlist"):
        p.limit_allow += tuple(item.strip() for item in value.split(",") if item.strip())
        found(short, Verdict.HONOURED, "")
    elif int(value) < 0:
        found(short, Verdict.NOT_HONOURED, "a negative limit")
    else:
        p.limits[short] = int(value)
        found(short, Verdict.HONOURED, "per proxy replica, keyed by the client address")


def _kilobytes(value: str) -> int:
    """An ingress-nginx KB count (`limit_rate {N}k`) in bytes; 0 when not one."""
    return int(value) * 1024 if value.isdigit() and len(value) <= 9 else 0


@_handles("limit-rate", "limit-rate-after")
def _limit_rate(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if int(value) < 0:
        found(short, Verdict.NOT_HONOURED, "a negative size")
        return
    if short == "limit-rate":
        p.limit_rate = int(value) * 1024
    else:
        p.limit_rate_after = int(value) * 1024
    if not p.limit_rate and short == "limit-rate-after" and not values.get("limit-rate"):
        found(short, Verdict.NOOP, "without limit-rate it does nothing")
    elif int(value) == 0:
        found(short, Verdict.HONOURED, "0: not paced")
    else:
        found(short)


@_handles("mirror-target")
def _mirror(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    """ingress-nginx's mirror location (mirror/main.go): Host the mirror-host, else the
    URL's host; the body unless mirror-request-body is off."""
    others = sorted(set(re.findall(r"\$[a-z_]+", value)) - {"$request_uri"})
    if others:
        found(short, Verdict.NOT_HONOURED, f"{others[0]}: only $request_uri is filled in")
        return
    p.url_mirror = UrlMirror(
        target=value,
        host=values.get("mirror-host", ""),
        request_body=values.get("mirror-request-body", "on") != "off",
    )
    found(short)


def _rate_limit(p: Plan, config: ControllerConfig) -> None:
    """The route's limits, with the ConfigMap's answers (503 unless it says)."""
    limits = p.limits
    if not (limits.get("limit-rps") or limits.get("limit-rpm") or limits.get("limit-connections")):
        return

    def status(key: str) -> int:
        text = config.text(key, "503")
        return int(text) if text.isdigit() and 400 <= int(text) <= 599 else 503

    p.rate_limit = RateLimit(
        rps=limits.get("limit-rps", 0),
        rpm=limits.get("limit-rpm", 0),
        burst_multiplier=limits.get("limit-burst-multiplier", 5) or 1,
        connections=limits.get("limit-connections", 0),
        allow=p.limit_allow,
        request_status=status("limit-req-status-code"),
        connection_status=status("limit-conn-status-code"),
    )


@_handles("load-balance")
def _balance(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if value == "ewma":
        p.balance = BalancePolicy.LEAST_CONN
        found("load-balance", Verdict.DIFFERENT, "ewma becomes leastconn")
    else:
        p.balance = BalancePolicy.ROUND_ROBIN
        found("load-balance", Verdict.HONOURED, "")


# The nginx variables the proxy computes exactly (waygate.proxy.hashkey).
_HASH_VARIABLE = re.compile(r"\$(request_uri|host|(http|cookie|arg)_[a-z0-9_]+)")


def _hash_key(value: str | None) -> str | None:
    """upstream-hash-by's value as the route's hash_by ("": the client address);
    None when the proxy cannot compute it."""
    if value in ("$remote_addr", "$binary_remote_addr"):
        return ""
    return value if value is not None and _HASH_VARIABLE.fullmatch(value) else None


# ingress-nginx's upstream-hash-by-subset-size when unset or 0.
_SUBSET_SIZE = 3


def _subset_size(values: Mapping[str, str]) -> int:
    """Endpoints per subset with upstream-hash-by-subset in force (0: no subsets)."""
    if not _flag(values.get("upstream-hash-by-subset", "false")):
        return 0
    return int(values.get("upstream-hash-by-subset-size") or 0) or _SUBSET_SIZE


@_handles("upstream-hash-by")
def _hash(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    key = _hash_key(value)
    subsets = _subset_size(values)
    if key is not None:
        p.balance = BalancePolicy.SOURCE
        p.hash_by = key
        p.hash_subset_size = subsets
    if key == "":
        found(
            "upstream-hash-by",
            Verdict.DIFFERENT,
            "the proxy's source balancing: a hash of the client address",
        )
    elif key is not None and subsets:
        found(
            "upstream-hash-by",
            Verdict.HONOURED,
            f"consistent hashing of {value} to a subset of endpoints (upstream-hash-by-subset)",
        )
    elif key is not None:
        found(
            "upstream-hash-by",
            Verdict.DIFFERENT,
            f"consistent hashing of {value} with bounded loads (the proxy's source "
            "balancing): an overloaded endpoint's keys spill to the next one",
        )
    else:
        found(
            "upstream-hash-by",
            Verdict.NOT_HONOURED,
            "only $remote_addr, $request_uri, $host, $http_*, $cookie_* and $arg_* are honoured",
        )


@_handles("upstream-hash-by-subset", "upstream-hash-by-subset-size")
def _hash_subset(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    """The subset itself is set with upstream-hash-by (`_hash`): here the verdicts."""
    if not _subset_size(values):
        found(short, Verdict.NOOP, "without upstream-hash-by-subset it does nothing")
    elif _hash_key(values.get("upstream-hash-by")) is None:
        found(short, Verdict.NOT_HONOURED, "its upstream-hash-by variable is not honoured")
    else:
        found(short)


@_handles("backend-protocol")
def _protocol(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    protocol = value.upper()
    if protocol == "HTTP":
        found("backend-protocol", Verdict.HONOURED, "")
    elif protocol == "GRPC":
        p.upstream_protocol = "grpc"
        found("backend-protocol", Verdict.HONOURED, "")
    elif protocol in ("HTTPS", "GRPCS", "AUTO_HTTP"):
        p.backend_tls = True
        p.upstream_protocol = "grpc" if protocol == "GRPCS" else ""
        p.scheme_from_client = protocol == "AUTO_HTTP"
        p.backend_server_name = values.get("proxy-ssl-name", "")
        found("backend-protocol", *_verification(protocol, values, ""))
    else:
        found("backend-protocol", Verdict.NOT_HONOURED, f"{protocol} backends are not honoured")


_AUTO_HTTP = (
    "per request: HTTPS to the backend when the client came over HTTPS, plain HTTP "
    "otherwise (nginx's $scheme://); "
)


def _verification(protocol: str, values: Mapping[str, str], ca_from: str) -> tuple[Verdict, str]:
    """backend-protocol HTTPS, GRPCS or AUTO_HTTP's verdict: how the backend's
    certificate is verified (`ca_from`: the Secret whose ca.crt it chains to; "": the
    system CAs), against nginx's proxy_ssl_verify (off unless proxy-ssl-verify on,
    which ingress-nginx reads only with proxy-ssl-secret)."""
    scheme = _AUTO_HTTP if protocol == "AUTO_HTTP" else ""
    if not ca_from:
        return Verdict.DIFFERENT, (
            scheme + "the backend's certificate is verified against the system CAs "
            "(nginx's default does not verify)"
        )
    against = f"the backend's certificate is verified against Secret {ca_from}'s ca.crt"
    if values.get("proxy-ssl-verify") != "on":
        return Verdict.DIFFERENT, f"{scheme}{against} though proxy-ssl-verify is off"
    if not values.get("proxy-ssl-name"):
        return Verdict.DIFFERENT, (
            f"{scheme}{against} for SERVICE.NAMESPACE.svc (without proxy-ssl-name nginx "
            "verifies the name upstream_balancer)"
        )
    return Verdict.HONOURED, scheme + against


def _proxy_ssl_secret(
    p: Plan, values: Mapping[str, str], secrets: Callable[[str, str], JSON | None], prefix: str
) -> None:
    """proxy-ssl-secret, read once backend-protocol is known (`proxyssl.read_secret`).
    A Secret that cannot be used refuses the Ingress: ingress-nginx denies the
    location (its 503) rather than reach the backend without the certificate."""
    value = values.get("proxy-ssl-secret")
    if value is None:
        return
    short = "proxy-ssl-secret"
    problem, material = proxyssl.read_secret(p.namespace, value, secrets)
    if material is None:
        p.note(Finding(short, value, Verdict.NOT_HONOURED, problem, refuses=True))
        p.refuse(
            INVALID,
            f"annotation {prefix}/{short}: {problem} (ingress-nginx denies the location: 503)",
        )
        return
    if not p.backend_tls:
        p.note(Finding(short, value, Verdict.NOOP, "without an HTTPS backend it does nothing"))
        return
    p.backend_secret = material
    if material.certificate and not material.ca:
        p.note(
            Finding(
                short,
                value,
                Verdict.DIFFERENT,
                "its tls.crt is presented to the backend though the Secret has no ca.crt "
                "(ingress-nginx then presents none)",
            )
        )
    elif material.certificate:
        note = "its tls.crt is presented to the backend, its ca.crt verifies the backend"
        p.note(Finding(short, value, Verdict.HONOURED, note))
    else:
        note = "ca.crt alone: the backend is verified against it, no client certificate sent"
        p.note(Finding(short, value, Verdict.HONOURED, note))
    if material.ca:
        verdict, note = _verification(values.get("backend-protocol", "").upper(), values, value)
        p.findings = [
            dataclasses.replace(f, verdict=verdict, note=note)
            if f.annotation == "backend-protocol"
            else f
            for f in p.findings
        ]


@_handles("proxy-connect-timeout", "proxy-read-timeout", "proxy-send-timeout")
def _timeouts(
    p: Plan,
    short: str,
    value: str,
    values: Mapping[str, str],
    found: Found,
    timeouts: dict[str, float],
    *_: Any,
) -> None:
    if short == "proxy-connect-timeout":
        timeouts["connect"] = float(value)
    else:
        read = float(values.get("proxy-read-timeout", "0") or 0)
        send = float(values.get("proxy-send-timeout", "0") or 0)
        timeouts["server"] = max(read, send) or timeouts["server"]
    found(short)


@_handles("proxy-request-buffering")
def _request_buffering(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.request_buffering = value == "on"
    found("proxy-request-buffering", Verdict.HONOURED, "")


@_handles("proxy-http-version")
def _http_version(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.upstream_http10 = value == "1.0"
    if p.upstream_http10 and values.get("backend-protocol", "").upper() in ("GRPC", "GRPCS"):
        found(short, Verdict.NOOP, "a gRPC backend speaks HTTP/2, which HTTP/1.0 does not change")
    else:
        found(short)


_TLS_BACKENDS = ("HTTPS", "GRPCS", "AUTO_HTTP")


@_handles("proxy-ssl-name", "proxy-ssl-verify", "proxy-ssl-server-name")
def _ssl_name(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if values.get("backend-protocol", "").upper() not in _TLS_BACKENDS:
        found(short, Verdict.NOOP, "without an HTTPS backend it does nothing")
    elif value == "on":  # proxy-ssl-verify, proxy-ssl-server-name: what the proxy does
        found(
            short,
            Verdict.HONOURED,
            "the backend's certificate is verified" if short == "proxy-ssl-verify" else "",
        )
    else:
        found(short)


@_handles("enable-opentelemetry", "opentelemetry-trust-incoming-span")
def _tracing(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    on = _flag(values.get("enable-opentelemetry", "true" if p.tracing else "false"))
    if short == "opentelemetry-trust-incoming-span" and not on:
        found(short, Verdict.NOOP, "without OpenTelemetry on for the Ingress it does nothing")
    elif short == "enable-opentelemetry" and _flag(value):
        found(
            short,
            Verdict.DIFFERENT,
            "spans at the proxy's own sampling (its --trace-ratio, and a client's sampled "
            "trace continued), not the ConfigMap's otel-sampler* keys",
        )
    else:
        found(short)


@_handles("opentelemetry-operation-name")
def _operation_name(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    unknown = span_variables_unknown(value)
    if unknown:
        found(short, Verdict.NOT_HONOURED, f"{unknown[0]}: not a variable Waygate fills in")
    elif not _flag(values.get("enable-opentelemetry", "true" if p.tracing else "false")):
        found(short, Verdict.NOOP, "without OpenTelemetry on for the Ingress it does nothing")
    else:
        found(short)


@_handles("enable-access-log")
def _access_log(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    found("enable-access-log")


# ---------------------------------------------------------------- responses


def redirect_pair(source: str, target: str) -> tuple[str, str] | str:
    """nginx proxy_redirect as ingress-nginx writes it from proxy-redirect-from/-to:
    (prefix, replacement) to rewrite (("", ""): `off` or `default`, nothing), or why
    it is not honoured."""
    if source in ("", "off", "default"):
        # `default`'s pattern is ingress-nginx's proxy_pass URL (http://upstream_balancer/),
        # which no backend names in its Location: nothing is rewritten there either.
        return "", ""
    if source.startswith("~") or target.startswith("~"):
        return "regular expressions (~) are not honoured"
    if target in ("", "off"):
        return "without proxy-redirect-to"
    if len(source.split()) != 1 or len(target.split()) != 1:
        return "nginx takes one prefix and one replacement"
    return source, target


def cookie_pair(value: str) -> tuple[str, str] | str | None:
    """proxy-cookie-domain / -path as nginx's directive: None for `off`, ("FROM", "TO"),
    or why it is not honoured."""
    if value in ("", "off"):
        return None
    parts = value.split()
    if len(parts) != 2:
        return "nginx takes `off` or a value and its replacement"
    if any(part.startswith("~") for part in parts):
        return "regular expressions (~) are not honoured"
    return parts[0], parts[1]


def status_list(value: str) -> tuple[int, ...]:
    """custom-http-errors' codes, sorted, duplicates once (checked by the grammar)."""
    return tuple(sorted({int(item) for item in value.replace(" ", "").split(",") if item}))


@_handles("proxy-redirect-from", "proxy-redirect-to")
def _proxy_redirect(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    source = values.get("proxy-redirect-from", p.redirect_from)
    pair = redirect_pair(source, values.get("proxy-redirect-to", p.redirect_to))
    if short == "proxy-redirect-to" and source in ("off", "default"):
        found(short, Verdict.NOOP, f"with proxy-redirect-from {source} it does nothing")
    elif isinstance(pair, str):
        found(short, Verdict.NOT_HONOURED, pair)
    else:
        found(short)


@_handles("relative-redirects")
def _relative_redirects(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    source = values.get("proxy-redirect-from", p.redirect_from)
    pair = redirect_pair(source, values.get("proxy-redirect-to", p.redirect_to))
    if _flag(value) and isinstance(pair, tuple) and pair[1].startswith("/"):
        found(
            short,
            Verdict.DIFFERENT,
            "a Location proxy-redirect-to rewrites to a path is made absolute all the same",
        )
    else:
        found(short)


@_handles("proxy-cookie-domain", "proxy-cookie-path")
def _proxy_cookie(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    pair = cookie_pair(value)
    if isinstance(pair, str):
        found(short, Verdict.NOT_HONOURED, pair)
    else:
        found(short)


@_handles("disable-proxy-intercept-errors")
def _intercept_errors(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if not values.get("custom-http-errors") and p.custom_http_errors:
        found(
            short,
            Verdict.NOOP,
            "without a custom-http-errors annotation it does nothing (the ConfigMap's "
            "codes follow the ConfigMap's disable-proxy-intercept-errors, as nginx's "
            "http-level proxy_intercept_errors)",
        )
    elif not values.get("custom-http-errors"):
        found(short, Verdict.NOOP, "without custom-http-errors it does nothing")
    else:
        found(short)


@_handles("connection-proxy-header")
def _connection_header(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if value.lower() == "upgrade":
        found(
            short,
            Verdict.DIFFERENT,
            "`upgrade` only for a request that asks for an upgrade (the proxy owns that hop)",
        )
    elif values.get("proxy-http-version", "1.0" if p.upstream_http10 else "1.1") == "1.0":
        found(
            short,
            Verdict.DIFFERENT,
            "with proxy-http-version 1.0 the backend gets Connection: close (one request "
            "per connection)",
        )
    else:
        found(short)


@_handles("custom-http-errors")
def _custom_errors(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if values.get("backend-protocol", "").upper() in ("GRPC", "GRPCS"):
        # ingress-nginx's grpc_pass ignores proxy_intercept_errors: nothing is intercepted.
        found(short, Verdict.NOOP, "a gRPC backend's answers are not intercepted (grpc_pass)")
    else:
        found(short)


def _response_defaults(p: Plan, config: ControllerConfig, where: str) -> None:
    """The ConfigMap's keys that give the response-side annotations their defaults
    (ingress-nginx's: off, none), before the annotations are read."""

    def configured(key: str, default: str, grammar: catalogue.Grammar) -> str:
        text = config.text(key, default)
        problem = grammar(text)
        if problem is not None:
            p.config_notes.append(f"ConfigMap {where} key {key}: invalid ({problem}), not used")
            return default
        return text

    p.redirect_from = configured("proxy-redirect-from", "off", catalogue.plain)
    p.redirect_to = configured("proxy-redirect-to", "off", catalogue.plain)
    p.cookie_domain = configured("proxy-cookie-domain", "off", catalogue.plain)
    p.cookie_path = configured("proxy-cookie-path", "off", catalogue.plain)
    p.custom_http_errors = status_list(configured("custom-http-errors", "", _codes_or_none))
    p.port_in_redirects = _flag(configured("use-port-in-redirects", "false", catalogue.boolean))
    # nginx's http-level proxy_intercept_errors, with the ConfigMap's custom-http-errors.
    p.intercept_errors_disabled = _flag(
        configured("disable-proxy-intercept-errors", "false", catalogue.boolean)
    )
    version = configured("proxy-http-version", "1.1", catalogue.one_of("1.0", "1.1"))
    p.upstream_http10 = version == "1.0"
    p.access_log_disabled = config.flag("disable-access-log", False) or config.flag(
        "disable-http-access-log", False
    )
    p.client_proxy_protocol = config.flag("use-proxy-protocol", False)
    p.tracing = _flag(configured("enable-opentelemetry", "false", catalogue.boolean))
    p.trust_incoming_span = _flag(
        configured("opentelemetry-trust-incoming-span", "true", catalogue.boolean)
    )
    p.span_name = configured("opentelemetry-operation-name", "", catalogue.span_template)


def _responses(p: Plan, values: Mapping[str, str]) -> None:
    """The response-side route fields: each annotation, else the ConfigMap's default
    (`_response_defaults`)."""
    pair = redirect_pair(
        values.get("proxy-redirect-from", p.redirect_from),
        values.get("proxy-redirect-to", p.redirect_to),
    )
    p.redirect_from, p.redirect_to = pair if isinstance(pair, tuple) else ("", "")
    domain = cookie_pair(values.get("proxy-cookie-domain", p.cookie_domain))
    p.cookie_domain = " ".join(domain) if isinstance(domain, tuple) else ""
    path = cookie_pair(values.get("proxy-cookie-path", p.cookie_path))
    p.cookie_path = " ".join(path) if isinstance(path, tuple) else ""
    if "custom-http-errors" in values:
        p.custom_http_errors = status_list(values["custom-http-errors"])
    if values.get("backend-protocol", "").upper() in ("GRPC", "GRPCS"):
        p.custom_http_errors = ()  # grpc_pass: nothing intercepted, as ingress-nginx
    if "custom-http-errors" in values:
        # The location's own error_page lines and proxy_intercept_errors: the
        # annotation's; else the ConfigMap's codes follow its http-level setting.
        p.intercept_errors_disabled = _flag(values.get("disable-proxy-intercept-errors", "false"))
    if "use-port-in-redirects" in values:
        p.port_in_redirects = _flag(values["use-port-in-redirects"])
    header = values.get("connection-proxy-header", "").lower()
    p.connection_header = header if header in ("keep-alive", "close") else ""
    if not _flag(values.get("enable-access-log", "true")):
        p.access_log_disabled = True  # (`true` cannot undo the ConfigMap's http-level off)
    if "enable-opentelemetry" in values:
        p.tracing = _flag(values["enable-opentelemetry"])
    if "opentelemetry-trust-incoming-span" in values:
        p.trust_incoming_span = _flag(values["opentelemetry-trust-incoming-span"])
    if "opentelemetry-operation-name" in values:
        p.span_name = values["opentelemetry-operation-name"]
    if span_variables_unknown(p.span_name):
        p.span_name = ""  # (reported by its handler; the ConfigMap's by the key's note)


#: ingress-nginx's variables an opentelemetry-operation-name may hold: per request
#: (the proxy fills them in: waygate.proxy.routing.SPAN_VARIABLES), or the route's
#: own, filled in here (`span_name`).
SPAN_REQUEST_VARIABLES: Final = ("$request_method", "$request_uri", "$uri", "$host", "$scheme")
SPAN_ROUTE_VARIABLES: Final = ("$service_name", "$namespace", "$ingress_name", "$location_path")


def span_variables_unknown(template: str) -> list[str]:
    """The variables in `template` that neither the proxy nor the resolver fills in."""
    known = (*SPAN_REQUEST_VARIABLES, *SPAN_ROUTE_VARIABLES)
    return [v for v in re.findall(r"\$[a-z_]+", template) if v not in known]


def span_name(p: Plan, route: Route, location: str) -> str:
    """The route's span name: opentelemetry-operation-name with the route's own
    variables filled in (ingress-nginx's $service_name is the backend Service's)."""
    if not p.span_name:
        return ""
    service = route.backends[0].service if route.backends else ""
    name = p.span_name
    for variable, value in (
        ("$service_name", service),
        ("$namespace", p.namespace),
        ("$ingress_name", p.name),
        ("$location_path", location),
    ):
        name = name.replace(variable, value)
    return name[:256]


def _codes_or_none(value: str) -> str | None:
    return None if value == "" else catalogue.status_codes(value)


@_handles(
    "canary",
    "canary-weight",
    "canary-weight-total",
    "canary-by-header",
    "canary-by-header-value",
    "canary-by-header-pattern",
    "canary-by-cookie",
)
def _canary(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if short == "canary":
        found("canary", Verdict.HONOURED, "")
    elif short in ("canary-weight", "canary-weight-total"):
        number = int(value)
        if number < 0 or (short == "canary-weight-total" and number == 0):
            found(short, Verdict.NOT_HONOURED, "out of range")
            return
        if short == "canary-weight":
            p.canary_weight = number
        else:
            p.canary_total = number
        found(short, Verdict.HONOURED, "")
    elif short == "canary-by-header":
        p.canary_header = value
        found(short, Verdict.HONOURED, "")
    elif short == "canary-by-cookie":
        p.canary_cookie = value
        found(short, Verdict.HONOURED, "")
    elif short == "canary-by-header-value":
        if not values.get("canary-by-header"):
            found(short, Verdict.NOOP, "without canary-by-header it does nothing")
            return
        p.canary_header_value = value
        found(short, Verdict.HONOURED, "")
    elif not values.get("canary-by-header") or values.get("canary-by-header-value"):
        found(short, Verdict.NOOP, "without canary-by-header, or with -value, it does nothing")
    else:
        p.canary_header_pattern = value
        found(
            short,
            Verdict.DIFFERENT,
            "matched anywhere in the value, as the proxy's regular expressions read it "
            "(RE2 syntax, not PCRE)",
        )


_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3}


def parse_size(value: str) -> int | None:
    """An nginx size (`8k`, `1m`, `0`: no limit) in bytes; None when it is not one."""
    found = re.fullmatch(r"(\d{1,12})([bkmgBKMG]?)", value.strip())
    if found is None:
        return None
    unit = found.group(2).lower()
    return int(found.group(1)) * _SIZE_UNITS["" if unit == "b" else unit]


@_handles("proxy-body-size")
def _body_size(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.max_request_body = parse_size(value) or 0
    found(short)


@_handles("service-upstream")
def _service_upstream(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    # "false" too: the annotation overrides the ConfigMap's service-upstream.
    p.service_upstream = _flag(value)
    if p.service_upstream:
        found(short)
    else:
        found(short, Verdict.HONOURED, "")


@_handles("default-backend")
def _default_backend(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    namespace, _slash, service = value.rpartition("/")
    if namespace and namespace != p.namespace:
        found(short, Verdict.NOT_HONOURED, "a Service of another namespace")
        return
    p.default_backend = service
    found(short)


# nginx's proxy_next_upstream conditions: a failed connect (error, timeout) and an
# answer (waygate.proxy.nextupstream: http_*, invalid_header, non_idempotent).
_NEXT_CONNECT = ("error", "timeout")
_NEXT_ANSWER = frozenset(
    (
        "invalid_header",
        "http_500",
        "http_502",
        "http_503",
        "http_504",
        "http_403",
        "http_404",
        "http_429",
        "non_idempotent",
    )
)
MAX_NEXT_UPSTREAM_TRIES = 100


_NEXT_ANSWERS_NOTE = (
    "{}: the answer is dropped and the request sent to another endpoint (while tries "
    "and proxy-next-upstream-timeout allow) only when it can be sent again exactly: "
    "without a body, or with one buffered whole in memory (proxy-request-buffering on, "
    "at most 64 KiB; not from an HTTP/2 client to an HTTP/2 backend) -- else the answer "
    "goes to the client as it came; POST, LOCK and PATCH only with non_idempotent. "
    "error and timeout: a connect that failed or timed out (a failure after the "
    "request was sent is a 502)"
)


@_handles("proxy-next-upstream-timeout")
def _next_upstream_timeout(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.next_upstream_timeout = float(value)
    if not p.next_upstream_timeout:
        found(short, Verdict.HONOURED, "0: no bound, ingress-nginx's default")
        return
    found(
        short,
        Verdict.DIFFERENT,
        "bounds the answers' redispatches (proxy-next-upstream http_*, invalid_header) "
        "from the request's start; connects are bounded by -tries and the connect timeout",
    )


@_handles("proxy-next-upstream", "proxy-next-upstream-tries")
def _next_upstream(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    if short == "proxy-next-upstream-tries":
        tries = int(value)
        if 1 <= tries <= MAX_NEXT_UPSTREAM_TRIES:
            p.next_upstream_tries = tries
            found(short, Verdict.HONOURED, "")
        elif tries == 0:
            found(short, Verdict.DIFFERENT, "0 (unlimited in nginx) is the proxy's default, 3")
        else:
            found(short, Verdict.NOT_HONOURED, f"outside 0..{MAX_NEXT_UPSTREAM_TRIES}")
        return
    tokens = value.split()
    unknown = [t for t in tokens if t not in _NEXT_ANSWER and t not in (*_NEXT_CONNECT, "off")]
    if unknown:
        found(short, Verdict.NOT_HONOURED, f"not an nginx proxy_next_upstream value: {unknown[0]}")
        return
    honoured = [t for t in tokens if t in _NEXT_CONNECT or t in _NEXT_ANSWER]
    p.next_upstream = " ".join(honoured) if honoured and "off" not in tokens else "off"
    answers = sorted(set(tokens) & _NEXT_ANSWER)
    if answers and "off" not in tokens:
        found(short, Verdict.DIFFERENT, _NEXT_ANSWERS_NOTE.format(", ".join(answers)))
    else:
        found(short)


_CORS_FIELDS = {
    "cors-allow-methods": "allow_methods",
    "cors-allow-headers": "allow_headers",
    "cors-expose-headers": "expose_headers",
}


@_handles(
    "enable-cors",
    *(
        f"cors-{n}"
        for n in (
            "allow-origin",
            "allow-methods",
            "allow-headers",
            "expose-headers",
            "allow-credentials",
            "max-age",
        )
    ),
)
def _cors(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    """enable-cors and its cors-* (waygate.proxy.cors answers them)."""
    if short == "enable-cors":
        fields: dict[str, Any] = {
            attr: values[key].strip() for key, attr in _CORS_FIELDS.items() if values.get(key)
        }
        origins = tuple(o.strip() for o in values.get("cors-allow-origin", "*").split(","))
        fields["allow_origins"] = tuple(o for o in origins if o) or ("*",)
        if "cors-allow-credentials" in values:
            fields["allow_credentials"] = _flag(values["cors-allow-credentials"])
        if values.get("cors-max-age"):
            fields["max_age"] = max(0, int(values["cors-max-age"]))
        p.cors = Cors(**fields)
        found(short, Verdict.HONOURED, "")
    elif short == "cors-allow-origin" and value.strip() != "*":
        found(short, Verdict.DIFFERENT, _CORS_ORIGIN)
    else:
        found(short, Verdict.HONOURED, "")


_CORS_ORIGIN = (
    "the whole Origin must match one listed (ingress-nginx's regex is anchored only "
    "at its end, so a longer Origin ending in a listed one passes there)"
)


@_handles("ssl-passthrough")
def _passthrough(
    p: Plan, short: str, value: str, values: Mapping[str, str], found: Found, *_: Any
) -> None:
    p.ssl_passthrough = _flag(value)
    found(short, Verdict.HONOURED, "" if not p.ssl_passthrough else None)


def _configmap_headers(
    namespace: str, value: str, config_maps: Callable[[str, str], JSON | None]
) -> tuple[list[tuple[str, str]], str]:
    """A ConfigMap's entries as header lines ("NS/NAME", or NAME in `namespace`): the
    plain headers and values, and why the first other is not ("": every entry is)."""
    given, _, name = value.rpartition("/")
    obj = config_maps(given or namespace, name)
    if obj is None:
        return [], f"ConfigMap {given or namespace}/{name} not found"
    headers, problem = [], ""
    for header, text in sorted((obj.get("data") or {}).items()):
        header, text = str(header), str(text)
        if (
            not _HEADER_NAME.fullmatch(header)
            or header.lower() in _PROTECTED
            or catalogue.header_value(text)
        ):
            problem = problem or f"header {header!r} is not a plain header and value"
            continue
        headers.append((header, text))
    return headers, problem


@_handles("custom-headers")
def _custom_headers(
    p: Plan,
    short: str,
    value: str,
    values: Mapping[str, str],
    found: Found,
    timeouts: dict[str, float],
    config_maps: Callable[[str, str], JSON | None],
) -> None:
    # ingress-nginx answers 503 where its headers cannot be set (a missing ConfigMap,
    # a bad header): the Ingress is not served rather than served without them.
    headers, problem = _configmap_headers(p.namespace, value, config_maps)
    unlisted = [name for name, _ in headers if name not in p.allowed_response_headers]
    if unlisted and not problem:
        # customheaders/main.go: every header must be listed (exactly as written).
        problem = (
            f"header {unlisted[0]!r} is not in the ConfigMap's global-allowed-response-headers"
        )
    p.response_set += headers
    if problem:
        p.note(Finding(short, value, Verdict.NOT_HONOURED, problem, True))
        p.refuse(UNSUPPORTED, f"annotation custom-headers: {problem}")
        return
    found("custom-headers")


# ---------------------------------------------------------------- snippets


def _snippet(p: Plan, short: str, text: str, config: ControllerConfig, prefix: str) -> None:
    where = f"annotation {prefix}/{short}"
    if not config.snippets_allowed:
        p.note(
            Finding(
                short,
                text,
                Verdict.NOT_HONOURED,
                "snippets are not allowed by the "
                "ConfigMap (allow-snippet-annotations, annotations-risk-level)",
                True,
            )
        )
        p.refuse(
            SNIPPETS_NOT_ALLOWED,
            f"{where}: snippets are not allowed by the ConfigMap "
            '(allow-snippet-annotations: "true" and annotations-risk-level: Critical)',
        )
        return
    if short in ("auth-snippet", "stream-snippet"):
        p.note(Finding(short, text, Verdict.NOT_HONOURED, "not honoured", True))
        p.refuse(UNSUPPORTED, f"{where}: not honoured")
        return
    try:
        statements = parse_snippet(text)
        differences: list[str] = []
        for directive, args in statements:
            _directive(p, directive, args, differences)
    except ValueError as exc:
        p.note(Finding(short, text, Verdict.NOT_HONOURED, str(exc), True))
        p.refuse(UNSUPPORTED, f"{where}: {exc}")
        return
    note = "; ".join(differences)
    p.note(Finding(short, text, Verdict.DIFFERENT if note else Verdict.HONOURED, note))


def parse_snippet(text: str) -> list[tuple[str, list[str]]]:
    """Statements `directive arg...;` of literal words and quoted strings; ValueError
    for anything else (blocks, comments, variables, escapes, an unterminated statement)."""
    statements: list[tuple[str, list[str]]] = []
    words: list[str] = []
    i, n = 0, len(text)
    while i < n:
        char = text[i]
        if char in " \t\r\n":
            i += 1
        elif char == ";":
            if not words:
                raise ValueError("an empty statement")
            statements.append((words[0], words[1:]))
            words = []
            i += 1
        elif char in "'\"":
            end = text.find(char, i + 1)
            if end < 0:
                raise ValueError("an unterminated quoted string")
            word = text[i + 1 : end]
            if any(c in word for c in "$\\\r\n"):
                raise ValueError("variables, escapes and line breaks in strings are not honoured")
            words.append(word)
            i = end + 1
        elif char in "{}":
            raise ValueError("blocks ({ }) are not honoured")
        elif char == "#":
            raise ValueError("comments are not honoured")
        elif char == "$":
            raise ValueError("nginx variables ($...) are not honoured")
        else:
            start = i
            while i < n and text[i] not in " \t\r\n;'\"{}#$":
                i += 1
            word = text[start:i]
            if "\\" in word:
                raise ValueError("escapes are not honoured")
            words.append(word)
    if words:
        raise ValueError(f"statement {words[0]!r} is not terminated by ;")
    return statements


def _header_pair(name: str, value: str, directive: str) -> tuple[str, str]:
    if not _HEADER_NAME.fullmatch(name) or not _HEADER_VALUE.fullmatch(value):
        raise ValueError(f"{directive}: {name!r} is not a plain header and value")
    if name.lower() in _PROTECTED:
        raise ValueError(f"{directive}: the proxy owns the {name} header")
    return name, value


def _directive(p: Plan, directive: str, args: list[str], differences: list[str]) -> None:
    if directive == "more_set_headers":
        if not args or any(a.startswith("-") for a in args):
            raise ValueError('more_set_headers: only "Name: value" arguments are honoured')
        for arg in args:
            name, colon, value = arg.partition(":")
            if not colon:
                raise ValueError(f'more_set_headers: {arg!r} is not "Name: value"')
            p.response_set.append(_header_pair(name.strip(), value.strip(), directive))
    elif directive == "more_clear_headers":
        if not args or any(a.startswith("-") or "*" in a for a in args):
            raise ValueError("more_clear_headers: only plain header names are honoured")
        for arg in args:
            p.response_remove.append(_header_pair(arg, "", directive)[0])
    elif directive == "add_header":
        if len(args) not in (2, 3) or (len(args) == 3 and args[2] != "always"):
            raise ValueError("add_header: NAME VALUE [always] only")
        p.response_add.append(_header_pair(args[0], args[1], directive))
        if len(args) == 2:
            differences.append("add_header is added to every response, not only 2xx/3xx")
    elif directive == "proxy_set_header":
        if len(args) != 2:
            raise ValueError("proxy_set_header: NAME VALUE only")
        if args[0].lower() == "host":
            if catalogue.hosts(args[1]):
                raise ValueError("proxy_set_header Host: not a host name")
            p.upstream_vhost = args[1]
        elif args[1] == "":
            p.request_remove.append(_header_pair(args[0], "", directive)[0])
        else:
            p.request_set.append(_header_pair(args[0], args[1], directive))
    elif directive == "return":
        code = int(args[0]) if args and args[0].isdigit() else 0
        if len(args) != 2 or code not in _REDIRECT_CODES or catalogue.url(args[1]):
            raise ValueError(
                "return: only a redirect (301, 302, 303, 307, 308 and an http(s) URL) is honoured"
            )
        # The Location exactly as written (nginx's return appends no $args).
        p.redirect_location = args[1]
        p.redirect = Redirect(status=code)
    else:
        raise ValueError(f"directive {directive!r} is not honoured")


# ---------------------------------------------------------------- paths


def _paths(p: Plan, obj: JSON) -> None:
    """Every rule path checked against its pathType (ingress-nginx's rules)."""
    spec = obj.get("spec") or {}
    # A regular expression path only with use-regex (rewrite-target makes plain paths
    # match as regular expressions, as ingress-nginx, but admits none of its own).
    regex = p.use_regex
    rules = spec.get("rules") or []
    if not isinstance(rules, list):
        return
    for r_index, rule in enumerate(rules):
        http = (rule or {}).get("http") or {} if isinstance(rule, dict) else {}
        paths = http.get("paths") or [] if isinstance(http, dict) else []
        for p_index, item in enumerate(paths if isinstance(paths, list) else []):
            item = item if isinstance(item, dict) else {}
            kind = str(item.get("pathType") or "ImplementationSpecific")
            value = str(item.get("path") or "/")
            where = f"spec.rules[{r_index}].http.paths[{p_index}].path"
            problem = _path_problem(kind, value, regex)
            if problem:
                p.refuse(INVALID_PATH, f"{where}: {problem}")
            p.paths.append((kind, value))
    if spec.get("defaultBackend") is not None:
        p.paths.append(("Prefix", "/"))


def _path_problem(kind: str, value: str, regex: bool) -> str:
    if kind in ("Exact", "Prefix") or not regex:
        if catalogue.path(value):
            return (
                f"{value!r} is not a plain absolute path (pathType {kind}"
                + ("" if kind != "ImplementationSpecific" else ", without use-regex")
                + ")"
            )
        return ""
    if not _REGEX_PATH.fullmatch(value):
        return f"{value!r} has characters a regular expression path may not have"
    reason = linear_regex.refusal(value)
    if reason is not None:  # the proxy matches with RE2 (waygate.core.regex)
        return f"{value!r} is not a regular expression Waygate can match ({reason})"
    return ""


# ---------------------------------------------------------------- routes


def _match_and_rewrite(p: Plan, kind: str, value: str) -> tuple[RouteMatch, Rewrite | None]:
    """The match of one path, and the path rewrite (None: none)."""
    regex = (p.use_regex or bool(p.rewrite_target)) and kind != "Exact"
    rewrite: Rewrite | None = None
    target = p.rewrite_target
    if target and "$" in target:
        idiom = _PREFIX_IDIOM.fullmatch(value)
        group = "$2" if idiom and idiom.group("sep") == "(/|$)" else "$1"
        if idiom and target.endswith(group) and target.count("$") == 1:
            replacement = target[: -len(group)] or "/"
            prefix = idiom.group("prefix").rstrip("/") or "/"
            return (
                RouteMatch(PathMatchType.PREFIX, prefix),
                Rewrite(path_type=PathModifierType.PREFIX, path=replacement),
            )
        rewrite = None  # capture groups: the route's rewrite_target (shape)
    elif target:
        rewrite = Rewrite(path_type=PathModifierType.FULL, path=target)
    if regex:
        return RouteMatch(PathMatchType.REGEX, f"(?i)(?:{value}).*"), rewrite
    if kind == "Exact":
        return RouteMatch(PathMatchType.EXACT, value), rewrite
    return RouteMatch(PathMatchType.PREFIX, value), rewrite


def refine(p: Plan) -> None:
    """rewrite-target's verdict, now that its paths are known."""
    target = p.rewrite_target
    if not target or "$" not in target:
        return
    idiom = all(_PREFIX_IDIOM.fullmatch(value) and kind != "Exact" for kind, value in p.paths)
    for index, finding in enumerate(p.findings):
        if finding.annotation == "rewrite-target":
            p.findings[index] = dataclasses.replace(
                finding,
                verdict=Verdict.DIFFERENT,
                note="a prefix replacement: the prefix is matched case-sensitively"
                if idiom
                else _CAPTURES,
            )


_CAPTURES = (
    "capture groups ($1..$9) from the path's regular expression matched against the "
    "path as sent (nginx matches its percent-decoded, slash-merged $uri); the query is kept"
)


def shape(p: Plan, routes: list[Route], tls_hosts: Iterable[str]) -> list[Route]:
    """The routes `gateway.translate` made from the Ingress's rules (one per path and
    port, `rule_index` the flattened path index) -> what ingress-nginx would serve."""
    secured = set(tls_hosts)
    unsecured = _unsecured_client_certificate_hosts(p, routes, secured)
    if unsecured:
        p.refuse(
            UNSUPPORTED,
            f"annotation auth-tls-secret: host {unsecured} has no TLS certificate "
            "(spec.tls), so no client certificate can be asked for on it",
        )
    if p.refusal_reason:
        return [refused(p, route) for route in routes]
    refine(p)
    out: list[Route] = []
    extra_hosts: dict[tuple[str, int], Route] = {}
    verdicts = p.verdict_lines()
    for route in routes:
        kind, value = (
            p.paths[route.rule_index] if route.rule_index < len(p.paths) else ("Prefix", "/")
        )
        match, path_rewrite = _match_and_rewrite(p, kind, value)
        # Capture groups beyond the prefix idiom: the proxy expands them from its match.
        captured = (
            p.rewrite_target
            if "$" in p.rewrite_target
            and path_rewrite is None
            and match.path_type is PathMatchType.REGEX
            else ""
        )
        rewrite = None
        if path_rewrite is not None or p.upstream_vhost:
            rewrite = Rewrite(
                hostname=p.upstream_vhost,
                path_type=path_rewrite.path_type if path_rewrite else PathModifierType.NONE,
                path=path_rewrite.path if path_rewrite else "",
            )
        redirect = p.redirect
        redirect_location = p.redirect_location
        # A literal redirect (`return CODE URL` in the location or server block) runs
        # in nginx's rewrite phase, before ingress-nginx's HTTPS redirect (Lua's
        # rewrite_by_lua, postponed to the phase's end): it answers plain HTTP too.
        if (
            route.listener_port == 80
            and not redirect_location
            and (p.force_ssl_redirect or (p.ssl_redirect and route.host in secured))
            # template.go isLocationInLocationList: the path, as written, under one.
            and not any(value.startswith(prefix) for prefix in p.no_tls_redirect)
        ):
            redirect = Redirect(
                scheme="https",
                status=p.redirect_code,
                strip_trailing_slash=not p.preserve_trailing_slash,
            )
            redirect_location = ""
        request = _modifier(p.request_set, [], p.request_remove)
        response = _modifier(p.response_set, p.response_add, p.response_remove)
        filters = None
        if request or response or redirect or rewrite:
            filters = RouteFilters(
                request_headers=request,
                response_headers=response,
                redirect=redirect,
                rewrite=rewrite,
            )
        sticky = p.sticky
        # ingress-nginx's cookie Path: the location's path (a regex one: "/").
        if (
            not sticky.disable_cookies
            and not sticky.cookie_path
            and value != "/"
            and match.path_type is not PathMatchType.REGEX
            and kind != "ImplementationSpecific"
        ):
            sticky = dataclasses.replace(sticky, cookie_path=value)
        tls = route.tls
        if tls is not None and p.hsts is not None:
            tls = dataclasses.replace(tls, hsts=p.hsts)
        if tls is not None and (p.tls_protocols or p.tls_ciphers):
            tls = dataclasses.replace(tls, protocols=p.tls_protocols, ciphers=p.tls_ciphers)
        if p.backend_tls:
            tls = _backend_tls(tls, p)
        backends = route.backends
        if p.service_upstream:
            # The Ingress's own backends (spec.defaultBackend's too); a default-backend
            # annotation's Service keeps its endpoints, as ingress-nginx's.
            backends = tuple(dataclasses.replace(b, use_cluster_ip=True) for b in backends)
        shaped = dataclasses.replace(
            route,
            backends=backends,
            matches=(match,),
            filters=filters,
            tls=tls,
            sticky=sticky,
            balance=p.balance,
            timeouts=p.timeouts,
            upstream_protocol=p.upstream_protocol,
            request_buffering=p.request_buffering,
            forwarded_headers=p.forwarded,
            client_address_header=p.client_address_header,
            ingress_verdicts=verdicts,
            access=p.access,
            rate_limit=p.rate_limit,
            limit_rate=p.limit_rate,
            limit_rate_after=p.limit_rate_after,
            url_mirror=p.url_mirror,
            # nginx.tmpl: no auth_request in a location under no-auth-locations.
            external_auth=None
            if any(value.startswith(prefix) for prefix in p.no_auth)
            else p.external_auth,
            cors=p.cors,
            max_request_body=p.max_request_body,
            next_upstream=p.next_upstream,
            next_upstream_tries=p.next_upstream_tries,
            next_upstream_timeout=p.next_upstream_timeout,
            rewrite_target=captured,
            default_backend=p.default_backend,
            hash_by=p.hash_by,
            hash_subset_size=p.hash_subset_size,
            redirect_from=p.redirect_from,
            redirect_to=p.redirect_to,
            cookie_domain=p.cookie_domain,
            cookie_path=p.cookie_path,
            custom_http_errors=p.custom_http_errors,
            intercept_errors_disabled=p.intercept_errors_disabled,
            port_in_redirects=p.port_in_redirects,
            connection_header=p.connection_header,
            access_log_disabled=p.access_log_disabled,
            client_proxy_protocol=p.client_proxy_protocol,
            tracing_off=not p.tracing,
            untrusted_trace_context=p.tracing and not p.trust_incoming_span,
            span_name=span_name(p, route, value) if p.tracing else "",
            upstream_scheme_from_client=p.scheme_from_client,
            upstream_http10=p.upstream_http10,
            redirect_location=redirect_location,
        )
        if p.ssl_passthrough and route.listener_port == 443:
            continue  # the host's TLS is passed through, never terminated here
        out.append(shaped)
        for alias in p.aliases:
            if alias != route.host and route.host:
                out.append(dataclasses.replace(shaped, name=f"{route.name}~{alias}", host=alias))
        if route.host:
            extra_hosts.setdefault((route.host, route.listener_port), shaped)
    if p.ssl_passthrough:
        out.extend(_passthrough_routes(p, routes, verdicts))
    for (host, port), model in sorted(extra_hosts.items()):
        for name_host in (host, *(a for a in p.aliases if a != host)):
            if p.app_root:
                out.append(
                    dataclasses.replace(
                        model,
                        name=f"ingress:{p.name}:app-root:{port}:{name_host}",
                        host=name_host,
                        matches=(RouteMatch(PathMatchType.EXACT, "/"),),
                        redirect_location="",
                        filters=RouteFilters(
                            redirect=Redirect(
                                path_type=PathModifierType.FULL, path=p.app_root, status=302
                            )
                        ),
                    )
                )
        if p.www_redirect:
            other = host[4:] if host.startswith("www.") else "www." + host
            if (other, port) not in extra_hosts and not host.startswith("*"):
                out.append(
                    dataclasses.replace(
                        model,
                        name=f"ingress:{p.name}:www:{port}:{other}",
                        host=other,
                        matches=(RouteMatch(PathMatchType.PREFIX, "/"),),
                        redirect_location="",
                        filters=RouteFilters(
                            redirect=Redirect(hostname=host, status=p.redirect_code)
                        ),
                    )
                )
    return out


def _unsecured_client_certificate_hosts(p: Plan, routes: list[Route], secured: set[str]) -> str:
    """A host of the Ingress that client certificates would be asked for on, without
    a certificate of its own ("" : none). ingress-nginx would serve it on the default
    certificate; here it would have no HTTPS route at all, and its plain HTTP one
    would reach the backend unchecked: refused instead."""
    rules = p.access.client_certificate if p.access is not None else None
    if rules is None or rules.verify == "off":
        return ""
    bare = sorted({r.host or "*" for r in routes if r.host not in secured})
    return bare[0] if bare else ""


def client_certificate_hosts(routes: list[Route], nginx: set[str]) -> list[Route]:
    """ingress-nginx's auth-tls-* are the server's (ssl_client_certificate is set in
    the host's server block, from the oldest Ingress of the host that has them): every
    route of an ingress-nginx Ingress on that host gets them. An Ingress refused for
    its auth-tls-* makes the host's other routes answer 403 (ingress-nginx's
    AuthTLSError: `return 403` in the server block), never serve unchecked. `nginx`:
    the names of the routes of ingress-nginx Ingresses (others are not touched)."""
    broken: dict[str, ClientCertificate] = {}
    chosen: dict[str, tuple[tuple[Any, ...], ClientCertificate]] = {}
    for route in routes:
        if route.name.split("~")[0] not in nginx:
            continue
        if route.ingress_refusal is not None:
            if "auth-tls-" in route.ingress_refusal[1] and route.host not in broken:
                why = (
                    f"host {route.host}: the client-certificate rules of {route.origin} are refused"
                )
                broken[route.host] = ClientCertificate(ca_certificates="", refusal=why)
            continue
        rules = route.access.client_certificate if route.access is not None else None
        if rules is None:
            continue
        # Oldest first (ingress-nginx sorts Ingresses by creation), then by name.
        created = route.created.timestamp() if route.created else 0.0
        rank: tuple[Any, ...] = (route.created is None, created, route.origin)
        if route.host not in chosen or rank < chosen[route.host][0]:
            chosen[route.host] = (rank, rules)
    hosts = {host: rules for host, (_, rules) in chosen.items()} | broken
    if not hosts:
        return routes
    out = []
    for route in routes:
        rules = hosts.get(route.host)
        if (
            rules is not None
            and route.name.split("~")[0] in nginx
            and route.ingress_refusal is None
        ):
            access = route.access or RouteAccess()
            if access.client_certificate != rules:
                route = dataclasses.replace(
                    route, access=dataclasses.replace(access, client_certificate=rules)
                )
        out.append(route)
    return out


def _passthrough_routes(p: Plan, routes: list[Route], verdicts: tuple[str, ...]) -> list[Route]:
    """ssl-passthrough: one route per host on the HTTPS port, by SNI, to the backend of
    the host's `/` path (else its first), as ingress-nginx's --enable-ssl-passthrough."""
    chosen: dict[str, Route] = {}
    for route in routes:
        if not route.host or route.listener_port != 80:
            continue
        _, value = p.paths[route.rule_index] if route.rule_index < len(p.paths) else ("", "/")
        if route.host not in chosen or value == "/":
            chosen[route.host] = route
    out = []
    for host in (*chosen, *(a for a in p.aliases if chosen and a not in chosen)):
        model = chosen.get(host) or next(iter(chosen.values()))
        out.append(
            dataclasses.replace(
                model,
                name=f"ingress:{p.name}:passthrough:443:{host}",
                host=host,
                matches=(),
                filters=None,
                tls=RouteTLS(TLSTermination.PASSTHROUGH),
                listener_port=443,
                listener_protocol="TLS",
                sticky=StickySessions(disable_cookies=True),
                upstream_protocol="",
                ingress_verdicts=verdicts,
            )
        )
    return out


def _modifier(
    set_: list[tuple[str, str]], add: list[tuple[str, str]], remove: list[str]
) -> HeaderModifier | None:
    if not (set_ or add or remove):
        return None
    return HeaderModifier(set=tuple(set_), add=tuple(add), remove=tuple(dict.fromkeys(remove)))


def _backend_tls(tls: RouteTLS | None, p: Plan) -> RouteTLS:
    """The reencrypt TLS of an HTTPS backend: proxy-ssl-name, and proxy-ssl-secret's
    client certificate and CAs (else the system CAs)."""
    secret = p.backend_secret or proxyssl.BackendTLS("")
    fields: dict[str, Any] = {
        "termination": TLSTermination.REENCRYPT,
        "destination_server_name": p.backend_server_name,
        "destination_system_ca": not secret.ca,
        "destination_ca_certificate": secret.ca,
        "backend_client_certificate": secret.certificate,
        "backend_client_key": secret.key,
    }
    if tls is None:
        return RouteTLS(insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW, **fields)
    return dataclasses.replace(tls, **fields)


def refused(p: Plan, route: Route) -> Route:
    """A route of a refused Ingress: kept so its status says why, never served
    (Admitted False; its backends invalid should a status ever be missing)."""
    return dataclasses.replace(
        route,
        backends=tuple(
            dataclasses.replace(b, invalid=f"not served: {p.refusal}") for b in route.backends
        ),
        ingress_refusal=(p.refusal_reason, p.refusal),
        ingress_verdicts=p.verdict_lines(),
    )


def placeholder(key: tuple[str, str], obj: JSON, p: Plan) -> Route:
    """The one route of a refused Ingress whose rules could not be read: it carries
    the refusal to the route status; it has no backend and is never served."""
    return Route(
        namespace=key[0],
        name=f"ingress:{key[1]}:refused",
        host="",
        matches=(RouteMatch(PathMatchType.PREFIX, "/"),),
        listener_port=80,
        origin=f"Ingress {key[0]}/{key[1]}",
        ingress_refusal=(p.refusal_reason, p.refusal),
        ingress_verdicts=p.verdict_lines(),
    )


# ---------------------------------------------------------------- canaries


def merge_canaries(routes: list[Route], canaries: list[tuple[Plan, list[Route]]]) -> list[Route]:
    """Canary Ingresses folded into their main Ingress's routes, as ingress-nginx's
    alternative backends: the main route of the same host, port and path gets the
    canary's backends after its own and the canary's policy (`Route.canary`), which
    the proxy decides per request as ingress-nginx's balancer does (its sticky
    cookie, then canary-by-header, then canary-by-cookie, then canary-weight of
    max(100, canary-weight-total)). The backends' weights say the same split for
    whoever reads the route. A canary without a main route is not served; a second
    canary of one main route is not used (ingress-nginx uses the first)."""
    out = list(routes)
    index = {
        (r.host, r.listener_port, r.matches[0] if r.matches else None): i
        for i, r in enumerate(out)
        if r.ingress_refusal is None and r.origin.startswith("Ingress ")
    }
    for plan, shaped in canaries:
        for canary in shaped:
            key = (canary.host, canary.listener_port, canary.matches[0] if canary.matches else None)
            at = index.get(key)
            if at is None:
                continue
            main = out[at]
            if main.filters is not None and main.filters.redirect is not None:
                continue  # answered by a redirect: no backend to share
            if main.canary is not None or not main.backends:
                continue
            # balancer.lua draws 1..max(100, weight-total).
            total = max(plan.canary_total, 100)
            weight = min(max(plan.canary_weight, 0), total)
            scale = 256 / total if total > 256 else 1.0
            out[at] = dataclasses.replace(
                main,
                backends=tuple(
                    dataclasses.replace(b, weight=round((total - weight) * scale))
                    for b in main.backends
                )
                + tuple(
                    dataclasses.replace(b, weight=round(weight * scale)) for b in canary.backends
                ),
                canary=Canary(
                    main_backends=len(main.backends),
                    weight=weight,
                    weight_total=total,
                    header=plan.canary_header,
                    header_value=plan.canary_header_value,
                    header_pattern=plan.canary_header_pattern,
                    cookie=plan.canary_cookie,
                    legacy_affinity=plan.canary_legacy_affinity,
                ),
            )
    return out


# ---------------------------------------------------------------- hosts with regular expressions


def regex_hosts(routes: list[Route], nginx: set[str]) -> list[Route]:
    """ingress-nginx's rule for a host where any location is a regular expression
    (use-regex or rewrite-target on any of its Ingresses): every Prefix path of the
    host becomes a case-insensitive regular expression anchored at the start
    (`location ~* "^PATH"`), tried longest first, as nginx tries them in the order
    ingress-nginx writes them. Exact paths stay exact; a prefix replacement
    (`PREFIX(/|$)(.*)` -> `/$2`) stays a prefix. `nginx`: the names of the routes
    of ingress-nginx Ingresses (others are not touched)."""
    hosts = {
        (r.host, r.listener_port)
        for r in routes
        if r.name.split("~")[0] in nginx
        and any(m.path_type is PathMatchType.REGEX for m in r.matches)
    }
    if not hosts:
        return routes
    out = []
    for route in routes:
        rewrite = route.filters.rewrite if route.filters is not None else None
        if (
            route.name.split("~")[0] in nginx
            and (route.host, route.listener_port) in hosts
            and route.matches
            and route.matches[0].path_type is PathMatchType.PREFIX
            and (rewrite is None or rewrite.path_type is not PathModifierType.PREFIX)
        ):
            match = route.matches[0]
            pattern = f"(?i)(?:{match.path}).*"
            if linear_regex.refusal(pattern) is not None:
                pattern = f"(?i)(?:{re.escape(match.path)}).*"
            route = dataclasses.replace(
                route,
                matches=(dataclasses.replace(match, path_type=PathMatchType.REGEX, path=pattern),),
            )
        out.append(route)
    return out
