"""Admin ports against DNS rebinding (issue 31, finding 10): a page that points its own
name at 127.0.0.1 (or a pod IP) makes the browser send that name as Host; the admin
port answers only IP literals, localhost and the names it was given, so the page reads
nothing, while kubelet's probes (Host: the pod IP) and the status page keep working."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from waygate.core.admin import AdminServer, Readiness
from waygate.core.statuspage import Section, StatusPage, cell


@pytest_asyncio.fixture
async def admin() -> AsyncIterator[AdminServer]:
    readiness = Readiness()
    readiness.set_ready()
    page = StatusPage("resolver", lambda: (True, "ready"))
    page.add("routes", lambda: [Section("Routes", ["route"], [[cell("demo/secret", "ok")]])])
    server = AdminServer(readiness, status=page, allowed_hosts=("waygate-proxy.infra.svc",))
    await server.start("127.0.0.1", 0)
    try:
        yield server
    finally:
        await server.stop()


async def get(port: int, path: str, *host_lines: str) -> tuple[int, bytes]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        head = f"GET {path} HTTP/1.1\r\n" + "".join(f"{line}\r\n" for line in host_lines)
        writer.write((head + "\r\n").encode())
        data = await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()
    status_line, _, rest = data.partition(b"\r\n")
    return int(status_line.split(b" ")[1]), rest.partition(b"\r\n\r\n")[2]


@pytest.mark.parametrize(
    "host",
    [
        "rebind.attacker.example",
        "rebind.attacker.example:9004",
        "localhost.attacker.example",
        "127.0.0.1.nip.io:9004",
    ],
)
@pytest.mark.parametrize("path", ["/status.json", "/", "/metrics", "/readyz"])
async def test_a_rebound_name_reads_nothing(admin: AdminServer, host: str, path: str) -> None:
    status, body = await get(admin.port, path, f"Host: {host}")
    assert status == 421
    assert b"demo/secret" not in body and b"DNS rebinding" in body


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.0.0.1:9004",
        "10.244.1.17:9004",  # kubelet's probe: the pod IP
        "[::1]:9004",
        "[fd00::17]",
        "localhost:9004",
        "LOCALHOST.",
        "waygate-proxy.infra.svc:9004",  # a configured name (--admin-hosts)
    ],
)
async def test_ip_literals_localhost_and_configured_names_are_answered(
    admin: AdminServer, host: str
) -> None:
    status, body = await get(admin.port, "/status.json", f"Host: {host}")
    assert status == 200 and json.loads(body)["services"]
    assert (await get(admin.port, "/healthz", f"Host: {host}"))[0] == 200


async def test_no_host_is_answered_and_two_are_refused(admin: AdminServer) -> None:
    assert (await get(admin.port, "/healthz"))[0] == 200
    status, _ = await get(admin.port, "/healthz", "Host: 127.0.0.1", "host: evil.example")
    assert status == 400
