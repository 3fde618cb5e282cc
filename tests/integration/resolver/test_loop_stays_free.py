"""A large routes file never stalls the event loop: other RPCs are answered meanwhile.

Reading, parsing and writing the file run in a worker thread. To make the
order of completion certain (not a race against the file's size), the parse
is held at a gate until the concurrent cheap RPC has been answered: were the
parse on the event loop, that RPC could not be answered before it, and the
order below would be reversed.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest

from tests.integration.resolver.conftest import start_resolver
from tests.support.poll import until as eventually
from waygate.resolver import filesource
from waygate.resolver.v1 import resolver_pb2 as pb

SERVICES, ENDPOINTS = 300, 10


def big_routes_file() -> str:
    lines = ["services:"]
    for s in range(SERVICES):
        lines += [
            "  - namespace: bulk",
            f"    name: svc-{s}",
            "    ports: [{name: http, port: 80, targetPort: 8080}]",
            "    endpoints:",
        ]
        lines += [f"      - address: 10.{s // 250}.{s % 250}.{e + 1}" for e in range(ENDPOINTS)]
    lines += ["routes:", "  - {namespace: bulk, name: r0, host: r0.example.com, to: svc-0}"]
    return "\n".join(lines) + "\n"


class ParseGate:
    """Holds every parse of the routes file until released (never longer than 5 s)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        real = filesource.parse_routes_file

        def gated(path: Path, text: str, **options: int) -> filesource.FileContent:
            self.entered.set()
            self.release.wait(5)
            return real(path, text, **options)

        monkeypatch.setattr(filesource, "parse_routes_file", gated)


async def test_resolve_is_answered_while_apply_route_works_on_a_big_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle, server, channel = await start_resolver(tmp_path, routes=big_routes_file())
    try:
        gate = ParseGate(monkeypatch)
        finished: list[str] = []

        async def apply() -> None:
            route = pb.Route(
                namespace="bulk",
                name="new",
                host="new.example.com",
                backends=[pb.RouteBackend(service="svc-1", weight=100)],
            )
            await handle.stub.ApplyRoute(pb.ApplyRouteRequest(route=route), timeout=30)
            finished.append("ApplyRoute")

        applying = asyncio.create_task(apply())
        await eventually(gate.entered.is_set)
        resolved = await handle.stub.Resolve(
            pb.ResolveRequest(namespace="bulk", name="svc-7"), timeout=10
        )
        finished.append("Resolve")
        gate.release.set()
        await applying
        assert finished == ["Resolve", "ApplyRoute"]
        assert len(resolved.targets) == ENDPOINTS
        assert handle.store.get_route("bulk", "new") is not None
    finally:
        gate.release.set()
        await channel.close()
        await server.stop(0)


async def test_the_reload_poll_parses_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handle, server, channel = await start_resolver(tmp_path, routes=big_routes_file())
    file = handle.file
    assert file is not None
    file.poll_interval = 0.02
    polling = asyncio.create_task(file.run())
    try:
        gate = ParseGate(monkeypatch)
        file.path.write_text(big_routes_file().replace("name: svc-7\n", "name: svc-seven\n"))
        await eventually(gate.entered.is_set)
        resolved = await handle.stub.Resolve(
            pb.ResolveRequest(namespace="bulk", name="svc-7"), timeout=10
        )
        assert len(resolved.targets) == ENDPOINTS, "answered from the last applied state"
        gate.release.set()
        await eventually(lambda: handle.store.get_service("bulk", "svc-seven") is not None)
        assert handle.store.get_service("bulk", "svc-7") is None
    finally:
        gate.release.set()
        polling.cancel()
        await asyncio.gather(polling, return_exceptions=True)
        await channel.close()
        await server.stop(0)
