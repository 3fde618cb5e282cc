"""Issue 29 finding 1 and 8: a rejected manifests file, and Gateway API / Ingress
mistakes, are visible everywhere, not only in the resolver's log.

One real `waygate resolver serve --routes-file --manifests` (plaintext loopback)
and the real CLI: `waygate routes`, `waygate gateways`, `waygate check`, the
admin port's /metrics and /status.json.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from pathlib import Path

import pytest

from tests.support.poll import until
from tests.support.processes import (
    ROOT,
    RunningService,
    http_get,
    resolver_serve_argv,
    run_cli,
    start_service,
)

pytestmark = pytest.mark.system

EXAMPLES = ROOT / "services" / "resolver" / "examples"

# Beside the example: an HTTPRoute to a Service that does not exist
# (ResolvedRefs=False), one for a host the Gateway does not listen for
# (Accepted=False), a Gateway of another class with its HTTPRoute, and an
# Ingress with no class while no IngressClass of Waygate's is the default
# (these three ignored, listed with the reason).
EXTRA = """
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: ghost
  namespace: demo
spec:
  parentRefs:
    - name: demo
  hostnames: [gateway.localtest.me]
  rules:
    - matches:
        - path: {type: PathPrefix, value: /ghost}
      backendRefs:
        - {name: nowhere, port: 80}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: elsewhere
  namespace: demo
spec:
  parentRefs:
    - name: demo
  hostnames: [other.example.com]
  rules:
    - backendRefs:
        - {name: echo-gateway, port: 80}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata:
  name: theirs
  namespace: demo
spec:
  gatewayClassName: other
  listeners:
    - {name: http, port: 80, protocol: HTTP}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: theirs
  namespace: demo
spec:
  parentRefs:
    - name: theirs
  rules:
    - backendRefs:
        - {name: echo-gateway, port: 80}
---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata:
  name: classless
  namespace: demo
spec:
  defaultBackend:
    service: {name: echo-gateway, port: {number: 80}}
"""

# An invalid regular expression: the whole edit is rejected (finding 1's input).
BROKEN = """
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: broken
  namespace: demo
spec:
  parentRefs:
    - name: demo
  rules:
    - matches:
        - path: {type: RegularExpression, value: "/(unclosed"}
      backendRefs:
        - {name: echo-gateway, port: 80}
