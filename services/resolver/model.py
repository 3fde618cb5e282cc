"""The resolver's domain objects: services, endpoints, routes, tunnel presence.

Plain frozen dataclasses mirroring `waygate.resolver.v1` (the proto side lives
in `convert.py`), so sources (file, Kubernetes), the store and the servers share
one vocabulary without importing grpc or protobuf.

Invariants:
- Every object is immutable and hashable-by-value; equality is what the store
  uses to tell an effective change from a no-op write.
- Collections are tuples, never lists, so an object cannot change after the
  store has accepted it.
- Each kind has a `key`; it is unique within the store for that kind.
- Durations are float seconds, or None for "the consumer's default".
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime
from types import MappingProxyType
from typing import Final

SERVICE_TYPES = ("ClusterIP", "NodePort", "LoadBalancer", "ExternalName")
PROTOCOLS = ("TCP", "UDP", "SCTP")

ServiceKey = tuple[str, str]  # (namespace, name)
EndpointKey = tuple[str, str, str]  # (namespace, service, address)
RouteKey = tuple[str, str]  # (namespace, name)


class Kind(enum.Enum):
    """The four kinds of object the store holds (ResourceKind in the proto)."""

    SERVICES = "services"
    ENDPOINTS = "endpoints"
    ROUTES = "routes"
    TUNNELS = "tunnels"


# ---------------------------------------------------------------- services


@dataclass(frozen=True)
class ServicePort:
    name: str
    port: int
    # The endpoint port this maps to: a number ("8080") or an endpoint port name.
    target_port: str
    protocol: str = "TCP"
    node_port: int = 0
    # Kubernetes appProtocol; HTTP2_PROTOCOLS make the proxy speak HTTP/2 to it.
    app_protocol: str = ""


@dataclass(frozen=True)
class Service:
    namespace: str
    name: str
    type: str = "ClusterIP"
    cluster_ips: tuple[str, ...] = ()
    headless: bool = False
    external_name: str = ""
    ports: tuple[ServicePort, ...] = ()

    @property
    def key(self) -> ServiceKey:
        return (self.namespace, self.name)


# ---------------------------------------------------------------- endpoints


@dataclass(frozen=True)
class EndpointPort:
    name: str
    port: int
    protocol: str = "TCP"


@dataclass(frozen=True)
class Endpoint:
    namespace: str
    service: str
    address: str
    ports: tuple[EndpointPort, ...] = ()
    ready: bool = True
    serving: bool = True
    terminating: bool = False
    zone: str = ""
    node_name: str = ""
    # Only reachable through a tunnel to node_name (an edge node behind NAT).
    tunnel: bool = False
    hostname: str = ""

    @property
    def key(self) -> EndpointKey:
        return (self.namespace, self.service, self.address)

    @property
    def service_key(self) -> ServiceKey:
        return (self.namespace, self.service)

    @property
    def usable(self) -> bool:
        """Ready for traffic: a terminating endpoint never is, even while serving."""
        return self.ready and not self.terminating


# ---------------------------------------------------------------- routes


class TLSTermination(enum.Enum):
    EDGE = "edge"
    PASSTHROUGH = "passthrough"
    REENCRYPT = "reencrypt"


class InsecureEdgePolicy(enum.Enum):
    # UNSPECIFIED in the proto means NONE, as an empty field does in OpenShift.
    NONE = "None"
    ALLOW = "Allow"
    REDIRECT = "Redirect"


class BalancePolicy(enum.Enum):
    # UNSPECIFIED: the proxy's default (leastconn, or source for passthrough).
    DEFAULT = ""
    RANDOM = "random"
    ROUND_ROBIN = "roundrobin"
    LEAST_CONN = "leastconn"
    SOURCE = "source"


class SameSite(enum.Enum):
    """The sticky cookie's SameSite attribute (UNSPECIFIED in the proto means Lax)."""

    LAX = "Lax"
    STRICT = "Strict"
    # The proxy adds Secure, as browsers require for SameSite=None.
    NONE = "None"


class ForwardedHeadersMode(enum.Enum):
    """X-Forwarded-* and Forwarded handling (OpenShift's set-forwarded-headers)."""

    APPEND = "append"
    REPLACE = "replace"
    IF_NONE = "if-none"
    NEVER = "never"


