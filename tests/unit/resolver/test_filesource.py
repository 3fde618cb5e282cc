"""The YAML file source: parsing, reload on change, bad edits rejected with their line."""

from __future__ import annotations

import dataclasses
import os
import textwrap
from pathlib import Path

import pytest

from tests.support.pki import self_signed
from waygate.core.errors import FailedPrecondition, InvalidArgument, NotFound
from waygate.resolver.filesource import EXAMPLE_ROUTES, FileError, FileSource, parse_routes_file
from waygate.resolver.model import (
    BalancePolicy,
    Route,
    RouteBackend,
    RouteTimeouts,
    RouteTLS,
    TLSTermination,
)
from waygate.resolver.store import Store

GOOD = textwrap.dedent(
    """\
    services:
      - namespace: shop
        name: web
        ports:
          - {name: http, port: 80, targetPort: 8080}
        endpoints:
          - address: 10.1.0.1
          - address: 10.1.0.2
            ready: false
            terminating: true
    routes:
      - namespace: shop
        name: web
        host: Shop.Example.com
        to: web
        timeouts: {connect: 2s, tunnel: 1h}
    """
)


def write(path: Path, text: str) -> None:
    path.write_text(text)
    # Make the change visible to mtime polling even within one clock tick.
    st = path.stat()
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))


@pytest.fixture
def routes_file(tmp_path: Path) -> Path:
    path = tmp_path / "routes.yaml"
    write(path, GOOD)
    return path


def test_parse_builds_services_endpoints_and_routes(routes_file: Path) -> None:
    content = parse_routes_file(routes_file, GOOD)
    (service,) = content.services
    assert service.key == ("shop", "web") and service.ports[0].target_port == "8080"
    assert [e.address for e in content.endpoints] == ["10.1.0.1", "10.1.0.2"]
    assert content.endpoints[0].ports[0].port == 8080, "endpoint ports default to the targets"
    assert content.endpoints[1].terminating and not content.endpoints[1].ready
    (route,) = content.routes
    assert route.host == "shop.example.com", "hosts are lower-cased"
    assert route.backends == (RouteBackend("web", 100),)
    assert route.timeouts == RouteTimeouts(connect=2.0, tunnel=3600.0)


@pytest.mark.parametrize(
    ("text", "line", "reason"),
    [
        ("services:\n  - name: web\n    prots: []\n", 3, "unknown key 'prots'"),
        ("routes:\n  - name: r\n    host: a.example.com\n    path: nope\n    to: web\n", 4, "path"),
        (
            "routes:\n  - name: r\n    host: a.example.com\n    backends: [{service: w, weight: 300}]\n",
            4,
            "backends[0].weight",
        ),
        ("services: [\n", 2, "not valid YAML"),
        ("services:\n  - name: web\n    ports:\n      - {port: true}\n", 4, "whole number"),
        (
            "routes:\n  - {name: r, host: a.example.com, to: w}\n  - {name: r, host: b.example.com, to: w}\n",
            3,
            "already defined on line 2",
        ),
        (
            "routes:\n  - {name: r, host: a.example.com, to: w, tls: {termination: sideways}}\n",
            2,
            "not one of edge",
        ),
        (
            "routes:\n  - {name: r, host: a.example.com, to: w, timeouts: {connect: soon}}\n",
            2,
            "timeouts.connect",
        ),
    ],
)
def test_errors_name_the_line_and_reason(tmp_path: Path, text: str, line: int, reason: str) -> None:
    with pytest.raises(FileError) as info:
        parse_routes_file(tmp_path / "r.yaml", text)
    assert info.value.line == line, str(info.value)
    assert reason in str(info.value)
    assert str(info.value).startswith(f"{tmp_path / 'r.yaml'}:{line}: ")


def test_empty_file_is_an_empty_view(tmp_path: Path) -> None:
    content = parse_routes_file(tmp_path / "r.yaml", "# nothing yet\n")
    assert (content.services, content.endpoints, content.routes) == ((), (), ())


