"""`waygate proxy serve --workers 2 --https-port 0`: both workers serve HTTPS on one
port (the parent reserves it, as it does the HTTP port), with the default
certificate from files; real processes, real TLS."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import pytest

from tests.support.pki import LocalCA
from tests.support.proxyharness import RecordingUpstream, read_response

from .test_proxy_system import start_proxy, start_resolver, wait_ready

pytestmark = pytest.mark.system

ROUTES = """
services:
  - namespace: demo
    name: echo
    ports:
      - {{name: http, port: 80, targetPort: {port}}}
    endpoints:
      - address: 127.0.0.1
routes:
  - namespace: demo
    name: echo
    host: echo.test
    to: echo
    targetPort: http
    tls:
      termination: edge
      insecureEdgeTerminationPolicy: Redirect
"""


async def https_get(port: int, ca: bytes) -> bytes:
    context = ssl.create_default_context(cadata=ca.decode())
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="echo.test"
    )
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: echo.test\r\n\r\n")
        return await read_response(reader, timeout=10)
    finally:
        writer.close()


async def test_two_workers_serve_https_on_one_port(tmp_path: Path) -> None:
    ca = LocalCA()
    files = ca.write_files(tmp_path / "tls", dns=["echo.test"])
    upstream = await RecordingUpstream().start()
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(ROUTES.format(port=upstream.port))
    resolver = await start_resolver(routes_file)
    proxy, _ = await start_proxy(
        resolver.grpc_address,
        "--workers",
        "2",
        "--https-port",
        "0",
        "--default-certificate",
        str(files.cert),
        "--default-key",
        str(files.key),
    )
    try:
        await wait_ready(proxy)
        listening = [e["https_port"] for e in proxy.logs if "https_port" in e]
        assert len(listening) == 2 and len(set(listening)) == 1, listening  # the reserved port
        port = listening[0]
        responses = await asyncio.gather(*(https_get(port, ca.pem) for _ in range(30)))
        assert all(r.startswith(b"HTTP/1.1 200 ") for r in responses)
        assert await proxy.stop() == 0
    finally:
        with contextlib.suppress(Exception):
            await proxy.stop()
        await resolver.stop()
        await upstream.stop()
