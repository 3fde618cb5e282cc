"""Routing decisions, sans-IO: which route a request matches and which endpoint serves it.

A `RouteTable` is built from one resolver `View` and never changes after; the
proxy swaps in a new table inside the resolver client's `on_view` callback, so
the next request sees the change with no reload, a request in flight keeps the
`Target` it started with, and an endpoint whose removal has been seen is never
picked again (its picker no longer holds it).

Rules:
- Host: lower-cased, port stripped (done by the parser). Exact hosts before
  wildcard routes; `*.example.com` matches exactly one more label
  (`a.example.com`, not `example.com` nor `a.b.example.com`).
- Path: the longest route path that is a prefix of the request path on a
  segment boundary (`/api` matches `/api` and `/api/x`, not `/apix`).
- Gateway API and Ingress routes (routes with `matches`) are kept apart per
  side (plain or TLS, from their listener port through `listener_ports`) and
  looked up first; the routes file's routes after. Their wildcards match any
  number of labels (`*.example.com` takes `a.b.example.com`); a route without
  host takes any host, after every hostname. Each match is one entry, ordered
  by the specification's precedence: Exact path, then RegularExpression
  (longer pattern first), then the longest PathPrefix; then a method match,
  more header matches, more query matches; then the older object, its
  "namespace/name", the lower rule index. Conditions (method, headers, query)
  are checked only for entries that have them.
- Backends: picked by weight (0..256, smooth weighted round robin, weight 0
  never), then the endpoint by the route's policy (waygate.core.balancing;
  default leastconn) among the backend's usable endpoints -- or its one target,
  the Service's cluster IP and port, when the backend asks for it (`use_cluster_ip`).
- Sticky sessions (unless the route disables cookies): the cookie value is a
  keyed BLAKE2b of the endpoint's address and port, so it reveals no address;
  a cookie naming a live endpoint of the route wins over the policy.
- Passive health: each failed connect to an endpoint makes the balancer skip
  it for a period that doubles with each consecutive failure (0.5 s up to
  30 s); a success resets it. When every endpoint is being skipped, the
  policy's pick is tried anyway (a failing attempt beats a certain 503).

Pickers are carried from one table to the next per (route, backend: its place
and Service name), so leastconn in-flight counts and round-robin positions survive
updates; two backends of one Service name (other namespaces, other ports, a
canary's cluster IP beside the main's endpoints) keep a picker each.
"""

from __future__ import annotations

import enum
import hashlib
import time
from collections.abc import Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any, Final, NamedTuple
from urllib.parse import parse_qsl

from waygate.core.balancing import Picker, RoundRobinPicker, SourceHashPicker, new_picker
from waygate.core.paths import normalize_request_path
from waygate.core.regex import LinearPattern, compile_linear
from waygate.proxy.tls import hsts_line
from waygate.resolver.client import (
    TCP_LISTENER,
    Endpoint,
    PathMatchType,
    Route,
    RouteBackend,
    RouteMatch,
    Service,
    ServicePort,
    TLSTermination,
    ValueMatchType,
    speaks_http2,
)

if TYPE_CHECKING:
    from waygate.proxy.access import AccessCheck

DEFAULT_POLICY = "leastconn"
FAILURE_BASE_SECONDS = 0.5
FAILURE_MAX_SECONDS = 30.0


class Target(NamedTuple):
    """One upstream endpoint: what the connect step receives."""

    address: str
    port: int
    tunnel: bool = False
    node: str = ""
    namespace: str = ""
    service: str = ""


# Gateway listener protocols whose routes this table serves on a side that must match.
_PLAIN_OR_TLS = frozenset(("HTTP", "HTTPS"))


class ListenerSide:
    """The table side of a Gateway listener served on a port of its own (not mapped to
    the proxy's HTTP or HTTPS port, waygate.proxy.listeners). Connections accepted
    there carry it as their `secure` value: truthy when TLS is terminated there (an
    HTTPS listener), falsy for plain HTTP, as the proxy's own ports' True and False
    are; equal only to the same port's side, so a lookup there finds that
    listener's routes and no other's."""

    __slots__ = ("port", "secure")

    def __init__(self, port: int, secure: bool = False) -> None:
        self.port = port
        self.secure = secure  # an HTTPS/TLS listener's port (TLS terminated there)

    def __bool__(self) -> bool:
        return self.secure

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ListenerSide) and other.port == self.port

    def __hash__(self) -> int:
        return hash((ListenerSide, self.port))

    def __repr__(self) -> str:
        return f"ListenerSide({self.port}, secure={self.secure})"


#: A connection's table side: the proxy's own HTTPS (True) or HTTP (False) port,
#: or a Gateway listener's own port (its ListenerSide, truthy when TLS).
Side = bool | ListenerSide


