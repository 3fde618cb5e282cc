"""Gateway API and Ingress objects (JSON as the API sends it) -> checked records.

Sans-IO, pure functions. This is the schema step: what the API server's CRD
validation would refuse (a port out of range, an unknown filter type, an
invalid regular expression, a missing required field) raises `SpecError` with
the field's path inside the object, so the manifests source can name the file
line (`path:line: reason`) and the Kubernetes source can set the object's
status (Accepted=False) instead. Everything after this step (which listener a
route attaches to, whether a backend exists or is granted) is semantics and
lives in `translate.py`.

Versions: GatewayClass, Gateway, HTTPRoute, GRPCRoute gateway.networking.k8s.io/v1;
TLSRoute v1 (v1alpha2/v1alpha3 accepted too, same fields used); ReferenceGrant
v1beta1 (v1 too); Ingress and IngressClass networking.k8s.io/v1.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from waygate.core import regex as linear_regex
from waygate.core.errors import excerpt
from waygate.resolver.model import (
    HeaderMatch,
    HeaderModifier,
    Mirror,
    PathMatchType,
    PathModifierType,
    Redirect,
    Rewrite,
    RouteFilters,
    RouteMatch,
    ValueMatchType,
)

JSON = dict[str, Any]
FieldPath = tuple[str | int, ...]

GATEWAY_GROUP = "gateway.networking.k8s.io"
CONTROLLER_NAME = "waygate.io/gateway-controller"
INGRESS_CONTROLLER = "waygate.io/ingress-controller"

MAX_PATH = 1024
# The CRDs' maxItems (gateway-api v1.x standard channel), checked on every source:
# the API server refuses more in a cluster, and a manifest must not get further.
MAX_RULES = 16
MAX_MATCHES = 64  # per rule; and at most MAX_MATCHES_PER_ROUTE in all the rules
MAX_MATCHES_PER_ROUTE = 128
MAX_FILTERS = 16
MAX_BACKEND_REFS = 16
MAX_HOSTNAMES = 16
MAX_PARENT_REFS = 32
MAX_VALUE_MATCHES = 16  # header or query parameter matches of one match
MAX_HEADERS = 16  # set, add or remove of one header modifier
MAX_LISTENERS = 64
MAX_CERTIFICATE_REFS = 64
MAX_ROUTE_KINDS = 8
MAX_GRANT_ENTRIES = 16
MAX_POLICY_TARGETS = 16
MAX_CA_REFS = 8
MAX_SANS = 5
# ...and maxLength of the values they hold.
MAX_HEADER_VALUE = 4096
MAX_QUERY_VALUE = 1024
MAX_REGEX = linear_regex.MAX_PATTERN
# A header name as RFC 9110 allows (token characters).
_HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]{1,256}$")
_HOSTNAME = re.compile(
    r"^(\*\.)?[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?(\.[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?)*$"
)
_METHODS = frozenset(
    ("GET", "HEAD", "POST", "PUT", "DELETE", "CONNECT", "OPTIONS", "TRACE", "PATCH")
)
_REDIRECT_CODES = frozenset((301, 302, 303, 307, 308))
_SCHEMES = frozenset(("http", "https"))


class SpecError(Exception):
    """An object the API server's schema would refuse: the field and why."""

    def __init__(self, where: FieldPath, reason: str) -> None:
        super().__init__(reason)
        self.where = where
        self.reason = reason

    def __str__(self) -> str:
        return f"{dotted(self.where)}: {self.reason}" if self.where else self.reason


def dotted(where: FieldPath) -> str:
    out = ""
    for part in where:
        out += f"[{part}]" if isinstance(part, int) else ("." if out else "") + part
    return out


# ---------------------------------------------------------------- field access


def _map(value: Any, where: FieldPath) -> JSON:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise SpecError(where, "must be a mapping")
    return value


def _list(value: Any, where: FieldPath, max_items: int | None = None) -> list[Any]:
    """A list field; `max_items`: the CRD's maxItems for it (enforced on every
    source, so a manifest is refused as the API server would refuse it)."""
    if value is None:
        return []
    if not isinstance(value, list):
        raise SpecError(where, "must be a list")
    if max_items is not None and len(value) > max_items:
        raise SpecError(where, f"must have at most {max_items} items (has {len(value)})")
    return value


def _str(fields: JSON, key: str, where: FieldPath, default: str = "") -> str:
    value = fields.get(key, default)
    if value is None:
        return default
    if not isinstance(value, str):
        raise SpecError((*where, key), "must be a string")
    return value


def _int(
    fields: JSON, key: str, where: FieldPath, default: int | None, low: int, high: int
) -> int | None:
    value = fields.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise SpecError((*where, key), "must be an integer")
    if not low <= value <= high:
        raise SpecError((*where, key), f"{value} is outside {low}..{high}")
    return value


