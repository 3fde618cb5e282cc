"""`routes apply` / `routes delete` edit the routes file in place (issue 29, finding 4):
the file's comments, order, quoting and indentation stay, and only the entry of
the route applied or deleted changes. ApplyRoute refuses what the file cannot
hold, ignores the resolver's own fields, and keeps a redacted key."""

from __future__ import annotations

import dataclasses
import difflib
import shutil
from pathlib import Path

import pytest

from tests.support.pki import self_signed
from waygate.core.errors import InvalidArgument
from waygate.resolver.filesource import EXAMPLE_ROUTES, FileSource
from waygate.resolver.model import (
    PathMatchType,
    Route,
    RouteBackend,
    RouteMatch,
    RouteStatus,
    RouteTLS,
    SameSite,
    StickySessions,
    TLSTermination,
)
from waygate.resolver.store import Store


@pytest.fixture
def source(tmp_path: Path) -> FileSource:
    path = tmp_path / "routes.yaml"
    shutil.copyfile(EXAMPLE_ROUTES, path)
    source = FileSource(Store(), path)
    assert source.load()
    return source


def changed_lines(before: str, after: str) -> list[str]:
    return [
        line
        for line in difflib.unified_diff(before.splitlines(), after.splitlines(), lineterm="", n=0)
        if line[:1] in "+-" and not line.startswith(("+++", "---"))
    ]


async def test_apply_changes_only_the_route_it_applies(source: FileSource) -> None:
    before = source.path.read_text()
    hello = source.store.get_route("demo", "hello")
    assert hello is not None
    await source.apply_route(
        dataclasses.replace(hello, sticky=StickySessions(same_site=SameSite.STRICT))
    )
    after = source.path.read_text()
    # Every comment of the example file is still there, and nothing else moved.
    assert [line for line in before.splitlines() if "#" in line] == [
        line for line in after.splitlines() if "#" in line
    ]
    assert changed_lines(before, after) == ["+    sticky:", "+      sameSite: Strict"]
    assert source.load() and source.store.get_route("demo", "hello").sticky.same_site is (
        SameSite.STRICT
    )


async def test_a_new_route_is_appended_in_the_files_style(source: FileSource) -> None:
    before = source.path.read_text()
    await source.apply_route(
        Route("demo", "new", "new.localtest.me", backends=(RouteBackend("echo"),))
    )
    assert changed_lines(before, source.path.read_text()) == [
        "+  - namespace: demo",
        "+    name: new",
        "+    host: new.localtest.me",
        "+    to: echo",
    ]


async def test_delete_removes_only_its_entry(source: FileSource) -> None:
    before = source.path.read_text()
    await source.delete_route("demo", "hello")
    removed = changed_lines(before, source.path.read_text())
    assert all(line.startswith("-") for line in removed)
    assert "-    name: hello" in removed and "-    balance: roundrobin" in removed
    assert not any("#" in line for line in removed), removed


async def test_a_pem_is_written_as_a_literal_block(source: FileSource) -> None:
    cert, key = self_signed("pem.localtest.me")
    await source.apply_route(
        Route(
            "demo",
            "pem",
            "pem.localtest.me",
            backends=(RouteBackend("echo"),),
            tls=RouteTLS(TLSTermination.EDGE, certificate=cert, key=key),
        )
    )
    text = source.path.read_text()
    assert "certificate: |" in text and "-----BEGIN CERTIFICATE-----\n" in text


async def test_apply_keeps_the_stored_key_of_a_redacted_certificate(source: FileSource) -> None:
    cert, key = self_signed("pem.localtest.me")
    route = Route(
        "demo",
        "pem",
        "pem.localtest.me",
        backends=(RouteBackend("echo"),),
        tls=RouteTLS(TLSTermination.EDGE, certificate=cert, key=key),
    )
    await source.apply_route(route)
    # As `routes get -o yaml` shows it: the key redacted, a status, a new path.
    shown = dataclasses.replace(
        route,
        path="/v2",
        tls=dataclasses.replace(route.tls, key=""),  # type: ignore[arg-type]
        status=RouteStatus(),
    )
    stored = await source.apply_route(shown)
    assert stored.path == "/v2" and stored.tls is not None and stored.tls.key == key
    # Another certificate without its key is still refused.
    other, _ = self_signed("other.localtest.me")
    with pytest.raises(InvalidArgument, match="tls.key"):
        await source.apply_route(
            dataclasses.replace(shown, tls=RouteTLS(TLSTermination.EDGE, certificate=other))
        )


async def test_apply_refuses_what_the_routes_file_cannot_hold(source: FileSource) -> None:
    before = source.path.read_text()
    route = Route(
        "demo",
        "m",
        "m.localtest.me",
        backends=(RouteBackend("echo"),),
        matches=(RouteMatch(PathMatchType.EXACT, "/x"),),
    )
    with pytest.raises(InvalidArgument, match="matches: a route of the routes file has no such"):
        await source.apply_route(route)
    with pytest.raises(InvalidArgument, match=r"backends\[0\].namespace"):
        await source.apply_route(
            dataclasses.replace(route, matches=(), backends=(RouteBackend("echo", namespace="x"),))
        )
    assert source.path.read_text() == before