class RouteOptions(NamedTuple):
    """A route's per-request settings, resolved once per table build."""

    name: str  # "namespace/name", the metrics label
    forwarded_mode: str
    connect_timeout: float
    server_timeout: float
    client_timeout: float
    http_request_timeout: float
    keep_alive_timeout: float
    tunnel_timeout: float
    cookie_name: bytes  # b"": no sticky cookie
    cookie_attributes: bytes
    # Take a request's body in before an upstream is used (Route requestBuffering).
    request_buffering: bool = True
    # ingress-nginx's OpenTelemetry annotations: TRACE_* (0: the proxy's own sampling,
    # a client's sampled trace continued), and the span's name (records.span_name_parts;
    # (): "proxy " + name).
    trace: int = 0
    span_name: tuple[bytes, ...] = ()


TRACE_OFF: Final = 1  # enable-opentelemetry "false": no span, the traceparent passed on
TRACE_UNTRUSTED: Final = 2  # opentelemetry-trust-incoming-span "false"


class Defaults(NamedTuple):
    connect_timeout: float = 5.0
    client_timeout: float = 30.0
    server_timeout: float = 30.0
    http_request_timeout: float = 10.0
    keep_alive_timeout: float = 300.0
    tunnel_timeout: float = 3600.0
    forwarded_mode: str = "append"


def _value(item: Any) -> Any:
    return item.value if isinstance(item, enum.Enum) else item


