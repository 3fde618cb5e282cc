"""Gateway listeners on ports of their own, through real resolver and proxy processes.

A Gateway listener whose port `--listener-ports` does not map is bound as is by
the proxy; one it cannot bind (the port is held by another socket here) is
reported to the resolver (ReportListeners) and shows Programmed=False with
the reason in `waygate gateways`, until the port is free and the proxy binds
it. An HTTPS listener on an unmapped port is reported the same way (HTTPS is
served on the proxy's HTTPS port only). Each own port serves only its own
listener's routes.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.support.gatewayapi import INFRA, TLS_SECRET, Conformance
from tests.support.poll import until

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

V1, V2 = (f"{INFRA}/infra-backend-v{n}" for n in (1, 2))


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class Ports:
    def __init__(self) -> None:
        self.free = free_port()
        # Held for the test: the proxy finds it in use.
        self.holder = socket.socket()
        self.holder.bind(("127.0.0.1", 0))
        self.holder.listen(1)
        self.busy = int(self.holder.getsockname()[1])
        self.https = free_port()


def manifests(ports: Ports, proxy_port: int) -> str:
    return f"""apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: own-ports, namespace: {INFRA}}}
spec:
  gatewayClassName: waygate
  listeners:
  - {{name: free, port: {ports.free}, protocol: HTTP}}
  - {{name: busy, port: {ports.busy}, protocol: HTTP}}
  - {{name: same, port: {proxy_port}, protocol: HTTP, hostname: same.example.com}}
  - name: secure
    port: {ports.https}
    protocol: HTTPS
    tls: {{certificateRefs: [{{name: {TLS_SECRET}}}]}}
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: to-v1, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: own-ports, sectionName: free}}, {{name: own-ports, sectionName: busy}},
               {{name: own-ports, sectionName: secure}}]
  hostnames: [own.example.com]
  rules: [{{backendRefs: [{{name: infra-backend-v1, port: 8080}}]}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: on-the-proxy-port, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: own-ports, sectionName: same}}]
  rules: [{{backendRefs: [{{name: infra-backend-v1, port: 8080}}]}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: on-80, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  hostnames: [own.example.com]
  rules: [{{backendRefs: [{{name: infra-backend-v2, port: 8080}}]}}]
"""


class Suite:
    def __init__(self, conformance: Conformance, ports: Ports) -> None:
        self.conformance = conformance
        self.ports = ports


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Suite]:
    ports = Ports()
    conformance = await Conformance(tmp_path_factory.mktemp("manifests")).start()
    try:
        await conformance.apply(extra=manifests(ports, conformance.port))
        yield Suite(conformance, ports)
    finally:
        ports.holder.close()
        await conformance.stop()


async def listeners(conformance: Conformance) -> dict[str, dict[str, tuple[str, str, str]]]:
    items = await conformance.gateways("--kind", "Gateway")
    (gateway,) = [i for i in items if i["metadata"]["name"] == "own-ports"]
    return {
        listener["name"]: {
            c["type"]: (c["status"], c["reason"], c["message"]) for c in listener["conditions"]
        }
        for listener in gateway["status"]["listeners"]
    }


async def get(port: int, host: str = "own.example.com") -> tuple[int, bytes]:
    import asyncio

    from tests.support.proxyharness import read_response

    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
        data = await read_response(reader, timeout=10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


async def test_an_unmapped_listener_port_is_bound_and_serves_only_its_routes(
    suite: Suite,
) -> None:
    async def served() -> bool:
        try:
            status, body = await get(suite.ports.free)
        except OSError:
            return False
        return status == 200 and V1.encode() in body

    await until(served, "the proxy to serve the listener's own port", timeout=20)
    # Port 80's route for the same host answers on the proxy's HTTP port, not here.
    response = await suite.conformance.request("/", host="own.example.com")
    assert response.backend == V2
    conditions = (await listeners(suite.conformance))["free"]
    assert conditions["Programmed"][:2] == ("True", "Programmed")


async def test_a_listener_on_the_proxy_s_own_http_port_is_served_there(suite: Suite) -> None:
    """Not bound a second time (which would fail as in use): the HTTP port serves it."""
    response = await suite.conformance.request("/", host="same.example.com")
    assert response.backend == V1
    conditions = (await listeners(suite.conformance))["same"]
    assert conditions["Programmed"][:2] == ("True", "Programmed")


async def test_a_port_in_use_is_programmed_false_with_the_reason(suite: Suite) -> None:
    busy = suite.ports.busy
    found: list[Any] = []

    async def reported() -> bool:
        found[:] = [await listeners(suite.conformance)]
        return found[0]["busy"]["Programmed"][0] == "False"

    await until(reported, f"the busy listener reported (last: {found})", timeout=20)
    status, reason, message = found[0]["busy"]["Programmed"]
    assert (status, reason) == ("False", "PortUnavailable")
    assert f"port {busy} is in use" in message and "proxy " in message
    # The Gateway as a whole still serves its other listener.
    items = await suite.conformance.gateways("--kind", "Gateway")
    (gateway,) = [i for i in items if i["metadata"]["name"] == "own-ports"]
    programmed = {c["type"]: c["status"] for c in gateway["status"]["conditions"]}["Programmed"]
    assert programmed == "True"


async def test_an_https_listener_on_its_own_port_terminates_tls_there(suite: Suite) -> None:
    """Bound as is too, with the HTTPS port's certificates chosen by SNI, and only its
    own routes: the HTTPS port does not answer for it."""
    import asyncio

    from tests.support.gatewayapi import tls_client_context
    from tests.support.proxyharness import read_response

    async def get_tls(port: int) -> bytes:
        reader, writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=tls_client_context(), server_hostname="own.example.com"
        )
        try:
            writer.write(b"GET / HTTP/1.1\r\nHost: own.example.com\r\n\r\n")
            return await read_response(reader, timeout=10)
        finally:
            writer.close()

    async def served() -> bool:
        try:
            answer = await get_tls(suite.ports.https)
        except (OSError, asyncio.IncompleteReadError):
            return False
        return answer.startswith(b"HTTP/1.1 200") and V1.encode() in answer

    await until(served, "the HTTPS listener's own port to serve its route", timeout=20)
    answer = await get_tls(suite.conformance.https_port)
    assert b"no route for host own.example.com" in answer, answer[:200]

    async def programmed() -> bool:
        return (await listeners(suite.conformance))["secure"]["Programmed"][0] == "True"

    await until(programmed, "the HTTPS listener Programmed", timeout=20)


async def test_freeing_the_port_heals_the_listener(suite: Suite) -> None:
    suite.ports.holder.close()

    async def programmed() -> bool:
        return (await listeners(suite.conformance))["busy"]["Programmed"][0] == "True"

    await until(programmed, "the freed port to be bound and reported", timeout=30)

    async def served() -> bool:
        status, body = await get(suite.ports.busy)
        return status == 200 and V1.encode() in body

    await until(served, "the freed port to serve its routes", timeout=10)


async def test_the_report_ends_with_the_proxy(suite: Suite) -> None:
    """A proxy that goes away takes its report with it: the listener problems it
    reported are no longer shown (what remains is the translation's own view)."""
    proxy = suite.conformance.proxy
    assert proxy is not None
    await proxy.stop()

    # Held again, the port makes the (re)started proxy's report say so ...
    suite.ports.holder = socket.socket()
    suite.ports.holder.bind(("127.0.0.1", suite.ports.busy))
    suite.ports.holder.listen(1)
    await suite.conformance.start_proxy()

    async def reported() -> bool:
        return (await listeners(suite.conformance))["busy"]["Programmed"][0] == "False"

    await until(reported, "the restarted proxy's report", timeout=20)
    # ... and a proxy that goes away takes its report with it.
    proxy = suite.conformance.proxy
    assert proxy is not None
    await proxy.stop()
    suite.conformance.proxy = None

    async def cleared() -> bool:
        return (await listeners(suite.conformance))["busy"]["Programmed"][0] == "True"

    await until(cleared, "the stopped proxy's report to be dropped", timeout=20)
