"""The ingress-nginx controller's flags and its ConfigMap, as Waygate reads them.

`IngressNginx` is what the resolver's flags say (--ingress-nginx and friends);
`ControllerConfig` is the controller ConfigMap's data, parsed on every
translation (so a change to the ConfigMap applies live). Every key is given a
verdict as annotations are: honoured (it gives annotations their defaults or
maps onto a route field), no-op (nginx tuning with no meaning for a streaming
proxy) or not honoured. The block lists (block-cidrs, -user-agents, -referers)
reach every route of the class (waygate.resolver.ingress_nginx.access), as do
server-tokens (a response filter on Server), ssl-protocols and ssl-ciphers
(RouteTLS.protocols, .ciphers of the class's TLS hosts) and forwarded-for-header
(Route.client_address_header). A
not-honoured key that bears on access (global authentication, a WAF, a
block list or default source range that cannot be honoured) makes every Ingress of the
class not served: the controller-wide protection cannot be given, so nothing
is served unprotected.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from waygate.core.tls import VERSIONS, policy_problem
from waygate.resolver.ingress_nginx.catalogue import DEFAULT_PREFIX, Verdict

#: ingress-nginx's controller name (IngressClass spec.controller).
CONTROLLER = "k8s.io/ingress-nginx"
DEFAULT_CLASS = "nginx"
RISK_LEVELS = ("Low", "Medium", "High", "Critical")

#: The ConfigMap's global-auth-KEY keys: the auth-KEY annotation's, for every Ingress.
GLOBAL_AUTH = (
    "url",
    "method",
    "signin",
    "signin-redirect-param",
    "response-headers",
    "request-redirect",
    "cache-key",
    "cache-duration",
    "always-set-cookie",
)
#: Keys that give the annotations their defaults or map onto route fields.
HONOURED_KEYS = frozenset(
    (
        "allow-snippet-annotations",
        "annotations-risk-level",
        "ssl-redirect",
        "force-ssl-redirect",
        "http-redirect-code",
        "no-tls-redirect-locations",
        "no-auth-locations",
        "load-balance",
        "service-upstream",
        "proxy-connect-timeout",
        "proxy-read-timeout",
        "proxy-send-timeout",
        "hsts",
        "hsts-max-age",
        "hsts-include-subdomains",
        "hsts-preload",
        "use-forwarded-headers",
        "compute-full-forwarded-for",
        "enable-opentelemetry",
        "opentelemetry-trust-incoming-span",
        "opentelemetry-operation-name",
        # The client address (waygate.resolver.ingress_nginx.access) and the block lists.
        "proxy-real-ip-cidr",
        "block-cidrs",
        # The source-range annotations' defaults (an Ingress's own annotation wins).
        "whitelist-source-range",
        "denylist-source-range",
        "block-user-agents",
        "block-referers",
        "limit-req-status-code",
        "limit-conn-status-code",
        "limit-rate",
        "limit-rate-after",
        # Global external authentication (checked against the annotations' grammars).
        *(f"global-auth-{key}" for key in GLOBAL_AUTH),
        "proxy-body-size",
        # The response-side defaults (waygate.proxy.errorpages, .responserewrite).
        "custom-http-errors",
        "disable-proxy-intercept-errors",
        "global-allowed-response-headers",
        "proxy-redirect-from",
        "proxy-redirect-to",
        "proxy-cookie-domain",
        "proxy-cookie-path",
        "use-port-in-redirects",
        "proxy-http-version",
        # The Server header (more_clear_headers Server) and the HTTPS listener's
        # versions and ciphers for the class's hosts: `server_header`, `tls_policy`.
        "server-tokens",
        "allow-backend-server-header",
        "ssl-protocols",
        "ssl-ciphers",
        # The client address's header (real_ip_header): `client_address_header`.
        "forwarded-for-header",
        # nginx's http-level `access_log off` (an Ingress cannot turn it back on).
        "disable-access-log",
        "disable-http-access-log",
    )
)
#: Keys that are the defaults of the annotations of the same name (ingress-nginx's
#: defaults.Backend, read by the annotation's parser when the Ingress has none): the
#: value passes the annotation's grammar and handler, so its verdict is the
#: annotation's for that value (`annotations.config_verdicts`); an annotation wins.
ANNOTATION_DEFAULT_KEYS = frozenset(
    (
        "proxy-next-upstream",
        "proxy-next-upstream-tries",
        "proxy-next-upstream-timeout",
        "proxy-request-buffering",
        "preserve-trailing-slash",
        "relative-redirects",
    )
)
#: Keys naming another ConfigMap "NS/NAME" whose entries are headers: added to every
#: response (add-headers: nginx's http-level more_set_headers) or set on every
#: request to the backend (proxy-set-headers: proxy_set_header in every location);
#: an Ingress's custom-headers / snippet headers win (`annotations.config_headers`).
HEADER_KEYS = ("add-headers", "proxy-set-headers")
#: Keys ingress-nginx parses into its defaults but gives no Ingress (the annotation's
#: parser has no ConfigMap default, nor does the template read the key): no-ops there too.
UNUSED_DEFAULT_KEYS = frozenset(
    ("upstream-hash-by", "upstream-hash-by-subset", "upstream-hash-by-subset-size", "app-root")
)
_UNUSED_DEFAULT = (
    "ingress-nginx reads it but no Ingress gets it (the annotation's parser has no "
    "ConfigMap default)"
)
#: nginx tuning with no meaning for a streaming proxy.
NOOP_KEYS = frozenset(
    (
        "worker-processes",
        "worker-cpu-affinity",
        "worker-shutdown-timeout",
        "max-worker-connections",
        "max-worker-open-files",
        "proxy-buffering",
        "proxy-buffer-size",
        "proxy-buffers-number",
        "proxy-busy-buffers-size",
        "proxy-max-temp-file-size",
        "client-body-buffer-size",
        "client-header-buffer-size",
        "large-client-header-buffers",
        "reuse-port",
        "variables-hash-bucket-size",
        "variables-hash-max-size",
        "server-name-hash-bucket-size",
        "server-name-hash-max-size",
        "map-hash-bucket-size",
        "proxy-headers-hash-bucket-size",
        "proxy-headers-hash-max-size",
        "enable-underscores-in-headers",
        "error-log-level",
        "enable-vts-status",
        "http2-max-field-size",
        "http2-max-header-size",
        "ssl-buffer-size",
        "ssl-session-cache",
        "ssl-session-cache-size",
        "ssl-session-tickets",
        "ssl-session-timeout",
        "upstream-keepalive-connections",
        "upstream-keepalive-requests",
        "upstream-keepalive-timeout",
        "upstream-keepalive-time",
    )
)
#: Not honoured and bearing on access: every Ingress of the class is refused.
ACCESS_KEYS = frozenset(
    (
        "global-auth-snippet",
        "allowlist-source-range",  # (not an ingress-nginx key: whitelist- is)
        "enable-modsecurity",
        "enable-owasp-modsecurity-crs",
        "modsecurity-snippet",
        "global-rate-limit-memcached-host",
    )
)
_TRUE = frozenset(("true", "1", "t", "True", "TRUE", "T"))
_BLOCK_RE2 = "regular expressions in RE2 syntax (linear time), not PCRE"
_BLOCK_CIDRS = (
    "also applied where an Ingress has source ranges of its own (nginx's http-level "
    "deny is not inherited by a location with allow/deny rules)"
)
#: ssl-protocols names nginx knows that Waygate does not serve (its floor is TLS 1.2).
OLD_PROTOCOLS = ("SSLv2", "SSLv3", "TLSv1", "TLSv1.1")
#: ingress-nginx's defaults (internal/ingress/controller/config/config.go).
DEFAULT_PROTOCOLS = "TLSv1.2 TLSv1.3"
DEFAULT_FORWARDED_FOR = "X-Forwarded-For"
#: An HTTP field name (RFC 9110 token).
_HEADER_NAME = re.compile(r"[!#$%&'*+.^_`|~0-9A-Za-z-]{1,128}")
#: use-proxy-protocol: "true" -- what a listener reads is the proxy's own setting.
PROXY_PROTOCOL = (
    "the proxy reads the PROXY header (v1 or v2) on its HTTP and HTTPS ports only when "
    "started with --proxy-protocol: set it on the proxies behind the load balancer that "
    "sends it (the client address, X-Forwarded-For, source ranges and block-cidrs are "
    "then the header's); a header's destination port 443 makes X-Forwarded-Proto https, "
    "but ssl-redirect still answers requests that reached the HTTP port"
)
_PROXY_PROTOCOL_TIMEOUT = "the proxy's --proxy-protocol-timeout (default 5s), not this key"
#: A class name or an annotation prefix (a DNS subdomain).
DNS_NAME = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


@dataclass(frozen=True)
class IngressNginx:
    """What the resolver's --ingress-nginx flags say."""

    class_name: str = DEFAULT_CLASS
    prefix: str = DEFAULT_PREFIX
    configmap: tuple[str, str] | None = None  # (namespace, name)
    default_certificate: tuple[str, str] | None = None
    tcp_services: tuple[str, str] | None = None  # --tcp-services-configmap

    @classmethod
    def from_settings(cls, settings: Any) -> IngressNginx | None:
        """The resolver's --ingress-nginx flags (its Settings), checked: None when off;
        ValueError "FIELD: why" for a flag that is wrong or cannot be honoured."""
        given = [
            name
            for name in (
                "ingress_nginx_configmap",
                "tcp_services_configmap",
                "default_ssl_certificate",
                "admission_webhook_port",
            )
            if getattr(settings, name)
        ]
        if not settings.ingress_nginx:
            if given or settings.ingress_nginx_class != DEFAULT_CLASS:
                raise ValueError(f"{(given or ['ingress_nginx_class'])[0]}: needs --ingress-nginx")
            return None
        if not settings.kubernetes and settings.manifests is None:
            raise ValueError("ingress_nginx: needs --kubernetes or --manifests")
        if settings.admission_webhook_port and not settings.kubernetes:
            raise ValueError(
                "admission_webhook_port: the webhook answers a cluster's API server; "
                "it needs --kubernetes"
            )
        configmap, certificate, tcp = (
            parse_reference(getattr(settings, name), name) if getattr(settings, name) else None
            for name in (
                "ingress_nginx_configmap",
                "default_ssl_certificate",
                "tcp_services_configmap",
            )
        )
        return cls(
            class_name=settings.ingress_nginx_class,
            prefix=settings.annotations_prefix,
            configmap=configmap,
            default_certificate=certificate,
            tcp_services=tcp,
        )

    def annotated(self, obj: Any) -> bool:
        """The object carries at least one annotation of the prefix."""
        annotations = ((obj or {}).get("metadata") or {}).get("annotations") or {}
        return isinstance(annotations, dict) and any(
            self.annotation(str(key)) is not None for key in annotations
        )

    def annotation(self, full: str) -> str | None:
        """The short name of an annotation of our prefix ("rewrite-target"), else None."""
        head, slash, short = full.partition("/")
        return short if slash and head == self.prefix else None


