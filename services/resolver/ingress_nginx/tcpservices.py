"""ingress-nginx's TCP services ConfigMap (--tcp-services-configmap), parsed and checked.

Each entry is `"PORT": "NAMESPACE/SERVICE:SERVICE_PORT[:PROXY][:PROXY]"`, as
ingress-nginx reads it (docs/user-guide/exposing-tcp-udp-services.md): the
proxy binds PORT and relays the connection's bytes to the Service's ready
endpoints at SERVICE_PORT (a number or a port name). The first PROXY
decodes a PROXY protocol header from the client (nginx `listen ...
proxy_protocol`), the second sends one to the backend (nginx
`proxy_protocol on`).

Sans-IO and pure. Invariants:
- An entry is served or refused alone, with the reason: a key that is not a
  port 1-65535, a value outside the grammar, a third or fourth field that is
  not PROXY (ingress-nginx ignores those silently; what cannot be honoured
  exactly is refused here), the newer `PROTOCOL://` prefix or `?options`
  suffix (not honoured). Every other entry is served.
- Each entry becomes one route of the one route model (listener_protocol
  TCP_LISTENER, listener_port PORT, one backend): it travels to proxies over
  Watch and carries status (ServiceNotFound, NoReadyEndpoints) like any route.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from waygate.resolver.model import TCP_LISTENER, Route, RouteBackend

#: A Kubernetes namespace or Service name (an RFC 1123 label).
_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
#: A Service port name (IANA_SVC_NAME) or a number.
_PORT_NAME = re.compile(r"[a-z0-9]([-a-z0-9]{0,13}[a-z0-9])?")
PROXY = "PROXY"
#: The route status reason of a refused entry.
INVALID = "InvalidTCPService"
MAX_ENTRIES = 1000


@dataclass(frozen=True)
class TcpService:
    port: int
    namespace: str
    service: str
    service_port: str
    proxy_from_client: bool = False
    proxy_to_backend: bool = False


def _port(text: str) -> int | None:
    if not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 1 <= port <= 65535 else None


def parse_entry(key: str, value: str) -> TcpService:
    """One entry; ValueError with the reason when it cannot be served exactly."""
    port = _port(key)
    if port is None:
        raise ValueError(f"key {key!r} is not a port number 1-65535")
    if "://" in value:
        raise ValueError(f"{value!r}: a PROTOCOL:// prefix is not honoured (TCP only)")
    if "?" in value:
        raise ValueError(f"{value!r}: ?options are not honoured")
    fields = value.strip().split(":")
    if len(fields) < 2 or len(fields) > 4:
        raise ValueError(f"{value!r} must be NAMESPACE/SERVICE:PORT[:PROXY][:PROXY]")
    namespace, slash, service = fields[0].partition("/")
    if not slash or not _LABEL.fullmatch(namespace) or not _LABEL.fullmatch(service):
        raise ValueError(f"{fields[0]!r} must be NAMESPACE/SERVICE (lower-case DNS labels)")
    service_port = fields[1]
    if _port(service_port) is None and not (
        _PORT_NAME.fullmatch(service_port) and not service_port.isdigit()
    ):
        raise ValueError(f"{service_port!r} is neither a port number nor a port name")
    flags = fields[2:]
    for flag in flags:
        if flag.upper() != PROXY:
            raise ValueError(f"{flag!r}: only PROXY may follow the port (PROXY protocol)")
    return TcpService(
        port,
        namespace,
        service,
        service_port,
        proxy_from_client=len(flags) >= 1,
        proxy_to_backend=len(flags) == 2,
    )


def parse(data: Mapping[str, str]) -> tuple[list[TcpService], dict[str, str]]:
    """(the entries served, the refused ones by key -> why), in port order."""
    served: list[TcpService] = []
    refused: dict[str, str] = {}
    for index, key in enumerate(sorted(data, key=lambda k: (len(k), k))):
        if index >= MAX_ENTRIES:
            refused[key] = f"more than {MAX_ENTRIES} entries"
            continue
        try:
            served.append(parse_entry(key, str(data[key])))
        except ValueError as exc:
            refused[key] = str(exc)
    return served, refused


def route_name(configmap: str, key: str) -> str:
    port = _port(key)
    return f"{configmap}-tcp-{port}" if port is not None else f"{configmap}-tcp-invalid"


def routes(namespace: str, name: str, data: Mapping[str, str]) -> list[Route]:
    """The ConfigMap's entries as routes: served ones, and refused ones (not admitted,
    their reason in the status, so `waygate check` shows them)."""
    origin = f"ConfigMap {namespace}/{name}"
    served, refused = parse(data)
    out = [
        Route(
            namespace=namespace,
            name=route_name(name, str(entry.port)),
            host="",
            backends=(
                RouteBackend(entry.service, 1, namespace=entry.namespace, port=entry.service_port),
            ),
            listener_port=entry.port,
            listener_protocol=TCP_LISTENER,
            origin=origin,
            proxy_protocol_from_client=entry.proxy_from_client,
            proxy_protocol_to_backend=entry.proxy_to_backend,
        )
        for entry in served
    ]
    for index, (key, why) in enumerate(sorted(refused.items())):
        port = _port(key) or 0
        out.append(
            Route(
                namespace=namespace,
                name=route_name(name, key) if port else f"{name}-tcp-invalid-{index}",
                host="",
                listener_port=port,
                listener_protocol=TCP_LISTENER,
                origin=origin,
                ingress_refusal=(INVALID, f"{origin} entry {key!r}: {why}"),
            )
        )
    return out
