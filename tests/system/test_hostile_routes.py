"""Hostile route authors against a real resolver (--manifests) and a real proxy, each
attack measured against a bystander client (issue 31, findings 6 and 7).

- ReDoS: a RegularExpression path match of `/redos/(a+)+$` and paths of 28 a's and
  "!" stalled a backtracking proxy seconds per request; with RE2 they are answered at
  once and the bystander on another host keeps every request and its latency.
- A pattern RE2 cannot express (a backreference) is refused at admission: the
  manifests edit is rejected with `path:line: reason` and the last good state stays.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.support.gatewayapi import INFRA, Conformance

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

REDOS_ROUTES = f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: redos, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  hostnames: ["redos.example"]
  rules:
  - matches:
    - path: {{type: RegularExpression, value: "/redos/(a+)+$"}}
    backendRefs: [{{name: infra-backend-v1, port: 8080}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: bystander, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  hostnames: ["bystander.example"]
  rules:
  - backendRefs: [{{name: infra-backend-v2, port: 8080}}]
"""


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def conformance(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Conformance]:
    running = await Conformance(tmp_path_factory.mktemp("manifests")).start()
    try:
        yield running
    finally:
        await running.stop()


def p99(latencies: list[float]) -> float:
    ordered = sorted(latencies)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]


async def test_redos_path_is_answered_at_once_and_the_bystander_keeps_its_service(
    conformance: Conformance,
) -> None:
    await conformance.apply(extra=REDOS_ROUTES)
    served = await conformance.eventually("/redos/aaa", host="redos.example", backend="")
    assert served.status == 200 and served.backend == f"{INFRA}/infra-backend-v1"
    attack_path = "/redos/" + "a" * 28 + "!"
    attack_times: list[float] = []
    bystander: list[tuple[int, float]] = []
    stop = asyncio.Event()

    async def attacker() -> None:
        # Three at once hung the backtracking proxy until its liveness check restarted it.
        while not stop.is_set():
            started = time.perf_counter()
            response = await conformance.request(attack_path, host="redos.example")
            attack_times.append(time.perf_counter() - started)
            assert response.status == 404  # matches no route of the host

    async def bystander_client() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                response = await conformance.request("/", host="bystander.example")
                status = response.status
            except (OSError, TimeoutError):
                status = 0
            bystander.append((status, time.perf_counter() - started))
            await asyncio.sleep(0.01)

    tasks = [asyncio.create_task(attacker()) for _ in range(3)]
    tasks.append(asyncio.create_task(bystander_client()))
    await asyncio.sleep(3)
    stop.set()
    await asyncio.gather(*tasks)
    # One backtracking attempt took the proxy 2.4-4.8 s; linear matching is microseconds.
    assert len(attack_times) >= 30, attack_times
    assert max(attack_times) < 1.0, max(attack_times)
    assert len(bystander) >= 20
    assert all(status == 200 for status, _ in bystander), bystander
    assert p99([latency for _, latency in bystander]) < 1.0


async def test_a_backreference_is_refused_at_admission_with_the_reason(
    conformance: Conformance,
) -> None:
    await conformance.apply(extra=REDOS_ROUTES)
    assert conformance.resolver is not None
    refused = REDOS_ROUTES.replace("/redos/(a+)+$", "/echo/(a+)/\\\\1")
    await conformance.apply(extra=refused, wait=False)
    resolver = conformance.resolver

    def rejection() -> str:
        found = [
            str(e.get("msg"))
            for e in resolver.logs
            if "manifests rejected" in str(e.get("msg")) and "10-test.yaml" in str(e.get("msg"))
        ]
        return found[-1] if found else ""

    from tests.support.poll import until

    await until(rejection, "the resolver to reject the edit", timeout=20)
    message = rejection()
    # Line 11: the edit starts with a "---" separator after an empty line.
    assert "10-test.yaml:11:" in message, message
    assert f"HTTPRoute {INFRA}/redos: spec.rules[0].matches[0].path.value" in message
    assert "backreferences are not supported" in message
    # The last good state stays: the admitted regex route still answers.
    response = await conformance.request("/redos/aa", host="redos.example")
    assert response.status == 200


# ---------------------------------------------------------------- host takeover