def test_load_and_reload_on_change(routes_file: Path) -> None:
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    assert source.load()
    assert store.get_route("shop", "web") is not None
    assert store.last_sync()[0] == f"file:{routes_file}"
    assert store.last_sync()[1] is not None
    version = store.version
    source.poll()
    assert store.version == version, "an unchanged file changes nothing"
    write(routes_file, GOOD.replace("      - address: 10.1.0.1\n", ""))
    source.poll()
    assert [e.address for e in store.endpoints_of("shop", "web")] == ["10.1.0.2"]
    assert store.version == version + 1


def test_bad_edit_keeps_last_good_state_and_reports_the_line(routes_file: Path) -> None:
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    assert source.load()
    version = store.version
    bad = GOOD.replace("host: Shop.Example.com", "host: shop_example.com")
    write(routes_file, bad)
    source.poll()
    assert store.version == version
    assert store.get_route("shop", "web") is not None
    assert source.last_error is not None
    assert source.last_error.startswith(f"{routes_file}:14: route shop/web: host:")
    synced = store.last_sync()[1]
    source.poll()
    assert store.last_sync()[1] == synced, "a rejected file does not count as fresh"
    write(routes_file, GOOD.replace("to: web", "to: web\n    balance: source"))
    source.poll()
    assert source.last_error is None
    route = store.get_route("shop", "web")
    assert route is not None and route.balance is BalancePolicy.SOURCE


def test_missing_file_is_an_error_that_keeps_state(routes_file: Path) -> None:
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    assert source.load()
    routes_file.unlink()
    source.poll()
    assert source.last_error is not None and "is missing" in source.last_error
    assert store.get_service("shop", "web") is not None