class PassiveHealth:
    """Connect failures per endpoint and the period each is skipped for."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._failures: dict[Target, tuple[int, float]] = {}
        self.on_change: Callable[[int], None] | None = None

    def failed(self, target: Target) -> None:
        count = self._failures.get(target, (0, 0.0))[0] + 1
        period = min(FAILURE_MAX_SECONDS, FAILURE_BASE_SECONDS * (2 ** (count - 1)))
        self._failures[target] = (count, self._clock() + period)
        if self.on_change is not None:
            self.on_change(len(self._failures))

    def succeeded(self, target: Target) -> None:
        if (
            self._failures
            and self._failures.pop(target, None) is not None
            and self.on_change is not None
        ):
            self.on_change(len(self._failures))

    @property
    def failing(self) -> bool:
        """Whether any endpoint has a recent connect failure (the fast path checks this)."""
        return bool(self._failures)

    def skipped(self, target: Target) -> bool:
        entry = self._failures.get(target) if self._failures else None
        return entry is not None and entry[1] > self._clock()

    def forget_except(self, alive: set[Target]) -> None:
        for target in [t for t in self._failures if t not in alive]:
            del self._failures[target]


class Backend:
    """One backend service of a route: its endpoints and their picker."""

    __slots__ = ("by_target", "cookies", "http2", "invalid", "picker", "service", "set_cookie")

    def __init__(
        self,
        service: str,
        picker: Picker[Target],
        cookie_key: bytes,
        options: RouteOptions,
        invalid: str = "",
        http2: bool = False,
    ) -> None:
        self.service = service
        self.picker = picker
        # Whether the proxy speaks HTTP/2 to this backend (`backend_speaks_http2`):
        # the backend decides the upstream protocol, never the client.
        self.http2 = http2
        # Why this backend cannot serve (a Gateway API backendRef that is not
        # found or not granted): its share of requests is answered 500.
        self.invalid = invalid
        self.cookies: dict[bytes, Target] = {}
        self.by_target: dict[Target, bytes] = {}
        # The whole Set-Cookie line per endpoint, built once per table.
        self.set_cookie: dict[Target, bytes] = {}
        if not options.cookie_name:
            return
        for target in picker.targets:
            value = sticky_value(cookie_key, target)
            self.cookies[value] = target
            self.by_target[target] = value
            self.set_cookie[target] = (
                b"Set-Cookie: "
                + options.cookie_name
                + b"="
                + value
                + options.cookie_attributes
                + b"\r\n"
            )


_PATH_PREFIX, _PATH_EXACT, _PATH_REGEX = 0, 1, 2
_PATH_KINDS = {
    PathMatchType.PREFIX: _PATH_PREFIX,
    PathMatchType.EXACT: _PATH_EXACT,
    PathMatchType.REGEX: _PATH_REGEX,
}
# Precedence of path kinds (lower first): Exact, RegularExpression, PathPrefix.
_PATH_RANK = {_PATH_EXACT: 0, _PATH_REGEX: 1, _PATH_PREFIX: 2}

ValueCheck = tuple[str, str, "LinearPattern | None"]


def _value_checks(items: tuple[Any, ...], *, lower: bool) -> tuple[ValueCheck, ...]:
    return tuple(
        (
            item.name.lower() if lower else item.name,
            item.value,
            compile_linear(item.value) if item.type is ValueMatchType.REGEX else None,
        )
        for item in items
    )


def _value_holds(check: ValueCheck, value: str | None) -> bool:
    if value is None:
        return False
    pattern = check[2]
    return value == check[1] if pattern is None else pattern.fullmatch(value) is not None


def request_headers(req: Any) -> dict[str, str]:
    """The request's header fields by lower-case name (repeated fields joined by ", "):
    an HTTP/1.1 head's field block, or an HTTP/2 request's (name, value) list."""
    pairs = getattr(req, "headers", None)
    if pairs is None:
        pairs = []
        for line in bytes(getattr(req, "fields", b"")).split(b"\r\n"):
            name, sep, value = line.partition(b":")
            if sep:
                pairs.append((name, value.strip()))
    out: dict[str, str] = {}
    for name, value in pairs:
        key = name.decode("latin-1").lower()
        text = value.decode("latin-1")
        out[key] = out[key] + ", " + text if key in out else text
    return out


def request_query(req: Any) -> dict[str, str]:
    """The first value of each query parameter (the spec: only the first counts), from
    an HTTP/1.1 head's target or an HTTP/2 request's :path."""
    target = getattr(req, "target", None)
    if target is None:
        target = req.path
    query = target.partition(b"?")[2]
    out: dict[str, str] = {}
    if query:
        for name, value in parse_qsl(query.decode("latin-1"), keep_blank_values=True):
            out.setdefault(name, value)
    return out


class RouteEntry:
    __slots__ = (
        "access",
        "backend_picker",
        "backends",
        "conditional",
        "headers",
        "hsts",
        "kind",
        "match_index",
        "method",
        "mirrors",
        "options",
        "path",
        "policies",
        "policy",
        "query",
        "rank",
        "regex",
        "route",
        "rules",
        "single",
        "upstream_scope",
    )

    def __init__(
        self,
        route: Route,
        path: bytes,
        options: RouteOptions,
        backends: list[Backend],
        weights: list[int],
        policy: str,
    ) -> None:
        self.route = route
        self.path = path
        self.options = options
        self.access: AccessCheck | None = None  # compiled by access.prepare (its rule)
        # The Strict-Transport-Security line it adds on HTTPS, built once (b"": none).
        self.hsts = hsts_line(route)
        self.upstream_scope = upstream_scope(route)
        # Per-route rule state a decision rule prepares once (decision.rules_of).
        self.policies: dict[str, Any] = {}
        self.backends = backends
        self.policy = policy
        self.backend_picker: RoundRobinPicker[int] | None = None
        if len(backends) > 1:
            self.backend_picker = RoundRobinPicker(list(range(len(backends))), weights)
        elif backends and weights[0] == 0:
            self.backends = []
        # One backend with one endpoint (the common route): what pick() would
        # answer for any request without a cookie or an endpoint to avoid, so
        # the request path takes it without a call. Pickers change only when a
        # table is built, and a new table builds new entries.
        self.single: tuple[Target, Backend] | None = None
        if len(self.backends) == 1 and not self.backends[0].invalid:
            only = self.backends[0].picker.targets
            if len(only) == 1 and self.backends[0].picker.weight(only[0]) > 0:
                self.single = (only[0], self.backends[0])
        # The match (routes-file routes: a path prefix and nothing else).
        self.kind = _PATH_PREFIX
        self.regex: LinearPattern | None = None
        self.method = b""
        self.headers: tuple[ValueCheck, ...] = ()
        self.query: tuple[ValueCheck, ...] = ()
        self.conditional = False
        self.match_index = 0
        self.rank = self._rank()
        # RequestMirror backends: (picker of their endpoints, percent of requests).
        self.mirrors: tuple[tuple[Picker[Target], int], ...] = ()
        # The per-request rules of waygate.proxy.decision that apply to this
        # route, chosen once per table by decision (None: not chosen yet).
        self.rules: Any = None

    def _rank(self) -> tuple[Any, ...]:
        """The sort key of the spec's precedence (lower first; see the module docstring)."""
        route = self.route
        length = len(self.regex.pattern) if self.regex is not None else len(self.path)
        return (
            _PATH_RANK[self.kind],
            -length,
            0 if self.method else 1,
            -len(self.headers),
            -len(self.query),
            route.created.timestamp() if route.created is not None else 0.0,
            route.origin or f"{route.namespace}/{route.name}",
            route.rule_index,
            self.match_index,
        )

    def for_match(self, match: RouteMatch, index: int) -> RouteEntry:
        """This entry (sharing backends and pickers) for one Gateway API match."""
        entry = RouteEntry.__new__(RouteEntry)
        for name in RouteEntry.__slots__:
            setattr(entry, name, getattr(self, name))
        entry.kind = _PATH_KINDS[match.path_type]
        path = match.path or "/"
        if entry.kind == _PATH_PREFIX and len(path) > 1:
            # The spec: a trailing slash is ignored ("/foo/" matches "/foo").
            path = path.rstrip("/") or "/"
        entry.path = path.encode()
        entry.regex = compile_linear(path) if entry.kind == _PATH_REGEX else None
        entry.method = match.method.encode()
        entry.headers = _value_checks(match.headers, lower=True)
        entry.query = _value_checks(match.query, lower=False)
        entry.conditional = bool(entry.method or entry.headers or entry.query)
        entry.match_index = index
        entry.rank = entry._rank()
        return entry

    def matches(self, path: bytes) -> bool:
        kind = self.kind
        if kind == _PATH_EXACT:
            return path == self.path
        if kind == _PATH_REGEX:
            assert self.regex is not None
            return self.regex.fullmatch(path.decode("utf-8", "replace")) is not None
        prefix = self.path
        if prefix == b"/" or path == prefix:
            return True
        return path.startswith(prefix) and (
            prefix[-1:] == b"/" or path[len(prefix) : len(prefix) + 1] in (b"/", b"?")
        )

    def holds(self, req: Any, seen: dict[str, Any]) -> bool:
        """Whether the request meets the method, header and query conditions; `seen`
        caches the parsed headers and query for the other entries of one lookup.
        Without a request (a caller that looks up by host and path only) no
        condition can hold."""
        if req is None:
            return False
        if self.method and req.method != self.method:
            return False
        if self.headers:
            headers = seen.get("h")
            if headers is None:
                headers = seen["h"] = request_headers(req)
            if not all(_value_holds(c, headers.get(c[0])) for c in self.headers):
                return False
        if self.query:
            query = seen.get("q")
            if query is None:
                query = seen["q"] = request_query(req)
            if not all(_value_holds(c, query.get(c[0])) for c in self.query):
                return False
        return True

    def pick(
        self, client_key: bytes, cookie: bytes | None, health: PassiveHealth, exclude: Target | None
    ) -> tuple[Target | None, Backend | None]:
        """The endpoint for one request (None when no endpoint is ready)."""
        backends = self.backends
        if not backends:
            return None, None
        if cookie is not None:
            for backend in backends:
                target = backend.cookies.get(cookie)
                if target is not None and target != exclude and not health.skipped(target):
                    return target, backend
        if self.backend_picker is None:
            backend = backends[0]
        else:
            index = self.backend_picker.pick()
            if index is None:
                return None, None
            backend = backends[index]
        picker = backend.picker
        key = client_key if self.policy == "source" else None
        first = picker.pick(key)
        if first is None:
            return None, backend
        target = first
        if exclude is None and not health.failing:
            return target, backend
        if key is not None and isinstance(picker, SourceHashPicker):
            # The same key again would be the same endpoint (or subset): the
            # ring is walked past the failed and the skipped endpoints instead.
            walked = picker.pick(key, lambda t: t == exclude or health.skipped(t))
            if walked is not None:
                return walked, backend
            return (None if first == exclude else first), backend
        tries = len(picker)
        while (target == exclude or health.skipped(target)) and tries > 1:
            tries -= 1
            candidate = picker.pick(key)
            if candidate is None:
                break
            target = candidate
        if target == exclude:
            return None, backend
        return target, backend


