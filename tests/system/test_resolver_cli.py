"""`waygate resolver serve` as a real process, driven by `waygate resolve` / `waygate routes`:
the routes file's state first (exit 1 while it is rejected), conditions in the STATUS
column, -o json/yaml, and routes get/apply -f/delete over ApplyRoute/DeleteRoute."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.processes import (
    ROOT,
    RunningService,
    child_env,
    http_get,
    resolver_serve_argv,
    run_cli,
    start_service,
)
from waygate.resolver.filesource import EXAMPLE_ROUTES, parse_routes_file

EXAMPLE = parse_routes_file(EXAMPLE_ROUTES, EXAMPLE_ROUTES.read_text())

pytestmark = pytest.mark.system


@pytest.fixture
async def resolver(tmp_path: Path):  # type: ignore[no-untyped-def]
    routes = tmp_path / "routes.yaml"
    shutil.copyfile(EXAMPLE_ROUTES, routes)
    # No heartbeats: what a watcher hears comes with a change or not at all.
    service = await start_service(resolver_serve_argv(routes, "--watch-heartbeat", "0"))
    try:
        yield service, routes
    finally:
        assert await service.stop() == 0


def cli(service: RunningService, *args: str) -> tuple[str, ...]:
    return (*args, "--addr", service.grpc_address, "--plaintext")


async def test_resolve_prints_endpoints_and_exit_codes(
    resolver: tuple[RunningService, Path],
) -> None:
    service, _ = resolver
    assert (await http_get(service.admin_port, "/readyz"))[0] == 200
    status, metrics = await http_get(service.admin_port, "/metrics")
    assert status == 200
    assert f'waygate_resolver_objects{{kind="routes"}} {len(EXAMPLE.routes)}.0' in metrics
    assert "waygate_resolver_routes_file_valid 1.0" in metrics
    code, out, err = await run_cli(*cli(service, "resolve", "demo/hello:http"))
    assert code == 0, err
    assert "service demo/hello (ClusterIP)" in out
    assert "127.0.0.1  8090  edge-local  edge  yes" in out
    code, out, err = await run_cli(*cli(service, "resolve", "demo/draining"))
    assert (code, out) == (3, "")
    assert err.strip() == "waygate: no endpoints available for service demo/draining"
    code, _, err = await run_cli(*cli(service, "resolve", "demo/upstream"))
    assert code == 1 and "FAILED_PRECONDITION" in err and "Traceback" not in err
    code, _, err = await run_cli(*cli(service, "resolve", "demo/missing"))
    assert code == 1 and "NOT_FOUND: service demo/missing not found" in err
    code, _, err = await run_cli(*cli(service, "resolve", "not-a-reference"))
    assert code == 2 and "NS/NAME" in err


async def test_routes_lists_and_watch_follows_file_edits(
    resolver: tuple[RunningService, Path],
) -> None:
    service, routes = resolver
    code, out, err = await run_cli(*cli(service, "routes"))
    assert code == 0, err
    assert "hello-tls.localtest.me" in out and "edge/Redirect" in out
    watcher = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "waygate",
        *cli(service, "routes", "--watch"),
        cwd=ROOT,
        env=child_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert watcher.stdout is not None
        async with asyncio.timeout(20):
            # The routes file's state, "# version ...", the header, and the example's routes.
            count = 3 + len(EXAMPLE.routes)
            lines = [(await watcher.stdout.readline()).decode() for _ in range(count)]
            assert lines[0].startswith(f"routes file {routes}: valid (version ")
            assert lines[1].startswith("# version ")
            assert "hello.localtest.me" in "".join(lines)
            assert "echo.localtest.me" in "".join(lines)
            # An invalid edit is rejected: no route changes, the resolver says why, and
            # the watcher hears of it at once (this resolver sends no heartbeats: it
            # used to show only with the next change or heartbeat, 30 s later).
            text = routes.read_text()
            routes.write_text(text.replace("host: hello.localtest.me", "host: HELLO_.localtest.me"))
            while not any("rejected" in str(e.get("msg")) for e in service.logs):
                await asyncio.sleep(0.05)
            rejected = next(e for e in service.logs if "rejected" in str(e.get("msg")))
            host_line = text.splitlines().index("    host: hello.localtest.me") + 1
            assert rejected["line"] == host_line and "host:" in rejected["reason"]
            shown = (await watcher.stdout.readline()).decode()
            assert shown.startswith(f"routes file {routes}: REJECTED: ") and "host:" in shown
            assert (await watcher.stdout.readline()).startswith(b"  serving the last good")
            routes.write_text(text.replace("host: hello.localtest.me", "host: hi.localtest.me"))
            valid = (await watcher.stdout.readline()).decode()
            assert valid.startswith(f"routes file {routes}: valid (version ")
            change = (await watcher.stdout.readline()).decode()
            assert change.startswith("+ demo/hello  hi.localtest.me/ -> hello")
    finally:
        watcher.terminate()
        await asyncio.wait_for(watcher.wait(), 10)
    code, out, _ = await run_cli(*cli(service, "resolve", "demo/hello"))
    assert code == 0, "the last good state kept serving throughout"


async def test_bad_routes_file_path_is_one_line_and_exit_1(tmp_path: Path) -> None:
    code, _, err = await run_cli(
        "resolver", "serve", "--grpc-port", "0", "--routes-file", str(tmp_path / "missing.yaml")
    )
    assert code == 1
    assert err.strip().endswith("is not a readable file") and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1


def test_up_arguments_copy_the_example_once(tmp_path: Path) -> None:
    from waygate.components import UpContext
    from waygate.resolver.app import up_arguments

    context = UpContext(tmp_path / "state", 0)
    args = up_arguments(context)
    copied = Path(args[1])
    assert args[0] == "--routes-file" and copied.read_bytes() == EXAMPLE_ROUTES.read_bytes()
    # Only the proxy receives route private keys over Watch.
    readers = args[args.index("--route-readers") + 1]
    assert readers == "spiffe://waygate.local/ns/local/sa/proxy"
    copied.write_text("routes: []\n")
    assert up_arguments(context) == args
    assert copied.read_text() == "routes: []\n", "an existing (edited) copy is kept"
    assert os.path.dirname(copied) == str(tmp_path / "state")


async def test_sigterm_ends_watches_at_once_and_watch_reconnects_to_a_new_resolver(
    tmp_path: Path,
) -> None:
    """With a 120 s grace, a stop that waited for the never-ending Watch would run
    into the test's time limit; instead the watcher is told to reconnect."""
    routes = tmp_path / "routes.yaml"
    shutil.copyfile(EXAMPLE_ROUTES, routes)
    service = await start_service(
        [
            "waygate",
            "resolver",
            "serve",
            "--grpc-port",
            "0",
            "--admin-port",
            "0",
            "--routes-file",
            str(routes),
            "--shutdown-grace",
            "120s",
        ]
    )
    watcher = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "waygate",
        *cli(service, "routes", "--watch"),
        cwd=ROOT,
        env=child_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        assert watcher.stdout is not None and watcher.stderr is not None
        async with asyncio.timeout(20):
            assert (await watcher.stdout.readline()).startswith(b"routes file ")
            assert (await watcher.stdout.readline()).startswith(b"# version ")
        assert await service.stop(timeout=60) == 0
        assert service.logged("draining: ended watch streams")
        async with asyncio.timeout(20):
            err = (await watcher.stderr.readline()).decode()
        assert err.startswith("waygate: the resolver is shutting down; reconnect and resume")
        assert "reconnecting in" in err
        assert watcher.returncode is None, "--watch keeps trying until interrupted"
        # A new resolver on the same port: the watcher's old version means nothing
        # to it, so the watcher gets (and prints) a fresh snapshot.
        port = str(service.grpc_ports[0])
        service = await start_service(
            [
                "waygate",
                "resolver",
                "serve",
                "--grpc-port",
                port,
                "--admin-port",
                "0",
                "--routes-file",
                str(routes),
            ]
        )
        async with asyncio.timeout(30):
            while not (line := await watcher.stdout.readline()).startswith(b"# version "):
                assert line, "the watcher exited instead of reconnecting"
        assert await service.stop() == 0
    finally:
        if watcher.returncode is None:
            watcher.kill()
            await watcher.wait()
        if service.process.returncode is None:
            await service.stop()