"""


async def metric(service: RunningService, name: str, source: str) -> float | None:
    code, text = await http_get(service.admin_port, "/metrics")
    assert code == 200
    for line in text.splitlines():
        if line.startswith(f'{name}{{source="{source}"}} '):
            return float(line.rsplit(" ", 1)[1])
    return None


async def test_a_rejected_manifests_file_shows_in_every_view(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    routes.write_text((EXAMPLES / "routes.yaml").read_text())
    manifests = tmp_path / "gateway.yaml"
    manifests.write_text((EXAMPLES / "gateway.yaml").read_text() + EXTRA)
    source = f"manifests:{manifests}"
    resolver = await start_service(resolver_serve_argv(routes, "--manifests", str(manifests)))
    addr = ("--addr", resolver.grpc_address, "--plaintext")
    try:
        code, text, problem = await run_cli("routes", *addr)
        assert code == 0, problem
        assert f"manifests {manifests}: valid (version " in text

        # Gateway API mistakes and the ignored Ingress, while the file is valid.
        code, text, _ = await run_cli("check", "--resolver", resolver.grpc_address, "--plaintext")
        assert f"✔ manifests {manifests} is valid" in text
        assert "✖ HTTPRoute demo/ghost on demo/demo: ResolvedRefs=False (BackendNotFound)" in text
        assert (
            "✖ HTTPRoute demo/elsewhere on demo/demo: Accepted=False (NoMatchingListenerHostname)"
            in text
        )
        assert code == 1
        ignored = [
            e for e in resolver.logs if str(e.get("msg", "")).startswith("Ingress demo/classless")
        ]
        assert len(ignored) == 1, resolver.logs[-10:]
        assert "ignored: no ingressClassName" in ignored[0]["msg"]
        assert (
            "‼ Ingress demo/classless ignored: no ingressClassName and no IngressClass of "
            "controller waygate.io/ingress-controller is marked" in text
        ), text
        assert (
            "‼ Gateway demo/theirs ignored: its gatewayClassName 'other' is not a GatewayClass "
            "of controller waygate.io/gateway-controller" in text
        )
        assert (
            "‼ HTTPRoute demo/theirs ignored: none of its parentRefs (demo/theirs) is a Gateway "
            "of a GatewayClass of controller waygate.io/gateway-controller" in text
        )
        code, listing, _ = await run_cli("gateways", *addr)
        assert "ignored: Ingress demo/classless: no ingressClassName" in listing, listing
        assert "ignored: HTTPRoute demo/theirs: none of its parentRefs" in listing
        assert await metric(resolver, "waygate_resolver_source_valid", source) == 1.0

        # The broken edit: the resolver keeps the last good state and says so everywhere.
        before = datetime.now(UTC).replace(microsecond=0)
        manifests.write_text(manifests.read_text() + BROKEN)
        lines = manifests.read_text().splitlines()
        line = next(n for n, text in enumerate(lines, 1) if "/(unclosed" in text)

        async def rejected() -> bool:
            return await metric(resolver, "waygate_resolver_source_valid", source) == 0.0

        await until(rejected, "the manifests source published as rejected")
        since = await metric(
            resolver, "waygate_resolver_source_last_error_timestamp_seconds", source
        )
        assert since is not None and since >= before.timestamp()

        code, text, problem = await run_cli("routes", *addr)
        assert f"manifests {manifests}: REJECTED: {manifests}:{line}:" in text, text
        assert "; failing since 20" in text and "serving the last good content" in text

        code, text, _ = await run_cli("gateways", *addr)
        assert code == 0
        assert f"manifests {manifests}: REJECTED: {manifests}:{line}:" in text
        assert "HTTPRoute" in text  # the last good objects are still listed
        code, text, _ = await run_cli("gateways", *addr, "-o", "json")
        (state,) = [s for s in json.loads(text)["sources"] if s["source"] == source]
        assert not state.get("valid", False)  # proto3 JSON leaves false out
        assert state["lastError"].startswith(f"{manifests}:{line}:")
        assert datetime.fromisoformat(state["errorSince"]) >= before

        code, text, _ = await run_cli("check", "--resolver", resolver.grpc_address, "--plaintext")
        assert code == 1
        assert f"✖ manifests {manifests} rejected (since " in text
        assert "    hint: fix that line and it reloads" in text
        assert f"✔ routes file {routes} is valid" in text

        code, body = await http_get(resolver.admin_port, "/status.json")
        (sources,) = [
            s for s in json.loads(body)["services"][0]["sections"] if s["title"] == "Route sources"
        ]
        (row,) = [r for r in sources["rows"] if r[0] == source]
        assert row[1]["text"] == "rejected" and f"{manifests}:{line}:" in row[3]
        assert sources["state"] == "bad"

        # Fixed: valid again everywhere, the error time cleared.
        manifests.write_text((EXAMPLES / "gateway.yaml").read_text())

        async def valid() -> bool:
            return await metric(resolver, "waygate_resolver_source_valid", source) == 1.0

        await until(valid, "the manifests source valid again")
        assert (
            await metric(resolver, "waygate_resolver_source_last_error_timestamp_seconds", source)
            == 0.0
        )
        code, text, _ = await run_cli("check", "--resolver", resolver.grpc_address, "--plaintext")
        assert f"✔ manifests {manifests} is valid" in text, text
        assert "✖ manifests" not in text and "✖ HTTPRoute" not in text, text
        # Translated twice with the Ingress (the first load, and the broken edit,
        # rejected after its translation), it was still logged once.
        ignored = [
            e for e in resolver.logs if str(e.get("msg", "")).startswith("Ingress demo/classless")
        ]
        assert len(ignored) == 1
    finally:
        await resolver.stop()