class HostIndex:
    """Host -> entries in precedence order: exact hosts, then wildcards, then any host."""

    __slots__ = ("any", "conditional", "deep", "exact", "wildcard")

    def __init__(self) -> None:
        # Whether any entry has method/header/query conditions (set by sort).
        self.conditional = False
        self.exact: dict[bytes, list[RouteEntry]] = {}
        # "*.example.com" by b"example.com": one label in front (the routes
        # file), or any number (`deep`, the Gateway API's rule).
        self.wildcard: dict[bytes, list[RouteEntry]] = {}
        self.deep: dict[bytes, list[RouteEntry]] = {}
        self.any: list[RouteEntry] = []

    def add(self, entry: RouteEntry, host: str, *, deep: bool) -> None:
        if not host:
            self.any.append(entry)
        elif host.startswith("*."):
            table = self.deep if deep else self.wildcard
            table.setdefault(host[2:].encode(), []).append(entry)
        else:
            self.exact.setdefault(host.encode(), []).append(entry)

    def sort(self) -> None:
        for table in (self.exact, self.wildcard, self.deep):
            for entries in table.values():
                entries.sort(key=_rank)
        self.any.sort(key=_rank)
        self.conditional = any(entry.conditional for entry in self.entries())

    def find(self, host: bytes, path: bytes, req: Any, hostless: bool = True) -> RouteEntry | None:
        """The entry for a request: exact host, then wildcards (the most specific
        first), then, with `hostless`, the entries that name no host."""
        entries = self.exact.get(host)
        # Parsed headers and query, shared by the entries of this lookup; only
        # an index with conditional entries pays for the dict.
        seen: dict[str, Any] = {} if self.conditional else _NO_CONDITIONS
        if entries is not None:
            for entry in entries:
                # A prefix "/" matches every path: the common route, taken without a call.
                if (
                    (entry.path == b"/" and entry.kind == _PATH_PREFIX) or entry.matches(path)
                ) and (not entry.conditional or entry.holds(req, seen)):
                    return entry
        dot = host.find(b".")
        if dot > 0:
            entries = self.wildcard.get(host[dot + 1 :])
            if entries is not None:
                for entry in entries:
                    if entry.matches(path) and (not entry.conditional or entry.holds(req, seen)):
                        return entry
            if self.deep:
                # The longest suffix first: the most specific wildcard wins.
                while dot > 0:
                    entries = self.deep.get(host[dot + 1 :])
                    if entries is not None:
                        for entry in entries:
                            if entry.matches(path) and (
                                not entry.conditional or entry.holds(req, seen)
                            ):
                                return entry
                    dot = host.find(b".", dot + 1)
        if hostless:
            for entry in self.any:
                if entry.matches(path) and (not entry.conditional or entry.holds(req, seen)):
                    return entry
        return None

    def find_hostless(self, path: bytes, req: Any) -> RouteEntry | None:
        seen: dict[str, Any] = {} if self.conditional else _NO_CONDITIONS
        for entry in self.any:
            if entry.matches(path) and (not entry.conditional or entry.holds(req, seen)):
                return entry
        return None

    def entries(self) -> Iterable[RouteEntry]:
        for table in (self.exact, self.wildcard, self.deep):
            for entries in table.values():
                yield from entries
        yield from self.any