def takeover_manifests(conformance: Conformance, *, evil: bool) -> str:
    """demo's Route for echo.localtest.me (backend: infra-backend-v1's upstream) and,
    with `evil`, the audit's takeover (finding 7): an Ingress of namespace evil for
    that host, and a Gateway of evil with that hostname and HTTPRoutes on / and /api
    (backend: infra-backend-v2's upstream)."""
    demo_port = conformance.backends[(INFRA, "infra-backend-v1")].port
    evil_port = conformance.backends[(INFRA, "infra-backend-v2")].port
    text = f"""apiVersion: v1
kind: Service
metadata: {{name: echo, namespace: demo}}
spec: {{ports: [{{name: http, port: 8080}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: echo-local
  namespace: demo
  labels: {{kubernetes.io/service-name: echo}}
addressType: IPv4
ports: [{{name: http, port: {demo_port}, protocol: TCP}}]
endpoints: [{{addresses: [127.0.0.1], conditions: {{ready: true}}}}]
---
apiVersion: waygate.io/v1
kind: Route
metadata: {{name: echo, namespace: demo}}
spec: {{host: echo.localtest.me, to: echo}}
"""
    if not evil:
        return text
    return (
        text
        + f"""---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: evil}}
spec: {{ports: [{{name: http, port: 8080}}]}}
---
apiVersion: discovery.k8s.io/v1
kind: EndpointSlice
metadata:
  name: web-local
  namespace: evil
  labels: {{kubernetes.io/service-name: web}}
addressType: IPv4
ports: [{{name: http, port: {evil_port}, protocol: TCP}}]
endpoints: [{{addresses: [127.0.0.1], conditions: {{ready: true}}}}]
---
apiVersion: networking.k8s.io/v1
kind: IngressClass
metadata: {{name: waygate-ingress}}
spec: {{controller: waygate.io/ingress-controller}}
---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata: {{name: takeover, namespace: evil}}
spec:
  ingressClassName: waygate-ingress
  rules:
  - host: echo.localtest.me
    http:
      paths:
      - {{path: /, pathType: Prefix, backend: {{service: {{name: web, port: {{number: 8080}}}}}}}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: gw, namespace: evil}}
spec:
  gatewayClassName: waygate
  listeners:
  - {{name: http, port: 80, protocol: HTTP, hostname: echo.localtest.me}}
"""
        + "".join(
            f"""---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: {name}, namespace: evil}}
spec:
  parentRefs: [{{name: gw}}]
  rules:
  - matches: [{{path: {{type: PathPrefix, value: {path}}}}}]
    backendRefs: [{{name: web, port: 8080}}]
"""
            for name, path in (("root", "/"), ("api", "/api"))
        )
    )


async def test_a_younger_namespace_cannot_take_a_host_through_ingress_or_gateway(
    conformance: Conformance,
) -> None:
    from tests.support.processes import run_cli

    demo = f"{INFRA}/infra-backend-v1"
    await conformance.apply(extra=takeover_manifests(conformance, evil=False))
    await conformance.eventually("/", host="echo.localtest.me", backend=demo)
    await conformance.apply(extra=takeover_manifests(conformance, evil=True))
    # The bystander is demo's own users: every path of the host stays demo's.
    for _ in range(20):
        for path in ("/", "/api", "/api/users", "/x"):
            response = await conformance.request(path, host="echo.localtest.me")
            assert (response.status, response.backend) == (200, demo), (path, response)
    assert conformance.resolver is not None
    address = conformance.resolver.grpc_address
    # Each younger claim is Conflicted in its own status...
    code, out, err = await run_cli("routes", "--addr", address, "-o", "wide")
    assert code == 0, err
    evil_rows = [line for line in out.splitlines() if line.startswith("evil ")]
    assert len(evil_rows) == 3, out  # the Ingress's path and the two HTTPRoutes' rules
    for row in evil_rows:
        assert "HostAlreadyClaimed" in row
        assert "host echo.localtest.me belongs to namespace demo" in row
    objects = {
        (item["kind"], item["metadata"]["name"]): item["status"]
        for item in await conformance.gateways("-n", "evil")
    }
    for name in ("root", "api"):
        (parent,) = objects[("HTTPRoute", name)]["parents"]
        conditions = {c["type"]: (c["status"], c["reason"]) for c in parent["conditions"]}
        assert conditions["Accepted"] == ("False", "HostAlreadyClaimed"), conditions
        assert conditions["Conflicted"] == ("True", "HostAlreadyClaimed"), conditions
    ingress = {c["type"]: c["reason"] for c in objects[("Ingress", "takeover")]["conditions"]}
    assert ingress == {"Conflicted": "HostAlreadyClaimed"}
    (listener,) = objects[("Gateway", "gw")]["listeners"]
    conflicted = next(c for c in listener["conditions"] if c["type"] == "Conflicted")
    assert (conflicted["status"], conflicted["reason"]) == ("True", "HostAlreadyClaimed")
    code, out, _ = await run_cli("gateways", "--addr", address, "-n", "evil")
    assert code == 0 and "Conflicted=True(HostAlreadyClaimed: host echo.localtest.me" in out
    # ...and in `waygate check`.
    code, out, _ = await run_cli("check", "--resolver", address)
    assert code == 1
    checked = [line for line in out.splitlines() if line.startswith("✖ route evil/")]
    assert len(checked) == 3 and all("HostAlreadyClaimed" in line for line in checked), out


HOSTLESS_TAKEOVER = """---
apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {name: gw, namespace: evil}
spec:
  gatewayClassName: waygate
  listeners: [{name: http, port: 80, protocol: HTTP}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {name: catch, namespace: evil}
spec:
  parentRefs: [{name: gw}]
  rules:
  - matches: [{path: {type: PathPrefix, value: /api}}]
    backendRefs: [{name: web, port: 8080}]
"""


async def test_a_hostless_route_cannot_take_paths_of_an_owned_host(
    conformance: Conformance,
) -> None:
    demo = f"{INFRA}/infra-backend-v1"
    await conformance.apply(extra=takeover_manifests(conformance, evil=False))
    await conformance.eventually("/", host="echo.localtest.me", backend=demo)
    evil_service = takeover_manifests(conformance, evil=True).split("kind: IngressClass")[0]
    evil_service = evil_service.rsplit("---", 1)[0]  # demo's objects and evil's Service only
    await conformance.apply(extra=evil_service + HOSTLESS_TAKEOVER)
    for path in ("/", "/api", "/api/users"):
        response = await conformance.request(path, host="echo.localtest.me")
        assert (response.status, response.backend) == (200, demo), (path, response)
