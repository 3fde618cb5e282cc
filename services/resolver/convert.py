"""Conversions between `waygate.resolver.v1` messages and the domain model.

Used by the gRPC boundary (`server.py`) and by clients (`commands.py`).
Invariants:
- `*_from_proto` never accepts an enum value it does not know: it raises
  InvalidArgument naming the field (a newer client must not be misread).
- Proto -> domain -> proto is lossless for every field the proto has.
- A route's TLS private key leaves the process only in Watch events to route
  readers (the proxy needs it); every other reply omits it.
- Change messages are cached by value: the same change sent to a hundred
  watchers is converted once.
- Knows no store: the client imports this module. Building Watch events from
  the store's snapshots and batches is `waygate.resolver.events`, the server's.
"""

from __future__ import annotations

import dataclasses
import functools
import ipaddress
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any, TypeVar

from google.protobuf import duration_pb2, timestamp_pb2

from waygate.core.errors import InvalidArgument
from waygate.resolver import model
from waygate.resolver.backendcerts import BackendCertificateState
from waygate.resolver.v1 import resolver_pb2 as pb

SERVICE_TYPES = {
    "ClusterIP": pb.SERVICE_TYPE_CLUSTER_IP,
    "NodePort": pb.SERVICE_TYPE_NODE_PORT,
    "LoadBalancer": pb.SERVICE_TYPE_LOAD_BALANCER,
    "ExternalName": pb.SERVICE_TYPE_EXTERNAL_NAME,
}
SERVICE_TYPE_NAMES = {v: k for k, v in SERVICE_TYPES.items()}

TERMINATIONS = {
    model.TLSTermination.EDGE: pb.TLS_TERMINATION_EDGE,
    model.TLSTermination.PASSTHROUGH: pb.TLS_TERMINATION_PASSTHROUGH,
    model.TLSTermination.REENCRYPT: pb.TLS_TERMINATION_REENCRYPT,
}
TERMINATION_NAMES = {v: k for k, v in TERMINATIONS.items()}

INSECURE_POLICIES = {
    model.InsecureEdgePolicy.NONE: pb.INSECURE_EDGE_POLICY_NONE,
    model.InsecureEdgePolicy.ALLOW: pb.INSECURE_EDGE_POLICY_ALLOW,
    model.InsecureEdgePolicy.REDIRECT: pb.INSECURE_EDGE_POLICY_REDIRECT,
}
INSECURE_POLICY_NAMES = {v: k for k, v in INSECURE_POLICIES.items()}
INSECURE_POLICY_NAMES[pb.INSECURE_EDGE_POLICY_UNSPECIFIED] = model.InsecureEdgePolicy.NONE

BALANCE_POLICIES = {
    model.BalancePolicy.DEFAULT: pb.BALANCE_POLICY_UNSPECIFIED,
    model.BalancePolicy.RANDOM: pb.BALANCE_POLICY_RANDOM,
    model.BalancePolicy.ROUND_ROBIN: pb.BALANCE_POLICY_ROUND_ROBIN,
    model.BalancePolicy.LEAST_CONN: pb.BALANCE_POLICY_LEAST_CONN,
    model.BalancePolicy.SOURCE: pb.BALANCE_POLICY_SOURCE,
}
BALANCE_POLICY_NAMES = {v: k for k, v in BALANCE_POLICIES.items()}

SAME_SITES = {
    model.SameSite.LAX: pb.SAME_SITE_LAX,
    model.SameSite.STRICT: pb.SAME_SITE_STRICT,
    model.SameSite.NONE: pb.SAME_SITE_NONE,
}
SAME_SITE_NAMES = {v: k for k, v in SAME_SITES.items()}
SAME_SITE_NAMES[pb.SAME_SITE_UNSPECIFIED] = model.SameSite.LAX

FORWARDED_MODES = {
    model.ForwardedHeadersMode.APPEND: pb.FORWARDED_HEADERS_MODE_APPEND,
    model.ForwardedHeadersMode.REPLACE: pb.FORWARDED_HEADERS_MODE_REPLACE,
    model.ForwardedHeadersMode.IF_NONE: pb.FORWARDED_HEADERS_MODE_IF_NONE,
    model.ForwardedHeadersMode.NEVER: pb.FORWARDED_HEADERS_MODE_NEVER,
}
FORWARDED_MODE_NAMES = {v: k for k, v in FORWARDED_MODES.items()}
FORWARDED_MODE_NAMES[pb.FORWARDED_HEADERS_MODE_UNSPECIFIED] = model.ForwardedHeadersMode.APPEND

PATH_MATCH_TYPES = {
    model.PathMatchType.PREFIX: pb.PATH_MATCH_TYPE_PREFIX,
    model.PathMatchType.EXACT: pb.PATH_MATCH_TYPE_EXACT,
    model.PathMatchType.REGEX: pb.PATH_MATCH_TYPE_REGULAR_EXPRESSION,
}
PATH_MATCH_TYPE_NAMES = {v: k for k, v in PATH_MATCH_TYPES.items()}
PATH_MATCH_TYPE_NAMES[pb.PATH_MATCH_TYPE_UNSPECIFIED] = model.PathMatchType.PREFIX