_NO_CONDITIONS: dict[str, Any] = {}


def _rank(entry: RouteEntry) -> tuple[Any, ...]:
    return entry.rank


def _whole_hosts(index: HostIndex) -> dict[bytes, RouteEntry]:
    return {
        host: entries[0]
        for host, entries in index.exact.items()
        if entries
        and entries[0].path == b"/"
        and entries[0].kind == _PATH_PREFIX
        and not entries[0].conditional
    }


class RouteTable:
    """The routes file's routes by host, and Gateway API / Ingress routes per side."""

    def __init__(
        self,
        legacy: HostIndex,
        sides: dict[Any, HostIndex],
        targets: set[Target],
    ) -> None:
        self._legacy = legacy
        # secure (the TLS side) -> Gateway API and Ingress entries served there.
        self._sides = sides
        self.targets = targets

    @classmethod
    def empty(cls) -> RouteTable:
        return cls(HostIndex(), {}, set())

    def serves_listeners(self, secure: Side) -> bool:
        """Whether Gateway API listeners are served on this side (a miss is then a 404)."""
        return secure in self._sides

    def whole_hosts(self) -> dict[Side, dict[bytes, RouteEntry]]:
        """Per side (False, True, each Gateway side): the hosts `lookup` answers with one
        entry whatever the path, headers and query are: an exact host whose first entry
        takes every path (a "/" prefix without conditions) in the index consulted first
        for it. `decision.decide` takes these without a lookup (`view.ProxyView`)."""
        legacy = _whole_hosts(self._legacy)
        by_side: dict[Side, dict[bytes, RouteEntry]] = {False: legacy, True: legacy}
        for key, side in self._sides.items():
            hosts = _whole_hosts(side)
            if not side.wildcard and not side.deep:
                # No wildcard of the side comes first: its other hosts are the routes file's.
                for host, entry in legacy.items():
                    if host not in side.exact:
                        hosts[host] = entry
            by_side[key] = hosts
        return by_side

    def lookup(
        self, host: bytes, path: bytes, req: Any = None, secure: Side = False
    ) -> RouteEntry | None:
        if b"%" in path:
            # Route paths are stored in this form (/%61dmin is /admin to both).
            path = normalize_request_path(path)
        if self._sides:
            side = self._sides.get(secure)
            if side is not None:
                # Entries naming the host, of every kind, before those that name none:
                # a host-less route claims no host, so it never takes an owned one's
                # paths (the resolver settles ownership among the named claims).
                entry = side.find(host, path, req, hostless=False)
                if entry is None:
                    entry = self._legacy.find(host, path, req, hostless=False)
                if entry is None:
                    entry = side.find_hostless(path, req)
                if entry is None:
                    entry = self._legacy.find_hostless(path, req)
                return entry
        return self._legacy.find(host, path, req)

    def entries(self) -> Iterable[RouteEntry]:
        yield from self._legacy.entries()
        for side in self._sides.values():
            yield from side.entries()


