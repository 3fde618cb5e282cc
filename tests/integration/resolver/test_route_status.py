"""Route status and the routes file's own state, over real gRPC (ListRoutes and Watch)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

from tests.integration.resolver.conftest import Resolver
from tests.support.poll import until as eventually
from waygate.resolver.v1 import resolver_pb2 as pb


def conditions(route: pb.Route) -> dict[str, tuple[str, str, str]]:
    return {c.type: (c.status, c.reason, c.message) for c in route.status.conditions}


async def test_list_routes_carries_conditions_and_the_file_state(resolver: Resolver) -> None:
    await resolver.stub.ApplyRoute(
        pb.ApplyRouteRequest(
            route=pb.Route(
                namespace="mine",
                name="ghost",
                host="ghost.example.com",
                backends=[pb.RouteBackend(service="doesnotexist", weight=1)],
            )
        ),
        timeout=5,
    )
    listed = await resolver.stub.ListRoutes(pb.ListRoutesRequest(), timeout=5)
    by_name = {r.name: r for r in listed.routes}
    assert conditions(by_name["ghost"])["ResolvedRefs"] == (
        "False",
        "ServiceNotFound",
        "service mine/doesnotexist not found",
    )
    assert conditions(by_name["ghost"])["Admitted"][0] == "True"
    assert conditions(by_name["web"])["ResolvedRefs"][:2] == ("True", "ResolvedRefs")
    assert all(c.HasField("last_transition_time") for c in by_name["web"].status.conditions)
    (state,) = listed.sources
    assert resolver.file is not None
    assert state.source == f"file:{resolver.file.path}"
    assert state.valid and not state.last_error
    assert state.loaded_version == resolver.store.version, "the apply wrote and reloaded it"


async def test_a_rejected_edit_is_served_with_path_and_line(resolver: Resolver) -> None:
    assert resolver.file is not None
    path: Path = resolver.file.path
    good = path.read_text()
    loaded = resolver.store.version
    path.write_text(good + "  - namespace: shop\n    name: broken\n")  # no host
    assert not await resolver.file.reload()
    listed = await resolver.stub.ListRoutes(pb.ListRoutesRequest(), timeout=5)
    (state,) = listed.sources
    assert not state.valid
    assert state.last_error.startswith(f"{path}:"), state.last_error
    assert "host" in state.last_error
    assert state.loaded_version == loaded, "still serving the last good content"
    assert [r.name for r in listed.routes] == ["web"]


async def test_watch_carries_status_changes_and_the_file_state(resolver: Resolver) -> None:
    stream = resolver.stub.Watch(pb.WatchRequest(), timeout=10)
    events: AsyncIterator[pb.WatchEvent] = stream.__aiter__()
    first = await anext(events)
    assert first.HasField("snapshot") and not first.snapshot.more
    (web,) = first.snapshot.routes
    assert conditions(web)["ResolvedRefs"][0] == "True"
    assert [s.valid for s in first.sources] == [True]
    # No ready endpoint left: the route is republished with its new status.
    assert resolver.file is not None
    path = resolver.file.path
    text = path.read_text()
    for node in ("node-a", "edge-1"):
        assert f"nodeName: {node}\n" in text
        text = text.replace(f"nodeName: {node}\n", f"nodeName: {node}\n        ready: false\n")
    path.write_text(text)
    assert await resolver.file.reload(), resolver.file.last_error
    routes: list[pb.Route] = []

    async def collect() -> None:
        async for event in events:
            changes = event.changes.changes
            routes.extend(c.route_upserted for c in changes if c.HasField("route_upserted"))
            if routes:
                return

    await asyncio.wait_for(collect(), 5)
    assert conditions(routes[-1])["ResolvedRefs"] == (
        "False",
        "NoReadyEndpoints",
        "service shop/web has no ready endpoints",
    )
    stream.cancel()
    await eventually(lambda: stream.done())
