"""The Route schema: every field a person writes in a route, declared once.

The routes file's route entries, the Route custom resource's `spec` and the
documents `waygate routes get -o yaml` prints and `routes apply` takes are one
format. This module declares it — each field's key, the model attribute it
fills, its type, allowed values and bounds (the CRD's maxLength/maxItems) — and
derives from that declaration:

- `read_route`: the one reader of that format, over YAML nodes (the routes
  file, `routes apply -f`, manifests; every error names its node's line) and
  over decoded JSON (Route objects from the Kubernetes API). Unknown keys,
  wrong types, values outside the allowed ones, strings over their maxLength
  and lists over their maxItems are refused naming the field, before anything
  is built; then `validation.validate_route` checks what types cannot say.
- `route_to_document`: the writer, in the same spelling (enum values as the
  file spells them: `Lax`, not `SAME_SITE_LAX`; durations as `5s`).
- `openapi_spec`: the structural part of the CRD's schema, which
  tests/unit/resolver/test_route_schema.py compares with
  deploy/kustomize/base/crd-route.yaml.

The same tests hold the model, the proto and `convert.py` to this declaration:
a model or proto field that is neither declared here nor listed in `DERIVED`
(set only by the resolver or the Gateway API translation, with the reason)
fails them, and so does a declared field that does not survive the proto and
the file both ways.

Invariants:
- Defaults are the model's (`model.py` dataclass defaults), except where a
  field says otherwise (a route's namespace in the file: "default").
- A null value means "unset", whatever the type, as in Kubernetes.
- Pure: no I/O; errors are `SchemaError` (an InvalidArgument) carrying the
  node and the path of keys, so each caller can name `path:line` or the field.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Generic, Protocol, TypeVar

import yaml

from waygate.core.errors import InvalidArgument, excerpt
from waygate.core.settings import parse_duration
from waygate.resolver import model
from waygate.resolver.validation import (
    MAX_ALTERNATE_BACKENDS,
    MAX_HOST_LENGTH,
    MAX_PATH_LENGTH,
    MAX_PEM_LENGTH,
    MAX_WEIGHT,
    shown,
    validate_route,
)

N = TypeVar("N")

# Field types.
STRING: Final = "string"
INTEGER: Final = "integer"
BOOLEAN: Final = "boolean"
DURATION: Final = "duration"  # "5s", "1m30s", "250ms"; a bare number is seconds
PORT: Final = "port"  # a port name or number (the CRD's int-or-string)
OBJECT: Final = "object"
LIST: Final = "list"  # a list of objects

#: The CRD's pattern for durations (what parse_duration reads, less bare numbers).
DURATION_PATTERN: Final = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h|d))+$"
#: The CRD's pattern for a route path (validation.normalize_path says the rest).
PATH_PATTERN: Final = r"^(/[A-Za-z0-9._~!$&'()*+,;=:@/%-]*)?$"
#: A Kubernetes name segment (namespace, service) and an object name.
MAX_LABEL_LENGTH: Final = 63
#: A port name (IANA service name: 15) or number (5 digits).
MAX_PORT_LENGTH: Final = 15
MAX_COOKIE_NAME_LENGTH: Final = 256

#: How many routes one source (the routes file, the Route objects of a cluster)
#: may produce, unless --max-routes-per-source says otherwise: far above any
#: hand-written file, far below what would exhaust the proxy's memory.
DEFAULT_MAX_ROUTES_PER_SOURCE: Final = 10_000


@dataclass(frozen=True)
class Field:
    """One key of the format."""

    key: str  # camelCase: the routes file's and the CRD's spelling
    attr: str  # the model attribute it fills ("" for the `to` shorthand)
    kind: str
    required: bool = False
    # The value when absent or null: `model.py`'s default unless given here.
    default: Any = None
    has_default: bool = False
    max_length: int | None = None
    # LIST: bounds on the number of items.
    min_items: int | None = None
    max_items: int | None = None
    # INTEGER bounds.
    minimum: int | None = None
    maximum: int | None = None
    # Allowed spellings of a string; with `enum`, its values.
    choices: tuple[str, ...] = ()
    enum_type: type[enum.Enum] | None = None
    pattern: str = ""
    # OBJECT and LIST: the nested fields and the dataclass they build.
    fields: tuple[Field, ...] = ()
    model_type: type | None = None

    def allowed(self) -> str:
        return ", ".join(self.choices)


def _choice(enum_type: type[enum.Enum]) -> tuple[str, ...]:
    return tuple(str(member.value) for member in enum_type if member.value)


def _enum(key: str, attr: str, enum_type: type[enum.Enum], *, required: bool = False) -> Field:
    """A string field whose allowed spellings are an enum's values."""
    return Field(
        key, attr, STRING, required=required, enum_type=enum_type, choices=_choice(enum_type)
    )


