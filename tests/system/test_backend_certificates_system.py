"""Backend certificates watched before a client hits them, end to end (issue 30 item 5).

A real resolver process and a real proxy process, reencrypt routes to real TLS
backends with certificates from `LocalCA`:

- a backend whose certificate expires in three days: the proxy reports it
  (ReportBackendCertificates), the route gets a BackendCertificate condition
  (`waygate routes get` shows which endpoint, which name, when; ResolvedRefs
  stays True) and `waygate check` warns;
- two backends of one route, one with a certificate that expires a few seconds
  into the test: before expiry the proxy's status page and metric warn, after
  it no client request fails (failed handshakes are redispatched to the other
  endpoint), and the expired endpoint is reported out of rotation.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.pki import LocalCA
from tests.support.poll import until
from tests.support.processes import RunningService, resolver_serve_argv, run_cli, start_service
from tests.support.proxyharness import read_response
from tests.system.test_proxy_system import start_proxy
from waygate.core.tls import server_context

pytestmark = pytest.mark.system


class ClosingTlsBackend:
    """A real HTTPS backend on `address` that answers one request per connection and
    closes it: every request through the proxy needs a new upstream handshake."""

    def __init__(self, address: str, certificate: tuple[bytes, bytes]) -> None:
        self.address = address
        self.context = server_context(chain_pem=certificate[0], key_pem=certificate[1])
        self.served = 0
        self.port = 0
        self._server: asyncio.AbstractServer | None = None

    async def start(self) -> ClosingTlsBackend:
        self._server = await asyncio.start_server(self._serve, self.address, 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            self.served += 1
            writer.write(
                b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nConnection: close\r\n\r\n"
                + self.address.rsplit(".", 1)[1].encode().rjust(3)
            )
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError, ssl.SSLError):
            pass
        finally:
            writer.close()

    async def stop(self) -> None:
        assert self._server is not None
        self._server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._server.wait_closed(), 2)


def routes(ca: LocalCA, backends: list[ClosingTlsBackend]) -> str:
    """One reencrypt route (plain HTTP allowed: the TLS under test is the upstream hop)
    to service demo/web, one endpoint per backend. JSON is YAML."""
    return json.dumps(
        {
            "services": [
                {
                    "namespace": "demo",
                    "name": "web",
                    "ports": [{"name": "https", "port": 443, "targetPort": "https"}],
                    "endpoints": [
                        {"address": b.address, "ports": [{"name": "https", "port": b.port}]}
                        for b in backends
                    ],
                }
            ],
            "routes": [
                {
                    "namespace": "demo",
                    "name": "secure",
                    "host": "secure.test",
                    "to": "web",
                    "targetPort": "https",
                    "tls": {
                        "termination": "reencrypt",
                        "destinationCACertificate": ca.pem.decode(),
                        "insecureEdgeTerminationPolicy": "Allow",
                    },
                }
            ],
        }
    )


@contextlib.asynccontextmanager
async def stack(
    tmp_path: Path, ca: LocalCA, backends: list[ClosingTlsBackend]
) -> AsyncIterator[tuple[RunningService, RunningService, int]]:
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(routes(ca, backends))
    resolver = await start_service(resolver_serve_argv(routes_file))
    try:
        proxy, http_port = await start_proxy(resolver.grpc_address)
        try:
            yield resolver, proxy, http_port
        finally:
            await proxy.stop()
    finally:
        await resolver.stop()


async def get(port: int) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: secure.test\r\n\r\n")
        return await read_response(reader, timeout=10)
    finally:
        writer.close()


async def admin(proxy: RunningService, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", proxy.admin_port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        return await read_response(reader, timeout=10)
    finally:
        writer.close()


def backend_rows(status_json: bytes) -> dict[str, list[Any]]:
    body = status_json.split(b"\r\n\r\n", 1)[1]
    document = json.loads(body)
    for section in (s for service in document["services"] for s in service["sections"]):
        if section.get("title") == "Backend certificates":
            return {row[1]: row for row in section.get("rows", [])}
    return {}


async def served(port: int) -> bool:
    """The proxy has the route (its first view may still be on the way)."""
    return b" 200 " in (await get(port)).split(b"\r\n", 1)[0]


async def test_a_backend_expiring_in_days_is_a_route_condition_and_a_check_warning(
    tmp_path: Path,
) -> None:
    ca = LocalCA(lifetime=dt.timedelta(days=3))
    backend = await ClosingTlsBackend("127.0.0.1", ca.issue(dns=["web.demo.svc"])).start()
    try:
        async with stack(tmp_path, ca, [backend]) as (resolver, _, port):
            cli = ("--addr", resolver.grpc_address, "--plaintext")
            await until(lambda: served(port), "the route served", timeout=20)

            async def condition_shown() -> str | None:
                response = await get(port)
                assert b" 200 " in response.split(b"\r\n", 1)[0], response
                code, out, err = await run_cli("routes", "get", "demo/secure", *cli)
                assert code == 0, err
                return out if "BackendCertificate" in out else None

            await until(condition_shown, "the BackendCertificate condition", timeout=30)
            out = await condition_shown()
            assert out is not None
            assert "ExpiringSoon" in out
            assert f"backend 127.0.0.1:{backend.port}" in out and "web.demo.svc" in out
            expires = ca.now() + dt.timedelta(days=3)
            assert f"{expires:%Y-%m-%dT%H}" in out  # when, in absolute time
            code, out, err = await run_cli("routes", "get", "demo/secure", "-o", "json", *cli)
            assert code == 0, err
            conditions = {c["type"]: c for c in json.loads(out)["status"]["conditions"]}
            assert conditions["ResolvedRefs"]["status"] == "True"
            assert conditions["BackendCertificate"]["status"] == "False"
            code, out, err = await run_cli(
                "check", "--resolver", resolver.grpc_address, "--plaintext"
            )
            assert code == 0, out + err  # a warning, not a failure
            line = next(line for line in out.splitlines() if "demo/secure" in line)
            assert "ExpiringSoon" in line and f"127.0.0.1:{backend.port}" in line
    finally:
        await backend.stop()


async def test_a_backend_whose_certificate_expires_during_the_run_leaves_rotation(
    tmp_path: Path,
) -> None:
    ca = LocalCA()
    good = await ClosingTlsBackend("127.0.0.1", ca.issue(dns=["web.demo.svc"])).start()
    short = LocalCA(lifetime=dt.timedelta(seconds=8))
    short.key, short.name, short.certificate = ca.key, ca.name, ca.certificate  # same CA
    expiring = ClosingTlsBackend("127.0.0.2", short.issue(dns=["web.demo.svc"]))
    expires_at = time.time() + 8
    await expiring.start()
    try:
        async with stack(tmp_path, ca, [good, expiring]) as (_, proxy, port):
            endpoint = f"127.0.0.2:{expiring.port}"
            failures: list[bytes] = []
            answered = 0
            stop = asyncio.Event()

            async def traffic() -> None:
                nonlocal answered
                while not stop.is_set():
                    response = await get(port)
                    if b" 200 " not in response.split(b"\r\n", 1)[0]:
                        failures.append(response[:300])
                    answered += 1
                    await asyncio.sleep(0.02)

            await until(lambda: served(port), "the route served", timeout=20)
            loader = asyncio.create_task(traffic())
            try:
                # Before expiry: both endpoints serve; the page and the metric warn.
                await until(lambda: expiring.served > 0 and good.served > 0, timeout=10)
                rows = backend_rows(await admin(proxy, "/status.json"))
                assert endpoint in rows, rows
                assert rows[endpoint][4] == "expires soon", rows
                metrics = (await admin(proxy, "/metrics")).decode()
                assert (
                    "waygate_proxy_upstream_certificate_expiry_timestamp_seconds"
                    f'{{endpoint="{endpoint}",route="demo/secure"}}' in metrics
                )
                assert time.time() < expires_at, "the warning came too late to be a warning"
                # After expiry: every request still answered, by the good endpoint...
                await asyncio.sleep(max(0.0, expires_at - time.time()) + 1)
                served_after = good.served
                bad_after = expiring.served
                await asyncio.sleep(3)
                assert good.served > served_after + 10
                assert expiring.served == bad_after  # no handshake completes there
                # ...and the expired endpoint is reported out of rotation.
                rows = backend_rows(await admin(proxy, "/status.json"))
                assert rows[endpoint][4] == "expired", rows
            finally:
                stop.set()
                await loader
            assert failures == [], failures[:3]
            assert answered > 50
    finally:
        await good.stop()
        await expiring.stop()
