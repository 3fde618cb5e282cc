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
    __slots__ = ("service", "weight")
    SERVICE_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_FIELD_NUMBER: _ClassVar[int]
    service: str
    weight: int
    def __init__(self, service: _Optional[str] = ..., weight: _Optional[int] = ...) -> None: ...

class RouteTLS(_message.Message):
    __slots__ = ("termination", "certificate", "key", "ca_certificate", "destination_ca_certificate", "insecure_edge_termination_policy", "hsts", "client_ca_certificate", "destination_server_name", "present_client_certificate")
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
    def __init__(self, termination: _Optional[_Union[TLSTermination, str]] = ..., certificate: _Optional[str] = ..., key: _Optional[str] = ..., ca_certificate: _Optional[str] = ..., destination_ca_certificate: _Optional[str] = ..., insecure_edge_termination_policy: _Optional[_Union[InsecureEdgePolicy, str]] = ..., hsts: _Optional[_Union[HSTS, _Mapping]] = ..., client_ca_certificate: _Optional[str] = ..., destination_server_name: _Optional[str] = ..., present_client_certificate: _Optional[bool] = ...) -> None: ...

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
    __slots__ = ("disable_cookies", "cookie_name", "same_site")
    DISABLE_COOKIES_FIELD_NUMBER: _ClassVar[int]
    COOKIE_NAME_FIELD_NUMBER: _ClassVar[int]
    SAME_SITE_FIELD_NUMBER: _ClassVar[int]
    disable_cookies: bool
    cookie_name: str
    same_site: SameSite
    def __init__(self, disable_cookies: _Optional[bool] = ..., cookie_name: _Optional[str] = ..., same_site: _Optional[_Union[SameSite, str]] = ...) -> None: ...

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
    __slots__ = ("namespace", "name", "host", "path", "backends", "target_port", "tls", "balance", "sticky", "timeouts", "auth_proxy_headers", "forwarded_headers", "upstream_protocol", "status", "creation_timestamp")
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
    STATUS_FIELD_NUMBER: _ClassVar[int]
    CREATION_TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
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
    status: RouteStatus
    creation_timestamp: _timestamp_pb2.Timestamp
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ..., host: _Optional[str] = ..., path: _Optional[str] = ..., backends: _Optional[_Iterable[_Union[RouteBackend, _Mapping]]] = ..., target_port: _Optional[str] = ..., tls: _Optional[_Union[RouteTLS, _Mapping]] = ..., balance: _Optional[_Union[BalancePolicy, str]] = ..., sticky: _Optional[_Union[StickySessions, _Mapping]] = ..., timeouts: _Optional[_Union[RouteTimeouts, _Mapping]] = ..., auth_proxy_headers: _Optional[bool] = ..., forwarded_headers: _Optional[_Union[ForwardedHeadersMode, str]] = ..., upstream_protocol: _Optional[str] = ..., status: _Optional[_Union[RouteStatus, _Mapping]] = ..., creation_timestamp: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

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
    __slots__ = ("source", "valid", "last_error", "loaded_version", "loaded_at")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    VALID_FIELD_NUMBER: _ClassVar[int]
    LAST_ERROR_FIELD_NUMBER: _ClassVar[int]
    LOADED_VERSION_FIELD_NUMBER: _ClassVar[int]
    LOADED_AT_FIELD_NUMBER: _ClassVar[int]
    source: str
    valid: bool
    last_error: str
    loaded_version: int
    loaded_at: _timestamp_pb2.Timestamp
    def __init__(self, source: _Optional[str] = ..., valid: _Optional[bool] = ..., last_error: _Optional[str] = ..., loaded_version: _Optional[int] = ..., loaded_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class RouteRef(_message.Message):
    __slots__ = ("namespace", "name")
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    namespace: str
    name: str
    def __init__(self, namespace: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

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
    __slots__ = ("version", "last_sync", "source", "snapshot", "changes", "epoch", "sources")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    LAST_SYNC_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    CHANGES_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    SOURCES_FIELD_NUMBER: _ClassVar[int]
    version: int
    last_sync: _timestamp_pb2.Timestamp
    source: str
    snapshot: Snapshot
    changes: Changes
    epoch: int
    sources: _containers.RepeatedCompositeFieldContainer[RouteSourceState]
    def __init__(self, version: _Optional[int] = ..., last_sync: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., source: _Optional[str] = ..., snapshot: _Optional[_Union[Snapshot, _Mapping]] = ..., changes: _Optional[_Union[Changes, _Mapping]] = ..., epoch: _Optional[int] = ..., sources: _Optional[_Iterable[_Union[RouteSourceState, _Mapping]]] = ...) -> None: ...

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