def _pem(key: str, attr: str) -> Field:
    return Field(key, attr, STRING, max_length=MAX_PEM_LENGTH)


HSTS_FIELDS: Final = (
    Field("maxAge", "max_age", DURATION, required=True, pattern=DURATION_PATTERN),
    Field("includeSubdomains", "include_subdomains", BOOLEAN),
    Field("preload", "preload", BOOLEAN),
)

TLS_FIELDS: Final = (
    _enum("termination", "termination", model.TLSTermination, required=True),
    _pem("certificate", "certificate"),
    _pem("key", "key"),
    _pem("caCertificate", "ca_certificate"),
    _pem("destinationCACertificate", "destination_ca_certificate"),
    _pem("clientCACertificate", "client_ca_certificate"),
    Field("destinationServerName", "destination_server_name", STRING, max_length=MAX_HOST_LENGTH),
    Field("presentClientCertificate", "present_client_certificate", BOOLEAN),
    Field("hsts", "hsts", OBJECT, fields=HSTS_FIELDS, model_type=model.HSTS),
    _enum(
        "insecureEdgeTerminationPolicy",
        "insecure_edge_termination_policy",
        model.InsecureEdgePolicy,
    ),
)

BACKEND_FIELDS: Final = (
    Field("service", "service", STRING, required=True, max_length=MAX_LABEL_LENGTH),
    Field("weight", "weight", INTEGER, minimum=0, maximum=MAX_WEIGHT),
)

STICKY_FIELDS: Final = (
    Field("disableCookies", "disable_cookies", BOOLEAN),
    Field("cookieName", "cookie_name", STRING, max_length=MAX_COOKIE_NAME_LENGTH),
    _enum("sameSite", "same_site", model.SameSite),
)

TIMEOUT_FIELDS: Final = tuple(
    Field(key, attr, DURATION, pattern=DURATION_PATTERN) for key, attr in model.TIMEOUT_KEYS.items()
)

#: The `to` shorthand: `to: web` is `backends: [{service: web}]`.
TO: Final = Field("to", "", STRING, max_length=MAX_LABEL_LENGTH)

#: A route's spec: the Route CRD's `spec`, and a routes-file entry less
#: namespace and name.
SPEC_FIELDS: Final = (
    Field("host", "host", STRING, required=True, max_length=MAX_HOST_LENGTH),
    Field("path", "path", STRING, max_length=MAX_PATH_LENGTH, pattern=PATH_PATTERN),
    TO,
    Field(
        "backends",
        "backends",
        LIST,
        min_items=1,
        max_items=1 + MAX_ALTERNATE_BACKENDS,
        fields=BACKEND_FIELDS,
        model_type=model.RouteBackend,
    ),
    Field("targetPort", "target_port", PORT, max_length=MAX_PORT_LENGTH),
    Field("tls", "tls", OBJECT, fields=TLS_FIELDS, model_type=model.RouteTLS),
    _enum("balance", "balance", model.BalancePolicy),
    Field("sticky", "sticky", OBJECT, fields=STICKY_FIELDS, model_type=model.StickySessions),
    Field("timeouts", "timeouts", OBJECT, fields=TIMEOUT_FIELDS, model_type=model.RouteTimeouts),
    Field("authProxyHeaders", "auth_proxy_headers", BOOLEAN),
    _enum("forwardedHeaders", "forwarded_headers", model.ForwardedHeadersMode),
    Field("upstreamProtocol", "upstream_protocol", STRING, choices=model.UPSTREAM_PROTOCOLS),
    Field("requestBuffering", "request_buffering", BOOLEAN),
)

