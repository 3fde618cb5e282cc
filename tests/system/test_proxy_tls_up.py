"""The README's HTTPS example through `waygate up`: the echo-tls edge route on 8443.

Real processes on a port offset: the proxy's default certificate comes from
this `up`'s certs (its names include echo-tls.localtest.me), the route comes
from the example routes file over the resolver's Watch. Made here with the
ssl module exactly as the README's curl does it:

    curl --cacert .waygate/ca.pem --resolve echo-tls.localtest.me:8443:127.0.0.1 \\
        https://echo-tls.localtest.me:8443/

and plain HTTP to the same host answers 302 to https (the route's Redirect).
"""

from __future__ import annotations

import asyncio
import json
import ssl
from pathlib import Path

import pytest

from waygate.components import COMPONENTS

from .test_up import Up
from .test_up_proxy import get

pytestmark = pytest.mark.system

PROXY = next(c for c in COMPONENTS if c.name == "proxy")
HOST = "echo-tls.localtest.me"


async def https_get(port: int, ca: Path) -> tuple[bytes, str]:
    context = ssl.create_default_context(cafile=str(ca))
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=context, server_hostname=HOST), 10
    )
    try:
        writer.write(f"GET /x HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), 10)
        version = writer.get_extra_info("ssl_object").version()
    finally:
        writer.close()
    return data, version


@pytest.fixture
async def up(tmp_path: Path):
    instance = Up(tmp_path)
    yield instance
    if instance.process is not None and instance.process.returncode is None:
        instance.process.kill()
        await instance.process.wait()


async def test_up_serves_the_echo_tls_edge_route_with_a_certificate_from_certs(up: Up) -> None:
    await up.start()
    https_port = PROXY.port("https_port") + up.offset
    http_port = PROXY.port("http_port") + up.offset
    ca = up.state_dir / "ca.pem"
    last: object = None
    async with asyncio.timeout(60):
        while True:
            try:
                data, version = await https_get(https_port, ca)
                if data.startswith(b"HTTP/1.1 200"):
                    break
                last = data[:200]
            except (OSError, ssl.SSLError, TimeoutError) as exc:
                last = exc
            await asyncio.sleep(0.3)
    assert version in ("TLSv1.2", "TLSv1.3"), last
    echoed = json.loads(data.partition(b"\r\n\r\n")[2])
    assert echoed["path"] == "/x"
    headers = {line.split(": ", 1)[0].lower(): line.split(": ", 1)[1] for line in echoed["headers"]}
    assert headers["host"] == HOST
    assert headers["x-forwarded-proto"] == "https"
    # Plain HTTP to the same route: 302 to https (insecureEdgeTerminationPolicy: Redirect).
    status, fields, _ = await get(http_port, HOST)
    assert status == 302
    assert fields["location"] == f"https://{HOST}:{https_port}/"
