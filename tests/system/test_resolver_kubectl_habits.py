"""kubectl habits of `waygate routes` (issue 29, findings 3 and 7), against a real
`waygate resolver serve` process over a routes file and a manifests file:

- `routes get NS/NAME -o yaml | routes apply -f -` round-trips: enums in the routes
  file's spelling, status ignored, a TLS route's redacted key kept;
- a route made from an HTTPRoute (its name holds '/') is addressable by `routes get`,
  and its PATH column shows its real match (a path and a header, not `/`);
- applying such a route back is refused, saying where it comes from.
"""

from __future__ import annotations

import asyncio
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.pki import self_signed
from tests.support.processes import (
    ROOT,
    RunningService,
    child_env,
    resolver_serve_argv,
    run_cli,
    start_service,
)
from waygate.resolver.filesource import EXAMPLE_ROUTES

pytestmark = pytest.mark.system

MANIFESTS = """\
apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata: {name: waygate}
spec: {controllerName: waygate.io/gateway-controller}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: gw, namespace: demo}
spec:
  gatewayClassName: waygate
  listeners:
    - {name: http, port: 80, protocol: HTTP, hostname: api.localtest.me}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: canary, namespace: demo}
spec:
  parentRefs: [{name: gw}]
  rules:
    - matches:
        - path: {type: PathPrefix, value: /api}
          headers: [{name: x-env, value: canary}]
      backendRefs: [{name: echo, port: 80}]
"""


@pytest.fixture
async def resolver(tmp_path: Path):  # type: ignore[no-untyped-def]
    routes = tmp_path / "routes.yaml"
    shutil.copyfile(EXAMPLE_ROUTES, routes)
    manifests = tmp_path / "gateway.yaml"
    manifests.write_text(MANIFESTS)
    service = await start_service(resolver_serve_argv(routes, "--manifests", str(manifests)))
    try:
        yield service, routes
    finally:
        assert await service.stop() == 0


def cli(service: RunningService, *args: str) -> tuple[str, ...]:
    return (*args, "--addr", service.grpc_address, "--plaintext")


async def pipeline(first: tuple[str, ...], second: tuple[str, ...]) -> tuple[int, str, str]:
    """`waygate FIRST | waygate SECOND` through a real shell pipe."""
    waygate = f"{shlex.quote(sys.executable)} -m waygate"
    command = f"set -o pipefail; {waygate} {shlex.join(first)} | {waygate} {shlex.join(second)}"
    process = await asyncio.create_subprocess_exec(
        "bash",
        "-c",
        command,
        cwd=ROOT,
        env=child_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 60)
    return process.returncode or 0, out.decode(), err.decode()


async def test_get_yaml_applies_back_unchanged(
    resolver: tuple[RunningService, Path], tmp_path: Path
) -> None:
    service, routes = resolver
    cert, key = self_signed("shop.localtest.me")
    manifest = tmp_path / "shop.yaml"
    manifest.write_text(
        yaml.safe_dump(
            {
                "namespace": "demo",
                "name": "shop",
                "host": "shop.localtest.me",
                "path": "/shop",
                "backends": [{"service": "echo", "weight": 7}, {"service": "hello", "weight": 1}],
                "tls": {
                    "termination": "edge",
                    "certificate": cert,
                    "key": key,
                    "insecureEdgeTerminationPolicy": "Redirect",
                },
                "balance": "roundrobin",
                "sticky": {"cookieName": "shop", "sameSite": "Lax"},
                "timeouts": {"connect": "2s", "httpRequest": "250ms"},
                "forwardedHeaders": "if-none",
            }
        )
    )
    code, _, err = await run_cli(*cli(service, "routes", "apply", "-f", str(manifest)))
    assert code == 0, err
    file_before = routes.read_text()
    code, shown, err = await run_cli(*cli(service, "routes", "get", "demo/shop", "-o", "yaml"))
    assert code == 0, err
    document = yaml.safe_load(shown)
    assert "SAME_SITE" not in shown and "TLS_TERMINATION" not in shown
    assert document["tls"]["termination"] == "edge" and "key" not in document["tls"]
    assert document["status"]["conditions"], "the status is shown"
    code, out, err = await pipeline(
        cli(service, "routes", "get", "demo/shop", "-o", "yaml"),
        cli(service, "routes", "apply", "-f", "-"),
    )
    # (This resolver is plaintext, so the answer also says the route's key is withheld.)
    assert code == 0 and out.startswith("route demo/shop applied"), (out, err)
    code, again, err = await run_cli(*cli(service, "routes", "get", "demo/shop", "-o", "yaml"))
    assert code == 0, err
    assert again == shown
    # Nothing changed, so the file did not either (its key kept, comments and all).
    assert routes.read_text() == file_before


async def test_a_gateway_route_is_addressable_and_shows_its_match(
    resolver: tuple[RunningService, Path],
) -> None:
    service, _ = resolver
    code, out, err = await run_cli(*cli(service, "routes", "-n", "demo", "-o", "yaml"))
    assert code == 0, err
    (derived,) = [r for r in yaml.safe_load(out)["routes"] if "derived" in r]
    name = derived["name"]
    assert "/" in name and derived["derived"]["from"] == "HTTPRoute demo/canary"
    code, table, err = await run_cli(*cli(service, "routes", "-n", "demo"))
    assert code == 0, err
    (row,) = [line for line in table.splitlines() if line.startswith(f"demo       {name}")]
    assert "/api header:x-env=canary" in row, row
    code, out, err = await run_cli(*cli(service, "routes", "get", f"demo/{name}"))
    assert code == 0, err
    assert "/api header:x-env=canary" in out
    code, out, err = await run_cli(*cli(service, "routes", "get", f"demo/{name}", "-o", "yaml"))
    assert code == 0, err
    document = yaml.safe_load(out)
    assert document["derived"]["matches"] == [
        {
            "path": {"type": "PathPrefix", "value": "/api"},
            "headers": [{"type": "Exact", "name": "x-env", "value": "canary"}],
        }
    ]
    code, out, err = await pipeline(
        cli(service, "routes", "get", f"demo/{name}", "-o", "yaml"),
        cli(service, "routes", "apply", "-f", "-"),
    )
    assert code == 2 and "made from HTTPRoute demo/canary and is read-only" in err, err
    assert "Traceback" not in err