def unavailable_reason(entry: RouteEntry) -> str:
    """Why a matched route has no endpoint to give, for the 503 page and grpc-message:
    the resolver's condition when it names one ("route mine/ghost: service
    mine/doesnotexist not found"), else the plain fact."""
    status = entry.route.status
    problem = status.problem() if status is not None else None
    if problem:
        return f"route {entry.options.name}: {problem}"
    return "no endpoint ready for route " + entry.options.name


def upstream_scope(route: Route) -> tuple[Any, ...] | None:
    """What an upstream connection for `route` promises beyond its endpoint: None for
    a plain one; for reencrypt, the destination CA (or the system's), the server
    name and SANs it was verified against and which client certificate went with it
    (the proxy's, or the route's own: ingress-nginx proxy-ssl-secret). Idle upstream
    connections are pooled per (endpoint, scope), so a plain route never takes a TLS
    connection and a reencrypt route only one verified and presented as it asks. A
    route whose scheme follows the client's (`upstream_scheme_from_client`) has this
    TLS scope; `decision.decide` gives a plain client's request None instead
    (`Forward.upstream_scope`)."""
    tls = route.tls
    if tls is None or tls.termination != TLSTermination.REENCRYPT:
        return None
    return (
        tls.destination_ca_certificate,
        tls.destination_server_name,
        tls.present_client_certificate,
        tls.destination_system_ca,
        tls.destination_san_hostnames,
        tls.destination_san_uris,
        tls.backend_client_certificate,
    )


def sticky_value(key: bytes, target: Target) -> bytes:
    digest = hashlib.blake2b(
        f"{target.address}|{target.port}".encode(), key=key, digest_size=12
    ).hexdigest()
    return digest.encode()


def service_port(service: Service | None, target_port: str) -> ServicePort | None:
    """The Service port a route's (or backendRef's) port names: by name or number, or
    the only port when none is named (None: not found, or ambiguous)."""
    if service is None:
        return None
    ports = service.ports
    if not target_port:
        return ports[0] if len(ports) == 1 else None
    for port in ports:
        if port.name == target_port or str(port.port) == target_port:
            return port
    return None


def backend_speaks_http2(route: Route, backend: RouteBackend, service: Service | None) -> bool:
    """Whether the proxy speaks HTTP/2 to this backend: the route's `upstreamProtocol`,
    else the `appProtocol` of the Service port the backend names. `service` is the
    backend's own (its namespace, or the route's when the backendRef names none) and
    the port the backendRef's, else the route's target port: the same rules as the
    endpoints it is given (`build_table`), so a cross-namespace backendRef or one
    port of a multi-port Service is judged by what it really is."""
    return speaks_http2(route, service_port(service, backend.port or route.target_port))


def endpoint_port(endpoint: Endpoint, target_port: str, service: Service | None) -> int | None:
    """The endpoint port a route's target_port names (None: the endpoint lacks it)."""
    ports = endpoint.ports
    if not ports:
        return None
    if not target_port:
        return ports[0].port
    if target_port.isdigit():
        number = int(target_port)
        if any(p.port == number for p in ports):
            return number
        if service is not None:
            for service_port in service.ports:
                if service_port.port == number:
                    return endpoint_port(endpoint, service_port.target_port, None) or number
        return number
    for port in ports:
        if port.name == target_port:
            return port.port
    if service is not None:
        for service_port in service.ports:
            if service_port.name == target_port:
                return endpoint_port(endpoint, service_port.target_port, None)
    return None