VALUE_MATCH_TYPES = {
    model.ValueMatchType.EXACT: pb.VALUE_MATCH_TYPE_EXACT,
    model.ValueMatchType.REGEX: pb.VALUE_MATCH_TYPE_REGULAR_EXPRESSION,
}
VALUE_MATCH_TYPE_NAMES = {v: k for k, v in VALUE_MATCH_TYPES.items()}
VALUE_MATCH_TYPE_NAMES[pb.VALUE_MATCH_TYPE_UNSPECIFIED] = model.ValueMatchType.EXACT

PATH_MODIFIERS = {
    model.PathModifierType.NONE: pb.PATH_MODIFIER_TYPE_UNSPECIFIED,
    model.PathModifierType.FULL: pb.PATH_MODIFIER_TYPE_REPLACE_FULL_PATH,
    model.PathModifierType.PREFIX: pb.PATH_MODIFIER_TYPE_REPLACE_PREFIX_MATCH,
}
PATH_MODIFIER_NAMES = {v: k for k, v in PATH_MODIFIERS.items()}

KINDS = {
    model.Kind.SERVICES: pb.RESOURCE_KIND_SERVICES,
    model.Kind.ENDPOINTS: pb.RESOURCE_KIND_ENDPOINTS,
    model.Kind.ROUTES: pb.RESOURCE_KIND_ROUTES,
    model.Kind.TUNNELS: pb.RESOURCE_KIND_TUNNELS,
}
KIND_NAMES = {v: k for k, v in KINDS.items()}

T = TypeVar("T")


def _enum(table: Mapping[Any, T], value: int, field: str) -> T:
    try:
        return table[value]
    except KeyError:
        raise InvalidArgument(f"{field}: unknown value {value}") from None


# ---------------------------------------------------------------- scalars


def timestamp(when: datetime | None) -> timestamp_pb2.Timestamp | None:
    if when is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(when)
    return stamp


def duration(seconds: float | None) -> duration_pb2.Duration | None:
    if seconds is None:
        return None
    message = duration_pb2.Duration()
    message.FromNanoseconds(round(seconds * 1e9))
    return message


def seconds(message: duration_pb2.Duration) -> float:
    return float(message.ToNanoseconds()) / 1e9


def when(message: Any, field: str) -> datetime | None:
    """An aware UTC datetime from a Timestamp field of `message`; None when unset."""
    if not message.HasField(field):
        return None
    stamp: timestamp_pb2.Timestamp = getattr(message, field)
    return stamp.ToDatetime(tzinfo=UTC)


# ---------------------------------------------------------------- services and endpoints


def service_to_proto(service: model.Service) -> pb.Service:
    return pb.Service(
        namespace=service.namespace,
        name=service.name,
        type=SERVICE_TYPES.get(service.type, pb.SERVICE_TYPE_UNSPECIFIED),
        cluster_ips=service.cluster_ips,
        headless=service.headless,
        external_name=service.external_name,
        ports=[
            pb.ServicePort(
                name=p.name,
                port=p.port,
                target_port=p.target_port,
                protocol=p.protocol,
                node_port=p.node_port,
                app_protocol=p.app_protocol,
            )
            for p in service.ports
        ],
    )


def service_from_proto(message: pb.Service) -> model.Service:
    service_type = _enum(
        dict(SERVICE_TYPE_NAMES) | {pb.SERVICE_TYPE_UNSPECIFIED: "ClusterIP"},
        message.type,
        "service.type",
    )
    return model.Service(
        namespace=message.namespace,
        name=message.name,
        type=str(service_type),
        cluster_ips=tuple(message.cluster_ips),
        headless=message.headless,
        external_name=message.external_name,
        ports=tuple(
            model.ServicePort(
                p.name, p.port, p.target_port, p.protocol or "TCP", p.node_port, p.app_protocol
            )
            for p in message.ports
        ),
    )


def endpoint_to_proto(endpoint: model.Endpoint) -> pb.Endpoint:
    return pb.Endpoint(
        namespace=endpoint.namespace,
        service=endpoint.service,
        address=endpoint.address,
        ports=[
            pb.EndpointPort(name=p.name, port=p.port, protocol=p.protocol) for p in endpoint.ports
        ],
        ready=endpoint.ready,
        serving=endpoint.serving,
        terminating=endpoint.terminating,
        zone=endpoint.zone,
        node_name=endpoint.node_name,
        tunnel=endpoint.tunnel,
        hostname=endpoint.hostname,
    )


def endpoint_from_proto(message: pb.Endpoint) -> model.Endpoint:
    return model.Endpoint(
        namespace=message.namespace,
        service=message.service,
        address=message.address,
        ports=tuple(model.EndpointPort(p.name, p.port, p.protocol or "TCP") for p in message.ports),
        ready=message.ready,
        serving=message.serving,
        terminating=message.terminating,
        zone=message.zone,
        node_name=message.node_name,
        tunnel=message.tunnel,
        hostname=message.hostname,
    )


