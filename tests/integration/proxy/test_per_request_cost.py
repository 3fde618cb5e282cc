"""Work the proxy does once instead of per request or per tick: the auth-proxy
identity per connection and route, the HSTS line per route entry, no access-log
record built while that logger is off, and the timer sweep walking every
connection once a second (ticks in between look only at timers due soon)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import ssl
from pathlib import Path
from typing import Any

import pytest

from tests.integration.proxy.test_tls_client_cert import client_ca_route
from tests.integration.proxy.test_tls_edge import edge, https_proxy
from tests.support.pki import LocalCA
from tests.support.proxyharness import (
    RecordingUpstream,
    endpoint,
    read_response,
    route,
    running_proxy,
    table,
)
from waygate.proxy import records as proxy_records
from waygate.proxy import tls as proxy_tls
from waygate.proxy.tls import EdgeCertificates
from waygate.resolver.model import HSTS


@pytest.fixture
async def upstream():
    up = await RecordingUpstream().start()
    yield up
    await up.stop()


async def _tls_requests(port: int, context: ssl.SSLContext, host: str, count: int) -> list[bytes]:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=host
    )
    try:
        out = []
        for _ in range(count):
            writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
            out.append(await read_response(reader))
        return out
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


async def test_client_identity_is_read_once_per_connection_and_route(
    tmp_path: Path, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[str] = []
    original = EdgeCertificates.client_identity

    def counting(self: EdgeCertificates, ssl_object: Any, route: Any) -> Any:
        calls.append(route.name)
        return original(self, ssl_object, route)

    monkeypatch.setattr(EdgeCertificates, "client_identity", counting)
    ca, client_ca = LocalCA(), LocalCA(name="Front proxy clients")
    routes = [client_ca_route(ca, client_ca, "auth.test", "auth")]
    context = ssl.create_default_context(cadata=ca.pem.decode())
    context.check_hostname = False
    cert, key = client_ca.issue(uris=["spiffe://waygate.local/ns/team/sa/alice"])
    (tmp_path / "client.pem").write_bytes(cert + key)
    context.load_cert_chain(tmp_path / "client.pem")
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, _, _):
        responses = await _tls_requests(port, context, "auth.test", 3)
    assert all(r.startswith(b"HTTP/1.1 200") for r in responses)
    assert bytes(upstream.received).count(b"X-Remote-User: spiffe://") == 3
    assert calls == ["auth"]


async def test_hsts_line_is_built_with_the_route_table_not_per_request(
    tmp_path: Path, upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    ca = LocalCA()
    routes = [
        route(
            "hsts.test",
            [("web", 100)],
            name="hsts",
            tls=edge(ca.issue(dns=["hsts.test"]), hsts=HSTS(max_age=600)),
        )
    ]
    context = ssl.create_default_context(cadata=ca.pem.decode())
    async with https_proxy(tmp_path, routes, upstream, ca) as (_, _, port, _, _):
        calls = []
        original = proxy_tls.hsts_line
        monkeypatch.setattr(proxy_tls, "hsts_line", lambda r: calls.append(r) or original(r))
        responses = await _tls_requests(port, context, "hsts.test", 3)
    assert all(b"Strict-Transport-Security: max-age=600\r\n" in r for r in responses)
    assert calls == []


async def test_no_access_log_record_is_built_while_the_logger_is_off(
    upstream: RecordingUpstream, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[int] = []
    monkeypatch.setattr(proxy_records, "_log", lambda *args: built.append(1))
    access = logging.getLogger("waygate.proxy.access")
    monkeypatch.setattr(access, "level", logging.WARNING)
    monkeypatch.setattr(access, "disabled", False)
    access.manager._clear_cache()  # type: ignore[attr-defined]
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    try:
        async with running_proxy(routes) as (_, port):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for _ in range(3):
                writer.write(b"GET / HTTP/1.1\r\nHost: echo.test\r\n\r\n")
                assert (await read_response(reader)).startswith(b"HTTP/1.1 200")
            writer.close()
    finally:
        access.manager._clear_cache()  # type: ignore[attr-defined]
    assert built == []


class CountingSet(set):  # type: ignore[type-arg]
    walks = 0

    def __iter__(self) -> Any:
        CountingSet.walks += 1
        return super().__iter__()


async def test_the_sweep_walks_every_connection_once_a_second_not_every_tick(
    upstream: RecordingUpstream,
) -> None:
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes) as (server, port):
        server.connections = CountingSet(server.connections)
        clients = []
        for _ in range(20):  # idle keep-alive connections
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\nHost: echo.test\r\n\r\n")
            await read_response(reader)
            clients.append(writer)
        CountingSet.walks = 0
        await asyncio.sleep(2.05)
        walks = CountingSet.walks
        for writer in clients:
            writer.close()
    # Ten ticks a second: a walk per tick would be about 20 here.
    assert 1 <= walks <= 4, walks


async def test_a_short_timeout_armed_between_full_sweeps_still_fires_on_time(
    upstream: RecordingUpstream,
) -> None:
    from waygate.proxy.routing import Defaults

    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes, defaults=Defaults(http_request_timeout=0.3)) as (_, port):
        loop = asyncio.get_running_loop()
        for _ in range(3):
            await asyncio.sleep(0.37)  # somewhere between two full sweeps
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET / HTTP/1.1\r\n")  # a head that never completes
            started = loop.time()
            async with asyncio.timeout(5):
                response = await reader.read()
            assert response.startswith(b"HTTP/1.1 408 "), response[:80]
            # 0.3 s and at most a tick or two late (generous: a loaded machine).
            assert loop.time() - started < 1.0
            writer.close()