#: Where a routes-file entry differs from a CRD: it names itself.
IDENTITY_FIELDS: Final = (
    Field(
        "namespace",
        "namespace",
        STRING,
        default="default",
        has_default=True,
        max_length=MAX_LABEL_LENGTH,
    ),
    Field("name", "name", STRING, required=True, max_length=MAX_HOST_LENGTH),
)
ENTRY_FIELDS: Final = IDENTITY_FIELDS + SPEC_FIELDS

#: Model fields no source of this format sets, and why (the tests require every
#: model and proto field to be declared above or listed here).
DERIVED: Final[Mapping[str, Mapping[str, str]]] = {
    "Route": {
        "created": "the source's creation time (the CRD's metadata.creationTimestamp)",
        "status": "computed by the resolver's store; ignored on apply",
        "matches": "Gateway API and Ingress routes (waygate.resolver.gateway)",
        "filters": "Gateway API and Ingress routes",
        "request_timeout": "HTTPRoute timeouts.request",
        "backend_request_timeout": "HTTPRoute timeouts.backendRequest",
        "listener_port": "the Gateway listener a Gateway API route is served on",
        "gateway": "the Gateway a Gateway API route is attached to",
        "listener_protocol": "that listener's protocol",
        "origin": "the Gateway API or Ingress object a route was made from",
        "rule_index": "the rule of that object (a precedence tie-breaker)",
        "ingress_refusal": "why an ingress-nginx Ingress is not served (its annotations)",
        "ingress_verdicts": "an ingress-nginx Ingress's per-annotation verdicts",
        "access": "ingress-nginx's access annotations and ConfigMap block lists",
        "host_claim": "a Gateway listener's hostname claim a route is attached through",
        "proxy_protocol_from_client": "a TCP services ConfigMap entry's first PROXY",
        "proxy_protocol_to_backend": "a TCP services ConfigMap entry's second PROXY",
        "rate_limit": "ingress-nginx limit-* annotations (per proxy replica)",
        "external_auth": "ingress-nginx auth-url and friends",
        "cors": "ingress-nginx enable-cors and cors-* annotations",
        "max_request_body": "ingress-nginx proxy-body-size",
        "next_upstream": "ingress-nginx proxy-next-upstream",
        "next_upstream_tries": "ingress-nginx proxy-next-upstream-tries",
        "rewrite_target": "ingress-nginx rewrite-target with capture groups",
        "default_backend": "ingress-nginx default-backend",
        "hash_by": "ingress-nginx upstream-hash-by",
        "hash_subset_size": "ingress-nginx upstream-hash-by-subset(-size)",
        "redirect_from": "ingress-nginx proxy-redirect-from",
        "redirect_to": "ingress-nginx proxy-redirect-to",
        "cookie_domain": "ingress-nginx proxy-cookie-domain",
        "cookie_path": "ingress-nginx proxy-cookie-path",
        "custom_http_errors": "ingress-nginx custom-http-errors",
        "intercept_errors_disabled": "ingress-nginx disable-proxy-intercept-errors",
        "port_in_redirects": "ingress-nginx use-port-in-redirects",
        "connection_header": "ingress-nginx connection-proxy-header",
        "access_log_disabled": 'ingress-nginx enable-access-log "false"',
        "client_proxy_protocol": 'ingress-nginx use-proxy-protocol "true"',
        "canary": "ingress-nginx canary annotations (a canary Ingress folded in)",
        "limit_rate": "ingress-nginx limit-rate",
        "limit_rate_after": "ingress-nginx limit-rate-after",
        "url_mirror": "ingress-nginx mirror-target, -host and -request-body",
        "next_upstream_timeout": "ingress-nginx proxy-next-upstream-timeout",
        "upstream_scheme_from_client": "ingress-nginx backend-protocol AUTO_HTTP",
        "upstream_http10": 'ingress-nginx proxy-http-version "1.0"',
        "redirect_location": "ingress-nginx permanent-redirect / temporal-redirect targets",
        "client_address_header": "ingress-nginx forwarded-for-header",
        "span_name": "ingress-nginx opentelemetry-operation-name",
        "tracing_off": "ingress-nginx enable-opentelemetry",
        "untrusted_trace_context": "ingress-nginx opentelemetry-trust-incoming-span",
    },
    "RouteBackend": {
        "namespace": "Gateway API backendRefs across namespaces (ReferenceGrant)",
        "port": "Gateway API backendRefs' port",
        "invalid": "why the resolver cannot use a Gateway API backendRef",
        "use_cluster_ip": "ingress-nginx service-upstream",
    },
    "StickySessions": {
        "cookie_path": "ingress-nginx session-cookie-path",
        "cookie_domain": "ingress-nginx session-cookie-domain",
        "cookie_max_age": "ingress-nginx session-cookie-max-age and -expires",
        "cookie_secure": "ingress-nginx session-cookie-secure",
    },
    "RouteTLS": {
        "destination_system_ca": "BackendTLSPolicy wellKnownCACertificates",
        "destination_san_hostnames": "BackendTLSPolicy subjectAltNames",
        "destination_san_uris": "BackendTLSPolicy subjectAltNames",
        "backend_client_certificate": "ingress-nginx proxy-ssl-secret's tls.crt",
        "backend_client_key": "ingress-nginx proxy-ssl-secret's tls.key",
        "protocols": "ingress-nginx ssl-protocols",
        "ciphers": "ingress-nginx ssl-ciphers",
    },
}