def _required(fields: JSON, key: str, where: FieldPath) -> str:
    value = _str(fields, key, where)
    if not value:
        raise SpecError((*where, key), "is required")
    return value


def _enum(fields: JSON, key: str, where: FieldPath, allowed: tuple[str, ...], default: str) -> str:
    value = _str(fields, key, where, default)
    if value not in allowed:
        raise SpecError((*where, key), f"{value!r} is not one of {', '.join(allowed)}")
    return value


def hostname(value: str, where: FieldPath, *, wildcard: bool = True) -> str:
    host = value.lower()
    if len(host) > 253 or not _HOSTNAME.match(host) or (not wildcard and host.startswith("*")):
        raise SpecError(where, f"{value!r} is not a valid hostname")
    return host


def _regex(value: str, where: FieldPath) -> str:
    """A route's regular expression, admitted only when RE2 can express it (the
    proxy matches with RE2, in linear time: waygate.core.regex)."""
    reason = linear_regex.refusal(value)
    if reason is not None:
        raise SpecError(where, f"invalid regular expression {excerpt(value)}: {reason}")
    return value


def _path(value: str, where: FieldPath) -> str:
    if not value.startswith("/"):
        raise SpecError(where, f"{value!r} must start with /")
    if len(value) > MAX_PATH or any(c in value for c in "\x00\r\n\t #?") or "//" in value:
        raise SpecError(where, f"{value!r} is not a valid path")
    return value


def meta(obj: JSON) -> tuple[str, str]:
    """(namespace, name); namespace "" for cluster-scoped kinds."""
    metadata = _map(obj.get("metadata"), ("metadata",))
    name = _required(metadata, "name", ("metadata",))
    return _str(metadata, "namespace", ("metadata",)), name


def generation(obj: JSON) -> int:
    value = (obj.get("metadata") or {}).get("generation")
    return value if isinstance(value, int) and not isinstance(value, bool) else 1


def created(obj: JSON) -> datetime | None:
    """metadata.creationTimestamp (None: unknown, which sorts oldest)."""
    value = (obj.get("metadata") or {}).get("creationTimestamp")
    if isinstance(value, datetime):
        return value if value.tzinfo is not None else value.replace(tzinfo=UTC)
    if isinstance(value, str) and value:
        try:
            return datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            return None
    return None


def labels(obj: JSON) -> dict[str, str]:
    found = (obj.get("metadata") or {}).get("labels") or {}
    return {str(k): str(v) for k, v in found.items()} if isinstance(found, dict) else {}


# ---------------------------------------------------------------- Gateway


@dataclass(frozen=True)
class RouteKind:
    group: str
    kind: str


@dataclass(frozen=True)
class SecretRef:
    group: str
    kind: str
    namespace: str
    name: str


@dataclass(frozen=True)
class ListenerSpec:
    name: str
    port: int
    protocol: str
    hostname: str  # "" : any
    tls_mode: str  # "Terminate" | "Passthrough" | "" (no tls block)
    certificate_refs: tuple[SecretRef, ...]
    namespaces_from: str  # Same | All | Selector
    selector: JSON
    kinds: tuple[RouteKind, ...]  # empty: the protocol's defaults