@dataclass(frozen=True)
class RouteBackend:
    service: str
    weight: int = 100
    # Gateway API backendRefs: the service's namespace (empty: the route's) and
    # its port (name or number; empty: the route's target_port).
    namespace: str = ""
    port: str = ""
    # Why this backend cannot be used (not found, not granted, unknown kind);
    # its share of the requests is answered 500, as the Gateway API says.
    invalid: str = ""
    # The Service's cluster IP at the Service port is this backend's one endpoint
    # (kube-proxy or a mesh balances: ingress-nginx's service-upstream); a Service
    # without one (headless, ExternalName) keeps its endpoints, as ingress-nginx.
    use_cluster_ip: bool = False


@dataclass(frozen=True)
class HSTS:
    """RFC 6797 Strict-Transport-Security sent on HTTPS responses."""

    max_age: float
    include_subdomains: bool = False
    preload: bool = False


@dataclass(frozen=True)
class RouteTLS:
    termination: TLSTermination
    certificate: str = ""
    key: str = ""
    ca_certificate: str = ""
    destination_ca_certificate: str = ""
    insecure_edge_termination_policy: InsecureEdgePolicy = InsecureEdgePolicy.NONE
    # None: no Strict-Transport-Security header.
    hsts: HSTS | None = None
    # PEM CA(s) a client certificate must chain to; set: a client certificate is required.
    client_ca_certificate: str = ""
    # Name the backend's certificate must carry and the SNI sent (reencrypt);
    # empty: SERVICE.NAMESPACE.svc of the backend.
    destination_server_name: str = ""
    # Present the proxy's own client certificate to the backend.
    present_client_certificate: bool = False
    # BackendTLSPolicy (reencrypt): verify the backend against the system's
    # well-known CAs instead (destination_ca_certificate empty), and accept it
    # when its certificate carries one of these SANs (set: the server name is
    # only the SNI sent, not the name verified).
    destination_system_ca: bool = False
    destination_san_hostnames: tuple[str, ...] = ()
    destination_san_uris: tuple[str, ...] = ()
    # ingress-nginx proxy-ssl-secret (reencrypt): the client certificate (PEM chain)
    # presented to the backend instead of the proxy's own, and its key (a secret,
    # withheld as `key` is).
    backend_client_certificate: str = ""
    backend_client_key: str = ""
    # ingress-nginx ssl-protocols and ssl-ciphers: the versions ("TLSv1.2",
    # "TLSv1.3"; empty: both) and TLS 1.2 cipher list (empty: the proxy's) of
    # the route's host.
    protocols: tuple[str, ...] = ()
    ciphers: str = ""


@dataclass(frozen=True)
class StickySessions:
    disable_cookies: bool = False
    cookie_name: str = ""
    same_site: SameSite = SameSite.LAX
    # ingress-nginx session-cookie-*: Path ("": /), Domain ("": none), Max-Age
    # (seconds; 0: a session cookie) and Secure of the cookie.
    cookie_path: str = ""
    cookie_domain: str = ""
    cookie_max_age: int = 0
    cookie_secure: bool = False


@dataclass(frozen=True)
class RouteTimeouts:
    connect: float | None = None
    client: float | None = None
    server: float | None = None
    http_request: float | None = None
    tunnel: float | None = None
    keep_alive: float | None = None


#: RouteTimeouts' fields in order, and each by its camelCase key (the routes
#: file's and the CRD's spelling): every converter reads these, none lists them.
TIMEOUT_FIELDS: tuple[str, ...] = tuple(f.name for f in dataclasses.fields(RouteTimeouts))
TIMEOUT_KEYS: Mapping[str, str] = MappingProxyType(
    {
        name.split("_")[0] + "".join(part.title() for part in name.split("_")[1:]): name
        for name in TIMEOUT_FIELDS
    }
)


# ---------------------------------------------------------------- route status

