"""A real resolver gRPC server on 127.0.0.1 port 0, in-process, over a real routes file."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from waygate.core.grpcserver import GrpcServer
from waygate.resolver.filesource import FileSource
from waygate.resolver.server import ResolverServicer
from waygate.resolver.store import DEFAULT_MAX_PENDING, Store
from waygate.resolver.tunnels import TunnelRegistry
from waygate.resolver.v1 import resolver_pb2_grpc

ROUTES = textwrap.dedent(
    """\
    services:
      - namespace: shop
        name: web
        clusterIPs: [10.96.0.10]
        ports:
          - {name: http, port: 80, targetPort: 8080}
          - {name: admin, port: 9000, targetPort: metrics}
        endpoints:
          - address: 10.1.0.1
            ports: [{name: http, port: 8080}, {name: metrics, port: 9100}]
            nodeName: node-a
            zone: z1
          - address: 10.1.0.2
            ports: [{name: http, port: 8080}, {name: metrics, port: 9100}]
            nodeName: edge-1
            tunnel: true
          - address: 10.1.0.3
            ready: false
          - address: 10.1.0.4
            ready: true
            terminating: true
      - namespace: shop
        name: nodeport
        type: NodePort
        ports: [{port: 80, targetPort: 8080, nodePort: 30080}]
        endpoints: [{address: 10.2.0.1}]
      - namespace: shop
        name: lb
        type: LoadBalancer
        ports: [{port: 443, targetPort: 8443, nodePort: 30443}]
        endpoints: [{address: 10.3.0.1}]
      - namespace: shop
        name: external
        type: ExternalName
        externalName: db.example.com
      - namespace: shop
        name: headless
        headless: true
        ports: [{port: 80, targetPort: 8080}]
        endpoints: [{address: 10.4.0.1}]
      - namespace: shop
        name: draining
        ports: [{port: 80, targetPort: 8080}]
        endpoints:
          - {address: 10.5.0.1, ready: false, serving: true, terminating: true}
      - namespace: shop
        name: empty
        ports: [{port: 80, targetPort: 8080}]
    routes:
      - namespace: shop
        name: web
        host: shop.example.com
        to: web
        targetPort: http
    """
)


@dataclass
class Resolver:
    store: Store
    file: FileSource | None
    tunnels: TunnelRegistry
    stub: resolver_pb2_grpc.ResolverStub
    address: str


async def start_resolver(
    tmp_path: Path,
    *,
    routes: str | None = ROUTES,
    history_limit: int = 10_000,
    tunnels: dict[str, float] | None = None,
    watch_heartbeat: float = 0.0,
    watch_max_pending: int = DEFAULT_MAX_PENDING,
) -> tuple[Resolver, GrpcServer, grpc.aio.Channel]:
    store = Store(history_limit=history_limit)
    file_source = None
    if routes is not None:
        path = tmp_path / "routes.yaml"
        path.write_text(routes)
        file_source = FileSource(store, path)
        assert file_source.load(), file_source.last_error
    registry = TunnelRegistry(store, **(tunnels or {}))
    servicer = ResolverServicer(
        store,
        routes=file_source,
        tunnels=registry,
        watch_heartbeat=watch_heartbeat,
        watch_max_pending=watch_max_pending,
    )
    server = GrpcServer(host="127.0.0.1", port=0, registrations=[servicer.registration()])
    port = await server.start()
    await server.set_serving()
    address = f"127.0.0.1:{port}"
    channel = grpc.aio.insecure_channel(address)
    stub = resolver_pb2_grpc.ResolverStub(channel)
    return Resolver(store, file_source, registry, stub, address), server, channel


@pytest.fixture
async def resolver(tmp_path: Path) -> AsyncIterator[Resolver]:
    handle, server, channel = await start_resolver(tmp_path)
    try:
        yield handle
    finally:
        await channel.close()
        await server.stop(0)