def gateway_listeners(obj: JSON) -> tuple[str, tuple[ListenerSpec, ...]]:
    """(gatewayClassName, listeners) of a Gateway."""
    namespace, _ = meta(obj)
    spec = _map(obj.get("spec"), ("spec",))
    class_name = _required(spec, "gatewayClassName", ("spec",))
    listeners: list[ListenerSpec] = []
    names: set[str] = set()
    raw = _list(spec.get("listeners"), ("spec", "listeners"), MAX_LISTENERS)
    if not raw:
        raise SpecError(("spec", "listeners"), "at least one listener is required")
    for index, item in enumerate(raw):
        where: FieldPath = ("spec", "listeners", index)
        fields = _map(item, where)
        name = _required(fields, "name", where)
        if name in names:
            raise SpecError((*where, "name"), f"listener name {name!r} is used twice")
        names.add(name)
        port = _int(fields, "port", where, None, 1, 65535)
        if port is None:
            raise SpecError((*where, "port"), "is required")
        protocol = _required(fields, "protocol", where)
        host = _str(fields, "hostname", where)
        if host:
            host = hostname(host, (*where, "hostname"))
        tls = _map(fields.get("tls"), (*where, "tls"))
        mode = ""
        refs: list[SecretRef] = []
        if "tls" in fields:
            mode = _enum(tls, "mode", (*where, "tls"), ("Terminate", "Passthrough"), "Terminate")
            for ref_index, ref in enumerate(
                _list(
                    tls.get("certificateRefs"),
                    (*where, "tls", "certificateRefs"),
                    MAX_CERTIFICATE_REFS,
                )
            ):
                ref_where: FieldPath = (*where, "tls", "certificateRefs", ref_index)
                ref_fields = _map(ref, ref_where)
                refs.append(
                    SecretRef(
                        _str(ref_fields, "group", ref_where),
                        _str(ref_fields, "kind", ref_where, "Secret"),
                        _str(ref_fields, "namespace", ref_where, namespace),
                        _required(ref_fields, "name", ref_where),
                    )
                )
        allowed = _map(fields.get("allowedRoutes"), (*where, "allowedRoutes"))
        namespaces = _map(allowed.get("namespaces"), (*where, "allowedRoutes", "namespaces"))
        ns_where: FieldPath = (*where, "allowedRoutes", "namespaces")
        namespaces_from = _enum(namespaces, "from", ns_where, ("Same", "All", "Selector"), "Same")
        selector = _map(namespaces.get("selector"), (*ns_where, "selector"))
        if namespaces_from == "Selector" and not selector:
            raise SpecError((*ns_where, "selector"), "is required when from is Selector")
        kinds = []
        for kind_index, kind in enumerate(
            _list(allowed.get("kinds"), (*where, "allowedRoutes", "kinds"), MAX_ROUTE_KINDS)
        ):
            kind_where: FieldPath = (*where, "allowedRoutes", "kinds", kind_index)
            kind_fields = _map(kind, kind_where)
            kinds.append(
                RouteKind(
                    _str(kind_fields, "group", kind_where, GATEWAY_GROUP),
                    _required(kind_fields, "kind", kind_where),
                )
            )
        listeners.append(
            ListenerSpec(
                name,
                port,
                protocol,
                host,
                mode,
                tuple(refs),
                namespaces_from,
                selector,
                tuple(kinds),
            )
        )
    return class_name, tuple(listeners)


# ---------------------------------------------------------------- routes


@dataclass(frozen=True)
class ParentRef:
    group: str
    kind: str
    namespace: str
    name: str
    section_name: str
    port: int  # 0: any

    def as_status(self) -> JSON:
        out: JSON = {"group": self.group, "kind": self.kind, "name": self.name}
        out["namespace"] = self.namespace
        if self.section_name:
            out["sectionName"] = self.section_name
        if self.port:
            out["port"] = self.port
        return out


@dataclass(frozen=True)
class BackendRef:
    group: str
    kind: str
    namespace: str
    name: str
    port: int  # 0: none given
    weight: int


@dataclass(frozen=True)
class RuleSpec:
    matches: tuple[RouteMatch, ...]
    filters: RouteFilters | None
    backends: tuple[BackendRef, ...]
    request_timeout: float | None = None
    backend_request_timeout: float | None = None
    # Mirrors' service refs, checked like backends (resolved in translate).
    mirror_refs: tuple[BackendRef, ...] = ()


@dataclass(frozen=True)
class RouteSpec:
    kind: str
    hostnames: tuple[str, ...]
    parents: tuple[ParentRef, ...]
    rules: tuple[RuleSpec, ...] = field(default=())


def parent_refs(obj: JSON, namespace: str) -> tuple[ParentRef, ...]:
    spec = _map(obj.get("spec"), ("spec",))
    refs = []
    for index, item in enumerate(
        _list(spec.get("parentRefs"), ("spec", "parentRefs"), MAX_PARENT_REFS)
    ):
        where: FieldPath = ("spec", "parentRefs", index)
        fields = _map(item, where)
        refs.append(
            ParentRef(
                _str(fields, "group", where, GATEWAY_GROUP),
                _str(fields, "kind", where, "Gateway"),
                _str(fields, "namespace", where, namespace),
                _required(fields, "name", where),
                _str(fields, "sectionName", where),
                _int(fields, "port", where, 0, 0, 65535) or 0,
            )
        )
    return tuple(refs)


def _hostnames(spec: JSON) -> tuple[str, ...]:
    out = []
    for index, item in enumerate(
        _list(spec.get("hostnames"), ("spec", "hostnames"), MAX_HOSTNAMES)
    ):
        if not isinstance(item, str):
            raise SpecError(("spec", "hostnames", index), "must be a string")
        out.append(hostname(item, ("spec", "hostnames", index)))
    return tuple(out)


def _backend_ref(item: Any, where: FieldPath, namespace: str, *, weighted: bool) -> BackendRef:
    fields = _map(item, where)
    ref = BackendRef(
        _str(fields, "group", where),
        _str(fields, "kind", where, "Service"),
        _str(fields, "namespace", where, namespace),
        _required(fields, "name", where),
        _int(fields, "port", where, 0, 0, 65535) or 0,
        (_int(fields, "weight", where, 1, 0, 1_000_000) or 0) if weighted else 1,
    )
    if ref.group in ("", "core") and ref.kind == "Service" and not ref.port:
        # The CRD's own rule (CEL): a Service reference names its port.
        raise SpecError((*where, "port"), "is required for a Service")
    return ref