async def test_routes_reads_every_page(resolver: tuple[RunningService, Path]) -> None:
    """More routes than one ListRoutes page (100 by default): the CLI follows
    next_page_token and prints each route once."""
    service, routes = resolver
    extra = "".join(
        f"  - {{namespace: demo, name: paged-{i:03d}, host: paged-{i:03d}.localtest.me, "
        "to: hello}\n"
        for i in range(150)
    )
    text = routes.read_text()
    assert text.rstrip().splitlines()[-1].startswith(" "), "routes: is the file's last section"
    routes.write_text(text.rstrip("\n") + "\n" + extra)
    expected = 150 + len(EXAMPLE.routes)
    async with asyncio.timeout(20):
        while True:
            code, out, err = await run_cli(*cli(service, "routes"))
            assert code == 0, err
            hosts = [line for line in out.splitlines() if "paged-" in line]
            if len(hosts) == 150:
                break
            await asyncio.sleep(0.2)
    assert len({line.split()[1] for line in hosts}) == 150, "each route once"
    assert "hello.localtest.me" in out
    assert sum(1 for line in out.splitlines() if ".localtest.me" in line) >= expected


async def test_routes_shows_the_file_state_first_and_fails_while_it_is_rejected(
    resolver: tuple[RunningService, Path],
) -> None:
    service, routes = resolver
    code, out, err = await run_cli(*cli(service, "routes"))
    assert code == 0, err
    first, header = out.splitlines()[:2]
    assert first.startswith(f"routes file {routes}: valid (version ")
    assert header.split() == [
        "NAMESPACE", "NAME", "HOST", "PATH", "BACKENDS", "PORT", "TLS", "STATUS"
    ]  # fmt: skip
    good = routes.read_text()
    routes.write_text(good.replace("host: hello.localtest.me", "host: HELLO_.localtest.me"))
    line = good.splitlines().index("    host: hello.localtest.me") + 1

    async def listing_until(wanted: int) -> tuple[str, str]:
        # The resolver polls the file once a second: a bounded number of tries.
        for _ in range(100):
            code, out, err = await run_cli(*cli(service, "routes"))
            if code == wanted:
                return out, err
        raise AssertionError(f"`waygate routes` never exited {wanted}: {err}")

    out, _ = await listing_until(1)
    first = out.splitlines()[0]
    assert first.startswith(
        f"routes file {routes}: REJECTED: {routes}:{line}: route demo/hello: host"
    ), first
    assert "serving the last good content" in out
    assert "hello.localtest.me" in out, "the last good routes are still listed"
    code, out, _ = await run_cli(*cli(service, "routes", "-o", "json"))
    document = json.loads(out)
    assert code == 1
    assert "valid" not in document["sources"][0], "false: left out of proto3 JSON"
    assert document["sources"][0]["lastError"].startswith(f"{routes}:{line}:")
    routes.write_text(good)
    out, _ = await listing_until(0)
    assert ": valid (version " in out.splitlines()[0]