# Derived fields the resolver keeps to itself: they reach clients as the route's
# status conditions (Admitted, AnnotationsHonoured), not as fields of the proto.
RESOLVER_ONLY: Final[Mapping[str, frozenset[str]]] = {
    "Route": frozenset({"ingress_refusal", "ingress_verdicts", "host_claim"}),
}


# ---------------------------------------------------------------- errors


class SchemaError(InvalidArgument):
    """A value the format refuses: `node` is where it is (a YAML node, for its line),
    `where` the path of keys and indexes to it within the route."""

    def __init__(
        self,
        what: str,
        where: tuple[str | int, ...],
        node: Any,
        reason: str,
        at: tuple[str | int, ...] | None = None,
    ) -> None:
        self.what, self.where, self.node, self.reason = what, where, node, reason
        # Where to point (an unknown key's own line): `where` and maybe the key.
        self.at = where if at is None else at
        # The dotted path, as validation's errors carry it.
        self.field = dotted(where)
        super().__init__(f"{what}: {self.field}: {reason}" if where else f"{what}: {reason}")


def key_path(field: str, keys: Mapping[str, str] | None = None) -> tuple[str | int, ...]:
    """A validation error's dotted attribute path ("backends[1].weight") as the
    path of keys and indexes in the format (("backends", 1, "weight")): the key
    `keys` or this schema gives an attribute, else its camelCase."""
    path: list[str | int] = []
    for part in field.split("."):
        name, *indexes = part.replace("]", "").split("[")
        head, *rest = name.split("_")
        camel = head + "".join(word.capitalize() for word in rest)
        path.append((keys or {}).get(name) or KEY_OF_ATTR.get(name, camel))
        path.extend(int(i) for i in indexes if i.isdigit())
    return tuple(path)


def dotted(where: Iterable[str | int]) -> str:
    text = ""
    for part in where:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


# ---------------------------------------------------------------- trees


class Tree(Protocol[N]):
    """The reader's view of a parsed document: YAML nodes or decoded JSON."""

    def is_mapping(self, node: N) -> bool: ...
    def is_sequence(self, node: N) -> bool: ...
    def entries(self, node: N) -> list[tuple[Any, N, N]]: ...  # (key, key node, value node)
    def elements(self, node: N) -> list[N]: ...
    def value(self, node: N) -> Any: ...