#: Condition types. Routes of the file and the Route CRD carry Admitted,
#: ResolvedRefs and Conflicted; the Gateway API kinds say Accepted where
#: OpenShift says Admitted (both mean "the proxy serves this route").
ADMITTED = "Admitted"
ACCEPTED = "Accepted"
RESOLVED_REFS = "ResolvedRefs"
CONFLICTED = "Conflicted"

#: Condition status values, spelled as Kubernetes spells them.
TRUE, FALSE, UNKNOWN = "True", "False", "Unknown"


@dataclass(frozen=True)
class RouteCondition:
    """One condition of a route, as a Kubernetes condition (metav1.Condition)."""

    type: str
    status: str  # TRUE | FALSE | UNKNOWN
    # CamelCase, machine-readable: why the condition has this status.
    reason: str
    # For people: what is wrong and with what ("service mine/ghost not found").
    message: str = ""
    # When `status` last changed (not reason or message), as in Kubernetes.
    last_transition: datetime | None = None
    # The source object's generation the condition was computed for (0: unknown).
    observed_generation: int = 0


@dataclass(frozen=True)
class RouteStatus:
    """What the resolver concluded about a route (computed, never read from a source)."""

    conditions: tuple[RouteCondition, ...] = ()

    def condition(self, type: str) -> RouteCondition | None:
        for condition in self.conditions:
            if condition.type == type:
                return condition
        return None

    @property
    def admitted(self) -> bool:
        """False when an Admitted or Accepted condition says False: the proxy must
        not serve the route (another route owns its host or host and path)."""
        return not any(
            c.type in (ADMITTED, ACCEPTED) and c.status == FALSE for c in self.conditions
        )

    def problem(self) -> str | None:
        """The first thing wrong, for a person (a 503 page, `waygate routes`), or None."""
        for condition in self.conditions:
            bad = (
                condition.status == TRUE
                if condition.type == CONFLICTED
                else condition.status == FALSE
            )
            if bad:
                return condition.message or condition.reason
        return None


@dataclass(frozen=True)
class SourceState:
    """A route source's own health (valid, or its last error and since when)."""

    source: str  # "file:PATH", "manifests:PATH", "kubernetes"
    valid: bool
    # `path:line: reason` of the rejected content; empty while valid.
    error: str = ""
    # The store version that holds the source's last accepted content (0: never loaded).
    loaded_version: int = 0
    # When the last accepted content was loaded.
    loaded_at: datetime | None = None
    # When the current run of failures began (None while valid).
    error_since: datetime | None = None


# ---------------------------------------------------------------- Gateway API route parts


class PathMatchType(enum.Enum):
    PREFIX = "PathPrefix"
    EXACT = "Exact"
    REGEX = "RegularExpression"


class ValueMatchType(enum.Enum):
    EXACT = "Exact"
    REGEX = "RegularExpression"


@dataclass(frozen=True)
class HeaderMatch:
    """One header (or query parameter) condition of a match."""

    name: str
    value: str
    type: ValueMatchType = ValueMatchType.EXACT


@dataclass(frozen=True)
class HostClaim:
    """A claim on a host made for a route by a Gateway listener's hostname: the
    Gateway (its namespace is the claim's), the listener, when it was made."""

    namespace: str
    gateway: str
    listener: str
    created: datetime | None = None

    @property
    def what(self) -> str:
        return f"Gateway {self.namespace}/{self.gateway} listener {self.listener}"


@dataclass(frozen=True)
class RouteMatch:
    """One HTTPRoute match: every condition must hold (a route matches when any does)."""

    path_type: PathMatchType = PathMatchType.PREFIX
    path: str = "/"
    headers: tuple[HeaderMatch, ...] = ()
    query: tuple[HeaderMatch, ...] = ()
    # Upper-case HTTP method; empty: any.
    method: str = ""


@dataclass(frozen=True)
class HeaderModifier:
    """Set (replace), add (append) and remove headers, in that order per the spec."""

    set: tuple[tuple[str, str], ...] = ()
    add: tuple[tuple[str, str], ...] = ()
    remove: tuple[str, ...] = ()


class PathModifierType(enum.Enum):
    NONE = ""
    FULL = "ReplaceFullPath"
    PREFIX = "ReplacePrefixMatch"