def _route_options(route: Route, defaults: Defaults) -> RouteOptions:
    timeouts = route.timeouts
    sticky = route.sticky

    def pick(value: float | None, default: float) -> float:
        return default if value is None or value <= 0 else value

    mode = _value(getattr(route, "forwarded_headers", None)) or defaults.forwarded_mode
    mode = str(mode).lower().replace("_", "-")
    if mode not in ("append", "replace", "if-none", "never"):
        mode = defaults.forwarded_mode
    cookie_name = b""
    attributes = b""
    if not sticky.disable_cookies:
        name = sticky.cookie_name or _default_cookie_name(route)
        cookie_name = name.encode()
        same_site = str(_value(getattr(sticky, "same_site", "")) or "").capitalize()
        if same_site not in ("Strict", "Lax", "None"):
            same_site = "Lax"
        path = getattr(sticky, "cookie_path", "") or "/"
        attributes = b"; Path=" + path.encode() + b"; HttpOnly; SameSite=" + same_site.encode()
        if getattr(sticky, "cookie_domain", ""):
            attributes += b"; Domain=" + sticky.cookie_domain.encode()
        if getattr(sticky, "cookie_max_age", 0):
            attributes += b"; Max-Age=%d" % sticky.cookie_max_age
        if same_site == "None" or getattr(sticky, "cookie_secure", False):
            attributes += b"; Secure"
    return RouteOptions(
        name=f"{route.namespace}/{route.name}",
        forwarded_mode=mode,
        connect_timeout=pick(timeouts.connect, defaults.connect_timeout),
        # HTTPRoute timeouts.request / backendRequest bound the wait for the backend.
        server_timeout=min(
            pick(timeouts.server, defaults.server_timeout),
            pick(route.request_timeout, defaults.server_timeout),
            pick(route.backend_request_timeout, defaults.server_timeout),
        ),
        client_timeout=pick(timeouts.client, defaults.client_timeout),
        http_request_timeout=pick(timeouts.http_request, defaults.http_request_timeout),
        keep_alive_timeout=pick(getattr(timeouts, "keep_alive", None), defaults.keep_alive_timeout),
        tunnel_timeout=pick(timeouts.tunnel, defaults.tunnel_timeout),
        cookie_name=cookie_name,
        cookie_attributes=attributes,
        request_buffering=getattr(route, "request_buffering", True),
        trace=TRACE_OFF
        if getattr(route, "tracing_off", False)
        else TRACE_UNTRUSTED
        if getattr(route, "untrusted_trace_context", False)
        else 0,
        span_name=span_name_parts(route.span_name) if getattr(route, "span_name", "") else (),
    )


# ingress-nginx opentelemetry-operation-name's per-request variables (the resolver
# fills in the route's own: $service_name, $namespace, $ingress_name, $location_path).
SPAN_VARIABLES = (b"$request_method", b"$request_uri", b"$uri", b"$host", b"$scheme")


def span_name_parts(template: str) -> tuple[bytes, ...]:
    """A route's span name as literal text and SPAN_VARIABLES, in order (built once
    per route)."""
    parts: list[bytes] = []
    rest = template.encode("utf-8")
    while rest:
        at = rest.find(b"$")
        if at < 0:
            parts.append(rest)
            break
        if at:
            parts.append(rest[:at])
        rest = rest[at:]
        variable = next((v for v in SPAN_VARIABLES if rest.startswith(v)), b"$")
        parts.append(variable)
        rest = rest[len(variable) :]
    return tuple(parts)


def _default_cookie_name(route: Route) -> str:
    # OpenShift names the cookie after a hash of the route, so it reveals nothing.
    return hashlib.blake2b(f"{route.namespace}/{route.name}".encode(), digest_size=8).hexdigest()


def _targets(
    endpoints: Iterable[Endpoint], target_port: str, service: Service | None
) -> list[Target]:
    """The usable endpoints of one service as targets at `target_port`."""
    targets: list[Target] = []
    for endpoint in endpoints:
        if not endpoint.usable:
            continue
        port = endpoint_port(endpoint, target_port, service)
        if port is None:
            continue
        target = Target(
            endpoint.address,
            port,
            endpoint.tunnel,
            endpoint.node_name,
            endpoint.namespace,
            endpoint.service,
        )
        if target not in targets:
            targets.append(target)
    return targets


def _backend_targets(
    backend: RouteBackend,
    route: Route,
    endpoints: Iterable[Endpoint],
    service: Service | None,
) -> list[Target]:
    """A route backend's targets: its Service's usable endpoints; with `use_cluster_ip`
    (ingress-nginx's service-upstream) one target, the Service's cluster IP at the
    Service port (not the target port: kube-proxy or a mesh balances behind it), or
    none when the Service has no such port. A Service without a cluster IP (headless,
    ExternalName) keeps its endpoints, as ingress-nginx falls back to them. Built
    with every table, so a changed Service moves the target with the next view."""
    port = backend.port or route.target_port
    if backend.use_cluster_ip and service is not None and service.cluster_ips:
        found = service_port(service, port)
        if found is None:
            return []
        return [Target(service.cluster_ips[0], found.port, False, "", *service.key)]
    return _targets(endpoints, port, service)


def _default_backend(
    route: Route,
    endpoints: Mapping[tuple[str, str], tuple[Endpoint, ...]],
    services: Mapping[tuple[str, str], Service],
    cookie_key: bytes,
    options: RouteOptions,
) -> Backend:
    """ingress-nginx's default-backend: the Service of the route's namespace taking
    the requests its own backends have no ready endpoint for (its first port)."""
    key = (route.namespace, route.default_backend)
    service = services.get(key)
    port = ""  # a Service of one port (or unknown): its only port, as a route's ""
    if service is not None and len(service.ports) > 1:
        port = service.ports[0].name or str(service.ports[0].port)
    targets = _targets(endpoints.get(key, ()), port, service)
    backend = RouteBackend(route.default_backend, 1, port=port)
    return Backend(
        route.default_backend,
        new_picker("roundrobin", targets),
        cookie_key,
        options,
        "",
        backend_speaks_http2(route, backend, service),
    )