def _rules(spec: JSON) -> list[Any]:
    """An HTTPRoute's or GRPCRoute's rules, within the CRD's bounds: at most
    MAX_RULES, and (its CEL rule) at most MAX_MATCHES_PER_ROUTE matches in all."""
    rules = _list(spec.get("rules"), ("spec", "rules"), MAX_RULES)
    total = sum(
        len(rule["matches"])
        for rule in rules
        if isinstance(rule, dict) and isinstance(rule.get("matches"), list)
    )
    if total > MAX_MATCHES_PER_ROUTE:
        raise SpecError(
            ("spec", "rules"),
            f"the rules have {total} matches in all; at most {MAX_MATCHES_PER_ROUTE}",
        )
    return rules


def _duration(fields: JSON, key: str, where: FieldPath) -> float | None:
    """A Gateway API Duration ("1h2m3s4ms" form, GEP-2257); "0s" means none."""
    value = _str(fields, key, where)
    if not value:
        return None
    found = re.fullmatch(r"(?:(\d+)h)?(?:(\d+)m(?!s))?(?:(\d+)s)?(?:(\d+)ms)?", value)
    if found is None or not any(found.groups()):
        raise SpecError((*where, key), f"{value!r} is not a duration such as 1h2m3s4ms")
    hours, minutes, secs, millis = (int(g or 0) for g in found.groups())
    total = hours * 3600 + minutes * 60 + secs + millis / 1000
    return total or None


def _value_matches(items: Any, where: FieldPath, *, header: bool) -> tuple[HeaderMatch, ...]:
    out = []
    seen: set[str] = set()
    for index, item in enumerate(_list(items, where, MAX_VALUE_MATCHES)):
        item_where: FieldPath = (*where, index)
        fields = _map(item, item_where)
        name = _required(fields, "name", item_where)
        if header and not _HEADER_NAME.match(name):
            raise SpecError((*item_where, "name"), f"{name!r} is not a header name")
        kind = _enum(fields, "type", item_where, ("Exact", "RegularExpression"), "Exact")
        value = _str(fields, "value", item_where)
        longest = MAX_HEADER_VALUE if header else MAX_QUERY_VALUE
        if len(value) > longest:
            raise SpecError((*item_where, "value"), f"longer than {longest} characters")
        if kind == "RegularExpression":
            _regex(value, (*item_where, "value"))
        # The spec: a repeated name is a match on its first occurrence only.
        key = name.lower() if header else name
        if key in seen:
            continue
        seen.add(key)
        out.append(HeaderMatch(name, value, ValueMatchType(kind)))
    return tuple(out)


def _match(item: Any, where: FieldPath) -> RouteMatch:
    fields = _map(item, where)
    path = _map(fields.get("path"), (*where, "path"))
    kind = _enum(
        path, "type", (*where, "path"), ("Exact", "PathPrefix", "RegularExpression"), "PathPrefix"
    )
    value = _str(path, "value", (*where, "path"), "/")
    if kind == "RegularExpression":
        _regex(value, (*where, "path", "value"))
    else:
        _path(value, (*where, "path", "value"))
    method = _str(fields, "method", where)
    if method and method not in _METHODS:
        raise SpecError((*where, "method"), f"{method!r} is not an HTTP method")
    return RouteMatch(
        PathMatchType(kind),
        value,
        _value_matches(fields.get("headers"), (*where, "headers"), header=True),
        _value_matches(fields.get("queryParams"), (*where, "queryParams"), header=False),
        method,
    )


def _header_modifier(value: Any, where: FieldPath) -> HeaderModifier:
    fields = _map(value, where)
    if not fields:
        raise SpecError(where, "is required for this filter type")

    def pairs(key: str) -> tuple[tuple[str, str], ...]:
        out = []
        for index, item in enumerate(_list(fields.get(key), (*where, key), MAX_HEADERS)):
            item_where: FieldPath = (*where, key, index)
            header = _map(item, item_where)
            name = _required(header, "name", item_where)
            if not _HEADER_NAME.match(name):
                raise SpecError((*item_where, "name"), f"{name!r} is not a header name")
            text = _str(header, "value", item_where)
            if len(text) > MAX_HEADER_VALUE:
                raise SpecError(
                    (*item_where, "value"), f"longer than {MAX_HEADER_VALUE} characters"
                )
            if any(c in text for c in "\r\n\x00"):
                raise SpecError((*item_where, "value"), "control characters are not allowed")
            out.append((name, text))
        return tuple(out)

    remove = []
    for index, item in enumerate(_list(fields.get("remove"), (*where, "remove"), MAX_HEADERS)):
        if not isinstance(item, str) or not _HEADER_NAME.match(item):
            raise SpecError((*where, "remove", index), f"{item!r} is not a header name")
        remove.append(item)
    return HeaderModifier(pairs("set"), pairs("add"), tuple(remove))


