"""`waygate routes [get|apply|delete]` against a real resolver process: the routes
file's state first (exit 1 while it is rejected), conditions in the STATUS
column, -o json/yaml, and ApplyRoute/DeleteRoute from a YAML file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml

from tests.support.processes import (
    RunningService,
    http_get,
    resolver_serve_argv,
    run_cli,
    start_service,
)
from waygate.resolver.filesource import EXAMPLE_ROUTES

pytestmark = pytest.mark.system


@pytest.fixture
async def resolver(tmp_path: Path):  # type: ignore[no-untyped-def]
    routes = tmp_path / "routes.yaml"
    shutil.copyfile(EXAMPLE_ROUTES, routes)
    service = await start_service(resolver_serve_argv(routes))
    try:
        yield service, routes
    finally:
        assert await service.stop() == 0


def cli(service: RunningService, *args: str) -> tuple[str, ...]:
    return (*args, "--addr", service.grpc_address, "--plaintext")


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
