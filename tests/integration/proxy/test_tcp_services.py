"""TCP services over real sockets: a TCP echo backend through the proxy's TCP service
port, the PROXY protocol read from the client and sent to the backend (v1 and v2),
an endpoint change, the per-port connection limit, a port removed (its listener
closed, its connections drained within the bound), a port that cannot be bound
(reported, the others served), and every fd and task given back."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from tests.support.proxyharness import running_proxy
from tests.support.tcpecho import EchoBackend, talk
from waygate.proxy import proxyproto
from waygate.proxy.routing import Defaults
from waygate.proxy.tcpservices import TCP_CONNECTIONS, TcpServices
from waygate.resolver.client import (
    TCP_LISTENER,
    Endpoint,
    EndpointPort,
    Route,
    RouteBackend,
    Service,
    ServicePort,
)

pytestmark = pytest.mark.asyncio


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@dataclass
class View:
    """The parts of a resolver view TcpServices reads."""

    routes: dict[Any, Route] = field(default_factory=dict)
    endpoints: dict[tuple[str, str], tuple[Endpoint, ...]] = field(default_factory=dict)
    services: dict[tuple[str, str], Service] = field(default_factory=dict)


def tcp_route(port: int, *, from_client: bool = False, to_backend: bool = False) -> Route:
    return Route(
        namespace="ingress-nginx",
        name=f"tcp-services-tcp-{port}",
        host="",
        backends=(RouteBackend("echo", 1, namespace="demo", port="5000"),),
        listener_port=port,
        listener_protocol=TCP_LISTENER,
        proxy_protocol_from_client=from_client,
        proxy_protocol_to_backend=to_backend,
    )


def view_of(routes: list[Route], *backends: EchoBackend) -> View:
    service = Service(
        namespace="demo",
        name="echo",
        ports=(ServicePort(name="tcp", port=5000, target_port="echo"),),
    )
    endpoints = tuple(
        Endpoint(
            namespace="demo",
            service="echo",
            address="127.0.0.1",
            ports=(EndpointPort(name="echo", port=backend.port),),
        )
        for backend in backends
    )
    return View({r.key: r for r in routes}, {("demo", "echo"): endpoints}, {service.key: service})


@contextlib.asynccontextmanager
async def tcp_services(**kw: Any) -> AsyncIterator[TcpServices]:
    async with running_proxy() as (server, _):
        services = TcpServices(
            server,
            "127.0.0.1",
            defaults=Defaults(connect_timeout=2.0),
            cookie_key=b"k" * 32,
            max_connections=kw.pop("max_connections", 100),
            drain=kw.pop("drain", 1.0),
            **kw,
        )
        try:
            yield services
        finally:
            await services.close(0.5)


def counted(port: int, outcome: str) -> float:
    return TCP_CONNECTIONS.labels(str(port), outcome)._value.get()


async def test_bytes_are_relayed_to_the_service_endpoints():
    async with EchoBackend("a") as backend, tcp_services() as tcp:
        port = free_port()
        tcp.on_view(view_of([tcp_route(port)], backend))
        assert await talk(port, b"hello") == b"a:hello"
        assert backend.firsts == [b"hello"]
        # A large transfer both ways (backpressure through the relay).
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        payload = os.urandom(1 << 20)
        writer.write(payload)
        received = bytearray()
        async with asyncio.timeout(10):
            while len(received) < len(payload) + 2:
                received += await reader.read(1 << 16)
        assert bytes(received) == b"a:" + payload
        writer.close()
        assert [row[0] for row in tcp.sections()[0].rows] == [port]


async def test_proxy_protocol_from_the_client_reaches_the_backend_as_sent_v1_and_v2():
    for version in (1, 2):
        async with EchoBackend("a") as backend, tcp_services(proxy_protocol_version=version) as tcp:
            port = free_port()
            tcp.on_view(view_of([tcp_route(port, from_client=True, to_backend=True)], backend))
            client = proxyproto.Addresses("203.0.113.7", 40000, "198.51.100.1", 5432)
            header = proxyproto.v2(client) if version == 2 else proxyproto.v1(client)
            # The client's header (the other version) is read; the one sent is the setting's.
            sent = proxyproto.v1(client) if version == 2 else proxyproto.v2(client)
            assert await talk(port, b"data", prefix=sent) == b"a:" + header + b"data"
            first = backend.firsts[0]
            parsed = proxyproto.read(first)
            assert parsed.status == proxyproto.OK and parsed.addresses == client
            assert first[parsed.length :] == b"data"


async def test_proxy_protocol_to_the_backend_names_the_real_client():
    async with EchoBackend("a") as backend, tcp_services() as tcp:
        port = free_port()
        tcp.on_view(view_of([tcp_route(port, to_backend=True)], backend))
        answer = await talk(port, b"x")
        parsed = proxyproto.read(answer[2:])
        assert parsed.status == proxyproto.OK
        assert parsed.addresses is not None
        assert parsed.addresses.source == "127.0.0.1"
        assert parsed.addresses.destination_port == port
        assert answer[2 + parsed.length :] == b"x"


async def test_a_client_without_its_proxy_header_is_closed_and_counted():
    async with EchoBackend("a") as backend, tcp_services() as tcp:
        port = free_port()
        tcp.on_view(view_of([tcp_route(port, from_client=True)], backend))
        before = counted(port, "bad_proxy_header")
        assert await talk(port, b"GET / HTTP/1.1\r\n\r\n") == b""
        assert counted(port, "bad_proxy_header") == before + 1
        assert backend.firsts == []


async def test_an_endpoint_change_moves_new_connections():
    async with EchoBackend("a") as one, EchoBackend("b") as two, tcp_services() as tcp:
        port = free_port()
        tcp.on_view(view_of([tcp_route(port)], one))
        assert await talk(port, b"1") == b"a:1"
        tcp.on_view(view_of([tcp_route(port)], two))
        assert await talk(port, b"2") == b"b:2"
        tcp.on_view(view_of([tcp_route(port)]))
        before = counted(port, "no_endpoint")
        assert await talk(port, b"3") == b""
        assert counted(port, "no_endpoint") == before + 1


async def test_least_conn_counts_open_relays():
    async with EchoBackend("a") as one, EchoBackend("b") as two, tcp_services() as tcp:
        port = free_port()
        tcp.on_view(view_of([tcp_route(port)], one, two))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"held")
        first = await reader.read(100)
        # While the first relay is open, new connections go to the other endpoint.
        other = b"b:" if first.startswith(b"a:") else b"a:"
        assert await talk(port, b"x") == other + b"x"
        writer.close()
        await writer.wait_closed()
        entry = tcp.table.lookup(f"tcp-{port}.invalid".encode(), b"/")
        assert entry is not None
        picker = entry.backends[0].picker

        def held() -> int:
            return sum(picker.inflight(t) for t in picker.targets)

        async with asyncio.timeout(5):
            while held():
                await asyncio.sleep(0.02)


async def test_connections_past_the_limit_are_closed():
    async with EchoBackend("a") as backend, tcp_services(max_connections=1) as tcp:
        port = free_port()
        tcp.on_view(view_of([tcp_route(port)], backend))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"held")
        assert await reader.read(100) == b"a:held"
        before = counted(port, "over_limit")
        assert await talk(port, b"more") == b""
        assert counted(port, "over_limit") == before + 1
        writer.close()


async def test_a_removed_port_closes_its_listener_and_drains_its_connections():
    async with EchoBackend("a") as backend, tcp_services(drain=0.5) as tcp:
        port = free_port()
        tcp.on_view(view_of([tcp_route(port)], backend))
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"held")
        assert await reader.read(100) == b"a:held"
        tcp.on_view(view_of([], backend))
        with pytest.raises(OSError):
            await talk(port, b"new")
        # The held connection still works within the bound, then is closed.
        writer.write(b"again")
        assert await reader.read(100) == b"again"
        async with asyncio.timeout(5):
            assert await reader.read(100) == b""
        writer.close()
        assert tcp.ports == {}


async def test_a_port_that_cannot_be_bound_is_reported_and_the_others_served():
    async with EchoBackend("a") as backend, tcp_services() as tcp:
        holder = socket.socket()
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        busy = holder.getsockname()[1]
        free = free_port()
        tcp.on_view(view_of([tcp_route(busy), tcp_route(free)], backend))
        assert await talk(free, b"ok") == b"a:ok"
        assert "in use" in tcp.failed[busy]
        states = {row[0]: row[5]["text"] for row in tcp.sections()[0].rows}
        assert states == {busy: f"port {busy} is in use", free: "listening"}
        holder.close()
        tcp.on_view(view_of([tcp_route(busy), tcp_route(free)], backend))
        assert await talk(busy, b"now") == b"a:now"


async def test_nothing_leaks():
    async with EchoBackend("a") as backend:
        fds, tasks = len(os.listdir("/proc/self/fd")), len(asyncio.all_tasks())
        async with tcp_services(drain=0.2) as tcp:
            port = free_port()
            tcp.on_view(view_of([tcp_route(port, from_client=True, to_backend=True)], backend))
            client = proxyproto.Addresses("192.0.2.1", 1, "192.0.2.2", 2)
            for _ in range(20):
                assert (await talk(port, b"x", prefix=proxyproto.v1(client))).endswith(b"x")
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
            tcp.on_view(view_of([], backend))
            await asyncio.sleep(0.5)
            for _, writer in held:
                writer.close()
        async with asyncio.timeout(5):
            while len(os.listdir("/proc/self/fd")) > fds or len(asyncio.all_tasks()) > tasks:
                await asyncio.sleep(0.05)


async def test_a_proxy_of_one_gateway_serves_no_tcp_services():
    async with EchoBackend("a") as backend, tcp_services(serve=False) as tcp:
        port = free_port()
        tcp.on_view(view_of([tcp_route(port)], backend))
        assert tcp.ports == {} and tcp.sections() == []
        with pytest.raises(OSError):
            await talk(port, b"x")