def _path_modifier(
    value: Any, where: FieldPath, matches: tuple[RouteMatch, ...]
) -> tuple[PathModifierType, str]:
    fields = _map(value, where)
    if not fields:
        return PathModifierType.NONE, ""
    kind = _enum(fields, "type", where, ("ReplaceFullPath", "ReplacePrefixMatch"), "")
    if kind == "ReplaceFullPath":
        return PathModifierType.FULL, _path(
            _str(fields, "replaceFullPath", where, "/") or "/", (*where, "replaceFullPath")
        )
    replacement = _str(fields, "replacePrefixMatch", where, "/") or "/"
    _path(replacement, (*where, "replacePrefixMatch"))
    if any(m.path_type is not PathMatchType.PREFIX for m in matches):
        raise SpecError(
            (*where, "type"), "ReplacePrefixMatch needs every match of the rule to be a PathPrefix"
        )
    return PathModifierType.PREFIX, replacement


def _filters(
    items: Any, where: FieldPath, namespace: str, matches: tuple[RouteMatch, ...]
) -> tuple[RouteFilters | None, tuple[BackendRef, ...]]:
    raw = _list(items, where, MAX_FILTERS)
    if not raw:
        return None, ()
    request = response = None
    redirect = None
    rewrite = None
    mirrors: list[Mirror] = []
    mirror_refs: list[BackendRef] = []
    for index, item in enumerate(raw):
        item_where: FieldPath = (*where, index)
        fields = _map(item, item_where)
        kind = _required(fields, "type", item_where)
        if kind == "RequestHeaderModifier":
            if request is not None:
                raise SpecError((*item_where, "type"), "RequestHeaderModifier given twice")
            request = _header_modifier(
                fields.get("requestHeaderModifier"), (*item_where, "requestHeaderModifier")
            )
        elif kind == "ResponseHeaderModifier":
            if response is not None:
                raise SpecError((*item_where, "type"), "ResponseHeaderModifier given twice")
            response = _header_modifier(
                fields.get("responseHeaderModifier"), (*item_where, "responseHeaderModifier")
            )
        elif kind == "RequestRedirect":
            sub: FieldPath = (*item_where, "requestRedirect")
            redirect_fields = _map(fields.get("requestRedirect"), sub)
            scheme = _str(redirect_fields, "scheme", sub)
            if scheme and scheme not in _SCHEMES:
                raise SpecError((*sub, "scheme"), f"{scheme!r} is not http or https")
            host = _str(redirect_fields, "hostname", sub)
            if host:
                host = hostname(host, (*sub, "hostname"), wildcard=False)
            status = _int(redirect_fields, "statusCode", sub, 302, 100, 599) or 302
            if status not in _REDIRECT_CODES:
                raise SpecError((*sub, "statusCode"), f"{status} is not 301, 302, 303, 307 or 308")
            path_type, path = _path_modifier(redirect_fields.get("path"), (*sub, "path"), matches)
            redirect = Redirect(
                scheme,
                host,
                _int(redirect_fields, "port", sub, 0, 0, 65535) or 0,
                path_type,
                path,
                status,
            )
        elif kind == "URLRewrite":
            sub = (*item_where, "urlRewrite")
            rewrite_fields = _map(fields.get("urlRewrite"), sub)
            host = _str(rewrite_fields, "hostname", sub)
            if host:
                host = hostname(host, (*sub, "hostname"), wildcard=False)
            path_type, path = _path_modifier(rewrite_fields.get("path"), (*sub, "path"), matches)
            rewrite = Rewrite(host, path_type, path)
        elif kind == "RequestMirror":
            sub = (*item_where, "requestMirror")
            mirror_fields = _map(fields.get("requestMirror"), sub)
            ref = _backend_ref(
                mirror_fields.get("backendRef"), (*sub, "backendRef"), namespace, weighted=False
            )
            percent = _int(mirror_fields, "percent", sub, 100, 0, 100)
            fraction = _map(mirror_fields.get("fraction"), (*sub, "fraction"))
            if fraction:
                numerator = _int(fraction, "numerator", (*sub, "fraction"), 0, 0, 1_000_000) or 0
                denominator = (
                    _int(fraction, "denominator", (*sub, "fraction"), 100, 1, 1_000_000) or 100
                )
                percent = min(100, round(100 * numerator / denominator))
            mirror_refs.append(ref)
            mirrors.append(Mirror(ref.name, ref.namespace, str(ref.port or ""), percent or 0))
        else:
            raise SpecError(
                (*item_where, "type"),
                f"unsupported filter type {kind!r} (RequestHeaderModifier, "
                "ResponseHeaderModifier, RequestRedirect, URLRewrite, RequestMirror)",
            )
    if redirect is not None and rewrite is not None:
        raise SpecError(where, "RequestRedirect and URLRewrite cannot be used together")
    filters = RouteFilters(request, response, redirect, rewrite, tuple(mirrors))
    return filters, tuple(mirror_refs)


