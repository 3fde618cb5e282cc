"""The proxy's Python work per request, without sockets: what the data plane costs itself.

    python -m bench.proxy.hotpath [--requests N] [--profile | --bare]
                                  [--route bench|plain|ingress|cors|rewrite|allow-list|affinity]
                                  [--connections N]

One `ProxyServer` with the benchmark's route, one client connection and one
pooled upstream connection, both over in-memory transports that only keep
what is written. Each request is the benchmark's keep-alive GET (as wrk sends
it) handed to `ClientConnection.data_received`, and the upstream's 64-byte
answer (as nginx sends it) to `UpstreamConnection.data_received`: every rule
of the request path runs (head checks, routing, balancing, header rewriting,
the response head's checks and rebuild, metrics, timers), but no syscall and
no event-loop turn. So the figure is the floor the per-request Python code
sets under the wrk benchmark's CPU per request, and the place to A/B a change
to that code in seconds instead of minutes. `--profile` prints cProfile's
view of the same loop (calls per request and where the time goes).

`--route plain` and `--route ingress` compare a route carrying the ingress-nginx
annotations users rely on most (issue 27 item 10: CORS, a rewrite, a source
allow-list and cookie affinity, decided by the request core) with a plain one, for the
same request (a GET of /api/64 with an `Origin` header, both routes on the path
prefix /api): the ratio of the two is what those rules cost per request. Both routes
are the ones the resolver makes of the end-to-end benchmark's two Ingresses
(`bench.proxy.annotations`: `ingress_routes`), so each carries what an Ingress route
carries (proxy-body-size's default 1m check among it). The rewrite is ingress-nginx's
commonest, `path: /api(/|$)(.*)` with `rewrite-target: /$2`, which the resolver turns
into a prefix URLRewrite of /api to / (the backend gets /64). The client sends no
affinity cookie, so each answer carries a Set-Cookie (a first visit's cost: the
dearer case). `--route cors` (or `rewrite`, `allow-list`, `affinity`): the plain
Ingress's route with that one rule added, to see which costs what.

`--connections N`: the requests go to N client connections in turn (as wrk's `-cN`
spreads them), so what a rule keeps per connection or for the last client is measured
as a loaded proxy meets it; the default, 1, is the figure recorded since round 1.

`--bare`: just the N requests (after 200 of warm-up), nothing measured or printed: for
an instruction count, which a shared machine's load does not move, e.g.
`PYTHONHASHSEED=0 valgrind --tool=callgrind --callgrind-out-file=/dev/null python -m
bench.proxy.hotpath --bare --route R --requests 5000`, less the same with
`--requests 0`, divided by 5000.
"""

from __future__ import annotations

import argparse
import cProfile
import dataclasses
import pstats
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from waygate.proxy.downstream_h1 import ClientConnection
from waygate.proxy.metrics import ProxyMetrics
from waygate.proxy.routing import Defaults, Target, build_table
from waygate.proxy.server import ProxyServer
from waygate.proxy.upstream import Dialer
from waygate.proxy.upstream_h1 import UpstreamConnection
from waygate.resolver.model import (
    Cors,
    Endpoint,
    EndpointPort,
    PathModifierType,
    Rewrite,
    Route,
    RouteAccess,
    RouteBackend,
    RouteFilters,
    StickySessions,
)