# ---------------------------------------------------------------- routes


def route_to_proto(route: model.Route, *, with_key: bool = True) -> pb.Route:
    """The route message; `with_key=False` leaves tls.key empty.

    Only the proxy's Watch needs the private key; any reply that merely shows
    routes (ListRoutes, ApplyRoute) must not hand it to whoever asks.
    """
    message = pb.Route(
        namespace=route.namespace,
        name=route.name,
        host=route.host,
        path=route.path,
        backends=[
            pb.RouteBackend(
                service=b.service,
                weight=b.weight,
                namespace=b.namespace,
                port=b.port,
                invalid=b.invalid,
                use_cluster_ip=b.use_cluster_ip,
            )
            for b in route.backends
        ],
        target_port=route.target_port,
        balance=BALANCE_POLICIES[route.balance],
        sticky=pb.StickySessions(
            disable_cookies=route.sticky.disable_cookies,
            cookie_name=route.sticky.cookie_name,
            same_site=SAME_SITES[route.sticky.same_site],
            cookie_path=route.sticky.cookie_path,
            cookie_domain=route.sticky.cookie_domain,
            cookie_max_age=route.sticky.cookie_max_age,
            cookie_secure=route.sticky.cookie_secure,
        ),
        timeouts=pb.RouteTimeouts(
            **{
                name: duration(getattr(route.timeouts, name))
                for name in model.TIMEOUT_FIELDS
                if getattr(route.timeouts, name) is not None
            }
        ),
        auth_proxy_headers=route.auth_proxy_headers,
        forwarded_headers=FORWARDED_MODES[route.forwarded_headers],
        upstream_protocol=route.upstream_protocol,
        request_buffering=route.request_buffering,
        status=None if route.status is None else route_status_to_proto(route.status),
        creation_timestamp=timestamp(route.created),
        matches=[_match_to_proto(m) for m in route.matches],
        request_timeout=duration(route.request_timeout),
        backend_request_timeout=duration(route.backend_request_timeout),
        listener_port=route.listener_port,
        gateway=route.gateway,
        origin=route.origin,
        rule_index=route.rule_index,
        listener_protocol=route.listener_protocol,
        proxy_protocol_from_client=route.proxy_protocol_from_client,
        proxy_protocol_to_backend=route.proxy_protocol_to_backend,
    )
    if route.filters is not None:
        message.filters.CopyFrom(_filters_to_proto(route.filters))
    if route.access is not None:
        message.access.CopyFrom(_access_to_proto(route.access, with_key))
    if (limit := route.rate_limit) is not None:
        message.rate_limit.CopyFrom(pb.RateLimit(**dataclasses.asdict(limit)))
    if (auth := route.external_auth) is not None:
        message.external_auth.CopyFrom(
            pb.ExternalAuth(
                url=auth.url,
                method=auth.method,
                signin=auth.signin,
                signin_redirect_param=auth.signin_redirect_param,
                response_headers=list(auth.response_headers),
                request_redirect=auth.request_redirect,
                proxy_set_headers=[
                    pb.RouteHeader(name=n, value=v) for n, v in auth.proxy_set_headers
                ],
                cache_key=auth.cache_key,
                cache_durations=[
                    pb.AuthCacheDuration(status=status, duration=duration(seconds))
                    for status, seconds in auth.cache_durations
                ],
                always_set_cookie=auth.always_set_cookie,
                trusted_proxies=list(auth.trusted_proxies),
                full_forwarded_for=auth.full_forwarded_for,
            )
        )
    if (cors := route.cors) is not None:
        message.cors.CopyFrom(
            pb.RouteCors(
                allow_origins=cors.allow_origins,
                allow_methods=cors.allow_methods,
                allow_headers=cors.allow_headers,
                expose_headers=cors.expose_headers,
                allow_credentials=cors.allow_credentials,
                max_age=cors.max_age,
            )
        )
    message.max_request_body = route.max_request_body
    message.next_upstream = route.next_upstream
    message.next_upstream_tries = route.next_upstream_tries
    message.rewrite_target = route.rewrite_target
    message.default_backend = route.default_backend
    message.hash_by = route.hash_by
    message.hash_subset_size = route.hash_subset_size
    message.redirect_from = route.redirect_from
    message.redirect_to = route.redirect_to
    message.cookie_domain = route.cookie_domain
    message.cookie_path = route.cookie_path
    message.custom_http_errors[:] = route.custom_http_errors
    message.intercept_errors_disabled = route.intercept_errors_disabled
    message.port_in_redirects = route.port_in_redirects
    message.connection_header = route.connection_header
    message.access_log_disabled = route.access_log_disabled
    message.client_proxy_protocol = route.client_proxy_protocol
    message.limit_rate = route.limit_rate
    message.limit_rate_after = route.limit_rate_after
    message.upstream_scheme_from_client = route.upstream_scheme_from_client
    message.upstream_http10 = route.upstream_http10
    message.redirect_location = route.redirect_location
    message.client_address_header = route.client_address_header
    message.span_name = route.span_name
    message.tracing_off = route.tracing_off
    message.untrusted_trace_context = route.untrusted_trace_context
    if route.next_upstream_timeout:
        message.next_upstream_timeout.FromNanoseconds(round(route.next_upstream_timeout * 1e9))
    if (url_mirror := route.url_mirror) is not None:
        message.url_mirror.CopyFrom(pb.UrlMirror(**dataclasses.asdict(url_mirror)))
    if (canary := route.canary) is not None:
        message.canary.CopyFrom(pb.RouteCanary(**dataclasses.asdict(canary)))
    if route.tls is not None:
        hsts = route.tls.hsts
        message.tls.CopyFrom(
            pb.RouteTLS(
                termination=TERMINATIONS[route.tls.termination],
                certificate=route.tls.certificate,
                key=route.tls.key if with_key else "",
                ca_certificate=route.tls.ca_certificate,
                destination_ca_certificate=route.tls.destination_ca_certificate,
                insecure_edge_termination_policy=INSECURE_POLICIES[
                    route.tls.insecure_edge_termination_policy
                ],
                hsts=None
                if hsts is None
                else pb.HSTS(
                    max_age=duration(hsts.max_age),
                    include_subdomains=hsts.include_subdomains,
                    preload=hsts.preload,
                ),
                client_ca_certificate=route.tls.client_ca_certificate,
                destination_server_name=route.tls.destination_server_name,
                present_client_certificate=route.tls.present_client_certificate,
                destination_system_ca=route.tls.destination_system_ca,
                destination_san_hostnames=route.tls.destination_san_hostnames,
                destination_san_uris=route.tls.destination_san_uris,
                backend_client_certificate=route.tls.backend_client_certificate,
                backend_client_key=route.tls.backend_client_key if with_key else "",
                protocols=route.tls.protocols,
                ciphers=route.tls.ciphers,
            )
        )
    return message