@dataclass(frozen=True)
class Redirect:
    """RequestRedirect: empty fields keep the request's own value."""

    scheme: str = ""
    hostname: str = ""
    port: int = 0
    path_type: PathModifierType = PathModifierType.NONE
    path: str = ""
    status: int = 302
    # ingress-nginx's HTTPS redirect without preserve-trailing-slash: a trailing
    # "/" of the request's path-and-query is dropped (not from "/" itself).
    strip_trailing_slash: bool = False


@dataclass(frozen=True)
class Rewrite:
    """URLRewrite: the request's Host and path as the backend sees them."""

    hostname: str = ""
    path_type: PathModifierType = PathModifierType.NONE
    path: str = ""


@dataclass(frozen=True)
class Mirror:
    """RequestMirror: a copy of each request goes here and its answer is dropped."""

    service: str
    namespace: str = ""
    port: str = ""
    percent: int = 100


@dataclass(frozen=True)
class RouteFilters:
    request_headers: HeaderModifier | None = None
    response_headers: HeaderModifier | None = None
    redirect: Redirect | None = None
    rewrite: Rewrite | None = None
    mirrors: tuple[Mirror, ...] = ()


@dataclass(frozen=True)
class RouteAccess:
    """Who may reach a route (ingress-nginx's access annotations; waygate.proxy.access
    decides it per request). `credentials` are secrets, withheld as tls.key is."""

    block: tuple[str, ...] = ()  # CIDRs answered 403 whatever else holds
    deny: tuple[str, ...] = ()
    allow: tuple[str, ...] = ()  # given: any address outside them is refused
    block_user_agents: tuple[str, ...] = ()  # "~REGEX" (case-sensitive), "~*REGEX", exact
    block_referers: tuple[str, ...] = ()
    # X-Forwarded-For names the client when the peer is within these (nginx real_ip).
    trusted_proxies: tuple[str, ...] = ()
    auth_type: str = ""  # "basic", "digest" or "" (none)
    auth_realm: str = ""
    credentials: tuple[str, ...] = ()  # "user:hash" lines (digest: "user:realm:HA1")
    satisfy_any: bool = False
    # auth-tls-*: the client certificate the route's host asks for (None: none).
    client_certificate: ClientCertificate | None = None


@dataclass(frozen=True)
class ClientCertificate:
    """ingress-nginx's auth-tls-* annotations (nginx's ssl_verify_client and friends):
    the proxy's HTTPS listener asks for a certificate on the route's host and
    decides each request by it (waygate.proxy.clientcert)."""

    ca_certificates: str  # PEM bundle: the Secret's ca.crt
    revocation_lists: str = ""  # PEM CRLs: the Secret's ca.crl (every CA needs one)
    verify: str = "on"  # on, optional, optional_no_ca, off
    depth: int = 1  # intermediate CAs allowed (ssl_verify_depth)
    error_page: str = ""  # a 302 there instead of the 400 page
    pass_certificate: bool = False  # ssl-client-cert to the backend
    match_subject: str = ""  # RE2 searched in the subject DN (auth-tls-match-cn)
    # Set: the host's auth-tls-* (another Ingress's) cannot be honoured: every request 403.
    refusal: str = ""


@dataclass(frozen=True)
class RateLimit:
    """ingress-nginx's limit-* annotations: per proxy replica, keyed by the client
    address (nginx limit_req with nodelay, limit_conn). 0: no such limit."""

    rps: int = 0
    rpm: int = 0
    # The burst a client may send at once: the rate times this (nginx limit_req burst).
    burst_multiplier: int = 5
    # Requests in flight per client address (nginx limit_conn).
    connections: int = 0
    # Client addresses and CIDRs never limited (limit-allowlist).
    allow: tuple[str, ...] = ()
    # The answers' statuses (the ConfigMap's limit-req-status-code, limit-conn-status-code).
    request_status: int = 503
    connection_status: int = 503