async def test_restoring_the_same_bytes_after_a_deletion_clears_the_error(
    routes_file: Path,
) -> None:
    """The missing file had no digest: the restored identical file was taken for
    "already applied", so the error stayed and every write stayed refused."""
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    assert source.load()
    saved = routes_file.read_bytes()
    routes_file.unlink()
    source.poll()
    assert source.last_error is not None
    routes_file.write_bytes(saved)
    st = routes_file.stat()
    os.utime(routes_file, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    source.poll()
    assert source.last_error is None
    await source.apply_route(
        Route("shop", "api", "api.example.com", backends=(RouteBackend("web"),))
    )
    assert store.get_route("shop", "api") is not None


async def test_apply_route_writes_the_file_and_survives_a_restart(routes_file: Path) -> None:
    cert, key = self_signed("api.example.com")
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    source.load()
    # As an editor or a plain copy may leave it: readable by everyone.
    routes_file.chmod(0o644)
    route = Route(
        "shop",
        "api",
        "API.example.com",
        "/v1",
        (RouteBackend("web", 3), RouteBackend("canary", 1)),
        tls=RouteTLS(TLSTermination.EDGE, cert, key),
        timeouts=RouteTimeouts(server=0.25),
    )
    stored = await source.apply_route(route)
    assert stored.host == "api.example.com"
    assert store.get_route("shop", "api") == stored
    assert routes_file.stat().st_mode & 0o777 == 0o600, "a file holding keys is written 0600"
    # A fresh process reading the same file sees the same routes.
    fresh = Store(initial_version=0)
    FileSource(fresh, routes_file).load()
    assert [_spec(r) for r in fresh.routes()] == [_spec(r) for r in store.routes()]
    await source.delete_route("shop", "api")
    assert store.get_route("shop", "api") is None
    with pytest.raises(NotFound):
        await source.delete_route("shop", "api")


async def test_apply_route_rejects_invalid_routes_without_touching_the_file(
    routes_file: Path,
) -> None:
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    source.load()
    before = routes_file.read_bytes()
    with pytest.raises(InvalidArgument, match="backends"):
        await source.apply_route(Route("shop", "bad", "a.example.com", "/", ()))
    assert routes_file.read_bytes() == before


async def test_routes_of_another_source_are_read_only(routes_file: Path) -> None:
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    source.load()
    store.upsert_route(
        Route("shop", "kube", "k.example.com", "/", (RouteBackend("w"),)), source="kubernetes"
    )
    with pytest.raises(FailedPrecondition, match="kubernetes"):
        await source.apply_route(Route("shop", "kube", "k.example.com", "/", (RouteBackend("w"),)))
    with pytest.raises(FailedPrecondition):
        await source.delete_route("shop", "kube")


async def test_apply_route_refuses_while_the_file_has_an_error(routes_file: Path) -> None:
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    source.load()
    write(routes_file, "routes: [\n")
    with pytest.raises(FailedPrecondition, match="fix it"):
        await source.apply_route(Route("shop", "x", "x.example.com", "/", (RouteBackend("w"),)))
    # Valid YAML, invalid content: still the file's fault, not the new route's.
    write(routes_file, GOOD.replace("host: Shop.Example.com", "host: shop_example.com"))
    before = routes_file.read_bytes()
    with pytest.raises(FailedPrecondition, match="fix it.*:14: route shop/web: host"):
        await source.apply_route(Route("shop", "x", "x.example.com", "/", (RouteBackend("w"),)))
    assert routes_file.read_bytes() == before


async def test_apply_route_parses_the_file_once(
    routes_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Validation of a large file is the expensive part: the text written is
    parsed once and that parse is what the store gets (no reload from disk)."""
    from waygate.resolver import filesource

    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    assert source.load()
    calls = []
    real = filesource.parse_routes_file

    def counting(path: Path, text: str, **options: int) -> filesource.FileContent:
        calls.append(path)
        return real(path, text, **options)

    monkeypatch.setattr(filesource, "parse_routes_file", counting)
    await source.apply_route(Route("shop", "x", "x.example.com", "/", (RouteBackend("web"),)))
    assert len(calls) == 1
    assert store.get_route("shop", "x") is not None
    version = store.version
    source.poll()
    assert len(calls) == 1 and store.version == version, "the written file is already applied"
    await source.delete_route("shop", "x")
    assert len(calls) == 2 and store.get_route("shop", "x") is None


def test_the_shipped_example_file_is_valid() -> None:
    path = EXAMPLE_ROUTES
    content = parse_routes_file(path, path.read_text())
    assert content.routes and content.services
    routes = {r.name: r for r in content.routes}
    endpoints = {e.service: e for e in content.endpoints}
    # A direct demo backend for the proxy, and the tunnelled one on edge-local.
    assert (
        routes["echo"].host == "echo.localtest.me" and routes["echo"].backends[0].service == "echo"
    )
    assert endpoints["echo"].address == "127.0.0.1" and not endpoints["echo"].tunnel
    assert [p.port for p in endpoints["echo"].ports] == [8090]
    assert endpoints["hello"].tunnel and endpoints["hello"].node_name == "edge-local"


def test_an_oversized_file_is_refused_and_state_kept(
    routes_file: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from waygate.resolver import filesource

    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    assert source.load()
    monkeypatch.setattr(filesource, "MAX_FILE_BYTES", 100)
    write(routes_file, GOOD + "# padding\n")
    source.poll()
    assert source.last_error is not None and "larger than" in source.last_error
    assert store.get_route("shop", "web") is not None


async def test_apply_route_refuses_a_file_changed_since_it_was_loaded(routes_file: Path) -> None:
    """Emptied after the last poll: "" parsed as an empty view, and the write
    replaced every service, endpoint and route with the one route applied."""
    store = Store(initial_version=0)
    source = FileSource(store, routes_file)
    assert source.load()
    routes_file.write_text("")
    route = Route("shop", "api", "api.example.com", backends=(RouteBackend("web"),))
    with pytest.raises(FailedPrecondition, match="changed since it was loaded; retry"):
        await source.apply_route(route)
    with pytest.raises(FailedPrecondition, match="changed since it was loaded"):
        await source.delete_route("shop", "web")
    assert routes_file.read_text() == "", "nothing written"
    assert store.get_service("shop", "web") is not None
    assert store.get_route("shop", "web") is not None
    # Once the new content is loaded, writes go to it.
    await source.reload()
    await source.apply_route(route)
    assert [r.name for r in store.routes()] == ["api"]


def _spec(route: Route) -> Route:
    """The route as its source wrote it (status and its times are the store's)."""
    return dataclasses.replace(route, status=None)