def route_from_proto(message: pb.Route) -> model.Route:
    """The domain route (not yet validated: see validation.validate_route)."""
    tls = None
    if message.HasField("tls") and message.tls.termination != pb.TLS_TERMINATION_UNSPECIFIED:
        termination = _enum(TERMINATION_NAMES, message.tls.termination, "tls.termination")
        policy = _enum(
            INSECURE_POLICY_NAMES,
            message.tls.insecure_edge_termination_policy,
            "tls.insecure_edge_termination_policy",
        )
        tls = model.RouteTLS(
            termination=termination,
            certificate=message.tls.certificate,
            key=message.tls.key,
            ca_certificate=message.tls.ca_certificate,
            destination_ca_certificate=message.tls.destination_ca_certificate,
            insecure_edge_termination_policy=policy,
            hsts=model.HSTS(
                max_age=seconds(message.tls.hsts.max_age),
                include_subdomains=message.tls.hsts.include_subdomains,
                preload=message.tls.hsts.preload,
            )
            if message.tls.HasField("hsts")
            else None,
            client_ca_certificate=message.tls.client_ca_certificate,
            destination_server_name=message.tls.destination_server_name,
            present_client_certificate=message.tls.present_client_certificate,
            destination_system_ca=message.tls.destination_system_ca,
            destination_san_hostnames=tuple(message.tls.destination_san_hostnames),
            destination_san_uris=tuple(message.tls.destination_san_uris),
            backend_client_certificate=message.tls.backend_client_certificate,
            backend_client_key=message.tls.backend_client_key,
            protocols=tuple(message.tls.protocols),
            ciphers=message.tls.ciphers,
        )
    elif message.HasField("tls") and (
        message.tls.certificate
        or message.tls.key
        or message.tls.destination_ca_certificate
        or message.tls.client_ca_certificate
        or message.tls.destination_server_name
        or message.tls.present_client_certificate
        or message.tls.backend_client_certificate
        or message.tls.backend_client_key
        or message.tls.protocols
        or message.tls.ciphers
        or message.tls.HasField("hsts")
    ):
        raise InvalidArgument(
            "tls.termination: required when any TLS setting is given "
            "(edge, passthrough or reencrypt)"
        )
    timeouts = model.RouteTimeouts(
        **{
            name: seconds(getattr(message.timeouts, name))
            if message.timeouts.HasField(name)
            else None
            for name in model.TIMEOUT_FIELDS
        }
    )
    return model.Route(
        namespace=message.namespace,
        name=message.name,
        host=message.host,
        path=message.path,
        backends=tuple(
            model.RouteBackend(
                b.service, b.weight, b.namespace, b.port, b.invalid, b.use_cluster_ip
            )
            for b in message.backends
        ),
        target_port=message.target_port,
        tls=tls,
        balance=_enum(BALANCE_POLICY_NAMES, message.balance, "balance"),
        sticky=model.StickySessions(
            message.sticky.disable_cookies,
            message.sticky.cookie_name,
            _enum(SAME_SITE_NAMES, message.sticky.same_site, "sticky.same_site"),
            message.sticky.cookie_path,
            message.sticky.cookie_domain,
            message.sticky.cookie_max_age,
            message.sticky.cookie_secure,
        ),
        timeouts=timeouts,
        auth_proxy_headers=message.auth_proxy_headers,
        forwarded_headers=_enum(
            FORWARDED_MODE_NAMES, message.forwarded_headers, "forwarded_headers"
        ),
        upstream_protocol=message.upstream_protocol,
        request_buffering=message.request_buffering
        if message.HasField("request_buffering")
        else True,
        created=when(message, "creation_timestamp"),
        status=route_status_from_proto(message.status) if message.HasField("status") else None,
        matches=tuple(_match_from_proto(m) for m in message.matches),
        filters=_filters_from_proto(message.filters) if message.HasField("filters") else None,
        rate_limit=_rate_limit_from_proto(message.rate_limit)
        if message.HasField("rate_limit")
        else None,
        external_auth=_external_auth_from_proto(message.external_auth)
        if message.HasField("external_auth")
        else None,
        request_timeout=seconds(message.request_timeout)
        if message.HasField("request_timeout")
        else None,
        backend_request_timeout=seconds(message.backend_request_timeout)
        if message.HasField("backend_request_timeout")
        else None,
        listener_port=message.listener_port,
        gateway=message.gateway,
        origin=message.origin,
        rule_index=message.rule_index,
        listener_protocol=message.listener_protocol,
        access=_access_from_proto(message.access) if message.HasField("access") else None,
        proxy_protocol_from_client=message.proxy_protocol_from_client,
        proxy_protocol_to_backend=message.proxy_protocol_to_backend,
        cors=_cors_from_proto(message.cors) if message.HasField("cors") else None,
        max_request_body=message.max_request_body,
        next_upstream=message.next_upstream,
        next_upstream_tries=message.next_upstream_tries,
        rewrite_target=message.rewrite_target,
        default_backend=message.default_backend,
        hash_by=message.hash_by,
        hash_subset_size=message.hash_subset_size,
        redirect_from=message.redirect_from,
        redirect_to=message.redirect_to,
        cookie_domain=message.cookie_domain,
        cookie_path=message.cookie_path,
        custom_http_errors=tuple(message.custom_http_errors),
        intercept_errors_disabled=message.intercept_errors_disabled,
        port_in_redirects=message.port_in_redirects,
        connection_header=message.connection_header,
        access_log_disabled=message.access_log_disabled,
        client_proxy_protocol=message.client_proxy_protocol,
        canary=_canary_from_proto(message.canary) if message.HasField("canary") else None,
        limit_rate=message.limit_rate,
        limit_rate_after=message.limit_rate_after,
        upstream_scheme_from_client=message.upstream_scheme_from_client,
        upstream_http10=message.upstream_http10,
        redirect_location=message.redirect_location,
        client_address_header=message.client_address_header,
        span_name=message.span_name,
        tracing_off=message.tracing_off,
        untrusted_trace_context=message.untrusted_trace_context,
        next_upstream_timeout=seconds(message.next_upstream_timeout)
        if message.HasField("next_upstream_timeout")
        else 0.0,
        url_mirror=model.UrlMirror(
            message.url_mirror.target, message.url_mirror.host, message.url_mirror.request_body
        )
        if message.HasField("url_mirror")
        else None,
    )