@dataclass(frozen=True)
class ExternalAuth:
    """ingress-nginx's auth-url and friends: every request is first asked of `url`
    (nginx auth_request); a 2xx lets it through, 401/403 answer the client."""

    url: str  # http(s)://HOST[:PORT]/PATH[?QUERY]
    method: str = ""  # "": the request's own
    signin: str = ""  # where a 401 is redirected ("": the 401 itself)
    signin_redirect_param: str = "rd"
    response_headers: tuple[str, ...] = ()  # copied from the answer to the request
    request_redirect: str = ""  # X-Auth-Request-Redirect ("": the request's URI)
    proxy_set_headers: tuple[tuple[str, str], ...] = ()  # more headers to the auth service
    # auth-cache-key (literal text, $http_NAME, $cookie_NAME, $remote_addr, $host; "":
    # no cache) and auth-cache-duration: (status, seconds) an answer is kept.
    cache_key: str = ""
    cache_durations: tuple[tuple[int, float], ...] = ()
    # auth-always-set-cookie: the answer's Set-Cookie also on non-2xx/3xx answers.
    always_set_cookie: bool = False
    # use-forwarded-headers (proxy-real-ip-cidr) and compute-full-forwarded-for: the
    # client address the auth service is told, as nginx's real_ip finds it.
    trusted_proxies: tuple[str, ...] = ()
    full_forwarded_for: bool = False


@dataclass(frozen=True)
class Canary:
    """A canary Ingress folded into its main Ingress's route (ingress-nginx's
    alternative backend): `Route.backends[:main_backends]` are the main ones, the
    rest the canary's; the proxy decides each request as ingress-nginx's
    balancer.lua: a sticky cookie naming a main endpoint, then one naming a canary
    endpoint (not with `legacy_affinity`), then the header, the cookie, the weight."""

    main_backends: int
    weight: int = 0
    weight_total: int = 100  # the draw is 1..max(100, weight_total), as balancer.lua
    header: str = ""
    header_value: str = ""  # the header's value exactly ("": always/never)
    header_pattern: str = ""  # a regular expression found in the header's value
    cookie: str = ""  # canary-by-cookie: its value "always" or "never"
    # affinity-canary-behavior legacy: the canary's answers set no sticky cookie.
    legacy_affinity: bool = False


@dataclass(frozen=True)
class UrlMirror:
    """ingress-nginx's mirror-target / -host / -request-body: a copy of each request
    to an http(s) URL (`$request_uri` in it: the request's target), fire and forget."""

    target: str
    host: str = ""  # the copy's Host ("": the URL's host)
    request_body: bool = True  # false: a request with a body is copied without it


@dataclass(frozen=True)
class Cors:
    """ingress-nginx's enable-cors with its cors-* annotations (their defaults here):
    origins are `*` or scheme://host[:port] with an optional `*.` subdomain wildcard."""

    allow_origins: tuple[str, ...] = ("*",)
    allow_methods: str = "GET, PUT, POST, DELETE, PATCH, OPTIONS"
    allow_headers: str = (
        "DNT,Keep-Alive,User-Agent,X-Requested-With,If-Modified-Since,"
        "Cache-Control,Content-Type,Range,Authorization"
    )
    expose_headers: str = ""
    allow_credentials: bool = True
    max_age: int = 1728000