def http_route(obj: JSON) -> RouteSpec:
    namespace, _ = meta(obj)
    spec = _map(obj.get("spec"), ("spec",))
    rules = []
    for index, item in enumerate(_rules(spec) or [{}]):
        where: FieldPath = ("spec", "rules", index)
        fields = _map(item, where)
        matches = tuple(
            _match(m, (*where, "matches", i))
            for i, m in enumerate(_list(fields.get("matches"), (*where, "matches"), MAX_MATCHES))
        ) or (RouteMatch(),)
        filters, mirror_refs = _filters(
            fields.get("filters"), (*where, "filters"), namespace, matches
        )
        backends = []
        for b_index, backend in enumerate(
            _list(fields.get("backendRefs"), (*where, "backendRefs"), MAX_BACKEND_REFS)
        ):
            b_where: FieldPath = (*where, "backendRefs", b_index)
            if _map(backend, b_where).get("filters"):
                raise SpecError(
                    (*b_where, "filters"), "filters on a backendRef are not supported by Waygate"
                )
            backends.append(_backend_ref(backend, b_where, namespace, weighted=True))
        timeouts = _map(fields.get("timeouts"), (*where, "timeouts"))
        request_timeout = _duration(timeouts, "request", (*where, "timeouts"))
        backend_timeout = _duration(timeouts, "backendRequest", (*where, "timeouts"))
        if (
            request_timeout is not None
            and backend_timeout is not None
            and backend_timeout > request_timeout
        ):
            raise SpecError(
                (*where, "timeouts", "backendRequest"), "must not be longer than request"
            )
        rules.append(
            RuleSpec(
                matches,
                filters,
                tuple(backends),
                request_timeout,
                backend_timeout,
                mirror_refs,
            )
        )
    return RouteSpec("HTTPRoute", _hostnames(spec), parent_refs(obj, namespace), tuple(rules))


def grpc_route(obj: JSON) -> RouteSpec:
    """GRPCRoute: a method match is a path match on /SERVICE/METHOD."""
    namespace, _ = meta(obj)
    spec = _map(obj.get("spec"), ("spec",))
    rules = []
    for index, item in enumerate(_rules(spec) or [{}]):
        where: FieldPath = ("spec", "rules", index)
        fields = _map(item, where)
        matches = []
        for m_index, raw in enumerate(
            _list(fields.get("matches"), (*where, "matches"), MAX_MATCHES)
        ):
            m_where: FieldPath = (*where, "matches", m_index)
            match_fields = _map(raw, m_where)
            method = _map(match_fields.get("method"), (*m_where, "method"))
            kind = _enum(
                method, "type", (*m_where, "method"), ("Exact", "RegularExpression"), "Exact"
            )
            service = _str(method, "service", (*m_where, "method"))
            name = _str(method, "method", (*m_where, "method"))
            if kind == "Exact":
                if service and name:
                    path_type, path = PathMatchType.EXACT, f"/{service}/{name}"
                elif service:
                    path_type, path = PathMatchType.PREFIX, f"/{service}"
                elif name:
                    path_type, path = PathMatchType.REGEX, f"/[^/]+/{re.escape(name)}"
                else:
                    path_type, path = PathMatchType.PREFIX, "/"
            else:
                path_type = PathMatchType.REGEX
                path = f"/{service or '[^/]+'}/{name or '[^/]+'}"
                _regex(path, (*m_where, "method"))
            matches.append(
                RouteMatch(
                    path_type,
                    path,
                    _value_matches(match_fields.get("headers"), (*m_where, "headers"), header=True),
                    (),
                    "POST",
                )
            )
        filters, mirror_refs = _filters(
            fields.get("filters"), (*where, "filters"), namespace, tuple(matches)
        )
        backends = tuple(
            _backend_ref(b, (*where, "backendRefs", i), namespace, weighted=True)
            for i, b in enumerate(
                _list(fields.get("backendRefs"), (*where, "backendRefs"), MAX_BACKEND_REFS)
            )
        )
        rules.append(
            RuleSpec(
                tuple(matches) or (RouteMatch(method="POST"),),
                filters,
                backends,
                mirror_refs=mirror_refs,
            )
        )
    return RouteSpec("GRPCRoute", _hostnames(spec), parent_refs(obj, namespace), tuple(rules))