def _canary_from_proto(message: pb.RouteCanary) -> model.Canary:
    return model.Canary(
        main_backends=message.main_backends,
        weight=message.weight,
        weight_total=message.weight_total,
        header=message.header,
        header_value=message.header_value,
        header_pattern=message.header_pattern,
        cookie=message.cookie,
        legacy_affinity=message.legacy_affinity,
    )


_ACCESS_LISTS = (
    "block",
    "deny",
    "allow",
    "block_user_agents",
    "block_referers",
    "trusted_proxies",
    "credentials",
)


def _access_to_proto(access: model.RouteAccess, with_credentials: bool) -> pb.RouteAccess:
    """The access rules; credentials (htpasswd hashes) only where keys go (`with_key`)."""
    message = pb.RouteAccess(
        auth_type=access.auth_type, auth_realm=access.auth_realm, satisfy_any=access.satisfy_any
    )
    for name in _ACCESS_LISTS:
        if name != "credentials" or with_credentials:
            getattr(message, name).extend(getattr(access, name))
    if access.client_certificate is not None:
        message.client_certificate.CopyFrom(
            pb.ClientCertificate(**dataclasses.asdict(access.client_certificate))
        )
    return message


def _access_from_proto(message: pb.RouteAccess) -> model.RouteAccess:
    client = None
    if message.HasField("client_certificate"):
        found = message.client_certificate
        client = model.ClientCertificate(
            **{f.name: getattr(found, f.name) for f in dataclasses.fields(model.ClientCertificate)}
        )
    return model.RouteAccess(
        auth_type=message.auth_type,
        auth_realm=message.auth_realm,
        satisfy_any=message.satisfy_any,
        client_certificate=client,
        **{name: tuple(getattr(message, name)) for name in _ACCESS_LISTS},
    )