class JsonTree(Tree[Any]):
    """Decoded JSON (the Kubernetes API's objects): a node is its value."""

    def is_mapping(self, node: Any) -> bool:
        return isinstance(node, dict)

    def is_sequence(self, node: Any) -> bool:
        return isinstance(node, list)

    def entries(self, node: Any) -> list[tuple[Any, Any, Any]]:
        return [(key, key, value) for key, value in node.items()]

    def elements(self, node: Any) -> list[Any]:
        return list(node)

    def value(self, node: Any) -> Any:
        if isinstance(node, dict | list):
            raise _NotScalar
        return node


class YamlTree(Tree[yaml.Node]):
    """Composed YAML nodes, which carry their lines; scalars are constructed one
    at a time with the safe constructor (one per tree: it is not thread-safe)."""

    def __init__(self) -> None:
        self._constructor = yaml.constructor.SafeConstructor()

    def is_mapping(self, node: yaml.Node) -> bool:
        return isinstance(node, yaml.MappingNode)

    def is_sequence(self, node: yaml.Node) -> bool:
        return isinstance(node, yaml.SequenceNode)

    def entries(self, node: yaml.Node) -> list[tuple[Any, yaml.Node, yaml.Node]]:
        return [(self.value(k), k, v) for k, v in node.value]

    def elements(self, node: yaml.Node) -> list[yaml.Node]:
        return list(node.value)

    def value(self, node: yaml.Node) -> Any:
        if not isinstance(node, yaml.ScalarNode):
            raise _NotScalar
        if node.tag == _STR:
            return node.value  # what the constructor would return, at a fraction of the cost
        try:
            return self._constructor.construct_object(node, deep=True)
        except (yaml.YAMLError, ValueError, OverflowError) as exc:  # 2026-13-45: a ValueError
            raise _BadScalar(str(exc)) from None


_STR: Final = "tag:yaml.org,2002:str"


class _NotScalar(ValueError):
    pass


class _BadScalar(ValueError):
    pass


def node_at(node: Any, where: Iterable[str | int]) -> Any:
    """The YAML node at a path of keys and indexes, or the deepest one on the way
    (so an error names the closest line)."""
    for part in where:
        if isinstance(part, str) and isinstance(node, yaml.MappingNode):
            child = next((v for k, v in node.value if getattr(k, "value", None) == part), None)
            if child is None and part == "backends":
                child = next((v for k, v in node.value if getattr(k, "value", None) == "to"), None)
        elif isinstance(part, int) and isinstance(node, yaml.SequenceNode):
            child = node.value[part] if part < len(node.value) else None
        else:
            child = None
        if child is None:
            break
        node = child
    return node


def line_of(node: Any) -> int | None:
    """The 1-based line of a YAML node; None for JSON."""
    mark = getattr(node, "start_mark", None)
    return mark.line + 1 if mark is not None else None


# ---------------------------------------------------------------- reading