@dataclass(frozen=True)
class Route:
    namespace: str
    name: str
    host: str
    path: str = "/"
    # The first backend is the route's "to"; the rest are alternate backends.
    backends: tuple[RouteBackend, ...] = ()
    target_port: str = ""
    # None: a plain HTTP route.
    tls: RouteTLS | None = None
    balance: BalancePolicy = BalancePolicy.DEFAULT
    sticky: StickySessions = field(default_factory=StickySessions)
    timeouts: RouteTimeouts = field(default_factory=RouteTimeouts)
    auth_proxy_headers: bool = False
    forwarded_headers: ForwardedHeadersMode = ForwardedHeadersMode.APPEND
    # "" (the service port's app_protocol decides), or one of UPSTREAM_PROTOCOLS.
    upstream_protocol: str = ""
    # Request buffering (as nginx's proxy_request_buffering): a request's body is
    # taken in whole before an upstream is used; off streams it (uploads that must
    # flow as they come). gRPC requests are never buffered.
    request_buffering: bool = True
    # When the source created it (the CRD's metadata.creationTimestamp); None: the
    # store's first sight of it decides its age (routes-file order within a load).
    created: datetime | None = None
    # Computed by the resolver's store (waygate.resolver.status); sources leave it None.
    status: RouteStatus | None = None
    # Gateway API and Ingress routes (waygate.resolver.gateway); the routes file
    # and the Route CRD leave these empty. With matches, `path` is unused and
    # the route serves a request when any match holds; an empty host then
    # means any host.
    matches: tuple[RouteMatch, ...] = ()
    filters: RouteFilters | None = None
    # timeouts.request / timeouts.backendRequest (None: none).
    request_timeout: float | None = None
    backend_request_timeout: float | None = None
    # The Gateway listener's port ("NS/NAME" of its Gateway), 0 for the
    # proxy's own ports: the proxy maps it to a local port (--listener-ports).
    listener_port: int = 0
    gateway: str = ""
    # That listener's protocol (HTTP, HTTPS, TLS): what a proxy binds for a
    # listener port it does not map to its own ports.
    listener_protocol: str = ""
    # The object it came from ("HTTPRoute NS/NAME") and the rule's index: with
    # `created`, the spec's tie-breakers between equally specific matches.
    origin: str = ""
    rule_index: int = 0
    # ingress-nginx Ingresses (waygate.resolver.ingress_nginx): set, the route
    # is not served (Admitted False) for this (CamelCase reason, message) -- an
    # annotation it cannot honour that bears on access, a value outside its
    # grammar, a path outside its pathType; and what of its annotations is not
    # honoured exactly ("annotation: verdict (why)"), its AnnotationsHonoured
    # condition.
    ingress_refusal: tuple[str, str] | None = None
    ingress_verdicts: tuple[str, ...] = ()
    # None: anyone may reach the route.
    access: RouteAccess | None = None
    # Whose claim on `host` this route is (waygate.resolver.status): a Gateway API
    # route attached through a listener's hostname is that Gateway's; None: its own.
    host_claim: HostClaim | None = None
    # TCP services (listener_protocol TCP_LISTENER): PROXY protocol from the
    # client (decoded) and to the backend (sent).
    proxy_protocol_from_client: bool = False
    proxy_protocol_to_backend: bool = False
    # ingress-nginx limit-* annotations (None: not limited).
    rate_limit: RateLimit | None = None
    # ingress-nginx auth-url and friends (None: no external authentication).
    external_auth: ExternalAuth | None = None
    # ingress-nginx responses: CORS (None: off) and the request body limit in
    # bytes (0: none), answered by the proxy (waygate.proxy.cors, .bodylimit).
    cors: Cors | None = None
    max_request_body: int = 0
    # proxy-next-upstream: "" (the proxy's default: "error timeout"), else the
    # tokens honoured ("error", "timeout"; "off"); connects tried at most
    # (0: the proxy's default, decision.MAX_CONNECT_ATTEMPTS).
    next_upstream: str = ""
    next_upstream_tries: int = 0
    # rewrite-target with capture groups ($1..$9 of the path regex; "": none).
    rewrite_target: str = ""
    # ingress-nginx default-backend: a Service of the route's namespace taking the
    # requests no endpoint of its own backends can ("": none).
    default_backend: str = ""
    # ingress-nginx upstream-hash-by: the nginx variable whose value is the source
    # policy's hash key ("": the client address).
    hash_by: str = ""
    # ingress-nginx upstream-hash-by-subset(-size): the source policy hashes to one
    # subset of this many endpoints, then picks one of them at random (0: off).
    hash_subset_size: int = 0
    # ingress-nginx's response-side annotations (waygate.proxy.responserewrite and
    # .errorpages): proxy-redirect-from/-to ("": none), proxy-cookie-domain and
    # -path ("FROM TO"; "": none), custom-http-errors and
    # disable-proxy-intercept-errors, use-port-in-redirects,
    # connection-proxy-header ("": the proxy's own) and enable-access-log "false".
    redirect_from: str = ""
    redirect_to: str = ""
    cookie_domain: str = ""
    cookie_path: str = ""
    custom_http_errors: tuple[int, ...] = ()
    intercept_errors_disabled: bool = False
    port_in_redirects: bool = False
    connection_header: str = ""
    access_log_disabled: bool = False
    # ingress-nginx use-proxy-protocol: clients arrive behind a PROXY protocol header
    # (read by a proxy with --proxy-protocol; one without it reports the mismatch).
    client_proxy_protocol: bool = False
    # ingress-nginx canary annotations: a canary folded into this route (None: none).
    canary: Canary | None = None
    # ingress-nginx limit-rate / limit-rate-after: a response's body paced to this
    # many bytes a second after its first `limit_rate_after` bytes (0: not paced).
    limit_rate: int = 0
    limit_rate_after: int = 0
    # ingress-nginx mirror-target: a copy of each request to a URL (None: none).
    url_mirror: UrlMirror | None = None
    # proxy-next-upstream-timeout in seconds (0: no bound on the tries' time).
    next_upstream_timeout: float = 0.0
    # ingress-nginx backend-protocol AUTO_HTTP: TLS to the backend (as `tls`
    # reencrypts) only for requests whose client came over TLS, plain otherwise.
    upstream_scheme_from_client: bool = False
    # proxy-http-version "1.0": HTTP/1.0 to an HTTP/1.1 backend (waygate.proxy.http10).
    upstream_http10: bool = False
    # permanent-redirect / temporal-redirect: the Location exactly as written
    # (nginx's `return CODE URL`; filters.redirect gives the status); "": none.
    redirect_location: str = ""
    # ingress-nginx forwarded-for-header: the header (lower-case) a trusted peer's
    # client address is read from; "": X-Forwarded-For.
    client_address_header: str = ""
    # ingress-nginx's OpenTelemetry annotations (waygate.proxy.records): the span's
    # name ("": the proxy's), no span at all, a client's trace context not trusted.
    span_name: str = ""
    tracing_off: bool = False
    untrusted_trace_context: bool = False

    @property
    def key(self) -> RouteKey:
        return (self.namespace, self.name)