@dataclass(frozen=True)
class KeyVerdict:
    key: str
    value: str
    verdict: Verdict
    note: str = ""


@dataclass(frozen=True)
class ControllerConfig:
    """The controller ConfigMap's data with ingress-nginx's defaults."""

    data: Mapping[str, str] = field(default_factory=dict)

    def text(self, key: str, default: str) -> str:
        value = self.data.get(key)
        return default if value is None or value == "" else str(value)

    def flag(self, key: str, default: bool) -> bool:
        value = self.data.get(key)
        return default if value is None or value == "" else str(value) in _TRUE

    def seconds(self, key: str, default: float) -> float:
        try:
            return float(self.text(key, str(default)))
        except ValueError:
            return default

    @property
    def snippets_allowed(self) -> bool:
        """ingress-nginx's model: allow-snippet-annotations (default false) and a risk
        level (default High) of Critical, the level of every snippet annotation."""
        return (
            self.flag("allow-snippet-annotations", False)
            and self.text("annotations-risk-level", "High") == "Critical"
        )

    def tls_policy(self) -> tuple[tuple[str, ...], str, dict[str, tuple[Verdict, str]]]:
        """ssl-protocols and ssl-ciphers as the class's routes carry them
        (RouteTLS.protocols, .ciphers) and each key's (verdict, note) when given."""
        notes: dict[str, tuple[Verdict, str]] = {}
        names = self.text("ssl-protocols", DEFAULT_PROTOCOLS).split()
        unknown = [n for n in names if n not in OLD_PROTOCOLS and n not in VERSIONS]
        served = tuple(n for n in VERSIONS if n in names)
        protocols: tuple[str, ...] = ()
        if unknown:
            notes["ssl-protocols"] = (
                Verdict.NOT_HONOURED,
                f"{unknown[0]!r} is not a protocol nginx knows: TLSv1.2 and TLSv1.3 are served",
            )
        elif not served:
            notes["ssl-protocols"] = (
                Verdict.NOT_HONOURED,
                "only protocols older than TLS 1.2, which Waygate never serves: the "
                "class's hosts keep TLSv1.2 and TLSv1.3",
            )
        else:
            differences = []
            if any(n in OLD_PROTOCOLS for n in names):
                older = " ".join(n for n in names if n in OLD_PROTOCOLS)
                differences.append(f"{older} not served (Waygate's floor is TLS 1.2)")
            if "TLSv1.3" not in served:
                differences.append(
                    "a client offering TLS 1.3 gets it (the version is chosen before "
                    "the host is known; only older versions are refused per host)"
                )
            elif "TLSv1.2" not in served:
                protocols = ("TLSv1.3",)
            notes["ssl-protocols"] = (
                (Verdict.DIFFERENT, "; ".join(differences))
                if differences
                else (Verdict.HONOURED, "")
            )
        ciphers = self.text("ssl-ciphers", "")
        if ciphers:
            problem = policy_problem((), ciphers)
            notes["ssl-ciphers"] = (
                (Verdict.NOT_HONOURED, f"{problem}: the proxy's ciphers apply")
                if problem
                else (Verdict.HONOURED, "the TLS 1.2 suites (TLS 1.3's are OpenSSL's, as nginx's)")
            )
            if problem:
                ciphers = ""
        return protocols, ciphers, notes

    def server_header(self) -> tuple[tuple[tuple[str, str], ...], tuple[str, ...], str]:
        """server-tokens (and allow-backend-server-header) as response filters: (lines
        set, names removed, the difference to report or "").

        ingress-nginx renders `server_tokens off; more_clear_headers Server;` by
        default: no Server header on any answer. With "true", nginx's proxy module
        hides the backend's Server (unless allow-backend-server-header) and sends its
        own, "nginx/VERSION"."""
        if not self.flag("server-tokens", False):
            return (), ("Server",), ""
        if self.flag("allow-backend-server-header", False):
            return (), (), ""
        return (
            (("Server", "waygate"),),
            (),
            "the backends' answers carry Server: waygate, without a version; the "
            "proxy's own answers carry no Server header",
        )

    def client_address_header(self) -> tuple[str, str]:
        """forwarded-for-header as Route.client_address_header (a lower-case name; ""
        for X-Forwarded-For or without use-forwarded-headers) and why it cannot be
        honoured ("" : it can)."""
        header = self.text("forwarded-for-header", DEFAULT_FORWARDED_FOR)
        if not _HEADER_NAME.fullmatch(header):
            return "", f"forwarded-for-header {header!r} is not a header name"
        if not self.flag("use-forwarded-headers", False) or header.lower() == "x-forwarded-for":
            return "", ""
        return header.lower(), ""

    def verdicts(self) -> list[KeyVerdict]:
        """Each key's verdict from its own value (`annotations.config_verdicts` judges
        the annotation defaults and the header keys further)."""
        out = []
        tls_notes = self.tls_policy()[2]
        for key in sorted(self.data):
            value = str(self.data[key])
            if key in tls_notes:
                verdict, note = tls_notes[key]
                out.append(KeyVerdict(key, value, verdict, note))
            elif key == "server-tokens" and self.server_header()[2]:
                out.append(KeyVerdict(key, value, Verdict.DIFFERENT, self.server_header()[2]))
            elif key == "forwarded-for-header" and self.client_address_header()[1]:
                out.append(
                    KeyVerdict(key, value, Verdict.NOT_HONOURED, self.client_address_header()[1])
                )
            elif key == "block-cidrs":
                out.append(KeyVerdict(key, value, Verdict.DIFFERENT, _BLOCK_CIDRS))
            elif key in ("block-user-agents", "block-referers") and "~" in value:
                out.append(KeyVerdict(key, value, Verdict.DIFFERENT, _BLOCK_RE2))
            elif key == "use-proxy-protocol" and value in _TRUE:
                out.append(KeyVerdict(key, value, Verdict.DIFFERENT, PROXY_PROTOCOL))
            elif key == "proxy-protocol-header-timeout":
                out.append(KeyVerdict(key, value, Verdict.DIFFERENT, _PROXY_PROTOCOL_TIMEOUT))
            elif (
                key in HONOURED_KEYS
                or key in ANNOTATION_DEFAULT_KEYS
                or key in HEADER_KEYS
                or key == "retry-non-idempotent"
                or (key == "use-proxy-protocol" and value not in _TRUE)
            ):
                out.append(KeyVerdict(key, value, Verdict.HONOURED))
            elif key in NOOP_KEYS:
                out.append(KeyVerdict(key, value, Verdict.NOOP, "nginx tuning"))
            elif key in UNUSED_DEFAULT_KEYS:
                out.append(KeyVerdict(key, value, Verdict.NOOP, _UNUSED_DEFAULT))
            elif key in ACCESS_KEYS:
                out.append(
                    KeyVerdict(
                        key,
                        value,
                        Verdict.NOT_HONOURED,
                        "bears on access: every Ingress of the class is not served",
                    )
                )
            else:
                out.append(KeyVerdict(key, value, Verdict.NOT_HONOURED, "not honoured"))
        return out

    def refusal(self) -> str:
        """Why no Ingress can be served under this ConfigMap ("" : they can)."""
        for key in sorted(self.data):
            if key in ACCESS_KEYS and str(self.data[key]).strip() not in ("", "false"):
                return f"ConfigMap key {key}: not honoured by Waygate, and it bears on access"
        return ""


