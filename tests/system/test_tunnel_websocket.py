"""A WebSocket session through the proxy and the tunnel, as separate processes.

resolver (a route to a service whose only endpoint is on edge node `edge-9`,
marked `tunnel`) + tunnel server (reporting presence) + agent + proxy: the
client speaks WebSocket to the proxy, the upgrade and every frame after it go
proxy -> tunnel server -> agent -> a websockets backend. Plaintext on loopback
(development mode) keeps this about the upgrade; the mTLS identities are
covered by test_tunnel_processes.py and test_tunnel_up.py.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import websockets
import yaml

from tests.support.processes import RunningService, start_service

pytestmark = pytest.mark.system


def routes(backend_port: int) -> dict:
    return {
        "services": [
            {
                "namespace": "ws",
                "name": "echo",
                "ports": [{"name": "http", "port": 80, "targetPort": backend_port}],
                "endpoints": [{"address": "127.0.0.1", "nodeName": "edge-9", "tunnel": True}],
            }
        ],
        "routes": [
            {"namespace": "ws", "name": "echo", "host": "ws.localtest.me", "to": "echo",
             "targetPort": "http"}
        ],
    }  # fmt: skip


async def test_websocket_session_through_proxy_and_tunnel(tmp_path: Path) -> None:
    async def echo(websocket: websockets.ServerConnection) -> None:
        async for message in websocket:
            await websocket.send(f"echo:{message}")

    services: list[RunningService] = []
    async with websockets.serve(echo, "127.0.0.1", 0) as backend:
        backend_port = backend.sockets[0].getsockname()[1]
        routes_file = tmp_path / "routes.yaml"
        routes_file.write_text(yaml.safe_dump(routes(backend_port)))
        routes_file.chmod(0o600)
        try:
            resolver = await start_service(
                ["waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
                 "--routes-file", str(routes_file)]
            )  # fmt: skip
            services.append(resolver)
            server = await start_service(
                ["waygate", "tunnel", "serve", "--grpc-port", "0", "--dial-port", "0", "--data-port", "0",
                 "--front-port", "0", "--admin-port", "0", "--server-id", "replica-a",
                 "--resolver-address", resolver.grpc_address, "--presence-lease", "5s"]
            )  # fmt: skip
            services.append(server)
            agent = await start_service(
                ["waygate", "tunnel", "agent", "--admin-port", "0", "--node", "edge-9",
                 "--allow", f"127.0.0.1/32:{backend_port}",
                 "--server-address", f"127.0.0.1:{server.grpc_ports[0]}"]
            )  # fmt: skip
            services.append(agent)
            proxy = await start_service(
                ["waygate", "proxy", "serve", "--http-port", "0", "--https-port", "0",
                 "--admin-port", "0", "--resolver-address", resolver.grpc_address]
            )  # fmt: skip
            services.append(proxy)
            http_port = next(
                e["http_port"]
                for e in proxy.logs
                if e.get("msg") == "proxy listening" and "http_port" in e
            )
            async with asyncio.timeout(30):
                while True:  # until the proxy's view holds the route and the presence
                    try:
                        # Host: ws.localtest.me, the connection to the proxy's port.
                        session = await websockets.connect(
                            "ws://ws.localtest.me/chat", host="127.0.0.1", port=http_port
                        )
                        break
                    except (websockets.InvalidStatus, OSError):
                        await asyncio.sleep(0.3)
            async with session:
                for i in range(20):
                    await session.send(f"message {i}")
                    assert await asyncio.wait_for(session.recv(), 10) == f"echo:message {i}"
        finally:
            for service in reversed(services):
                await service.stop()