def _cors_from_proto(message: pb.RouteCors) -> model.Cors:
    return model.Cors(
        tuple(message.allow_origins),
        message.allow_methods,
        message.allow_headers,
        message.expose_headers,
        message.allow_credentials,
        message.max_age,
    )


def route_status_to_proto(status: model.RouteStatus) -> pb.RouteStatus:
    return pb.RouteStatus(
        conditions=[
            pb.RouteCondition(
                type=c.type,
                status=c.status,
                reason=c.reason,
                message=c.message,
                last_transition_time=timestamp(c.last_transition),
                observed_generation=c.observed_generation,
            )
            for c in status.conditions
        ]
    )


def route_status_from_proto(message: pb.RouteStatus) -> model.RouteStatus:
    return model.RouteStatus(
        tuple(
            model.RouteCondition(
                type=c.type,
                status=c.status,
                reason=c.reason,
                message=c.message,
                last_transition=when(c, "last_transition_time"),
                observed_generation=c.observed_generation,
            )
            for c in message.conditions
        )
    )


def source_state_to_proto(state: model.SourceState) -> pb.RouteSourceState:
    return pb.RouteSourceState(
        source=state.source,
        valid=state.valid,
        last_error=state.error,
        loaded_version=state.loaded_version,
        loaded_at=timestamp(state.loaded_at),
        error_since=timestamp(state.error_since),
    )


def source_state_from_proto(message: pb.RouteSourceState) -> model.SourceState:
    return model.SourceState(
        source=message.source,
        valid=message.valid,
        error=message.last_error,
        loaded_version=message.loaded_version,
        loaded_at=when(message, "loaded_at"),
        error_since=when(message, "error_since"),
    )


def _values_to_proto(values: tuple[model.HeaderMatch, ...]) -> list[pb.RouteValueMatch]:
    return [
        pb.RouteValueMatch(name=v.name, value=v.value, type=VALUE_MATCH_TYPES[v.type])
        for v in values
    ]


def _values_from_proto(values: Any, field: str) -> tuple[model.HeaderMatch, ...]:
    return tuple(
        model.HeaderMatch(v.name, v.value, _enum(VALUE_MATCH_TYPE_NAMES, v.type, field))
        for v in values
    )


def _match_to_proto(match: model.RouteMatch) -> pb.RouteMatch:
    return pb.RouteMatch(
        path_type=PATH_MATCH_TYPES[match.path_type],
        path=match.path,
        headers=_values_to_proto(match.headers),
        query_params=_values_to_proto(match.query),
        method=match.method,
    )


def _match_from_proto(message: pb.RouteMatch) -> model.RouteMatch:
    return model.RouteMatch(
        path_type=_enum(PATH_MATCH_TYPE_NAMES, message.path_type, "matches.path_type"),
        path=message.path or "/",
        headers=_values_from_proto(message.headers, "matches.headers.type"),
        query=_values_from_proto(message.query_params, "matches.query_params.type"),
        method=message.method,
    )


def _modifier_to_proto(modifier: model.HeaderModifier) -> pb.RouteHeaderModifier:
    return pb.RouteHeaderModifier(
        set=[pb.RouteHeader(name=n, value=v) for n, v in modifier.set],
        add=[pb.RouteHeader(name=n, value=v) for n, v in modifier.add],
        remove=list(modifier.remove),
    )


def _modifier_from_proto(message: pb.RouteHeaderModifier) -> model.HeaderModifier:
    return model.HeaderModifier(
        set=tuple((h.name, h.value) for h in message.set),
        add=tuple((h.name, h.value) for h in message.add),
        remove=tuple(message.remove),
    )


def _filters_to_proto(filters: model.RouteFilters) -> pb.RouteFilters:
    message = pb.RouteFilters(
        mirrors=[
            pb.RouteMirror(namespace=m.namespace, service=m.service, port=m.port, percent=m.percent)
            for m in filters.mirrors
        ]
    )
    if filters.request_headers is not None:
        message.request_headers.CopyFrom(_modifier_to_proto(filters.request_headers))
    if filters.response_headers is not None:
        message.response_headers.CopyFrom(_modifier_to_proto(filters.response_headers))
    if (redirect := filters.redirect) is not None:
        message.redirect.CopyFrom(
            pb.RouteRedirect(
                scheme=redirect.scheme,
                hostname=redirect.hostname,
                port=redirect.port,
                path_type=PATH_MODIFIERS[redirect.path_type],
                path=redirect.path,
                status_code=redirect.status,
                strip_trailing_slash=redirect.strip_trailing_slash,
            )
        )
    if (rewrite := filters.rewrite) is not None:
        message.rewrite.CopyFrom(
            pb.RouteRewrite(
                hostname=rewrite.hostname,
                path_type=PATH_MODIFIERS[rewrite.path_type],
                path=rewrite.path,
            )
        )
    return message