def tls_route(obj: JSON) -> RouteSpec:
    namespace, _ = meta(obj)
    spec = _map(obj.get("spec"), ("spec",))
    rules = []
    for index, item in enumerate(_list(spec.get("rules"), ("spec", "rules"), MAX_RULES)):
        where: FieldPath = ("spec", "rules", index)
        fields = _map(item, where)
        backends = tuple(
            _backend_ref(b, (*where, "backendRefs", i), namespace, weighted=True)
            for i, b in enumerate(
                _list(fields.get("backendRefs"), (*where, "backendRefs"), MAX_BACKEND_REFS)
            )
        )
        rules.append(RuleSpec((), None, backends))
    if not rules:
        raise SpecError(("spec", "rules"), "at least one rule is required")
    return RouteSpec("TLSRoute", _hostnames(spec), parent_refs(obj, namespace), tuple(rules))


# ---------------------------------------------------------------- ReferenceGrant


@dataclass(frozen=True)
class Grant:
    """One ReferenceGrant: `from` (group, kind, namespace) may reach `to` (group, kind, name)."""

    namespace: str
    from_: tuple[tuple[str, str, str], ...]
    to: tuple[tuple[str, str, str], ...]  # name "" : any


def reference_grant(obj: JSON) -> Grant:
    namespace, _ = meta(obj)
    spec = _map(obj.get("spec"), ("spec",))
    froms = []
    for index, item in enumerate(_list(spec.get("from"), ("spec", "from"), MAX_GRANT_ENTRIES)):
        where: FieldPath = ("spec", "from", index)
        fields = _map(item, where)
        froms.append(
            (
                _str(fields, "group", where),
                _required(fields, "kind", where),
                _required(fields, "namespace", where),
            )
        )
    tos = []
    for index, item in enumerate(_list(spec.get("to"), ("spec", "to"), MAX_GRANT_ENTRIES)):
        where = ("spec", "to", index)
        fields = _map(item, where)
        tos.append(
            (
                _str(fields, "group", where),
                _required(fields, "kind", where),
                _str(fields, "name", where),
            )
        )
    if not froms or not tos:
        raise SpecError(("spec",), "from and to each need at least one entry")
    return Grant(namespace, tuple(froms), tuple(tos))


# ---------------------------------------------------------------- Ingress


@dataclass(frozen=True)
class IngressBackend:
    service: str
    port: str  # name or number
    # Set: a resource backend or a backend without service (not supported).
    invalid: str = ""


@dataclass(frozen=True)
class IngressPath:
    path_type: PathMatchType
    path: str
    backend: IngressBackend


@dataclass(frozen=True)
class IngressRule:
    host: str  # "" : any
    paths: tuple[IngressPath, ...]


@dataclass(frozen=True)
class IngressSpec:
    class_name: str
    default_backend: IngressBackend | None
    rules: tuple[IngressRule, ...]
    tls: tuple[tuple[tuple[str, ...], str], ...]  # (hosts, secretName)


def _ingress_backend(value: Any, where: FieldPath) -> IngressBackend:
    fields = _map(value, where)
    if "resource" in fields:
        return IngressBackend("", "", "resource backends are not supported by Waygate")
    service = _map(fields.get("service"), (*where, "service"))
    name = _required(service, "name", (*where, "service"))
    port = _map(service.get("port"), (*where, "service", "port"))
    number = _int(port, "number", (*where, "service", "port"), 0, 0, 65535) or 0
    port_name = _str(port, "name", (*where, "service", "port"))
    if bool(number) == bool(port_name):
        raise SpecError((*where, "service", "port"), "exactly one of number and name is required")
    return IngressBackend(name, port_name or str(number))


def ingress(obj: JSON) -> IngressSpec:
    spec = _map(obj.get("spec"), ("spec",))
    class_name = _str(spec, "ingressClassName", ("spec",))
    if not class_name:
        annotations = (obj.get("metadata") or {}).get("annotations") or {}
        class_name = str(annotations.get("kubernetes.io/ingress.class", ""))
    default = None
    if spec.get("defaultBackend") is not None:
        default = _ingress_backend(spec["defaultBackend"], ("spec", "defaultBackend"))
    rules = []
    for index, item in enumerate(_list(spec.get("rules"), ("spec", "rules"))):
        where: FieldPath = ("spec", "rules", index)
        fields = _map(item, where)
        host = _str(fields, "host", where)
        if host:
            host = hostname(host, (*where, "host"))
        http = _map(fields.get("http"), (*where, "http"))
        paths = []
        for p_index, raw in enumerate(_list(http.get("paths"), (*where, "http", "paths"))):
            p_where: FieldPath = (*where, "http", "paths", p_index)
            path_fields = _map(raw, p_where)
            kind = _enum(
                path_fields,
                "pathType",
                p_where,
                ("Exact", "Prefix", "ImplementationSpecific"),
                "ImplementationSpecific",
            )
            path = _path(_str(path_fields, "path", p_where, "/") or "/", (*p_where, "path"))
            paths.append(
                IngressPath(
                    PathMatchType.EXACT if kind == "Exact" else PathMatchType.PREFIX,
                    path,
                    _ingress_backend(path_fields.get("backend"), (*p_where, "backend")),
                )
            )
        rules.append(IngressRule(host, tuple(paths)))
    tls = []
    for index, item in enumerate(_list(spec.get("tls"), ("spec", "tls"))):
        where = ("spec", "tls", index)
        fields = _map(item, where)
        hosts = tuple(
            hostname(str(h), (*where, "hosts", i))
            for i, h in enumerate(_list(fields.get("hosts"), (*where, "hosts")))
        )
        tls.append((hosts, _str(fields, "secretName", where)))
    return IngressSpec(class_name, default, tuple(rules), tuple(tls))


