"""Validation of routes, services and endpoints, shared by every way in.

The YAML file source, `ApplyRoute` and the Kubernetes Route custom resource
all pass objects through here before they reach the store, so the proxy only
ever sees routes it can serve.

Invariants:
- A valid object comes back normalised (host lower-cased, empty path -> "/");
  an invalid one raises `InvalidArgument` whose message names the object and
  the offending field, e.g. `route default/web: tls.key: does not match ...`.
- Rules follow OpenShift Routes: RFC 1123 host (a leading "*." for wildcard
  routes), path starting with "/", weights 0..256 (all zero is allowed: the
  proxy answers 503), at most 3 alternate backends, TLS PEM that parses and a
  key that matches its certificate, and per-termination rules (passthrough
  carries no certificate, key, CA or path, and cannot set cookies).
- Every string field is bounded (names and hosts 253, paths
  `MAX_PATH_LENGTH`, PEM fields `MAX_PEM_LENGTH`), and an error repeats a
  caller-supplied value only as `excerpt()` (quoted, escaped, cut), so a
  hostile value can neither flood a log nor overflow a client's metadata.
- Paths are RFC 3986 path characters only: no control characters, spaces,
  backslashes or non-ASCII; no dot-segments, whether written `..`,
  percent-encoded (`%2e%2e`) or followed by parameters (`..;x`); no empty
  segments (`//`) but a trailing '/'; no encoded '/', '\\' or control
  characters. Percent-escapes are put in one form (`waygate.core.paths`:
  unreserved characters decoded, the rest upper-cased), the form the proxy
  matches request paths in, so two spellings of one path are one route.
- Pure functions of their input: no I/O, no clock except certificate parsing.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re

from cryptography import x509
from cryptography.exceptions import UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

from waygate.core import regex as linear_regex
from waygate.core.errors import EXCERPT_LIMIT, InvalidArgument, excerpt
from waygate.core.paths import normalize_escapes
from waygate.core.tls import policy_problem
from waygate.resolver.model import (
    HSTS,
    PROTOCOLS,
    SERVICE_TYPES,
    UPSTREAM_PROTOCOLS,
    Endpoint,
    EndpointPort,
    InsecureEdgePolicy,
    PathMatchType,
    Route,
    RouteTLS,
    SameSite,
    Service,
    ServicePort,
    TLSTermination,
    ValueMatchType,
)

MAX_WEIGHT = 256
MAX_ALTERNATE_BACKENDS = 3
MAX_HOST_LENGTH = 253
MAX_PATH_LENGTH = 1024
# A certificate chain or CA bundle of a route; 64 KiB holds dozens of certificates.
MAX_PEM_LENGTH = 64 * 1024
# RFC 6797 max-age bound: two years (hstspreload.org asks for at least one).
MAX_HSTS_MAX_AGE = 2 * 365 * 86400.0
PRELOAD_MIN_MAX_AGE = 365 * 86400.0
# A month is longer than any sensible proxy timeout; more is almost surely a unit mistake.
MAX_TIMEOUT_SECONDS = 30 * 86400.0

_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?$")
_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# IANA service name, as Kubernetes port names: 1-15 chars, a letter, no "--".
_PORT_NAME = re.compile(r"^(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?$")
_COOKIE_NAME = re.compile(r"^[!#$%&'*+\-.^_`|~0-9A-Za-z]{1,256}$")
_NODE_NAME = _SUBDOMAIN


_PATH_CHARS = re.compile(r"^[A-Za-z0-9\-._~!$&'()*+,;=:@/%]*$")
_PERCENT = re.compile(r"%(..)?")


def normalize_path(path: str, what: str, field: str = "path") -> str:
    """A route path prefix, normalised (see the module docstring); "" means "/"."""
    if not path:
        return "/"
    if len(path) > MAX_PATH_LENGTH:
        raise _fail(what, field, f"{excerpt(path)} is longer than {MAX_PATH_LENGTH} characters")
    if not path.startswith("/"):
        raise _fail(what, field, f"{excerpt(path)} must start with '/'")
    if not _PATH_CHARS.match(path):
        raise _fail(
            what,
            field,
            f"{excerpt(path)}: a path prefix holds only URL path characters (no spaces, "
            "control characters, backslashes, quotes, '?', '#' or non-ASCII; "
            "percent-encode them)",
        )
    for match in _PERCENT.finditer(path):
        digits = match[1]
        if digits is None or not all(c in "0123456789abcdefABCDEF" for c in digits):
            raise _fail(what, field, f"{excerpt(path)}: '%' must start a %XX escape")
        char = chr(int(digits, 16))
        if char in "/\\" or ord(char) < 0x20 or ord(char) == 0x7F:
            raise _fail(
                what,
                field,
                f"{excerpt(path)}: an encoded '/', '\\' or control character (%{digits}) "
                "is ambiguous in a route path",
            )
    # The proxy puts request paths in the same form before matching them.
    normalised = normalize_escapes(path)
    segments = normalised.split("/")[1:]
    # A segment's parameters (";...") do not hide it: "..;" is ".." to many servers.
    if any(segment.partition(";")[0] in (".", "..") for segment in segments):
        raise _fail(
            what,
            field,
            f"{excerpt(path)}: dot-segments ('.' or '..', also percent-encoded or followed "
            "by ';') are not allowed in a route path",
        )
    # Only the last segment may be empty (a prefix ending in '/').
    if "" in segments[:-1]:
        raise _fail(
            what,
            field,
            f"{excerpt(path)}: empty segments ('//') are not allowed in a route path",
        )
    return normalised


def check_pem_length(value: str, what: str, field: str) -> None:
    if len(value) > MAX_PEM_LENGTH:
        raise _fail(what, field, f"{len(value)} characters; at most {MAX_PEM_LENGTH}")


def _fail(what: str, field: str, reason: str) -> InvalidArgument:
    error = InvalidArgument(f"{what}: {field}: {reason}")
    # The dotted field path (e.g. "backends[1].weight"), for callers that can
    # point at it, such as the file source naming the line.
    error.field = field  # type: ignore[attr-defined]
    return error


# ---------------------------------------------------------------- names


def check_label(value: str, what: str, field: str) -> None:
    """A DNS-1123 label (namespace, service name)."""
    if not value:
        raise _fail(what, field, "is required")
    if not _LABEL.match(value):
        raise _fail(
            what,
            field,
            f"{excerpt(value)} is not a DNS-1123 label (lower-case letters, digits and '-', "
            "at most 63, starting and ending with a letter or digit)",
        )


def check_name(value: str, what: str, field: str) -> None:
    """A DNS-1123 subdomain (object names such as a route's)."""
    if not value:
        raise _fail(what, field, "is required")
    if len(value) > MAX_HOST_LENGTH or not _SUBDOMAIN.match(value):
        raise _fail(
            what,
            field,
            f"{excerpt(value)} is not a DNS-1123 subdomain (lower-case letters, digits, '-' and '.')",
        )


def normalize_host(host: str, what: str, field: str = "host") -> str:
    """RFC 1123 host name, lower-cased; a leading "*." makes it a wildcard."""
    if not host:
        raise _fail(what, field, "is required")
    lowered = host.strip().lower().rstrip(".")
    name = lowered[2:] if lowered.startswith("*.") else lowered
    if len(lowered) > MAX_HOST_LENGTH:
        raise _fail(what, field, f"{excerpt(host)} is longer than {MAX_HOST_LENGTH} characters")
    if "*" in name:
        raise _fail(what, field, f"{excerpt(host)}: a wildcard is only allowed as a leading '*.'")
    labels = name.split(".")
    if lowered.startswith("*.") and len(labels) < 2:
        raise _fail(
            what, field, f"{excerpt(host)}: a wildcard needs at least two labels after '*.'"
        )
    for label in labels:
        if not _LABEL.match(label):
            raise _fail(
                what,
                field,
                f"{excerpt(host)} is not an RFC 1123 host name (label {excerpt(label)}: letters, digits "
                "and '-', 1-63 characters, not starting or ending with '-')",
            )
    with_ip = name.replace(".", "")
    if with_ip.isdigit():
        raise _fail(what, field, f"{excerpt(host)} is an IP address; routes need a host name")
    return lowered


def check_portshown(value: str, what: str, field: str) -> None:
    """A port given by number (1..65535) or by IANA-style name; empty is allowed."""
    if not value:
        return
    if value.isascii() and value.isdigit():
        if not 1 <= int(value) <= 65535:
            raise _fail(what, field, f"port {value} is outside 1..65535")
        return
    if not _PORT_NAME.match(value) or "--" in value:
        raise _fail(
            what,
            field,
            f"{excerpt(value)} is neither a port number nor a port name "
            "(1-15 lower-case letters, digits and '-')",
        )


def _check_port_number(value: int, what: str, field: str, *, allow_zero: bool = False) -> None:
    low = 0 if allow_zero else 1
    if not low <= value <= 65535:
        raise _fail(what, field, f"{value} is outside {low}..65535")


# ---------------------------------------------------------------- routes


def validate_route(route: Route) -> Route:
    """The route normalised, or InvalidArgument naming the field that is wrong."""
    what = f"route {shown(route.namespace)}/{shown(route.name)}"
    check_label(route.namespace, what, "namespace")
    check_name(route.name, what, "name")
    host = normalize_host(route.host, what)
    path = normalize_path(route.path, what)
    if not route.backends:
        raise _fail(what, "backends", "at least one backend (the route's service) is required")
    if len(route.backends) > 1 + MAX_ALTERNATE_BACKENDS:
        raise _fail(
            what,
            "backends",
            f"{len(route.backends) - 1} alternate backends; at most {MAX_ALTERNATE_BACKENDS}",
        )
    seen: set[str] = set()
    for index, backend in enumerate(route.backends):
        field = f"backends[{index}]"
        check_label(backend.service, what, f"{field}.service")
        if backend.service in seen:
            raise _fail(what, f"{field}.service", f"{excerpt(backend.service)} is listed twice")
        seen.add(backend.service)
        if not 0 <= backend.weight <= MAX_WEIGHT:
            raise _fail(what, f"{field}.weight", f"{backend.weight} is outside 0..{MAX_WEIGHT}")
    check_portshown(route.target_port, what, "target_port")
    tls = _validate_tls(route.tls, what, path) if route.tls is not None else None
    passthrough = tls is not None and tls.termination is TLSTermination.PASSTHROUGH
    if route.sticky.cookie_name:
        if passthrough:
            raise _fail(what, "sticky.cookie_name", "passthrough routes cannot set cookies")
        if not _COOKIE_NAME.match(route.sticky.cookie_name):
            raise _fail(
                what,
                "sticky.cookie_name",
                f"{excerpt(route.sticky.cookie_name)} is not a valid cookie name",
            )
    if route.sticky.same_site is not SameSite.LAX and passthrough:
        raise _fail(what, "sticky.same_site", "passthrough routes cannot set cookies")
    if route.upstream_protocol:
        if route.upstream_protocol not in UPSTREAM_PROTOCOLS:
            raise _fail(
                what,
                "upstream_protocol",
                f"{excerpt(route.upstream_protocol)} is not one of {', '.join(UPSTREAM_PROTOCOLS)}",
            )
        if passthrough:
            raise _fail(what, "upstream_protocol", "passthrough routes relay TLS untouched")
    _check_match_patterns(route, what)
    for timeout_field in dataclasses.fields(route.timeouts):
        value = getattr(route.timeouts, timeout_field.name)
        if value is None:
            continue
        if not 0 < value <= MAX_TIMEOUT_SECONDS:
            raise _fail(
                what,
                f"timeouts.{timeout_field.name}",
                f"{value}s must be more than 0 and at most {MAX_TIMEOUT_SECONDS:.0f}s",
            )
    return dataclasses.replace(route, host=host, path=path, tls=tls)


def _check_match_patterns(route: Route, what: str) -> None:
    """Regular expressions of a route's matches (ApplyRoute may carry them): only
    what RE2 can express is admitted, the proxy matches with it (core/regex.py)."""
    for index, match in enumerate(route.matches):
        checks = [("path", match.path)] if match.path_type is PathMatchType.REGEX else []
        for kind, values in (("headers", match.headers), ("query", match.query)):
            checks += [
                (f"{kind}[{i}].value", v.value)
                for i, v in enumerate(values)
                if v.type is ValueMatchType.REGEX
            ]
        for field, pattern in checks:
            reason = linear_regex.refusal(pattern)
            if reason is not None:
                raise _fail(what, f"matches[{index}].{field}", f"{excerpt(pattern)}: {reason}")


def validate_tls(tls: RouteTLS, what: str) -> RouteTLS:
    """A route TLS block checked on its own (the Gateway API's listener certificates)."""
    return _validate_tls(tls, what, "/")


def _validate_tls(tls: RouteTLS, what: str, path: str) -> RouteTLS:
    termination = tls.termination
    for field in _PEM_FIELDS:
        check_pem_length(getattr(tls, field), what, f"tls.{field}")
    if termination is TLSTermination.PASSTHROUGH:
        for field in _PEM_FIELDS:
            if getattr(tls, field):
                raise _fail(
                    what,
                    f"tls.{field}",
                    "passthrough routes forward TLS untouched and take no certificate material",
                )
        if tls.hsts is not None:
            raise _fail(what, "tls.hsts", "passthrough routes cannot add response headers")
        if tls.protocols or tls.ciphers:
            field = "protocols" if tls.protocols else "ciphers"
            raise _fail(what, f"tls.{field}", "a passthrough route's TLS is the backend's")
        if tls.destination_server_name or tls.present_client_certificate:
            field = (
                "destination_server_name"
                if tls.destination_server_name
                else "present_client_certificate"
            )
            raise _fail(what, f"tls.{field}", "only reencrypt routes open TLS to the backend")
        if tls.insecure_edge_termination_policy is InsecureEdgePolicy.ALLOW:
            raise _fail(
                what,
                "tls.insecure_edge_termination_policy",
                "passthrough routes allow only None or Redirect",
            )
        if path != "/":
            raise _fail(what, "path", "passthrough routes route by SNI and cannot have a path")
        return tls
    if termination is TLSTermination.EDGE:
        for field in (
            "destination_ca_certificate",
            "destination_server_name",
            "present_client_certificate",
            "destination_system_ca",
            "destination_san_hostnames",
            "destination_san_uris",
            "backend_client_certificate",
        ):
            if getattr(tls, field):
                raise _fail(what, f"tls.{field}", "only reencrypt routes open TLS to the backend")
    if tls.hsts is not None:
        _check_hsts(tls.hsts, what)
    if tls.protocols or tls.ciphers:
        for field, problem in (
            ("tls.protocols", policy_problem(tls.protocols, "")),
            ("tls.ciphers", policy_problem((), tls.ciphers)),
        ):
            if problem:
                raise _fail(what, field, problem)
    server_name = tls.destination_server_name
    if server_name:
        server_name = normalize_host(server_name, what, "tls.destination_server_name")
        if server_name.startswith("*."):
            raise _fail(
                what, "tls.destination_server_name", "a server name to verify is not a wildcard"
            )
    if tls.client_ca_certificate:
        _parse_certificates(tls.client_ca_certificate, what, "tls.client_ca_certificate")
    _check_pair(tls.certificate, tls.key, what, "certificate", "key")
    _check_pair(
        tls.backend_client_certificate,
        tls.backend_client_key,
        what,
        "backend_client_certificate",
        "backend_client_key",
    )
    if tls.ca_certificate:
        _parse_certificates(tls.ca_certificate, what, "tls.ca_certificate")
    if tls.destination_ca_certificate:
        _parse_certificates(tls.destination_ca_certificate, what, "tls.destination_ca_certificate")
    return dataclasses.replace(tls, destination_server_name=server_name)


_PEM_FIELDS = (
    "certificate",
    "key",
    "ca_certificate",
    "destination_ca_certificate",
    "client_ca_certificate",
    "backend_client_certificate",
    "backend_client_key",
)


def _check_pair(certificate: str, key: str, what: str, cert_field: str, key_field: str) -> None:
    """A certificate and its key: both or neither, PEM, the key the certificate's."""
    if bool(certificate) != bool(key):
        missing = key_field if certificate else cert_field
        raise _fail(
            what,
            f"tls.{missing}",
            "give the certificate and its key together, or neither (the proxy's default)",
        )
    if certificate:
        certificates = _parse_certificates(certificate, what, f"tls.{cert_field}")
        parsed = _parse_private_key(key, what, f"tls.{key_field}")
        if _public_bytes(parsed.public_key()) != _public_bytes(certificates[0].public_key()):
            raise _fail(
                what,
                f"tls.{key_field}",
                f"does not match the public key of tls.{cert_field}'s first certificate",
            )


def _check_hsts(hsts: HSTS, what: str) -> None:
    if not 0 <= hsts.max_age <= MAX_HSTS_MAX_AGE:
        raise _fail(
            what,
            "tls.hsts.max_age",
            f"{hsts.max_age:g}s is outside 0..{MAX_HSTS_MAX_AGE:.0f}s (two years)",
        )
    if hsts.preload and (hsts.max_age < PRELOAD_MIN_MAX_AGE or not hsts.include_subdomains):
        raise _fail(
            what,
            "tls.hsts.preload",
            f"preload needs max_age of at least {PRELOAD_MIN_MAX_AGE:.0f}s (a year) and "
            "include_subdomains, as browsers' preload lists require",
        )


def shown(value: str) -> str:
    """A namespace or name for `what`: as is when short and plain, else an excerpt."""
    if not value:
        return "?"
    if len(value) <= EXCERPT_LIMIT and value.isprintable():
        return value
    return excerpt(value)


def _parse_certificates(pem: str, what: str, field: str) -> list[x509.Certificate]:
    try:
        certificates = x509.load_pem_x509_certificates(pem.encode())
    except ValueError as exc:
        raise _fail(what, field, f"is not PEM certificate data ({exc})") from None
    if not certificates:
        raise _fail(what, field, "contains no PEM certificate")
    return certificates


def _parse_private_key(pem: str, what: str, field: str = "tls.key") -> PrivateKeyTypes:
    try:
        return serialization.load_pem_private_key(pem.encode(), password=None)
    except TypeError:
        raise _fail(what, field, "is encrypted; give an unencrypted PEM key") from None
    except (ValueError, UnsupportedAlgorithm) as exc:
        raise _fail(what, field, f"is not a PEM private key ({exc})") from None


def _public_bytes(public_key: object) -> bytes:
    return public_key.public_bytes(  # type: ignore[attr-defined,no-any-return]
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )


# ---------------------------------------------------------------- services and endpoints


def validate_service(service: Service) -> Service:
    what = f"service {shown(service.namespace)}/{shown(service.name)}"
    check_label(service.namespace, what, "namespace")
    check_label(service.name, what, "name")
    if service.type not in SERVICE_TYPES:
        raise _fail(
            what, "type", f"{excerpt(service.type)} is not one of {', '.join(SERVICE_TYPES)}"
        )
    if service.type == "ExternalName":
        if not service.external_name:
            raise _fail(what, "external_name", "an ExternalName service needs external_name")
        normalize_host(service.external_name, what, "external_name")
    elif service.external_name:
        raise _fail(what, "external_name", "only ExternalName services have one")
    if service.headless and service.cluster_ips:
        raise _fail(what, "cluster_ips", "a headless service has no cluster IPs")
    for index, ip in enumerate(service.cluster_ips):
        try:
            ipaddress.ip_address(ip)
        except ValueError:
            raise _fail(
                what, f"cluster_ips[{index}]", f"{excerpt(ip)} is not an IP address"
            ) from None
    names: set[str] = set()
    for index, port in enumerate(service.ports):
        _check_service_port(port, what, f"ports[{index}]", service.type)
        if port.name in names:
            raise _fail(what, f"ports[{index}].name", f"{excerpt(port.name)} is used twice")
        names.add(port.name)
    if len(service.ports) > 1 and "" in names:
        raise _fail(what, "ports", "every port needs a name when a service has several")
    return service


def _check_service_port(port: ServicePort, what: str, field: str, service_type: str) -> None:
    if port.name:
        check_portshown(port.name, what, f"{field}.name")
        if port.name.isascii() and port.name.isdigit():
            raise _fail(what, f"{field}.name", "a port name cannot be a number")
    _check_port_number(port.port, what, f"{field}.port")
    if not port.target_port:
        raise _fail(what, f"{field}.target_port", "is required (a number or a port name)")
    check_portshown(port.target_port, what, f"{field}.target_port")
    if port.protocol not in PROTOCOLS:
        raise _fail(
            what, f"{field}.protocol", f"{excerpt(port.protocol)} is not one of {PROTOCOLS}"
        )
    _check_port_number(port.node_port, what, f"{field}.node_port", allow_zero=True)
    if port.node_port and service_type not in ("NodePort", "LoadBalancer"):
        raise _fail(what, f"{field}.node_port", "only NodePort and LoadBalancer services have one")
    if len(port.app_protocol) > 253 or not port.app_protocol.isprintable():
        # Kubernetes: a label-style name, or a domain-prefixed one (kubernetes.io/h2c).
        raise _fail(
            what, f"{field}.app_protocol", f"{excerpt(port.app_protocol)} is not a protocol name"
        )


def validate_endpoint(endpoint: Endpoint) -> Endpoint:
    what = (
        f"endpoint {shown(endpoint.namespace)}/{shown(endpoint.service)}/{shown(endpoint.address)}"
    )
    check_label(endpoint.namespace, what, "namespace")
    check_label(endpoint.service, what, "service")
    if not endpoint.address:
        raise _fail(what, "address", "is required")
    try:
        ipaddress.ip_address(endpoint.address)
    except ValueError:
        normalize_host(endpoint.address, what, "address")
    if endpoint.tunnel and not endpoint.node_name:
        raise _fail(what, "node_name", "a tunnel endpoint needs the node whose tunnel reaches it")
    if endpoint.node_name and not _NODE_NAME.match(endpoint.node_name):
        raise _fail(what, "node_name", f"{excerpt(endpoint.node_name)} is not a DNS-1123 subdomain")
    names: set[str] = set()
    for index, port in enumerate(endpoint.ports):
        _check_endpoint_port(port, what, f"ports[{index}]")
        if port.name in names:
            raise _fail(what, f"ports[{index}].name", f"{excerpt(port.name)} is used twice")
        names.add(port.name)
    return endpoint


def _check_endpoint_port(port: EndpointPort, what: str, field: str) -> None:
    if port.name:
        check_portshown(port.name, what, f"{field}.name")
    _check_port_number(port.port, what, f"{field}.port")
    if port.protocol not in PROTOCOLS:
        raise _fail(
            what, f"{field}.protocol", f"{excerpt(port.protocol)} is not one of {PROTOCOLS}"
        )