def build_table(
    routes: Mapping[Any, Route],
    endpoints: Mapping[tuple[str, str], tuple[Endpoint, ...]],
    services: Mapping[tuple[str, str], Service],
    *,
    defaults: Defaults,
    cookie_key: bytes,
    previous: RouteTable | None = None,
    listener_ports: Mapping[int, Any] | None = None,
    gateway: str = "",
) -> RouteTable:
    """A new table; pickers of routes and backends that stay are carried over.

    `listener_ports` maps a Gateway listener port to the side that serves it
    (True: TLS); routes on other listener ports are not served. `gateway`
    ("NS/NAME"): serve only that Gateway's routes (and no Ingress).
    """
    carried: dict[tuple[str, str, int, str], Picker[Target]] = {}
    if previous is not None:
        for entry in previous.entries():
            route_key = (entry.route.namespace, entry.route.name)
            for place, backend in enumerate(entry.backends):
                carried[(*route_key, place, backend.service)] = backend.picker
    legacy = HostIndex()
    sides: dict[Any, HostIndex] = {}
    ports = {80: False, 443: True} if listener_ports is None else listener_ports
    alive: set[Target] = set()
    for route in routes.values():
        if route.status is not None and not route.status.admitted:
            continue  # another, older route owns its host or host and path (resolver status)
        if route.tls is not None and _value(route.tls.termination) == "passthrough":
            continue  # TLS passthrough is served by the HTTPS listener (next issue)
        if route.listener_protocol == TCP_LISTENER:
            continue  # a TCP service: bytes on its own port (waygate.proxy.tcpservices)
        side: HostIndex = legacy
        if route.listener_port:
            secure = ports.get(route.listener_port)
            if secure is None or (gateway and route.gateway != gateway):
                continue
            if route.listener_protocol in _PLAIN_OR_TLS and (
                route.listener_protocol == "HTTPS"
            ) != bool(secure):
                # An HTTPS listener mapped to the plain port (or HTTP to the TLS one)
                # is not served there: never HTTPS routes in clear text. The proxy
                # reports it (waygate.proxy.listeners).
                continue
            side = sides.setdefault(secure, HostIndex())
        policy = str(_value(route.balance) or DEFAULT_POLICY)
        subset_size = route.hash_subset_size if policy == "source" else 0
        options = _route_options(route, defaults)
        backends: list[Backend] = []
        weights: list[int] = []
        route_backends = route.backends
        if (
            not route_backends
            and route.matches
            and route.listener_port
            and (route.filters is None or route.filters.redirect is None)
        ):
            # The spec: a rule without backends (and no redirect) answers 500.
            route_backends = (RouteBackend("", 1, invalid="the rule has no backendRefs"),)
        for place, route_backend in enumerate(route_backends):
            key = (route_backend.namespace or route.namespace, route_backend.service)
            service = services.get(key)
            targets = (
                _backend_targets(route_backend, route, endpoints.get(key, ()), service)
                if not route_backend.invalid
                else []
            )
            alive.update(targets)
            picker = carried.get((route.namespace, route.name, place, route_backend.service))
            if picker is None or picker.policy != policy or picker.subset_size != subset_size:
                picker = new_picker(policy, targets, subset_size=subset_size)
            else:
                picker.update(targets)
            backends.append(
                Backend(
                    route_backend.service,
                    picker,
                    cookie_key,
                    options,
                    route_backend.invalid,
                    backend_speaks_http2(route, route_backend, service),
                )
            )
            weights.append(max(0, min(256, route_backend.weight)))
        entry = RouteEntry(route, (route.path or "/").encode(), options, backends, weights, policy)
        if route.filters is not None and route.filters.mirrors:
            mirrors = []
            for mirror in route.filters.mirrors:
                key = (mirror.namespace or route.namespace, mirror.service)
                targets = _targets(endpoints.get(key, ()), mirror.port, services.get(key))
                alive.update(targets)
                mirrors.append((new_picker("roundrobin", targets), mirror.percent))
            entry.mirrors = tuple(mirrors)
        if route.default_backend:
            fallback = _default_backend(route, endpoints, services, cookie_key, options)
            alive.update(fallback.picker.targets)
            entry.policies["default_backend"] = fallback
        host = route.host.lower()
        deep = bool(route.gateway)
        if route.matches:
            for index, match in enumerate(route.matches):
                side.add(entry.for_match(match, index), host, deep=deep)
        else:
            side.add(entry, host, deep=deep)
    legacy.sort()
    for side_index in sides.values():
        side_index.sort()
    return RouteTable(legacy, sides, alive)
