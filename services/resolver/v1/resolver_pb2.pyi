import datetime

from google.protobuf import duration_pb2 as _duration_pb2
from google.protobuf import timestamp_pb2 as _timestamp_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ServiceType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_TYPE_UNSPECIFIED: _ClassVar[ServiceType]
    SERVICE_TYPE_CLUSTER_IP: _ClassVar[ServiceType]
    SERVICE_TYPE_NODE_PORT: _ClassVar[ServiceType]
    SERVICE_TYPE_LOAD_BALANCER: _ClassVar[ServiceType]
    SERVICE_TYPE_EXTERNAL_NAME: _ClassVar[ServiceType]

class TLSTermination(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TLS_TERMINATION_UNSPECIFIED: _ClassVar[TLSTermination]
    TLS_TERMINATION_EDGE: _ClassVar[TLSTermination]
    TLS_TERMINATION_PASSTHROUGH: _ClassVar[TLSTermination]
    TLS_TERMINATION_REENCRYPT: _ClassVar[TLSTermination]

class InsecureEdgePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INSECURE_EDGE_POLICY_UNSPECIFIED: _ClassVar[InsecureEdgePolicy]
    INSECURE_EDGE_POLICY_NONE: _ClassVar[InsecureEdgePolicy]
    INSECURE_EDGE_POLICY_ALLOW: _ClassVar[InsecureEdgePolicy]
    INSECURE_EDGE_POLICY_REDIRECT: _ClassVar[InsecureEdgePolicy]

class BalancePolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BALANCE_POLICY_UNSPECIFIED: _ClassVar[BalancePolicy]
    BALANCE_POLICY_RANDOM: _ClassVar[BalancePolicy]
    BALANCE_POLICY_ROUND_ROBIN: _ClassVar[BalancePolicy]
    BALANCE_POLICY_LEAST_CONN: _ClassVar[BalancePolicy]
    BALANCE_POLICY_SOURCE: _ClassVar[BalancePolicy]

class SameSite(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SAME_SITE_UNSPECIFIED: _ClassVar[SameSite]
    SAME_SITE_LAX: _ClassVar[SameSite]
    SAME_SITE_STRICT: _ClassVar[SameSite]
    SAME_SITE_NONE: _ClassVar[SameSite]

class ForwardedHeadersMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FORWARDED_HEADERS_MODE_UNSPECIFIED: _ClassVar[ForwardedHeadersMode]
    FORWARDED_HEADERS_MODE_APPEND: _ClassVar[ForwardedHeadersMode]
    FORWARDED_HEADERS_MODE_REPLACE: _ClassVar[ForwardedHeadersMode]
    FORWARDED_HEADERS_MODE_IF_NONE: _ClassVar[ForwardedHeadersMode]
    FORWARDED_HEADERS_MODE_NEVER: _ClassVar[ForwardedHeadersMode]

class PathMatchType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PATH_MATCH_TYPE_UNSPECIFIED: _ClassVar[PathMatchType]
    PATH_MATCH_TYPE_PREFIX: _ClassVar[PathMatchType]
    PATH_MATCH_TYPE_EXACT: _ClassVar[PathMatchType]
    PATH_MATCH_TYPE_REGULAR_EXPRESSION: _ClassVar[PathMatchType]

class ValueMatchType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    VALUE_MATCH_TYPE_UNSPECIFIED: _ClassVar[ValueMatchType]
    VALUE_MATCH_TYPE_EXACT: _ClassVar[ValueMatchType]
    VALUE_MATCH_TYPE_REGULAR_EXPRESSION: _ClassVar[ValueMatchType]

class PathModifierType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PATH_MODIFIER_TYPE_UNSPECIFIED: _ClassVar[PathModifierType]
    PATH_MODIFIER_TYPE_REPLACE_FULL_PATH: _ClassVar[PathModifierType]
    PATH_MODIFIER_TYPE_REPLACE_PREFIX_MATCH: _ClassVar[PathModifierType]

class PickPolicy(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PICK_POLICY_UNSPECIFIED: _ClassVar[PickPolicy]
    PICK_POLICY_RANDOM: _ClassVar[PickPolicy]
    PICK_POLICY_ROUND_ROBIN: _ClassVar[PickPolicy]
    PICK_POLICY_HASH: _ClassVar[PickPolicy]

class ResourceKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RESOURCE_KIND_UNSPECIFIED: _ClassVar[ResourceKind]
    RESOURCE_KIND_SERVICES: _ClassVar[ResourceKind]
    RESOURCE_KIND_ENDPOINTS: _ClassVar[ResourceKind]
    RESOURCE_KIND_ROUTES: _ClassVar[ResourceKind]
    RESOURCE_KIND_TUNNELS: _ClassVar[ResourceKind]
SERVICE_TYPE_UNSPECIFIED: ServiceType
SERVICE_TYPE_CLUSTER_IP: ServiceType
SERVICE_TYPE_NODE_PORT: ServiceType
SERVICE_TYPE_LOAD_BALANCER: ServiceType
SERVICE_TYPE_EXTERNAL_NAME: ServiceType
TLS_TERMINATION_UNSPECIFIED: TLSTermination
TLS_TERMINATION_EDGE: TLSTermination
TLS_TERMINATION_PASSTHROUGH: TLSTermination
TLS_TERMINATION_REENCRYPT: TLSTermination
INSECURE_EDGE_POLICY_UNSPECIFIED: InsecureEdgePolicy
INSECURE_EDGE_POLICY_NONE: InsecureEdgePolicy
INSECURE_EDGE_POLICY_ALLOW: InsecureEdgePolicy
INSECURE_EDGE_POLICY_REDIRECT: InsecureEdgePolicy
BALANCE_POLICY_UNSPECIFIED: BalancePolicy
BALANCE_POLICY_RANDOM: BalancePolicy
BALANCE_POLICY_ROUND_ROBIN: BalancePolicy
BALANCE_POLICY_LEAST_CONN: BalancePolicy
BALANCE_POLICY_SOURCE: BalancePolicy
SAME_SITE_UNSPECIFIED: SameSite
SAME_SITE_LAX: SameSite
SAME_SITE_STRICT: SameSite
SAME_SITE_NONE: SameSite
FORWARDED_HEADERS_MODE_UNSPECIFIED: ForwardedHeadersMode
FORWARDED_HEADERS_MODE_APPEND: ForwardedHeadersMode
FORWARDED_HEADERS_MODE_REPLACE: ForwardedHeadersMode
FORWARDED_HEADERS_MODE_IF_NONE: ForwardedHeadersMode
FORWARDED_HEADERS_MODE_NEVER: ForwardedHeadersMode
PATH_MATCH_TYPE_UNSPECIFIED: PathMatchType
PATH_MATCH_TYPE_PREFIX: PathMatchType
PATH_MATCH_TYPE_EXACT: PathMatchType
PATH_MATCH_TYPE_REGULAR_EXPRESSION: PathMatchType
VALUE_MATCH_TYPE_UNSPECIFIED: ValueMatchType
VALUE_MATCH_TYPE_EXACT: ValueMatchType
VALUE_MATCH_TYPE_REGULAR_EXPRESSION: ValueMatchType
PATH_MODIFIER_TYPE_UNSPECIFIED: PathModifierType
PATH_MODIFIER_TYPE_REPLACE_FULL_PATH: PathModifierType
PATH_MODIFIER_TYPE_REPLACE_PREFIX_MATCH: PathModifierType
PICK_POLICY_UNSPECIFIED: PickPolicy
PICK_POLICY_RANDOM: PickPolicy
PICK_POLICY_ROUND_ROBIN: PickPolicy
PICK_POLICY_HASH: PickPolicy
RESOURCE_KIND_UNSPECIFIED: ResourceKind
RESOURCE_KIND_SERVICES: ResourceKind
RESOURCE_KIND_ENDPOINTS: ResourceKind
RESOURCE_KIND_ROUTES: ResourceKind
RESOURCE_KIND_TUNNELS: ResourceKind

class ServiceRef(_message.Message):
    __slots__ = ("namespace", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class ServicePort(_message.Message):
    __slots__ = ("name", "port", "target_port", "protocol", "node_port", "app_protocol")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    TARGET_PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    NODE_PORT_FIELD_NUMBER: _ClassVar[int]
    APP_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    name: str
    port: int
    target_port: str
    protocol: str
    node_port: int
    app_protocol: str
    def __init__(self, name: _Optional[str] = ..., port: _Optional[int] = ..., target_port: _Optional[str] = ..., protocol: _Optional[str] = ..., node_port: _Optional[int] = ..., app_protocol: _Optional[str] = ...) -> None: ...

class Service(_message.Message):
    __slots__ = ("namespace", "name", "type", "cluster_ips", "headless", "external_name", "ports")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    CLUSTER_IPS_FIELD_NUMBER: _ClassVar[int]
    HEADLESS_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_NAME_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    type: ServiceType
    cluster_ips: _containers.RepeatedScalarFieldContainer[str]
    headless: bool
    external_name: str
    ports: _containers.RepeatedCompositeFieldContainer[ServicePort]
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., type: _Optional[_Union[ServiceType, str]] = ..., cluster_ips: _Optional[_Iterable[str]] = ..., headless: _Optional[bool] = ..., external_name: _Optional[str] = ..., ports: _Optional[_Iterable[_Union[ServicePort, _Mapping]]] = ...) -> None: ...

class EndpointPort(_message.Message):
    __slots__ = ("name", "port", "protocol")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    name: str
    port: int
    protocol: str
    def __init__(self, name: _Optional[str] = ..., port: _Optional[int] = ..., protocol: _Optional[str] = ...) -> None: ...

class Endpoint(_message.Message):
    __slots__ = ("namespace", "service", "address", "ports", "ready", "serving", "terminating", "zone", "node_name", "tunnel", "hostname")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORTS_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    SERVING_FIELD_NUMBER: _ClassVar[int]
    TERMINATING_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    service: str
    address: str
    ports: _containers.RepeatedCompositeFieldContainer[EndpointPort]
    ready: bool
    serving: bool
    terminating: bool
    zone: str
    node_name: str
    tunnel: bool
    hostname: str
    def __init__(self, namespace: _Optional[str] = ..., service: _Optional[str] = ..., address: _Optional[str] = ..., ports: _Optional[_Iterable[_Union[EndpointPort, _Mapping]]] = ..., ready: _Optional[bool] = ..., serving: _Optional[bool] = ..., terminating: _Optional[bool] = ..., zone: _Optional[str] = ..., node_name: _Optional[str] = ..., tunnel: _Optional[bool] = ..., hostname: _Optional[str] = ...) -> None: ...

class EndpointRef(_message.Message):
    __slots__ = ("namespace", "service", "address")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    service: str
    address: str
    def __init__(self, namespace: _Optional[str] = ..., service: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class RouteBackend(_message.Message):
    __slots__ = ("service", "weight", "namespace", "port", "invalid", "use_cluster_ip")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    INVALID_FIELD_NUMBER: _ClassVar[int]
    USE_CLUSTER_IP_FIELD_NUMBER: _ClassVar[int]
    service: str
    weight: int
    namespace: str
    port: str
    invalid: str
    use_cluster_ip: bool
    def __init__(self, service: _Optional[str] = ..., weight: _Optional[int] = ..., namespace: _Optional[str] = ..., port: _Optional[str] = ..., invalid: _Optional[str] = ..., use_cluster_ip: _Optional[bool] = ...) -> None: ...

class RouteTLS(_message.Message):
    __slots__ = ("termination", "certificate", "key", "ca_certificate", "destination_ca_certificate", "insecure_edge_termination_policy", "hsts", "client_ca_certificate", "destination_server_name", "present_client_certificate", "destination_system_ca", "destination_san_hostnames", "destination_san_uris", "backend_client_certificate", "backend_client_key", "protocols", "ciphers")
    TERMINATION_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    KEY_FIELD_NUMBER: _ClassVar[int]
    CA_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_CA_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    INSECURE_EDGE_TERMINATION_POLICY_FIELD_NUMBER: _ClassVar[int]
    HSTS_FIELD_NUMBER: _ClassVar[int]
    CLIENT_CA_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_SERVER_NAME_FIELD_NUMBER: _ClassVar[int]
    PRESENT_CLIENT_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_SYSTEM_CA_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_SAN_HOSTNAMES_FIELD_NUMBER: _ClassVar[int]
    DESTINATION_SAN_URIS_FIELD_NUMBER: _ClassVar[int]
    BACKEND_CLIENT_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    BACKEND_CLIENT_KEY_FIELD_NUMBER: _ClassVar[int]
    PROTOCOLS_FIELD_NUMBER: _ClassVar[int]
    CIPHERS_FIELD_NUMBER: _ClassVar[int]
    termination: TLSTermination
    certificate: str
    key: str
    ca_certificate: str
    destination_ca_certificate: str
    insecure_edge_termination_policy: InsecureEdgePolicy
    hsts: HSTS
    client_ca_certificate: str
    destination_server_name: str
    present_client_certificate: bool
    destination_system_ca: bool
    destination_san_hostnames: _containers.RepeatedScalarFieldContainer[str]
    destination_san_uris: _containers.RepeatedScalarFieldContainer[str]
    backend_client_certificate: str
    backend_client_key: str
    protocols: _containers.RepeatedScalarFieldContainer[str]
    ciphers: str
    def __init__(self, termination: _Optional[_Union[TLSTermination, str]] = ..., certificate: _Optional[str] = ..., key: _Optional[str] = ..., ca_certificate: _Optional[str] = ..., destination_ca_certificate: _Optional[str] = ..., insecure_edge_termination_policy: _Optional[_Union[InsecureEdgePolicy, str]] = ..., hsts: _Optional[_Union[HSTS, _Mapping]] = ..., client_ca_certificate: _Optional[str] = ..., destination_server_name: _Optional[str] = ..., present_client_certificate: _Optional[bool] = ..., destination_system_ca: _Optional[bool] = ..., destination_san_hostnames: _Optional[_Iterable[str]] = ..., destination_san_uris: _Optional[_Iterable[str]] = ..., backend_client_certificate: _Optional[str] = ..., backend_client_key: _Optional[str] = ..., protocols: _Optional[_Iterable[str]] = ..., ciphers: _Optional[str] = ...) -> None: ...

class HSTS(_message.Message):
    __slots__ = ("max_age", "include_subdomains", "preload")
    MAX_AGE_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_SUBDOMAINS_FIELD_NUMBER: _ClassVar[int]
    PRELOAD_FIELD_NUMBER: _ClassVar[int]
    max_age: _duration_pb2.Duration
    include_subdomains: bool
    preload: bool
    def __init__(self, max_age: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., include_subdomains: _Optional[bool] = ..., preload: _Optional[bool] = ...) -> None: ...

class StickySessions(_message.Message):
    __slots__ = ("disable_cookies", "cookie_name", "same_site", "cookie_path", "cookie_domain", "cookie_max_age", "cookie_secure")
    DISABLE_COOKIES_FIELD_NUMBER: _ClassVar[int]
    COOKIE_NAME_FIELD_NUMBER: _ClassVar[int]
    SAME_SITE_FIELD_NUMBER: _ClassVar[int]
    COOKIE_PATH_FIELD_NUMBER: _ClassVar[int]
    COOKIE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    COOKIE_MAX_AGE_FIELD_NUMBER: _ClassVar[int]
    COOKIE_SECURE_FIELD_NUMBER: _ClassVar[int]
    disable_cookies: bool
    cookie_name: str
    same_site: SameSite
    cookie_path: str
    cookie_domain: str
    cookie_max_age: int
    cookie_secure: bool
    def __init__(self, disable_cookies: _Optional[bool] = ..., cookie_name: _Optional[str] = ..., same_site: _Optional[_Union[SameSite, str]] = ..., cookie_path: _Optional[str] = ..., cookie_domain: _Optional[str] = ..., cookie_max_age: _Optional[int] = ..., cookie_secure: _Optional[bool] = ...) -> None: ...

class RouteTimeouts(_message.Message):
    __slots__ = ("connect", "client", "server", "http_request", "tunnel", "keep_alive")
    CONNECT_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SERVER_FIELD_NUMBER: _ClassVar[int]
    HTTP_REQUEST_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_FIELD_NUMBER: _ClassVar[int]
    KEEP_ALIVE_FIELD_NUMBER: _ClassVar[int]
    connect: _duration_pb2.Duration
    client: _duration_pb2.Duration
    server: _duration_pb2.Duration
    http_request: _duration_pb2.Duration
    tunnel: _duration_pb2.Duration
    keep_alive: _duration_pb2.Duration
    def __init__(self, connect: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., client: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., server: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., http_request: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., tunnel: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., keep_alive: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class Route(_message.Message):
    __slots__ = ("namespace", "name", "host", "path", "backends", "target_port", "tls", "balance", "sticky", "timeouts", "auth_proxy_headers", "forwarded_headers", "upstream_protocol", "request_buffering", "status", "creation_timestamp", "matches", "filters", "request_timeout", "backend_request_timeout", "listener_port", "gateway", "origin", "rule_index", "listener_protocol", "access", "proxy_protocol_from_client", "proxy_protocol_to_backend", "rate_limit", "external_auth", "cors", "max_request_body", "next_upstream", "next_upstream_tries", "rewrite_target", "default_backend", "hash_by", "redirect_from", "redirect_to", "cookie_domain", "cookie_path", "custom_http_errors", "intercept_errors_disabled", "port_in_redirects", "connection_header", "access_log_disabled", "canary", "limit_rate", "limit_rate_after", "url_mirror", "next_upstream_timeout", "hash_subset_size", "upstream_scheme_from_client", "upstream_http10", "redirect_location", "client_address_header", "client_proxy_protocol", "span_name", "tracing_off", "untrusted_trace_context")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    BACKENDS_FIELD_NUMBER: _ClassVar[int]
    TARGET_PORT_FIELD_NUMBER: _ClassVar[int]
    TLS_FIELD_NUMBER: _ClassVar[int]
    BALANCE_FIELD_NUMBER: _ClassVar[int]
    STICKY_FIELD_NUMBER: _ClassVar[int]
    TIMEOUTS_FIELD_NUMBER: _ClassVar[int]
    AUTH_PROXY_HEADERS_FIELD_NUMBER: _ClassVar[int]
    FORWARDED_HEADERS_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BUFFERING_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CREATION_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    MATCHES_FIELD_NUMBER: _ClassVar[int]
    FILTERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    BACKEND_REQUEST_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    LISTENER_PORT_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    RULE_INDEX_FIELD_NUMBER: _ClassVar[int]
    LISTENER_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    ACCESS_FIELD_NUMBER: _ClassVar[int]
    PROXY_PROTOCOL_FROM_CLIENT_FIELD_NUMBER: _ClassVar[int]
    PROXY_PROTOCOL_TO_BACKEND_FIELD_NUMBER: _ClassVar[int]
    RATE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    EXTERNAL_AUTH_FIELD_NUMBER: _ClassVar[int]
    CORS_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BODY_FIELD_NUMBER: _ClassVar[int]
    NEXT_UPSTREAM_FIELD_NUMBER: _ClassVar[int]
    NEXT_UPSTREAM_TRIES_FIELD_NUMBER: _ClassVar[int]
    REWRITE_TARGET_FIELD_NUMBER: _ClassVar[int]
    DEFAULT_BACKEND_FIELD_NUMBER: _ClassVar[int]
    HASH_BY_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FROM_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_TO_FIELD_NUMBER: _ClassVar[int]
    COOKIE_DOMAIN_FIELD_NUMBER: _ClassVar[int]
    COOKIE_PATH_FIELD_NUMBER: _ClassVar[int]
    CUSTOM_HTTP_ERRORS_FIELD_NUMBER: _ClassVar[int]
    INTERCEPT_ERRORS_DISABLED_FIELD_NUMBER: _ClassVar[int]
    PORT_IN_REDIRECTS_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_HEADER_FIELD_NUMBER: _ClassVar[int]
    ACCESS_LOG_DISABLED_FIELD_NUMBER: _ClassVar[int]
    CANARY_FIELD_NUMBER: _ClassVar[int]
    LIMIT_RATE_FIELD_NUMBER: _ClassVar[int]
    LIMIT_RATE_AFTER_FIELD_NUMBER: _ClassVar[int]
    URL_MIRROR_FIELD_NUMBER: _ClassVar[int]
    NEXT_UPSTREAM_TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    HASH_SUBSET_SIZE_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_SCHEME_FROM_CLIENT_FIELD_NUMBER: _ClassVar[int]
    UPSTREAM_HTTP10_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_LOCATION_FIELD_NUMBER: _ClassVar[int]
    CLIENT_ADDRESS_HEADER_FIELD_NUMBER: _ClassVar[int]
    CLIENT_PROXY_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    SPAN_NAME_FIELD_NUMBER: _ClassVar[int]
    TRACING_OFF_FIELD_NUMBER: _ClassVar[int]
    UNTRUSTED_TRACE_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    host: str
    path: str
    backends: _containers.RepeatedCompositeFieldContainer[RouteBackend]
    target_port: str
    tls: RouteTLS
    balance: BalancePolicy
    sticky: StickySessions
    timeouts: RouteTimeouts
    auth_proxy_headers: bool
    forwarded_headers: ForwardedHeadersMode
    upstream_protocol: str
    request_buffering: bool
    status: RouteStatus
    creation_timestamp: _timestamp_pb2.Timestamp
    matches: _containers.RepeatedCompositeFieldContainer[RouteMatch]
    filters: RouteFilters
    request_timeout: _duration_pb2.Duration
    backend_request_timeout: _duration_pb2.Duration
    listener_port: int
    gateway: str
    origin: str
    rule_index: int
    listener_protocol: str
    access: RouteAccess
    proxy_protocol_from_client: bool
    proxy_protocol_to_backend: bool
    rate_limit: RateLimit
    external_auth: ExternalAuth
    cors: RouteCors
    max_request_body: int
    next_upstream: str
    next_upstream_tries: int
    rewrite_target: str
    default_backend: str
    hash_by: str
    redirect_from: str
    redirect_to: str
    cookie_domain: str
    cookie_path: str
    custom_http_errors: _containers.RepeatedScalarFieldContainer[int]
    intercept_errors_disabled: bool
    port_in_redirects: bool
    connection_header: str
    access_log_disabled: bool
    canary: RouteCanary
    limit_rate: int
    limit_rate_after: int
    url_mirror: UrlMirror
    next_upstream_timeout: _duration_pb2.Duration
    hash_subset_size: int
    upstream_scheme_from_client: bool
    upstream_http10: bool
    redirect_location: str
    client_address_header: str
    client_proxy_protocol: bool
    span_name: str
    tracing_off: bool
    untrusted_trace_context: bool
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., host: _Optional[str] = ..., path: _Optional[str] = ..., backends: _Optional[_Iterable[_Union[RouteBackend, _Mapping]]] = ..., target_port: _Optional[str] = ..., tls: _Optional[_Union[RouteTLS, _Mapping]] = ..., balance: _Optional[_Union[BalancePolicy, str]] = ..., sticky: _Optional[_Union[StickySessions, _Mapping]] = ..., timeouts: _Optional[_Union[RouteTimeouts, _Mapping]] = ..., auth_proxy_headers: _Optional[bool] = ..., forwarded_headers: _Optional[_Union[ForwardedHeadersMode, str]] = ..., upstream_protocol: _Optional[str] = ..., request_buffering: _Optional[bool] = ..., status: _Optional[_Union[RouteStatus, _Mapping]] = ..., creation_timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., matches: _Optional[_Iterable[_Union[RouteMatch, _Mapping]]] = ..., filters: _Optional[_Union[RouteFilters, _Mapping]] = ..., request_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., backend_request_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., listener_port: _Optional[int] = ..., gateway: _Optional[str] = ..., origin: _Optional[str] = ..., rule_index: _Optional[int] = ..., listener_protocol: _Optional[str] = ..., access: _Optional[_Union[RouteAccess, _Mapping]] = ..., proxy_protocol_from_client: _Optional[bool] = ..., proxy_protocol_to_backend: _Optional[bool] = ..., rate_limit: _Optional[_Union[RateLimit, _Mapping]] = ..., external_auth: _Optional[_Union[ExternalAuth, _Mapping]] = ..., cors: _Optional[_Union[RouteCors, _Mapping]] = ..., max_request_body: _Optional[int] = ..., next_upstream: _Optional[str] = ..., next_upstream_tries: _Optional[int] = ..., rewrite_target: _Optional[str] = ..., default_backend: _Optional[str] = ..., hash_by: _Optional[str] = ..., redirect_from: _Optional[str] = ..., redirect_to: _Optional[str] = ..., cookie_domain: _Optional[str] = ..., cookie_path: _Optional[str] = ..., custom_http_errors: _Optional[_Iterable[int]] = ..., intercept_errors_disabled: _Optional[bool] = ..., port_in_redirects: _Optional[bool] = ..., connection_header: _Optional[str] = ..., access_log_disabled: _Optional[bool] = ..., canary: _Optional[_Union[RouteCanary, _Mapping]] = ..., limit_rate: _Optional[int] = ..., limit_rate_after: _Optional[int] = ..., url_mirror: _Optional[_Union[UrlMirror, _Mapping]] = ..., next_upstream_timeout: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ..., hash_subset_size: _Optional[int] = ..., upstream_scheme_from_client: _Optional[bool] = ..., upstream_http10: _Optional[bool] = ..., redirect_location: _Optional[str] = ..., client_address_header: _Optional[str] = ..., client_proxy_protocol: _Optional[bool] = ..., span_name: _Optional[str] = ..., tracing_off: _Optional[bool] = ..., untrusted_trace_context: _Optional[bool] = ...) -> None: ...

class UrlMirror(_message.Message):
    __slots__ = ("target", "host", "request_body")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    REQUEST_BODY_FIELD_NUMBER: _ClassVar[int]
    target: str
    host: str
    request_body: bool
    def __init__(self, target: _Optional[str] = ..., host: _Optional[str] = ..., request_body: _Optional[bool] = ...) -> None: ...

class RouteCanary(_message.Message):
    __slots__ = ("main_backends", "weight", "weight_total", "header", "header_value", "header_pattern", "cookie", "legacy_affinity")
    MAIN_BACKENDS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_TOTAL_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    HEADER_VALUE_FIELD_NUMBER: _ClassVar[int]
    HEADER_PATTERN_FIELD_NUMBER: _ClassVar[int]
    COOKIE_FIELD_NUMBER: _ClassVar[int]
    LEGACY_AFFINITY_FIELD_NUMBER: _ClassVar[int]
    main_backends: int
    weight: int
    weight_total: int
    header: str
    header_value: str
    header_pattern: str
    cookie: str
    legacy_affinity: bool
    def __init__(self, main_backends: _Optional[int] = ..., weight: _Optional[int] = ..., weight_total: _Optional[int] = ..., header: _Optional[str] = ..., header_value: _Optional[str] = ..., header_pattern: _Optional[str] = ..., cookie: _Optional[str] = ..., legacy_affinity: _Optional[bool] = ...) -> None: ...

class RouteAccess(_message.Message):
    __slots__ = ("block", "deny", "allow", "block_user_agents", "block_referers", "trusted_proxies", "auth_type", "auth_realm", "credentials", "satisfy_any", "client_certificate")
    BLOCK_FIELD_NUMBER: _ClassVar[int]
    DENY_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    BLOCK_USER_AGENTS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REFERERS_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_PROXIES_FIELD_NUMBER: _ClassVar[int]
    AUTH_TYPE_FIELD_NUMBER: _ClassVar[int]
    AUTH_REALM_FIELD_NUMBER: _ClassVar[int]
    CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    SATISFY_ANY_FIELD_NUMBER: _ClassVar[int]
    CLIENT_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    block: _containers.RepeatedScalarFieldContainer[str]
    deny: _containers.RepeatedScalarFieldContainer[str]
    allow: _containers.RepeatedScalarFieldContainer[str]
    block_user_agents: _containers.RepeatedScalarFieldContainer[str]
    block_referers: _containers.RepeatedScalarFieldContainer[str]
    trusted_proxies: _containers.RepeatedScalarFieldContainer[str]
    auth_type: str
    auth_realm: str
    credentials: _containers.RepeatedScalarFieldContainer[str]
    satisfy_any: bool
    client_certificate: ClientCertificate
    def __init__(self, block: _Optional[_Iterable[str]] = ..., deny: _Optional[_Iterable[str]] = ..., allow: _Optional[_Iterable[str]] = ..., block_user_agents: _Optional[_Iterable[str]] = ..., block_referers: _Optional[_Iterable[str]] = ..., trusted_proxies: _Optional[_Iterable[str]] = ..., auth_type: _Optional[str] = ..., auth_realm: _Optional[str] = ..., credentials: _Optional[_Iterable[str]] = ..., satisfy_any: _Optional[bool] = ..., client_certificate: _Optional[_Union[ClientCertificate, _Mapping]] = ...) -> None: ...

class ClientCertificate(_message.Message):
    __slots__ = ("ca_certificates", "revocation_lists", "verify", "depth", "error_page", "pass_certificate", "match_subject", "refusal")
    CA_CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    REVOCATION_LISTS_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    DEPTH_FIELD_NUMBER: _ClassVar[int]
    ERROR_PAGE_FIELD_NUMBER: _ClassVar[int]
    PASS_CERTIFICATE_FIELD_NUMBER: _ClassVar[int]
    MATCH_SUBJECT_FIELD_NUMBER: _ClassVar[int]
    REFUSAL_FIELD_NUMBER: _ClassVar[int]
    ca_certificates: str
    revocation_lists: str
    verify: str
    depth: int
    error_page: str
    pass_certificate: bool
    match_subject: str
    refusal: str
    def __init__(self, ca_certificates: _Optional[str] = ..., revocation_lists: _Optional[str] = ..., verify: _Optional[str] = ..., depth: _Optional[int] = ..., error_page: _Optional[str] = ..., pass_certificate: _Optional[bool] = ..., match_subject: _Optional[str] = ..., refusal: _Optional[str] = ...) -> None: ...

class ExternalAuth(_message.Message):
    __slots__ = ("url", "method", "signin", "signin_redirect_param", "response_headers", "request_redirect", "proxy_set_headers", "cache_key", "cache_durations", "always_set_cookie", "trusted_proxies", "full_forwarded_for")
    URL_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    SIGNIN_FIELD_NUMBER: _ClassVar[int]
    SIGNIN_REDIRECT_PARAM_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    REQUEST_REDIRECT_FIELD_NUMBER: _ClassVar[int]
    PROXY_SET_HEADERS_FIELD_NUMBER: _ClassVar[int]
    CACHE_KEY_FIELD_NUMBER: _ClassVar[int]
    CACHE_DURATIONS_FIELD_NUMBER: _ClassVar[int]
    ALWAYS_SET_COOKIE_FIELD_NUMBER: _ClassVar[int]
    TRUSTED_PROXIES_FIELD_NUMBER: _ClassVar[int]
    FULL_FORWARDED_FOR_FIELD_NUMBER: _ClassVar[int]
    url: str
    method: str
    signin: str
    signin_redirect_param: str
    response_headers: _containers.RepeatedScalarFieldContainer[str]
    request_redirect: str
    proxy_set_headers: _containers.RepeatedCompositeFieldContainer[RouteHeader]
    cache_key: str
    cache_durations: _containers.RepeatedCompositeFieldContainer[AuthCacheDuration]
    always_set_cookie: bool
    trusted_proxies: _containers.RepeatedScalarFieldContainer[str]
    full_forwarded_for: bool
    def __init__(self, url: _Optional[str] = ..., method: _Optional[str] = ..., signin: _Optional[str] = ..., signin_redirect_param: _Optional[str] = ..., response_headers: _Optional[_Iterable[str]] = ..., request_redirect: _Optional[str] = ..., proxy_set_headers: _Optional[_Iterable[_Union[RouteHeader, _Mapping]]] = ..., cache_key: _Optional[str] = ..., cache_durations: _Optional[_Iterable[_Union[AuthCacheDuration, _Mapping]]] = ..., always_set_cookie: _Optional[bool] = ..., trusted_proxies: _Optional[_Iterable[str]] = ..., full_forwarded_for: _Optional[bool] = ...) -> None: ...

class AuthCacheDuration(_message.Message):
    __slots__ = ("status", "duration")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    status: int
    duration: _duration_pb2.Duration
    def __init__(self, status: _Optional[int] = ..., duration: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class RateLimit(_message.Message):
    __slots__ = ("rps", "rpm", "burst_multiplier", "connections", "allow", "request_status", "connection_status")
    RPS_FIELD_NUMBER: _ClassVar[int]
    RPM_FIELD_NUMBER: _ClassVar[int]
    BURST_MULTIPLIER_FIELD_NUMBER: _ClassVar[int]
    CONNECTIONS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_FIELD_NUMBER: _ClassVar[int]
    REQUEST_STATUS_FIELD_NUMBER: _ClassVar[int]
    CONNECTION_STATUS_FIELD_NUMBER: _ClassVar[int]
    rps: int
    rpm: int
    burst_multiplier: int
    connections: int
    allow: _containers.RepeatedScalarFieldContainer[str]
    request_status: int
    connection_status: int
    def __init__(self, rps: _Optional[int] = ..., rpm: _Optional[int] = ..., burst_multiplier: _Optional[int] = ..., connections: _Optional[int] = ..., allow: _Optional[_Iterable[str]] = ..., request_status: _Optional[int] = ..., connection_status: _Optional[int] = ...) -> None: ...

class RouteCors(_message.Message):
    __slots__ = ("allow_origins", "allow_methods", "allow_headers", "expose_headers", "allow_credentials", "max_age")
    ALLOW_ORIGINS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_METHODS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_HEADERS_FIELD_NUMBER: _ClassVar[int]
    EXPOSE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    ALLOW_CREDENTIALS_FIELD_NUMBER: _ClassVar[int]
    MAX_AGE_FIELD_NUMBER: _ClassVar[int]
    allow_origins: _containers.RepeatedScalarFieldContainer[str]
    allow_methods: str
    allow_headers: str
    expose_headers: str
    allow_credentials: bool
    max_age: int
    def __init__(self, allow_origins: _Optional[_Iterable[str]] = ..., allow_methods: _Optional[str] = ..., allow_headers: _Optional[str] = ..., expose_headers: _Optional[str] = ..., allow_credentials: _Optional[bool] = ..., max_age: _Optional[int] = ...) -> None: ...

class RouteCondition(_message.Message):
    __slots__ = ("type", "status", "reason", "message", "last_transition_time", "observed_generation")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    LAST_TRANSITION_TIME_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    type: str
    status: str
    reason: str
    message: str
    last_transition_time: _timestamp_pb2.Timestamp
    observed_generation: int
    def __init__(self, type: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., last_transition_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., observed_generation: _Optional[int] = ...) -> None: ...

class RouteStatus(_message.Message):
    __slots__ = ("conditions",)
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    conditions: _containers.RepeatedCompositeFieldContainer[RouteCondition]
    def __init__(self, conditions: _Optional[_Iterable[_Union[RouteCondition, _Mapping]]] = ...) -> None: ...

class RouteSourceState(_message.Message):
    __slots__ = ("source", "valid", "last_error", "loaded_version", "loaded_at", "error_since")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    ERROR_SINCE_FIELD_NUMBER: _ClassVar[int]
    source: str
    valid: bool
    last_error: str
    loaded_version: int
    loaded_at: _timestamp_pb2.Timestamp
    error_since: _timestamp_pb2.Timestamp
    def __init__(self, source: _Optional[str] = ..., valid: _Optional[bool] = ..., last_error: _Optional[str] = ..., loaded_version: _Optional[int] = ..., loaded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., error_since: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RouteRef(_message.Message):
    __slots__ = ("namespace", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class RouteValueMatch(_message.Message):
    __slots__ = ("name", "value", "type")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    type: ValueMatchType
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ..., type: _Optional[_Union[ValueMatchType, str]] = ...) -> None: ...

class RouteMatch(_message.Message):
    __slots__ = ("path_type", "path", "headers", "query_params", "method")
    PATH_TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    HEADERS_FIELD_NUMBER: _ClassVar[int]
    QUERY_PARAMS_FIELD_NUMBER: _ClassVar[int]
    METHOD_FIELD_NUMBER: _ClassVar[int]
    path_type: PathMatchType
    path: str
    headers: _containers.RepeatedCompositeFieldContainer[RouteValueMatch]
    query_params: _containers.RepeatedCompositeFieldContainer[RouteValueMatch]
    method: str
    def __init__(self, path_type: _Optional[_Union[PathMatchType, str]] = ..., path: _Optional[str] = ..., headers: _Optional[_Iterable[_Union[RouteValueMatch, _Mapping]]] = ..., query_params: _Optional[_Iterable[_Union[RouteValueMatch, _Mapping]]] = ..., method: _Optional[str] = ...) -> None: ...

class RouteHeader(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: str
    def __init__(self, name: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...

class RouteHeaderModifier(_message.Message):
    __slots__ = ("set", "add", "remove")
    SET_FIELD_NUMBER: _ClassVar[int]
    ADD_FIELD_NUMBER: _ClassVar[int]
    REMOVE_FIELD_NUMBER: _ClassVar[int]
    set: _containers.RepeatedCompositeFieldContainer[RouteHeader]
    add: _containers.RepeatedCompositeFieldContainer[RouteHeader]
    remove: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, set: _Optional[_Iterable[_Union[RouteHeader, _Mapping]]] = ..., add: _Optional[_Iterable[_Union[RouteHeader, _Mapping]]] = ..., remove: _Optional[_Iterable[str]] = ...) -> None: ...

class RouteRedirect(_message.Message):
    __slots__ = ("scheme", "hostname", "port", "path_type", "path", "status_code", "strip_trailing_slash")
    SCHEME_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PATH_TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    STATUS_CODE_FIELD_NUMBER: _ClassVar[int]
    STRIP_TRAILING_SLASH_FIELD_NUMBER: _ClassVar[int]
    scheme: str
    hostname: str
    port: int
    path_type: PathModifierType
    path: str
    status_code: int
    strip_trailing_slash: bool
    def __init__(self, scheme: _Optional[str] = ..., hostname: _Optional[str] = ..., port: _Optional[int] = ..., path_type: _Optional[_Union[PathModifierType, str]] = ..., path: _Optional[str] = ..., status_code: _Optional[int] = ..., strip_trailing_slash: _Optional[bool] = ...) -> None: ...

class RouteRewrite(_message.Message):
    __slots__ = ("hostname", "path_type", "path")
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    PATH_TYPE_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    hostname: str
    path_type: PathModifierType
    path: str
    def __init__(self, hostname: _Optional[str] = ..., path_type: _Optional[_Union[PathModifierType, str]] = ..., path: _Optional[str] = ...) -> None: ...

class RouteMirror(_message.Message):
    __slots__ = ("namespace", "service", "port", "percent")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PERCENT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    service: str
    port: str
    percent: int
    def __init__(self, namespace: _Optional[str] = ..., service: _Optional[str] = ..., port: _Optional[str] = ..., percent: _Optional[int] = ...) -> None: ...

class RouteFilters(_message.Message):
    __slots__ = ("request_headers", "response_headers", "redirect", "rewrite", "mirrors")
    REQUEST_HEADERS_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_HEADERS_FIELD_NUMBER: _ClassVar[int]
    REDIRECT_FIELD_NUMBER: _ClassVar[int]
    REWRITE_FIELD_NUMBER: _ClassVar[int]
    MIRRORS_FIELD_NUMBER: _ClassVar[int]
    request_headers: RouteHeaderModifier
    response_headers: RouteHeaderModifier
    redirect: RouteRedirect
    rewrite: RouteRewrite
    mirrors: _containers.RepeatedCompositeFieldContainer[RouteMirror]
    def __init__(self, request_headers: _Optional[_Union[RouteHeaderModifier, _Mapping]] = ..., response_headers: _Optional[_Union[RouteHeaderModifier, _Mapping]] = ..., redirect: _Optional[_Union[RouteRedirect, _Mapping]] = ..., rewrite: _Optional[_Union[RouteRewrite, _Mapping]] = ..., mirrors: _Optional[_Iterable[_Union[RouteMirror, _Mapping]]] = ...) -> None: ...

class TunnelServer(_message.Message):
    __slots__ = ("id", "address")
    ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    id: str
    address: str
    def __init__(self, id: _Optional[str] = ..., address: _Optional[str] = ...) -> None: ...

class TunnelPresence(_message.Message):
    __slots__ = ("node", "servers")
    NODE_FIELD_NUMBER: _ClassVar[int]
    SERVERS_FIELD_NUMBER: _ClassVar[int]
    node: str
    servers: _containers.RepeatedCompositeFieldContainer[TunnelServer]
    def __init__(self, node: _Optional[str] = ..., servers: _Optional[_Iterable[_Union[TunnelServer, _Mapping]]] = ...) -> None: ...

class ResolveRequest(_message.Message):
    __slots__ = ("namespace", "name", "port", "pick", "hash_key")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PICK_FIELD_NUMBER: _ClassVar[int]
    HASH_KEY_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    port: str
    pick: PickPolicy
    hash_key: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., port: _Optional[str] = ..., pick: _Optional[_Union[PickPolicy, str]] = ..., hash_key: _Optional[str] = ...) -> None: ...

class Target(_message.Message):
    __slots__ = ("address", "port", "node_name", "zone", "tunnel")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    NODE_NAME_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_FIELD_NUMBER: _ClassVar[int]
    address: str
    port: int
    node_name: str
    zone: str
    tunnel: bool
    def __init__(self, address: _Optional[str] = ..., port: _Optional[int] = ..., node_name: _Optional[str] = ..., zone: _Optional[str] = ..., tunnel: _Optional[bool] = ...) -> None: ...

class ResolveResponse(_message.Message):
    __slots__ = ("service", "targets", "picked", "version", "last_sync")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    PICKED_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_FIELD_NUMBER: _ClassVar[int]
    service: Service
    targets: _containers.RepeatedCompositeFieldContainer[Target]
    picked: Target
    version: int
    last_sync: _timestamp_pb2.Timestamp
    def __init__(self, service: _Optional[_Union[Service, _Mapping]] = ..., targets: _Optional[_Iterable[_Union[Target, _Mapping]]] = ..., picked: _Optional[_Union[Target, _Mapping]] = ..., version: _Optional[int] = ..., last_sync: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class WatchRequest(_message.Message):
    __slots__ = ("resume_from_version", "kinds", "resume_epoch")
    RESUME_FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    RESUME_EPOCH_FIELD_NUMBER: _ClassVar[int]
    resume_from_version: int
    kinds: _containers.RepeatedScalarFieldContainer[ResourceKind]
    resume_epoch: int
    def __init__(self, resume_from_version: _Optional[int] = ..., kinds: _Optional[_Iterable[_Union[ResourceKind, str]]] = ..., resume_epoch: _Optional[int] = ...) -> None: ...

class Snapshot(_message.Message):
    __slots__ = ("services", "endpoints", "routes", "tunnels", "more")
    SERVICES_FIELD_NUMBER: _ClassVar[int]
    ENDPOINTS_FIELD_NUMBER: _ClassVar[int]
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    TUNNELS_FIELD_NUMBER: _ClassVar[int]
    MORE_FIELD_NUMBER: _ClassVar[int]
    services: _containers.RepeatedCompositeFieldContainer[Service]
    endpoints: _containers.RepeatedCompositeFieldContainer[Endpoint]
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    tunnels: _containers.RepeatedCompositeFieldContainer[TunnelPresence]
    more: bool
    def __init__(self, services: _Optional[_Iterable[_Union[Service, _Mapping]]] = ..., endpoints: _Optional[_Iterable[_Union[Endpoint, _Mapping]]] = ..., routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., tunnels: _Optional[_Iterable[_Union[TunnelPresence, _Mapping]]] = ..., more: _Optional[bool] = ...) -> None: ...

class Change(_message.Message):
    __slots__ = ("service_upserted", "service_deleted", "endpoint_upserted", "endpoint_deleted", "route_upserted", "route_deleted", "tunnel_presence")
    SERVICE_UPSERTED_FIELD_NUMBER: _ClassVar[int]
    SERVICE_DELETED_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_UPSERTED_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_DELETED_FIELD_NUMBER: _ClassVar[int]
    ROUTE_UPSERTED_FIELD_NUMBER: _ClassVar[int]
    ROUTE_DELETED_FIELD_NUMBER: _ClassVar[int]
    TUNNEL_PRESENCE_FIELD_NUMBER: _ClassVar[int]
    service_upserted: Service
    service_deleted: ServiceRef
    endpoint_upserted: Endpoint
    endpoint_deleted: EndpointRef
    route_upserted: Route
    route_deleted: RouteRef
    tunnel_presence: TunnelPresence
    def __init__(self, service_upserted: _Optional[_Union[Service, _Mapping]] = ..., service_deleted: _Optional[_Union[ServiceRef, _Mapping]] = ..., endpoint_upserted: _Optional[_Union[Endpoint, _Mapping]] = ..., endpoint_deleted: _Optional[_Union[EndpointRef, _Mapping]] = ..., route_upserted: _Optional[_Union[Route, _Mapping]] = ..., route_deleted: _Optional[_Union[RouteRef, _Mapping]] = ..., tunnel_presence: _Optional[_Union[TunnelPresence, _Mapping]] = ...) -> None: ...

class Changes(_message.Message):
    __slots__ = ("from_version", "changes", "coalesced")
    FROM_VERSION_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    COALESCED_FIELD_NUMBER: _ClassVar[int]
    from_version: int
    changes: _containers.RepeatedCompositeFieldContainer[Change]
    coalesced: bool
    def __init__(self, from_version: _Optional[int] = ..., changes: _Optional[_Iterable[_Union[Change, _Mapping]]] = ..., coalesced: _Optional[bool] = ...) -> None: ...

class WatchEvent(_message.Message):
    __slots__ = ("version", "last_sync", "source", "snapshot", "changes", "epoch", "sources", "route_keys_withheld")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    ROUTE_KEYS_WITHHELD_FIELD_NUMBER: _ClassVar[int]
    version: int
    last_sync: _timestamp_pb2.Timestamp
    source: str
    snapshot: Snapshot
    changes: Changes
    epoch: int
    sources: _containers.RepeatedCompositeFieldContainer[RouteSourceState]
    route_keys_withheld: str
    def __init__(self, version: _Optional[int] = ..., last_sync: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., source: _Optional[str] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., changes: _Optional[_Union[Changes, _Mapping]] = ..., epoch: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[RouteSourceState, _Mapping]]] = ..., route_keys_withheld: _Optional[str] = ...) -> None: ...

class ListRoutesRequest(_message.Message):
    __slots__ = ("namespace", "page_size", "page_token")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    PAGE_SIZE_FIELD_NUMBER: _ClassVar[int]
    PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    page_size: int
    page_token: str
    def __init__(self, namespace: _Optional[str] = ..., page_size: _Optional[int] = ..., page_token: _Optional[str] = ...) -> None: ...

class ListRoutesResponse(_message.Message):
    __slots__ = ("routes", "version", "next_page_token", "sources")
    ROUTES_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    NEXT_PAGE_TOKEN_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    routes: _containers.RepeatedCompositeFieldContainer[Route]
    version: int
    next_page_token: str
    sources: _containers.RepeatedCompositeFieldContainer[RouteSourceState]
    def __init__(self, routes: _Optional[_Iterable[_Union[Route, _Mapping]]] = ..., version: _Optional[int] = ..., next_page_token: _Optional[str] = ..., sources: _Optional[_Iterable[_Union[RouteSourceState, _Mapping]]] = ...) -> None: ...

class ApplyRouteRequest(_message.Message):
    __slots__ = ("route",)
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    route: Route
    def __init__(self, route: _Optional[_Union[Route, _Mapping]] = ...) -> None: ...

class ApplyRouteResponse(_message.Message):
    __slots__ = ("route", "version")
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    VERSION_FIELD_NUMBER: _ClassVar[int]
    route: Route
    version: int
    def __init__(self, route: _Optional[_Union[Route, _Mapping]] = ..., version: _Optional[int] = ...) -> None: ...

class DeleteRouteRequest(_message.Message):
    __slots__ = ("ref",)
    REF_FIELD_NUMBER: _ClassVar[int]
    ref: RouteRef
    def __init__(self, ref: _Optional[_Union[RouteRef, _Mapping]] = ...) -> None: ...

class DeleteRouteResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...

class GatewayCondition(_message.Message):
    __slots__ = ("type", "status", "reason", "message", "observed_generation", "last_transition_time")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    STATUS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    OBSERVED_GENERATION_FIELD_NUMBER: _ClassVar[int]
    LAST_TRANSITION_TIME_FIELD_NUMBER: _ClassVar[int]
    type: str
    status: str
    reason: str
    message: str
    observed_generation: int
    last_transition_time: _timestamp_pb2.Timestamp
    def __init__(self, type: _Optional[str] = ..., status: _Optional[str] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ..., observed_generation: _Optional[int] = ..., last_transition_time: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class GatewayListenerStatus(_message.Message):
    __slots__ = ("name", "attached_routes", "supported_kinds", "conditions")
    NAME_FIELD_NUMBER: _ClassVar[int]
    ATTACHED_ROUTES_FIELD_NUMBER: _ClassVar[int]
    SUPPORTED_KINDS_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    name: str
    attached_routes: int
    supported_kinds: _containers.RepeatedScalarFieldContainer[str]
    conditions: _containers.RepeatedCompositeFieldContainer[GatewayCondition]
    def __init__(self, name: _Optional[str] = ..., attached_routes: _Optional[int] = ..., supported_kinds: _Optional[_Iterable[str]] = ..., conditions: _Optional[_Iterable[_Union[GatewayCondition, _Mapping]]] = ...) -> None: ...

class GatewayParentStatus(_message.Message):
    __slots__ = ("gateway_namespace", "gateway_name", "section_name", "port", "controller_name", "conditions")
    GATEWAY_NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    GATEWAY_NAME_FIELD_NUMBER: _ClassVar[int]
    SECTION_NAME_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    CONTROLLER_NAME_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    gateway_namespace: str
    gateway_name: str
    section_name: str
    port: int
    controller_name: str
    conditions: _containers.RepeatedCompositeFieldContainer[GatewayCondition]
    def __init__(self, gateway_namespace: _Optional[str] = ..., gateway_name: _Optional[str] = ..., section_name: _Optional[str] = ..., port: _Optional[int] = ..., controller_name: _Optional[str] = ..., conditions: _Optional[_Iterable[_Union[GatewayCondition, _Mapping]]] = ...) -> None: ...

class GatewayObjectStatus(_message.Message):
    __slots__ = ("kind", "namespace", "name", "generation", "conditions", "listeners", "parents", "addresses")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    GENERATION_FIELD_NUMBER: _ClassVar[int]
    CONDITIONS_FIELD_NUMBER: _ClassVar[int]
    LISTENERS_FIELD_NUMBER: _ClassVar[int]
    PARENTS_FIELD_NUMBER: _ClassVar[int]
    ADDRESSES_FIELD_NUMBER: _ClassVar[int]
    kind: str
    namespace: str
    name: str
    generation: int
    conditions: _containers.RepeatedCompositeFieldContainer[GatewayCondition]
    listeners: _containers.RepeatedCompositeFieldContainer[GatewayListenerStatus]
    parents: _containers.RepeatedCompositeFieldContainer[GatewayParentStatus]
    addresses: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, kind: _Optional[str] = ..., namespace: _Optional[str] = ..., name: _Optional[str] = ..., generation: _Optional[int] = ..., conditions: _Optional[_Iterable[_Union[GatewayCondition, _Mapping]]] = ..., listeners: _Optional[_Iterable[_Union[GatewayListenerStatus, _Mapping]]] = ..., parents: _Optional[_Iterable[_Union[GatewayParentStatus, _Mapping]]] = ..., addresses: _Optional[_Iterable[str]] = ...) -> None: ...

class ListGatewaysRequest(_message.Message):
    __slots__ = ("namespace", "kinds")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    KINDS_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    kinds: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, namespace: _Optional[str] = ..., kinds: _Optional[_Iterable[str]] = ...) -> None: ...

class ListGatewaysResponse(_message.Message):
    __slots__ = ("objects", "sources", "ignored")
    OBJECTS_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    IGNORED_FIELD_NUMBER: _ClassVar[int]
    objects: _containers.RepeatedCompositeFieldContainer[GatewayObjectStatus]
    sources: _containers.RepeatedCompositeFieldContainer[RouteSourceState]
    ignored: _containers.RepeatedCompositeFieldContainer[IgnoredObject]
    def __init__(self, objects: _Optional[_Iterable[_Union[GatewayObjectStatus, _Mapping]]] = ..., sources: _Optional[_Iterable[_Union[RouteSourceState, _Mapping]]] = ..., ignored: _Optional[_Iterable[_Union[IgnoredObject, _Mapping]]] = ...) -> None: ...

class IgnoredObject(_message.Message):
    __slots__ = ("kind", "namespace", "name", "reason")
    KIND_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    kind: str
    namespace: str
    name: str
    reason: str
    def __init__(self, kind: _Optional[str] = ..., namespace: _Optional[str] = ..., name: _Optional[str] = ..., reason: _Optional[str] = ...) -> None: ...

class GatewayListenerReport(_message.Message):
    __slots__ = ("proxy", "listeners")
    PROXY_FIELD_NUMBER: _ClassVar[int]
    LISTENERS_FIELD_NUMBER: _ClassVar[int]
    proxy: str
    listeners: _containers.RepeatedCompositeFieldContainer[ListenerState]
    def __init__(self, proxy: _Optional[str] = ..., listeners: _Optional[_Iterable[_Union[ListenerState, _Mapping]]] = ...) -> None: ...

class ListenerState(_message.Message):
    __slots__ = ("gateway", "port", "protocol", "local_port", "reason", "message")
    GATEWAY_FIELD_NUMBER: _ClassVar[int]
    PORT_FIELD_NUMBER: _ClassVar[int]
    PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    LOCAL_PORT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    gateway: str
    port: int
    protocol: str
    local_port: int
    reason: str
    message: str
    def __init__(self, gateway: _Optional[str] = ..., port: _Optional[int] = ..., protocol: _Optional[str] = ..., local_port: _Optional[int] = ..., reason: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class GatewayListenerReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class BackendCertificateReport(_message.Message):
    __slots__ = ("proxy", "certificates")
    PROXY_FIELD_NUMBER: _ClassVar[int]
    CERTIFICATES_FIELD_NUMBER: _ClassVar[int]
    proxy: str
    certificates: _containers.RepeatedCompositeFieldContainer[BackendCertificateState]
    def __init__(self, proxy: _Optional[str] = ..., certificates: _Optional[_Iterable[_Union[BackendCertificateState, _Mapping]]] = ...) -> None: ...

class BackendCertificateState(_message.Message):
    __slots__ = ("namespace", "route", "endpoint", "names", "not_before", "not_after", "verdict")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    ROUTE_FIELD_NUMBER: _ClassVar[int]
    ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    NAMES_FIELD_NUMBER: _ClassVar[int]
    NOT_BEFORE_FIELD_NUMBER: _ClassVar[int]
    NOT_AFTER_FIELD_NUMBER: _ClassVar[int]
    VERDICT_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    route: str
    endpoint: str
    names: _containers.RepeatedScalarFieldContainer[str]
    not_before: _timestamp_pb2.Timestamp
    not_after: _timestamp_pb2.Timestamp
    verdict: str
    def __init__(self, namespace: _Optional[str] = ..., route: _Optional[str] = ..., endpoint: _Optional[str] = ..., names: _Optional[_Iterable[str]] = ..., not_before: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., not_after: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., verdict: _Optional[str] = ...) -> None: ...

class BackendCertificateReportResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TunnelReport(_message.Message):
    __slots__ = ("server", "nodes", "lease")
    SERVER_FIELD_NUMBER: _ClassVar[int]
    NODES_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    server: TunnelServer
    nodes: _containers.RepeatedScalarFieldContainer[str]
    lease: _duration_pb2.Duration
    def __init__(self, server: _Optional[_Union[TunnelServer, _Mapping]] = ..., nodes: _Optional[_Iterable[str]] = ..., lease: _Optional[_Union[datetime.timedelta, _duration_pb2.Duration, _Mapping]] = ...) -> None: ...

class ReportTunnelsResponse(_message.Message):
    __slots__ = ("version",)
    VERSION_FIELD_NUMBER: _ClassVar[int]
    version: int
    def __init__(self, version: _Optional[int] = ...) -> None: ...
