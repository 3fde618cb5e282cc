"""The README's example through `waygate up`: a request to the proxy reaches the demo backend.

Real processes: `waygate up` (certs, resolver, proxy, ..., the demo backend)
on a port offset. `curl -H 'Host: echo.localtest.me' http://127.0.0.1:8080/`
is made here with a raw socket: the proxy, fed over mTLS by the resolver from
the example routes file, forwards it to the demo backend, which answers with
what it received. Also: demo/hello reaches the same backend through up's
tunnel (server and agent), up's Gateway (gateway.localtest.me) reaches it through
an HTTPRoute, a tunnel endpoint on a node no agent holds answers 502 with the
reason, a host without a route answers 404 saying so (the HTTP port serves a
Gateway listener), and
SIGTERM leaves no child behind.
"""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import pytest
import yaml

from tests.support.poll import until
from waygate.components import COMPONENTS

from .test_up import Up, alive, children_of

pytestmark = pytest.mark.system

PROXY = next(c for c in COMPONENTS if c.name == "proxy")


async def get(port: int, host: str, *headers: str) -> tuple[int, dict[str, str], bytes]:
    """GET / with this Host (and extra header lines) over a fresh connection."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        extra = "".join(f"{line}\r\n" for line in headers)
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n{extra}Connection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    fields = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
    return int(lines[0].split()[1]), {k.lower(): v for k, v in fields.items()}, body


@pytest.fixture
async def up(tmp_path: Path):
    if not PROXY.implemented:
        pytest.fail("the proxy is not implemented: services/proxy/app.py is missing")
    instance = Up(tmp_path)
    yield instance
    if instance.process is not None and instance.process.returncode is None:
        instance.process.kill()
        await instance.process.wait()


async def test_the_readme_example_reaches_the_demo_backend_through_the_proxy(up: Up) -> None:
    await up.start()
    proxy_port = PROXY.port("http_port") + up.offset
    answers: list[tuple[int, dict[str, str], bytes]] = []

    async def echo_route_served() -> bool:
        answers.append(await get(proxy_port, "echo.localtest.me", "X-Remote-User: admin"))
        return answers[-1][0] == 200

    # The proxy is ready once it has the resolver's first snapshot; allow for a
    # slow machine all the same.
    async with asyncio.timeout(30):
        while not await echo_route_served():
            await asyncio.sleep(0.2)
    status, headers, body = answers[-1]
    assert headers["content-type"] == "application/json"
    echoed = json.loads(body)
    assert echoed["method"] == "GET" and echoed["path"] == "/"
    received = {
        line.split(": ", 1)[0].lower(): line.split(": ", 1)[1] for line in echoed["headers"]
    }
    assert received["host"] == "echo.localtest.me"
    assert received["x-forwarded-for"] == "127.0.0.1"
    # Client-sent identity headers never reach a backend.
    assert "x-remote-user" not in received

    # demo/hello lives behind the tunnel (node edge-local, held by up's agent): the
    # same demo backend answers once the agent's presence has reached the proxy.
    async with asyncio.timeout(30):
        while (hello := await get(proxy_port, "hello.localtest.me"))[0] != 200:
            await asyncio.sleep(0.2)
    assert json.loads(hello[2])["headers"][0] == "Host: hello.localtest.me"
    # up's manifests (gateway.yaml beside the routes file) put a Gateway listener on
    # the HTTP port: its HTTPRoute reaches the same demo backend, with its filter.
    async with asyncio.timeout(30):
        while (gateway := await get(proxy_port, "gateway.localtest.me"))[0] != 200:
            await asyncio.sleep(0.2)
    assert "X-Waygate-Gateway: demo/demo" in json.loads(gateway[2])["headers"]
    # A host no route takes: a Gateway listener's answer (404, the spec), saying why.
    status, _, body = await get(proxy_port, "nothing-here.localtest.me")
    assert status == 404 and b"nothing-here.localtest.me" in body

    # A tunnel endpoint on a node no agent holds answers 502 with the reason. The
    # route is added by editing up's routes file, which the resolver reloads.
    routes_file = up.state_dir / "routes.yaml"
    routes = yaml.safe_load(routes_file.read_text())
    routes["services"].append(
        {
            "namespace": "demo",
            "name": "offline",
            "ports": [{"name": "http", "port": 80, "targetPort": 8090}],
            "endpoints": [{"address": "127.0.0.1", "nodeName": "edge-gone", "tunnel": True}],
        }
    )
    routes["routes"].append(
        {"namespace": "demo", "name": "offline", "host": "offline.localtest.me",
         "to": "offline", "targetPort": "http"}
    )  # fmt: skip
    routes_file.write_text(yaml.safe_dump(routes))
    async with asyncio.timeout(30):
        # 404 until the reloaded route reaches the proxy (no route yet).
        while (offline := await get(proxy_port, "offline.localtest.me"))[0] == 404:
            await asyncio.sleep(0.2)
    status, headers, body = offline
    assert status == 502, (status, body)
    assert "edge-gone" in headers["x-waygate-error"] and b"edge-gone" in body

    # The proxy watches the resolver of this `up`, with a certificate from its certs.
    assert up.process is not None
    children = children_of(up.process.pid)
    proxy_command = next(
        Path(f"/proc/{pid}/cmdline").read_text().split("\x00")
        for pid in children
        if "\x00proxy\x00serve\x00" in Path(f"/proc/{pid}/cmdline").read_text()
    )
    resolver_port = next(c for c in COMPONENTS if c.name == "resolver").port("grpc_port")
    flag = proxy_command.index("--resolver-address")
    assert proxy_command[flag + 1] == f"127.0.0.1:{resolver_port + up.offset}"
    assert "--certs-address" in proxy_command

    up.process.send_signal(signal.SIGTERM)
    await up.wait_for_line("waygate up: stopped", timeout=60)
    assert await asyncio.wait_for(up.process.wait(), 30) == 0
    await until(lambda: not [pid for pid in children if alive(pid)], "every child gone", timeout=10)