HOST = "bench.localtest.me"
REQUEST = b"GET /64 HTTP/1.1\r\nHost: bench.localtest.me\r\n\r\n"
# --route plain|ingress|<rule>: a GET from a browser page of another origin, on the
# routes' path prefix /api.
ORIGIN_REQUEST = (
    b"GET /api/64 HTTP/1.1\r\nHost: bench.localtest.me\r\nOrigin: https://app.example.com\r\n\r\n"
)
API_PREFIX = "/api"
# What ingress-nginx's enable-cors, cors-allow-origin, rewrite-target (/$2 of /api(/|$)(.*)),
# whitelist-source-range and affinity: cookie become on the one route model, by the
# --route name of each alone.
RULES_BY_NAME: dict[str, dict[str, Any]] = {
    "cors": {"cors": Cors(allow_origins=("https://app.example.com",))},
    "rewrite": {
        "filters": RouteFilters(rewrite=Rewrite(path_type=PathModifierType.PREFIX, path="/"))
    },
    "allow-list": {"access": RouteAccess(allow=("127.0.0.0/8", "10.0.0.0/8"))},
    "affinity": {"sticky": StickySessions(cookie_name="route")},
}
INGRESS_RULES: dict[str, Any] = {k: v for rule in RULES_BY_NAME.values() for k, v in rule.items()}
RESPONSE = (
    b"HTTP/1.1 200 OK\r\nServer: nginx/1.22.1\r\nDate: Mon, 23 Nov 2026 04:00:00 GMT\r\n"
    b"Content-Type: application/octet-stream\r\nContent-Length: 64\r\n"
    b"Last-Modified: Mon, 23 Nov 2026 03:00:00 GMT\r\nConnection: keep-alive\r\n"
    b'ETag: "6741a0b0-40"\r\nAccept-Ranges: bytes\r\n\r\n' + b"x" * 63 + b"\n"
)


class MemoryTransport:
    """Just enough of asyncio.Transport: remembers the bytes written."""

    def __init__(self, peer: str = "127.0.0.1") -> None:
        self.written = 0
        self.last = b""
        self._peer = (peer, 40000)
        self._closing = False

    def write(self, data: bytes) -> None:
        self.written += len(data)
        self.last = data

    def writelines(self, pieces: Any) -> None:
        for piece in pieces:
            self.write(piece)

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self._peer if name == "peername" else default

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        pass

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def is_closing(self) -> bool:
        return self._closing

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        pass

    def close(self) -> None:
        self._closing = True

    def abort(self) -> None:
        self._closing = True


# Every client connection `build` made, in the order made (the last is the one returned).
clients: list[ClientConnection] = []


def ingress_routes(upstream_port: int) -> tuple[dict[str, Route], list[Endpoint], list[Any]]:
    """The routes the resolver makes of `bench.proxy.annotations`' two Ingresses (the
    plain one's /api path, and the annotated one), on this benchmark's host, with the
    Service and endpoints they name: what the end-to-end benchmark's proxy serves."""
    from bench.proxy.annotations import manifests
    from waygate.resolver.ingress_nginx.config import IngressNginx
    from waygate.resolver.manifests import parse_manifests

    with tempfile.TemporaryDirectory() as tmp:
        manifests(Path(tmp) / "m", upstream_port)
        file = Path(tmp) / "m" / "bench.yaml"
        content = parse_manifests([(file, file.read_text())], ingress_nginx=IngressNginx())
    routes = {
        "plain" if route.origin.endswith("/plain") else "ingress": dataclasses.replace(
            route, host=HOST
        )
        for route in content.routes
        if route.matches and route.matches[0].path == API_PREFIX
    }
    return routes, content.endpoints, content.services