@dataclass
class _Reader(Generic[N]):
    tree: Tree[N]
    what: str

    def fail(
        self, where: tuple[str | int, ...], node: N, reason: str, key: str | None = None
    ) -> SchemaError:
        return SchemaError(self.what, where, node, reason, None if key is None else (*where, key))

    def mapping(
        self, node: N, fields: tuple[Field, ...], where: tuple[str | int, ...]
    ) -> dict[str, tuple[Field, N]]:
        if not self.tree.is_mapping(node):
            raise self.fail(where, node, "must be a mapping")
        by_key = {f.key: f for f in fields}
        found: dict[str, tuple[Field, N]] = {}
        for key, key_node, value_node in self.tree.entries(node):
            if not isinstance(key, str):
                raise self.fail(where, key_node, f"keys must be strings, not {excerpt(repr(key))}")
            if key not in by_key:
                raise self.fail(
                    where,
                    key_node,
                    f"unknown key {excerpt(key)} (allowed: {', '.join(by_key)})",
                    key,
                )
            if key in found:
                raise self.fail(where, key_node, f"key {excerpt(key)} appears twice", key)
            found[key] = (by_key[key], value_node)
        for field in fields:
            if field.required and self._unset(found, (*where, field.key)):
                raise self.fail((*where, field.key), node, "is required")
        return found

    def _unset(self, found: dict[str, tuple[Field, N]], where: tuple[str | int, ...]) -> bool:
        key = str(where[-1])
        if key not in found:
            return True
        node = found[key][1]
        return (
            not self.tree.is_mapping(node)
            and not self.tree.is_sequence(node)
            and (self.scalar(node, where) in (None, ""))
        )

    def scalar(self, node: N, where: tuple[str | int, ...]) -> Any:
        try:
            return self.tree.value(node)
        except _NotScalar:
            raise self.fail(where, node, "expected a single value, not a list or mapping") from None
        except _BadScalar as exc:
            raise self.fail(where, node, f"bad value: {exc}") from None

    def object(
        self, node: N, fields: tuple[Field, ...], where: tuple[str | int, ...]
    ) -> dict[str, Any]:
        """The model keyword arguments of the mapping at `node` (absent keys left out)."""
        values: dict[str, Any] = {}
        for key, (field, value_node) in self.mapping(node, fields, where).items():
            value = self.field(field, value_node, (*where, key))
            if value is not None:
                values[field.attr or key] = value
        return values

    def field(self, field: Field, node: N, where: tuple[str | int, ...]) -> Any:
        """The field's model value, or None when null (unset)."""
        if field.kind == OBJECT:
            if not self.tree.is_mapping(node) and self.scalar(node, where) is None:
                return None
            assert field.model_type is not None
            return field.model_type(**self.object(node, field.fields, where))
        if field.kind == LIST:
            if not self.tree.is_sequence(node):
                if self.scalar(node, where) is None:
                    return None
                raise self.fail(where, node, "must be a list")
            items = self.tree.elements(node)
            if field.max_items is not None and len(items) > field.max_items:
                raise self.fail(where, node, f"{len(items)} items; at most {field.max_items}")
            assert field.model_type is not None
            return tuple(
                field.model_type(**self.object(item, field.fields, (*where, index)))
                for index, item in enumerate(items)
            )
        value = self.scalar(node, where)
        if value is None:
            return None
        return self.plain(field, value, node, where)

    def plain(self, field: Field, value: Any, node: N, where: tuple[str | int, ...]) -> Any:
        shown_value = excerpt(repr(value))
        if field.kind == BOOLEAN:
            if not isinstance(value, bool):
                raise self.fail(where, node, f"must be true or false, not {shown_value}")
            return value
        if field.kind == INTEGER:
            # bool is an int in Python; a weight of `true` is a mistake, not 1.
            if isinstance(value, bool) or not isinstance(value, int):
                raise self.fail(where, node, f"must be a whole number, not {shown_value}")
            if (field.minimum is not None and value < field.minimum) or (
                field.maximum is not None and value > field.maximum
            ):
                raise self.fail(where, node, f"{value} is outside {field.minimum}..{field.maximum}")
            return value
        if field.kind == DURATION:
            if isinstance(value, bool):
                raise self.fail(where, node, f"must be a duration such as 5s, not {shown_value}")
            if isinstance(value, int | float):
                return float(value)
            if not isinstance(value, str):
                raise self.fail(where, node, f"must be a duration such as 5s, not {shown_value}")
            if len(value) > 64:
                raise self.fail(where, node, f"{excerpt(value)} is not a duration such as 5s")
            try:
                return parse_duration(value)
            except ValueError as exc:
                raise self.fail(where, node, str(exc)) from None
        # STRING and PORT: a number written unquoted is its text (targetPort: 8080).
        if isinstance(value, int | float) and not isinstance(value, bool):
            value = str(value)
        if not isinstance(value, str):
            raise self.fail(where, node, f"must be a string, not {shown_value}")
        if field.max_length is not None and len(value) > field.max_length:
            raise self.fail(
                where,
                node,
                f"{len(value)} characters ({excerpt(value)}); at most {field.max_length}",
            )
        if field.choices:
            if value == "":
                return None
            if value not in field.choices:
                raise self.fail(where, node, f"{excerpt(value)} is not one of {field.allowed()}")
            return field.enum_type(value) if field.enum_type is not None else value
        return value


