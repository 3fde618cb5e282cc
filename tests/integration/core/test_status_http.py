"""The status page over real sockets: an admin port serves / and /status.json,
and `waygate up`'s gathered page reads other admin ports, naming the one that
does not answer instead of failing."""

from __future__ import annotations

import asyncio
import json
import socket

from tests.support.processes import http_get
from waygate.core.admin import AdminServer, Readiness
from waygate.core.statuspage import GatheredStatus, Section, StatusPage, cell


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def serve(page: StatusPage) -> AdminServer:
    readiness = Readiness()
    readiness.set_ready()
    server = AdminServer(readiness, status=page)
    await server.start("127.0.0.1", 0)
    return server


async def test_an_admin_port_serves_the_page_and_its_json():
    page = StatusPage("resolver", lambda: (True, "ready"))
    page.add("routes", lambda: [Section("Routes", ["route"], [[cell("demo/echo", "ok")]])])
    server = await serve(page)
    try:
        status, body = await http_get(server.port, "/")
        assert status == 200 and body.startswith("<!doctype html>")
        status, body = await http_get(server.port, "/status.json?now")
        assert status == 200
        document = json.loads(body)
        (service,) = document["services"]
        assert service["service"] == "resolver" and service["ready"] is True
        assert service["sections"][0]["rows"] == [[{"text": "demo/echo", "state": "ok"}]]
        # The probes are where they were.
        assert await http_get(server.port, "/readyz") == (200, "ready\n")
    finally:
        await server.stop()


async def test_without_a_page_the_paths_are_not_found():
    server = AdminServer(Readiness())
    await server.start("127.0.0.1", 0)
    try:
        assert (await http_get(server.port, "/status.json"))[0] == 404
    finally:
        await server.stop()


async def test_the_gathered_page_reads_every_admin_port_and_names_a_silent_one():
    proxy = StatusPage("proxy")
    proxy.add("routes", lambda: [Section("Routes", ["route"], [["demo/echo"]])])
    server = await serve(proxy)
    dead = free_port()
    gathered = GatheredStatus(
        "Waygate (waygate up)",
        [("proxy", "127.0.0.1", server.port), ("certs", "127.0.0.1", dead)],
        timeout=5,
    )
    front = await serve(gathered)  # type: ignore[arg-type]
    try:
        status, body = await http_get(front.port, "/status.json")
        assert status == 200
        first, second = json.loads(body)["services"]
        assert first["service"] == "proxy"
        assert first["address"] == f"admin http://127.0.0.1:{server.port}/"
        assert first["sections"][0]["rows"] == [["demo/echo"]]
        assert second["service"] == "certs" and second["error"].startswith("no status: ")
        assert (await http_get(front.port, "/"))[0] == 200
    finally:
        await asyncio.gather(front.stop(), server.stop())