async def test_apply_get_delete_and_the_status_of_a_route_to_nowhere(
    resolver: tuple[RunningService, Path], tmp_path: Path
) -> None:
    service, _ = resolver
    manifest = tmp_path / "ghost.yaml"
    manifest.write_text(
        "namespace: mine\nname: ghost\nhost: ghost.localtest.me\nto: doesnotexist\n"
        "---\n"
        "apiVersion: waygate.io/v1\nkind: Route\nmetadata: {namespace: demo, name: api2}\n"
        "spec: {host: echo.localtest.me, path: /v2, to: echo}\n"
    )
    code, out, err = await run_cli(*cli(service, "routes", "apply", "-f", str(manifest)))
    assert code == 0, err
    assert out.splitlines() == [
        "route mine/ghost applied; ServiceNotFound: service mine/doesnotexist not found",
        "route demo/api2 applied",
    ]
    status, metrics = await http_get(service.admin_port, "/metrics")
    assert status == 200
    assert (
        'waygate_resolver_route_condition{reason="ServiceNotFound",route="mine/ghost",'
        'status="False",type="ResolvedRefs"} 1.0'
    ) in metrics
    code, out, err = await run_cli(*cli(service, "routes", "get", "mine/ghost"))
    assert code == 0, err
    assert "ServiceNotFound" in out
    assert "ResolvedRefs  False   ServiceNotFound" in out
    code, out, _ = await run_cli(*cli(service, "routes", "get", "mine/ghost", "-o", "yaml"))
    document = yaml.safe_load(out)
    conditions = {c["type"]: c for c in document["status"]["conditions"]}
    assert conditions["ResolvedRefs"]["message"] == "service mine/doesnotexist not found"
    assert conditions["Admitted"]["status"] == "True"
    code, out, _ = await run_cli(*cli(service, "routes", "-o", "wide", "-n", "mine"))
    assert "service mine/doesnotexist not found" in out.splitlines()[-1]
    code, out, err = await run_cli(*cli(service, "routes", "delete", "mine/ghost"))
    assert (code, out.strip()) == (0, "route mine/ghost deleted"), err
    code, _, err = await run_cli(*cli(service, "routes", "get", "mine/ghost"))
    assert code == 1 and "route mine/ghost not found" in err
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nhost: Bad_Host\nto: y\n")
    code, _, err = await run_cli(*cli(service, "routes", "apply", "-f", str(bad)))
    assert code == 2 and "host" in err and "Traceback" not in err