def read_route(
    tree: Tree[N],
    node: N,
    *,
    identity: tuple[str, str] | None = None,
    created: Any = None,
    validate: bool = True,
) -> model.Route:
    """The route a routes-file entry (identity None: it names itself) or a Route
    spec (identity: the object's namespace and name) describes, validated.

    SchemaError (with node and path) when the format refuses it; InvalidArgument
    with a `field` from validation when the values do not make a servable route.
    """
    if identity is None:
        reader = _Reader(tree, "route")
        namespace, name = _identity(tree, node)
        reader.what = f"route {shown(namespace)}/{shown(name)}"
        values = reader.object(node, ENTRY_FIELDS, ())
        values.setdefault("namespace", "default")
        values.setdefault("name", "")
    else:
        namespace, name = identity
        reader = _Reader(tree, f"route {shown(namespace)}/{shown(name)}")
        values = reader.object(node, SPEC_FIELDS, ())
        values.update(namespace=namespace, name=name)
    shorthand = values.pop(TO.key, None)
    if shorthand is not None:
        if "backends" in values:
            raise reader.fail((TO.key,), node, "give either 'to' or 'backends', not both")
        values["backends"] = (model.RouteBackend(shorthand),)
    route = model.Route(created=created, **values)
    return validate_route(route) if validate else route


def _identity(tree: Tree[N], node: N) -> tuple[str, str]:
    """Namespace and name for error messages, before the entry is read."""
    found = {"namespace": "default", "name": ""}
    if tree.is_mapping(node):
        for key, _, value_node in tree.entries(node):
            if key in found:
                try:
                    value = tree.value(value_node)
                except (_NotScalar, _BadScalar):
                    continue
                if isinstance(value, str):
                    found[key] = value
    return found["namespace"], found["name"]


def refuse_derived(route: model.Route) -> None:
    """InvalidArgument naming the first field set that this format cannot hold
    (a Gateway API route's matches, a backendRef's namespace, ...): a route
    written into the routes file must not lose a field silently. The resolver's
    own fields (status, creation time) are ignored, not refused."""
    what = f"route {shown(route.namespace)}/{shown(route.name)}"
    parts: list[tuple[str, str, Any]] = [("Route", "", route)]
    parts += [("RouteBackend", f"backends[{i}].", b) for i, b in enumerate(route.backends)]
    if route.tls is not None:
        parts.append(("RouteTLS", "tls.", route.tls))
    for owner, prefix, obj in parts:
        defaults = {
            f.name: f.default_factory()
            if f.default_factory is not dataclasses.MISSING
            else f.default
            for f in dataclasses.fields(obj)
        }
        for attr, why in DERIVED[owner].items():
            if attr in IGNORED_ON_APPLY:
                continue
            if getattr(obj, attr) != defaults[attr]:
                raise InvalidArgument(
                    f"{what}: {prefix}{attr}: a route of the routes file has no such field "
                    f"(it is {why})"
                )


#: The resolver's own fields: a route applied with them (as `routes get -o yaml`
#: prints it) is taken without them.
IGNORED_ON_APPLY: Final = frozenset({"status", "created"})


# ---------------------------------------------------------------- writing


def format_duration(seconds: float) -> str:
    if seconds == 0 or (seconds >= 1 and float(seconds).is_integer()):
        return f"{int(seconds)}s"
    return f"{round(seconds * 1000)}ms"


def _default(owner: type, field: Field) -> Any:
    if field.has_default:
        return field.default
    for declared in dataclasses.fields(owner):
        if declared.name == field.attr:
            if declared.default is not dataclasses.MISSING:
                return declared.default
            if declared.default_factory is not dataclasses.MISSING:
                return declared.default_factory()
    return dataclasses.MISSING