async def build(
    upstream_port: int = 8091,
    rules: dict[str, Any] | None = None,
    path: str = "/",
    connections: int = 1,
    route_name: str = "bench",
) -> tuple[ClientConnection, UpstreamConnection]:
    """A server with the benchmark's route (on `path`; with `rules`: those route fields
    too), a client connection and its pooled upstream (`connections` > 1: that many
    client connections, the others in `clients`)."""
    if route_name == "bench":
        route = Route(
            namespace="bench",
            name="upstream",
            host=HOST,
            path=path,
            backends=(RouteBackend(service="upstream", weight=100),),
            **(rules or {}),
        )
        endpoints = [
            Endpoint(
                namespace="bench",
                service="upstream",
                address="127.0.0.1",
                ports=(EndpointPort(name="http", port=upstream_port),),
            )
        ]
        services: list[Any] = []
    else:
        # The plain Ingress's route (with one rule of the annotated one: the rule alone)
        # or the annotated Ingress's.
        made, endpoints, services = ingress_routes(upstream_port)
        route = made["ingress" if route_name == "ingress" else "plain"]
        if rules and route_name != "ingress":
            route = dataclasses.replace(route, **rules)
    by_service: dict[Any, tuple[Endpoint, ...]] = {}
    for endpoint in endpoints:
        by_service[endpoint.service_key] = (*by_service.get(endpoint.service_key, ()), endpoint)
    server = ProxyServer(
        defaults=Defaults(),
        dialer=Dialer(),
        metrics=ProxyMetrics(),
        cookie_key=b"k" * 32,
        max_connections=1000,
        listen_port=8080,
    )
    server.set_table(
        build_table(
            {route.key: route},
            by_service,
            {service.key: service for service in services},
            defaults=Defaults(),
            cookie_key=b"k" * 32,
        )
    )
    for _ in range(connections):
        client = ClientConnection(server)
        client.connection_made(MemoryTransport())
        clients.append(client)
    target = next(iter(server.table.targets))
    assert isinstance(target, Target)
    upstream = UpstreamConnection(server, target)
    upstream.connection_made(MemoryTransport())
    server.pool.put(upstream)
    return client, upstream


def one_request(
    client: ClientConnection, upstream: UpstreamConnection, request: bytes = REQUEST
) -> None:
    client.data_received(request)
    upstream.data_received(RESPONSE)


def turns(requests: int) -> Any:
    """The client connection of each of `requests` requests: every connection in turn."""
    count = len(clients)
    for index in range(requests):
        yield clients[index % count]


async def measure(
    requests: int, profile: bool, route: str = "bench", bare: bool = False, connections: int = 1
) -> None:
    rules = INGRESS_RULES if route == "ingress" else RULES_BY_NAME.get(route)
    client, upstream = await build(
        rules=rules,
        path="/" if route == "bench" else API_PREFIX,
        connections=connections,
        route_name=route,
    )
    request = REQUEST if route == "bench" else ORIGIN_REQUEST
    one_request(client, upstream, request)
    assert client.transport.last.startswith(b"HTTP/1.1 200 OK"), client.transport.last  # type: ignore[union-attr]
    assert (
        client.exchange.upstream is None and upstream in client.server.pool._idle[upstream.target]
    )  # type: ignore[attr-defined]
    if route == "ingress":
        answer = client.transport.last  # type: ignore[union-attr]
        assert b"Access-Control-Allow-Origin: https://app.example.com" in answer, answer
        assert b"Set-Cookie: route=" in answer, answer
        sent = upstream.transport.last  # type: ignore[union-attr]
        assert sent.startswith(b"GET /64 HTTP/1.1\r\n"), sent
    if bare:
        for client in turns(200 + requests):
            one_request(client, upstream, request)
        return
    for client in turns(2000):
        one_request(client, upstream, request)
    if profile:
        profiler = cProfile.Profile()
        profiler.enable()
        for client in turns(requests):
            one_request(client, upstream, request)
        profiler.disable()
        stats = pstats.Stats(profiler)
        print(f"{stats.total_calls / requests:.1f} Python calls per request")  # type: ignore[attr-defined]
        stats.sort_stats("tottime").print_stats(25)
        return
    best = float("inf")
    for _ in range(5):
        started = time.process_time()
        for client in turns(requests):
            one_request(client, upstream, request)
        best = min(best, (time.process_time() - started) / requests)
    print(f"{best * 1e6:.2f} µs of CPU per request (best of 5 x {requests})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=50_000)
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--bare", action="store_true", help="run the requests, measure nothing")
    parser.add_argument(
        "--route", choices=("bench", "plain", "ingress", *RULES_BY_NAME), default="bench"
    )
    parser.add_argument("--connections", type=int, default=1)
    args = parser.parse_args()
    uvloop.run(measure(args.requests, args.profile, args.route, args.bare, args.connections))


if __name__ == "__main__":
    main()