def keeps_secret(obj: Any, settings: IngressNginx | None) -> bool:
    """Whether a watched Secret is kept: TLS ones always; with --ingress-nginx also
    Opaque ones (auth-secret's htpasswd: auth-file or auth-map)."""
    kind = (obj or {}).get("type") or "Opaque"
    return kind == "kubernetes.io/tls" or (settings is not None and kind == "Opaque")


def config_from(obj: Any) -> ControllerConfig:
    data = (obj or {}).get("data") or {}
    if not isinstance(data, dict):
        return ControllerConfig()
    return ControllerConfig({str(k): str(v) for k, v in data.items()})


def parse_reference(value: str, what: str) -> tuple[str, str]:
    """NS/NAME -> (namespace, name); ValueError naming `what` otherwise."""
    namespace, slash, name = value.partition("/")
    if not slash or not namespace or not name or "/" in name:
        raise ValueError(f"{what}: {value!r} must be NAMESPACE/NAME")
    return namespace, name


def class_of(obj: Any) -> str:
    """The class an Ingress names: spec.ingressClassName, else the legacy annotation."""
    spec = obj.get("spec") if isinstance(obj.get("spec"), dict) else {}
    name = spec.get("ingressClassName")
    if isinstance(name, str) and name:
        return name
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    legacy = annotations.get("kubernetes.io/ingress.class") if isinstance(annotations, dict) else ""
    return str(legacy or "")