def _write(obj: Any, fields: tuple[Field, ...]) -> dict[str, Any]:
    doc: dict[str, Any] = {}
    for field in fields:
        if not field.attr:
            continue
        value = getattr(obj, field.attr)
        if not field.required and value == _default(type(obj), field):
            continue
        if value is None:
            continue
        doc[field.key] = _written(field, value)
    return doc


def _written(field: Field, value: Any) -> Any:
    if field.kind == OBJECT:
        return _write(value, field.fields)
    if field.kind == LIST:
        return [_write(item, field.fields) for item in value]
    if field.kind == DURATION:
        return format_duration(value)
    if isinstance(value, enum.Enum):
        return value.value
    return value


def route_to_document(route: model.Route) -> dict[str, Any]:
    """A route as the routes file spells it (the inverse of `read_route`)."""
    doc = {"namespace": route.namespace, "name": route.name}
    doc |= spec_document(route)
    return doc


def spec_document(route: model.Route) -> dict[str, Any]:
    """A route's spec as the routes file and the Route CRD spell it."""
    doc = _write(route, SPEC_FIELDS)
    backends = route.backends
    if len(backends) == 1 and backends[0] == model.RouteBackend(backends[0].service):
        # The shorthand, where it says everything, at the place `backends` had.
        doc = {(TO.key if k == "backends" else k): v for k, v in doc.items()}
        doc[TO.key] = backends[0].service
    return doc


# ---------------------------------------------------------------- the CRD


def openapi_spec(fields: tuple[Field, ...] = SPEC_FIELDS) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a mapping of these fields: types,
    required keys, enums, patterns, bounds (what the CRD's schema must say)."""
    schema: dict[str, Any] = {
        "type": "object",
        "properties": {field.key: _openapi(field) for field in fields},
    }
    required = [field.key for field in fields if field.required]
    if required:
        schema["required"] = required
    return schema


def _openapi(field: Field) -> dict[str, Any]:
    if field.kind == OBJECT:
        return openapi_spec(field.fields)
    if field.kind == LIST:
        schema: dict[str, Any] = {"type": "array", "items": openapi_spec(field.fields)}
        for key, value in (("minItems", field.min_items), ("maxItems", field.max_items)):
            if value is not None:
                schema[key] = value
        return schema
    if field.kind == PORT:
        schema = {"x-kubernetes-int-or-string": True}
    elif field.kind == DURATION:
        schema = {"type": "string"}
    else:
        schema = {"type": field.kind}
    if field.max_length is not None:
        schema["maxLength"] = field.max_length
    if field.minimum is not None:
        schema["minimum"] = field.minimum
    if field.maximum is not None:
        schema["maximum"] = field.maximum
    if field.pattern:
        schema["pattern"] = field.pattern
    if field.choices:
        schema["enum"] = list(field.choices) if field.required else ["", *field.choices]
    return schema


#: The structural keys `openapi_spec` says; a CRD's descriptions, defaults,
#: list-map keys and CEL rules are its own.
STRUCTURAL_KEYS: Final = frozenset(
    {
        "type",
        "properties",
        "items",
        "required",
        "enum",
        "pattern",
        "maxLength",
        "minItems",
        "maxItems",
        "minimum",
        "maximum",
        "x-kubernetes-int-or-string",
    }
)


def structural(schema: Mapping[str, Any]) -> dict[str, Any]:
    """Only the structural keys of an OpenAPI schema, recursively."""
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key not in STRUCTURAL_KEYS:
            continue
        if key == "properties":
            value = {name: structural(sub) for name, sub in value.items()}
        elif key == "items":
            value = structural(value)
        out[key] = value
    return out


def all_fields(fields: tuple[Field, ...] = ENTRY_FIELDS) -> Iterable[tuple[Field, Field | None]]:
    """Every field, nested ones included, with the field it is nested in."""
    for field in fields:
        yield field, None
        for nested, parent in all_fields(field.fields):
            yield nested, parent or field


#: Model attribute -> key, for errors from `validation` (which name attributes).
KEY_OF_ATTR: Final[Mapping[str, str]] = {
    field.attr: field.key for field, _ in all_fields() if field.attr
}
