"""ingress-nginx's TCP services through a real resolver (--manifests --ingress-nginx
--tcp-services-configmap) and a real proxy process.

The ConfigMap's entries (ingress-nginx's docs/user-guide/exposing-tcp-udp-services.md
format) become ports of the proxy: a TCP echo backend without and with the PROXY
protocol both sides, an HTTP backend relayed as bytes, a bad entry refused alone
(shown by `waygate check`, every other entry served), an entry removed (its port
closed).
"""

from __future__ import annotations

import asyncio
import json
import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio
import yaml

from tests.support.gatewayapi import INFRA, Conformance, local_slice
from tests.support.poll import until
from tests.support.processes import http_get, run_cli
from tests.support.tcpecho import EchoBackend, talk
from waygate.proxy import proxyproto

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Conformance]:
    conformance = Conformance(
        tmp_path_factory.mktemp("manifests"),
        resolver_args=("--ingress-nginx", "--tcp-services-configmap", "ingress-nginx/tcp"),
    )
    await conformance.start()
    try:
        yield conformance
    finally:
        await conformance.stop()


def documents(echo_port: int, entries: dict[str, str]) -> str:
    service: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "tcp-echo", "namespace": INFRA},
        "spec": {"ports": [{"name": "echo", "port": 5000, "targetPort": echo_port}]},
    }
    configmap = {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": "tcp", "namespace": "ingress-nginx"},
        "data": entries,
    }
    return yaml.safe_dump_all([service, local_slice(service, echo_port), configmap])


async def connects(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except OSError:
        return False
    writer.close()
    return True


async def test_configmap_entries_are_served_as_tcp_ports(suite: Conformance) -> None:
    plain, proxied, http, bad = (free_port() for _ in range(4))
    async with EchoBackend("echo") as echo:
        entries = {
            str(plain): f"{INFRA}/tcp-echo:5000",
            str(proxied): f"{INFRA}/tcp-echo:echo:PROXY:PROXY",
            str(http): f"{INFRA}/infra-backend-v1:8080",
            str(bad): f"{INFRA}/tcp-echo:5000;proxy_pass evil",
        }
        await suite.apply(extra=documents(echo.port, entries))

        async def served() -> bool:
            try:
                return await talk(plain, b"hi") == b"echo:hi"
            except OSError:
                return False

        await until(served, "the proxy to serve the TCP service port", timeout=20)

        # PROXY from the client: its addresses are what the backend is told (v1 sent).
        client = proxyproto.Addresses("203.0.113.9", 41000, "198.51.100.1", proxied)
        answer = await talk(proxied, b"x", prefix=proxyproto.v2(client))
        assert answer == b"echo:" + proxyproto.v1(client) + b"x"

        # An HTTP backend, as bytes.
        reader, writer = await asyncio.open_connection("127.0.0.1", http)
        writer.write(b"GET /tcp HTTP/1.1\r\nHost: tcp.example.com\r\nConnection: close\r\n\r\n")
        response = b""
        async with asyncio.timeout(10):
            while b"infra-backend-v1" not in response:
                piece = await reader.read(65536)
                assert piece, response
                response += piece
        writer.close()
        assert response.startswith(b"HTTP/1.1 200")
        assert b"infra-backend-v1" in response

        # The bad entry is refused alone, with the reason, and `waygate check` says so.
        assert not await connects(bad)
        assert suite.resolver is not None
        code, out, _ = await run_cli("check", "--resolver", suite.resolver.grpc_address)
        assert code != 0, out
        assert "InvalidTCPService" in out and f"'{bad}'" in out
        assert f"TCP service port {plain}: {INFRA}/tcp-echo:echo" in out

        # The proxy's status page: per port its service, endpoints, connections, state;
        # its metrics per port.
        assert suite.proxy is not None
        code, body = await http_get(suite.proxy.admin_port, "/status.json")
        assert code == 200
        sections = [s for entry in json.loads(body)["services"] for s in entry["sections"]]
        [section] = [s for s in sections if s["title"] == "TCP services"]
        rows = {row[0]: row for row in section["rows"]}
        assert set(rows) == {plain, proxied, http}
        assert rows[plain][1] == f"{INFRA}/tcp-echo:echo"
        assert rows[plain][2]["text"] == 1 and rows[plain][5]["text"] == "listening"
        assert rows[proxied][4] == "from client/to backend"
        code, text = await http_get(suite.proxy.admin_port, "/metrics")
        assert f'waygate_proxy_tcp_connections_total{{outcome="relayed",port="{plain}"}}' in text
        assert f'waygate_proxy_tcp_service_up{{port="{proxied}"}} 1.0' in text

        # An entry removed: its port is closed, the others go on.
        del entries[str(plain)]
        await suite.apply(extra=documents(echo.port, entries))

        async def closed() -> bool:
            return not await connects(plain)

        await until(closed, "the removed TCP service port to close", timeout=20)
        assert (await talk(proxied, b"y", prefix=proxyproto.v1(client))).endswith(b"y")
        await suite.apply()