def _external_auth_from_proto(message: pb.ExternalAuth) -> model.ExternalAuth:
    return model.ExternalAuth(
        url=message.url,
        method=message.method,
        signin=message.signin,
        signin_redirect_param=message.signin_redirect_param,
        response_headers=tuple(message.response_headers),
        request_redirect=message.request_redirect,
        proxy_set_headers=tuple((h.name, h.value) for h in message.proxy_set_headers),
        cache_key=message.cache_key,
        cache_durations=tuple((d.status, seconds(d.duration)) for d in message.cache_durations),
        always_set_cookie=message.always_set_cookie,
        trusted_proxies=tuple(message.trusted_proxies),
        full_forwarded_for=message.full_forwarded_for,
    )


def _rate_limit_from_proto(message: pb.RateLimit) -> model.RateLimit:
    return model.RateLimit(
        message.rps,
        message.rpm,
        message.burst_multiplier,
        message.connections,
        tuple(message.allow),
        message.request_status,
        message.connection_status,
    )


def _filters_from_proto(message: pb.RouteFilters) -> model.RouteFilters:
    redirect = rewrite = None
    if message.HasField("redirect"):
        r = message.redirect
        redirect = model.Redirect(
            scheme=r.scheme,
            hostname=r.hostname,
            port=r.port,
            path_type=_enum(PATH_MODIFIER_NAMES, r.path_type, "filters.redirect.path_type"),
            path=r.path,
            status=r.status_code or 302,
            strip_trailing_slash=r.strip_trailing_slash,
        )
    if message.HasField("rewrite"):
        w = message.rewrite
        rewrite = model.Rewrite(
            hostname=w.hostname,
            path_type=_enum(PATH_MODIFIER_NAMES, w.path_type, "filters.rewrite.path_type"),
            path=w.path,
        )
    return model.RouteFilters(
        request_headers=_modifier_from_proto(message.request_headers)
        if message.HasField("request_headers")
        else None,
        response_headers=_modifier_from_proto(message.response_headers)
        if message.HasField("response_headers")
        else None,
        redirect=redirect,
        rewrite=rewrite,
        mirrors=tuple(
            model.Mirror(m.service, m.namespace, m.port, m.percent or 100) for m in message.mirrors
        ),
    )


# ---------------------------------------------------------------- tunnels


def tunnel_to_proto(presence: model.TunnelPresence) -> pb.TunnelPresence:
    return pb.TunnelPresence(
        node=presence.node,
        servers=[pb.TunnelServer(id=s.id, address=s.address) for s in presence.servers],
    )


def tunnel_from_proto(message: pb.TunnelPresence) -> model.TunnelPresence:
    return model.TunnelPresence(
        node=message.node,
        servers=tuple(model.TunnelServer(s.id, s.address) for s in message.servers),
    )


# ---------------------------------------------------------------- watch


@functools.lru_cache(maxsize=8192)
def change_to_proto(change: model.Change, with_key: bool = True) -> pb.Change:
    value, key = change.value, change.key
    if change.kind is model.Kind.SERVICES:
        if isinstance(value, model.Service):
            return pb.Change(service_upserted=service_to_proto(value))
        return pb.Change(service_deleted=pb.ServiceRef(namespace=key[0], name=key[1]))
    if change.kind is model.Kind.ENDPOINTS:
        if isinstance(value, model.Endpoint):
            return pb.Change(endpoint_upserted=endpoint_to_proto(value))
        return pb.Change(
            endpoint_deleted=pb.EndpointRef(namespace=key[0], service=key[1], address=key[2])
        )
    if change.kind is model.Kind.ROUTES:
        if isinstance(value, model.Route):
            return pb.Change(route_upserted=route_to_proto(value, with_key=with_key))
        return pb.Change(route_deleted=pb.RouteRef(namespace=key[0], name=key[1]))
    if isinstance(value, model.TunnelPresence):
        return pb.Change(tunnel_presence=tunnel_to_proto(value))
    return pb.Change(tunnel_presence=pb.TunnelPresence(node=str(key)))


def kinds_from_proto(kinds: list[int]) -> frozenset[model.Kind] | None:
    wanted = set()
    for value in kinds:
        if value == pb.RESOURCE_KIND_UNSPECIFIED:
            continue
        wanted.add(_enum(KIND_NAMES, value, "kinds"))
    return frozenset(wanted) or None


# ---------------------------------------------------------------- Gateway API status


def _conditions_to_proto(conditions: Any) -> list[pb.GatewayCondition]:
    out = []
    for item in conditions or []:
        message = pb.GatewayCondition(
            type=str(item.get("type", "")),
            status=str(item.get("status", "")),
            reason=str(item.get("reason", "")),
            message=str(item.get("message", "")),
            observed_generation=int(item.get("observedGeneration", 0)),
        )
        when = item.get("lastTransitionTime")
        if when:
            message.last_transition_time.FromJsonString(str(when))
        out.append(message)
    return out


def _conditions_from_proto(conditions: Any) -> list[dict[str, Any]]:
    out = []
    for c in conditions:
        item: dict[str, Any] = {
            "type": c.type,
            "status": c.status,
            "reason": c.reason,
            "message": c.message,
            "observedGeneration": c.observed_generation,
        }
        if c.HasField("last_transition_time"):
            item["lastTransitionTime"] = c.last_transition_time.ToJsonString()
        out.append(item)
    return out