# ---------------------------------------------------------------- Gateway listeners


@dataclass(frozen=True)
class ListenerState:
    """What one proxy does with one Gateway listener (ReportListeners)."""

    gateway: str  # "NS/NAME"
    port: int  # the listener's port in the Gateway
    protocol: str  # HTTP, HTTPS, TLS
    local_port: int = 0  # the proxy's port serving it; 0: not served
    # Empty when served; else CamelCase (PortUnavailable) and the human reason.
    reason: str = ""
    message: str = ""


# ---------------------------------------------------------------- tunnel presence


@dataclass(frozen=True)
class TunnelServer:
    # Stable replica identity (e.g. the pod name) and its dialer-facing address.
    id: str
    address: str


@dataclass(frozen=True)
class TunnelPresence:
    node: str
    servers: tuple[TunnelServer, ...] = ()

    @property
    def key(self) -> str:
        return self.node


# ---------------------------------------------------------------- changes

Object = Service | Endpoint | Route | TunnelPresence


@dataclass(frozen=True)
class Change:
    """One effective change: `value` is the new state, or None when `key` was deleted."""

    kind: Kind
    key: tuple[str, ...] | str
    value: Object | None

    @property
    def deleted(self) -> bool:
        return self.value is None


# ---------------------------------------------------------------- upstream protocols

# What a route's upstreamProtocol may say; "" leaves it to the service port.
UPSTREAM_PROTOCOLS: Final = ("http", "h2c", "h2", "grpc")
#: Route.listener_protocol of a TCP service: bytes relayed on listener_port.
TCP_LISTENER: Final = "TCP"
# The appProtocol / upstreamProtocol values that mean HTTP/2 to the backend
# (Kubernetes' kubernetes.io/h2c, and the common h2c, h2, grpc).
HTTP2_PROTOCOLS: Final = frozenset(("kubernetes.io/h2c", "h2c", "h2", "grpc"))


def speaks_http2(route: Route, port: ServicePort | None) -> bool:
    """Whether the proxy speaks HTTP/2 to this route's backend port."""
    if route.upstream_protocol:
        return route.upstream_protocol in HTTP2_PROTOCOLS
    return port is not None and port.app_protocol.lower() in HTTP2_PROTOCOLS