def classes(
    ingress_classes: Mapping[tuple[str, str], Any], settings: IngressNginx | None
) -> dict[str, Any]:
    """The classes ingress-nginx would serve, by name: IngressClasses whose
    controller is k8s.io/ingress-nginx, and --ingress-nginx-class when no
    IngressClass of that name exists (then the object is {})."""
    if settings is None:
        return {}
    out = {
        key[1]: obj
        for key, obj in ingress_classes.items()
        if ((obj or {}).get("spec") or {}).get("controller") == CONTROLLER
    }
    if not any(key[1] == settings.class_name for key in ingress_classes):
        out[settings.class_name] = {}
    return out


def default_class(ingress_classes: Mapping[str, Any]) -> str | None:
    """The class (by name) annotated ingressclass.kubernetes.io/is-default-class: "true"."""
    return next(
        (
            name
            for name, obj in sorted(ingress_classes.items())
            if (((obj or {}).get("metadata") or {}).get("annotations") or {}).get(
                "ingressclass.kubernetes.io/is-default-class"
            )
            == "true"
        ),
        None,
    )


def with_plain_paths(obj: Any) -> Any:
    """A copy of an Ingress whose rule paths are all "/": its paths are the
    plan's to check (regular expressions are not paths the Gateway parser takes)."""
    spec = obj.get("spec")
    if not isinstance(spec, dict) or not isinstance(spec.get("rules"), list):
        return obj
    rules = []
    for rule in spec["rules"]:
        if isinstance(rule, dict) and isinstance(rule.get("http"), dict):
            http = dict(rule["http"])
            if isinstance(http.get("paths"), list):
                http["paths"] = [
                    {**item, "path": "/"} if isinstance(item, dict) else item
                    for item in http["paths"]
                ]
            rule = {**rule, "http": http}
        rules.append(rule)
    return {**obj, "spec": {**spec, "rules": rules}}