def gateway_status_to_proto(
    kind: str, namespace: str, name: str, generation: int, status: Mapping[str, Any]
) -> pb.GatewayObjectStatus:
    """One object's status (as the Kubernetes API spells it) -> its message."""
    message = pb.GatewayObjectStatus(
        kind=kind,
        namespace=namespace,
        name=name,
        generation=generation,
        conditions=_conditions_to_proto(status.get("conditions")),
        listeners=[
            pb.GatewayListenerStatus(
                name=str(item.get("name", "")),
                attached_routes=int(item.get("attachedRoutes", 0)),
                supported_kinds=[str(k.get("kind", "")) for k in item.get("supportedKinds") or []],
                conditions=_conditions_to_proto(item.get("conditions")),
            )
            for item in status.get("listeners") or []
        ],
        parents=[
            pb.GatewayParentStatus(
                gateway_namespace=str(item[ref].get("namespace", "")),
                gateway_name=str(item[ref].get("name", "")),
                section_name=str(item[ref].get("sectionName", "")),
                port=int(item[ref].get("port", 0)),
                controller_name=str(item.get("controllerName", "")),
                conditions=_conditions_to_proto(item.get("conditions")),
            )
            for field, ref in (("parents", "parentRef"), ("ancestors", "ancestorRef"))
            for item in status.get(field) or []
        ],
        addresses=[str(a.get("value", "")) for a in status.get("addresses") or []]
        + [
            str(a.get("ip") or a.get("hostname") or "")
            for a in (status.get("loadBalancer") or {}).get("ingress") or []
        ],
    )
    return message


def gateway_status_from_proto(message: pb.GatewayObjectStatus) -> dict[str, Any]:
    """The message -> the object's status as the Kubernetes API spells it (for -o yaml)."""
    status: dict[str, Any] = {}
    if message.kind == "Ingress":
        status["loadBalancer"] = {
            "ingress": [{"ip": a} if _is_ip(a) else {"hostname": a} for a in message.addresses]
        }
        if message.conditions:  # Waygate's own (a host conflict); not in Kubernetes
            status["conditions"] = _conditions_from_proto(message.conditions)
        return status
    if message.addresses:
        status["addresses"] = [{"value": a} for a in message.addresses]
    if message.conditions:
        status["conditions"] = _conditions_from_proto(message.conditions)
    if message.kind == "Gateway":
        status["listeners"] = [
            {
                "name": item.name,
                "attachedRoutes": item.attached_routes,
                "supportedKinds": [
                    {"group": "gateway.networking.k8s.io", "kind": k} for k in item.supported_kinds
                ],
                "conditions": _conditions_from_proto(item.conditions),
            }
            for item in message.listeners
        ]
    if message.parents or message.kind == "BackendTLSPolicy":
        # A policy's status lists the Gateways it is used through as ancestors.
        field, ref_name = (
            ("ancestors", "ancestorRef")
            if message.kind == "BackendTLSPolicy"
            else ("parents", "parentRef")
        )
        status[field] = []
        for item in message.parents:
            ref: dict[str, Any] = {
                "group": "gateway.networking.k8s.io",
                "kind": "Gateway",
                "namespace": item.gateway_namespace,
                "name": item.gateway_name,
            }
            if item.section_name:
                ref["sectionName"] = item.section_name
            if item.port:
                ref["port"] = item.port
            status[field].append(
                {
                    ref_name: ref,
                    "controllerName": item.controller_name,
                    "conditions": _conditions_from_proto(item.conditions),
                }
            )
    return status


def _is_ip(address: str) -> bool:
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return False
    return True


def listener_state_to_proto(state: model.ListenerState) -> pb.ListenerState:
    return pb.ListenerState(
        gateway=state.gateway,
        port=state.port,
        protocol=state.protocol,
        local_port=state.local_port,
        reason=state.reason,
        message=state.message,
    )


def listener_state_from_proto(message: pb.ListenerState) -> model.ListenerState:
    return model.ListenerState(
        gateway=message.gateway,
        port=message.port,
        protocol=message.protocol,
        local_port=message.local_port,
        reason=message.reason,
        message=message.message,
    )


def backend_certificate_to_proto(state: BackendCertificateState) -> pb.BackendCertificateState:
    return pb.BackendCertificateState(
        namespace=state.namespace,
        route=state.route,
        endpoint=state.endpoint,
        names=state.names,
        not_before=timestamp(state.not_before),
        not_after=timestamp(state.not_after),
        verdict=state.verdict,
    )


def backend_certificate_from_proto(message: pb.BackendCertificateState) -> BackendCertificateState:
    epoch = datetime.fromtimestamp(0, UTC)
    return BackendCertificateState(
        namespace=message.namespace,
        route=message.route,
        endpoint=message.endpoint,
        names=tuple(message.names),
        not_before=when(message, "not_before") or epoch,
        not_after=when(message, "not_after") or epoch,
        verdict=message.verdict,
    )