# ---------------------------------------------------------------- BackendTLSPolicy


@dataclass(frozen=True)
class PolicyTarget:
    group: str
    kind: str
    name: str
    section_name: str  # "" : every port of the Service


@dataclass(frozen=True)
class LocalRef:
    group: str
    kind: str
    name: str


@dataclass(frozen=True)
class BackendTLSPolicySpec:
    """BackendTLSPolicy (gateway.networking.k8s.io/v1, GA in v1.4; v1alpha3 read too)."""

    targets: tuple[PolicyTarget, ...]
    ca_refs: tuple[LocalRef, ...]
    well_known: str  # "" or "System" (another value: the policy is not accepted)
    hostname: str
    san_hostnames: tuple[str, ...]
    san_uris: tuple[str, ...]


def backend_tls_policy(obj: JSON) -> BackendTLSPolicySpec:
    """The schema checks of the CRD (and its CEL rules) for a BackendTLSPolicy."""
    spec = _map(obj.get("spec"), ("spec",))
    targets = []
    seen: set[tuple[str, str, str, str]] = set()
    raw_targets = _list(spec.get("targetRefs"), ("spec", "targetRefs"), MAX_POLICY_TARGETS)
    if not raw_targets:
        raise SpecError(("spec", "targetRefs"), "at least one targetRef is required")
    for index, item in enumerate(raw_targets):
        where: FieldPath = ("spec", "targetRefs", index)
        fields = _map(item, where)
        target = PolicyTarget(
            _str(fields, "group", where),
            _required(fields, "kind", where),
            _required(fields, "name", where),
            _str(fields, "sectionName", where),
        )
        identity = (target.group, target.kind, target.name, target.section_name)
        if identity in seen:
            raise SpecError(where, "sectionName must be unique for the same target")
        seen.add(identity)
        targets.append(target)
    where = ("spec", "validation")
    validation = _map(spec.get("validation"), where)
    refs = []
    for index, item in enumerate(
        _list(validation.get("caCertificateRefs"), (*where, "caCertificateRefs"), MAX_CA_REFS)
    ):
        ref_where: FieldPath = (*where, "caCertificateRefs", index)
        fields = _map(item, ref_where)
        refs.append(
            LocalRef(
                _str(fields, "group", ref_where),
                _required(fields, "kind", ref_where),
                _required(fields, "name", ref_where),
            )
        )
    well_known = _str(validation, "wellKnownCACertificates", where)
    if refs and well_known:
        raise SpecError(
            where, "must not contain both caCertificateRefs and wellKnownCACertificates"
        )
    if not refs and not well_known:
        raise SpecError(where, "must specify either caCertificateRefs or wellKnownCACertificates")
    host = hostname(_required(validation, "hostname", where), (*where, "hostname"), wildcard=False)
    san_hosts: list[str] = []
    san_uris: list[str] = []
    for index, item in enumerate(
        _list(validation.get("subjectAltNames"), (*where, "subjectAltNames"), MAX_SANS)
    ):
        san_where: FieldPath = (*where, "subjectAltNames", index)
        fields = _map(item, san_where)
        kind = _enum(fields, "type", san_where, ("Hostname", "URI"), "")
        name, uri = _str(fields, "hostname", san_where), _str(fields, "uri", san_where)
        if kind == "Hostname":
            if not name or uri:
                raise SpecError(san_where, "type Hostname takes hostname (and no uri)")
            san_hosts.append(hostname(name, (*san_where, "hostname")))
        else:
            if not uri or name:
                raise SpecError(san_where, "type URI takes uri (and no hostname)")
            if not re.match(r"^[A-Za-z][A-Za-z0-9+.\-]*:\S+$", uri):
                raise SpecError((*san_where, "uri"), f"{uri!r} is not an absolute URI")
            san_uris.append(uri)
    return BackendTLSPolicySpec(
        tuple(targets), tuple(refs), well_known, host, tuple(san_hosts), tuple(san_uris)
    )
