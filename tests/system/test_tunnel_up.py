"""`waygate up` serves demo/hello through proxy -> tunnel server -> agent -> demo backend.

The example route's endpoint is on node `edge-local` and marked `tunnel`, so the
proxy has no way to it but the tunnel. Ports are offset (as in test_up.py); the
routes file `up` would copy from the example is seeded first with the demo
backend's offset port, and the agent allows exactly that port.
"""

from __future__ import annotations

import asyncio
import random
import signal
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.processes import ROOT, child_env
from waygate.resolver.filesource import EXAMPLE_ROUTES
from waygate.supervisor import DEMO_PORT

pytestmark = pytest.mark.system


async def test_up_serves_the_edge_route_through_the_tunnel(tmp_path: Path) -> None:
    offset = random.randrange(10000, 22900, 100)
    state = tmp_path / "state"
    state.mkdir()
    routes = yaml.safe_load(EXAMPLE_ROUTES.read_text())
    hello = next(s for s in routes["services"] if s["name"] == "hello")
    assert hello["endpoints"][0]["tunnel"] is True
    assert hello["endpoints"][0]["nodeName"] == "edge-local"
    hello["ports"][0]["targetPort"] = DEMO_PORT + offset
    (state / "routes.yaml").write_text(yaml.safe_dump(routes))
    (state / "routes.yaml").chmod(0o600)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "waygate", "up", "--port-offset", str(offset),
        "--state-dir", str(state), cwd=ROOT, env=child_env(),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        status, body = 0, b""
        async with asyncio.timeout(90):
            while status != 200:
                await asyncio.sleep(0.5)
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", 8080 + offset)
                except OSError:
                    continue
                writer.write(b"GET /through-the-tunnel HTTP/1.1\r\nHost: hello.localtest.me\r\n"
                             b"Connection: close\r\n\r\n")  # fmt: skip
                data = await reader.read()
                writer.close()
                head, _, body = data.partition(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
        assert b'"path": "/through-the-tunnel"' in body
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()
