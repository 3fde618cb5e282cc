"""`waygate proxy serve` as a real process fed by a real resolver process.

Route changes and a resolver restart during a request loop fail no request;
SIGTERM drains in-flight requests; a 1 GiB upload and a 1 GiB download stream
through with the proxy's RSS growing by less than 64 MiB.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import signal
from pathlib import Path

import pytest

from tests.support.poll import until
from tests.support.processes import RunningService, start_service
from tests.support.proxyharness import RecordingUpstream, body_json, read_response

pytestmark = pytest.mark.system

GiB = 1 << 30


def routes_yaml(port: int, *, path: str = "/", request_buffering: bool = True) -> str:
    return f"""
services:
  - namespace: demo
    name: echo
    ports:
      - {{name: http, port: 80, targetPort: {port}}}
    endpoints:
      - address: 127.0.0.1
routes:
  - namespace: demo
    name: echo
    host: echo.test
    path: {path}
    to: echo
    targetPort: http
    requestBuffering: {str(request_buffering).lower()}
"""


async def start_resolver(routes_file: Path) -> RunningService:
    return await start_service(
        [
            "waygate",
            "resolver",
            "serve",
            "--grpc-port",
            "0",
            "--admin-port",
            "0",
            "--routes-file",
            str(routes_file),
            "--routes-poll-interval",
            "0.1",
        ]
    )


async def start_proxy(resolver_address: str, *extra: str) -> tuple[RunningService, int]:
    proxy = await start_service(
        [
            "waygate",
            "proxy",
            "serve",
            "--http-port",
            "0",
            "--https-port",
            "0",
            "--admin-port",
            "0",
            "--resolver-address",
            resolver_address,
            "--shutdown-grace",
            "10s",
            *extra,
        ]
    )
    entry = next(e for e in proxy.logs if e.get("msg") == "proxy listening" and "http_port" in e)
    return proxy, int(entry["http_port"])


async def get(port: int, path: str = "/", host: bytes = b"echo.test") -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET " + path.encode() + b" HTTP/1.1\r\nHost: " + host + b"\r\n\r\n")
        return await read_response(reader, timeout=10)
    finally:
        writer.close()


async def ready(proxy: RunningService) -> bool:
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", proxy.admin_port)
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        data = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        return data.startswith(b"HTTP/1.1 200")
    except OSError:
        return False


async def wait_ready(proxy: RunningService) -> None:
    deadline = asyncio.get_running_loop().time() + 20
    while not await ready(proxy):
        assert asyncio.get_running_loop().time() < deadline, "proxy never became ready"
        await asyncio.sleep(0.1)


async def test_route_change_and_resolver_restart_fail_no_request(tmp_path: Path) -> None:
    a = await RecordingUpstream("a").start()
    b = await RecordingUpstream("b").start()
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(routes_yaml(a.port))
    resolver = await start_resolver(routes_file)
    proxy, port = await start_proxy(resolver.grpc_address)
    try:
        await wait_ready(proxy)
        results: list[bytes] = []
        stop = asyncio.Event()

        async def loop() -> None:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            try:
                while not stop.is_set():
                    writer.write(b"GET / HTTP/1.1\r\nHost: echo.test\r\n\r\n")
                    results.append(await read_response(reader, timeout=10))
            finally:
                writer.close()

        task = asyncio.create_task(loop())
        await until(lambda: len(results) > 20, "requests through the proxy", timeout=20)
        routes_file.write_text(routes_yaml(b.port))
        await until(lambda: b.requests, "the route change to reach the proxy", timeout=20)
        # The resolver goes away and comes back on the same port: the proxy keeps
        # serving its last table meanwhile.
        address = resolver.grpc_address
        await resolver.stop()
        before = len(results)
        await until(lambda: len(results) > before + 50, "requests while the resolver is away")
        resolver = await start_service(
            [
                "waygate",
                "resolver",
                "serve",
                "--grpc-port",
                address.rsplit(":", 1)[1],
                "--admin-port",
                "0",
                "--routes-file",
                str(routes_file),
            ]
        )
        routes_file.write_text(routes_yaml(a.port))
        count_a = len(a.requests)
        await until(lambda: len(a.requests) > count_a + 5, "the resumed watch", timeout=30)
        stop.set()
        await asyncio.wait_for(task, 15)
        assert results and all(r.startswith(b"HTTP/1.1 200 ") for r in results)
    finally:
        for entry in proxy.logs:
            if entry.get("level") not in ("info", "debug"):
                print("PROXY", entry)
        await proxy.stop()
        await resolver.stop()
        await a.stop()
        await b.stop()


async def test_sigterm_drains_in_flight_requests(tmp_path: Path) -> None:
    upstream = await RecordingUpstream().start()
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(routes_yaml(upstream.port))
    resolver = await start_resolver(routes_file)
    proxy, port = await start_proxy(resolver.grpc_address)
    try:
        await wait_ready(proxy)
        in_flight = [asyncio.create_task(get(port, "/slow?s=1")) for _ in range(10)]
        await until(lambda: len(upstream.requests) == 10, "ten requests in flight")
        proxy.process.send_signal(signal.SIGTERM)
        responses = await asyncio.gather(*in_flight)
        assert all(r.startswith(b"HTTP/1.1 200 ") for r in responses)
        assert await proxy.stop(sig=None) == 0
    finally:
        with contextlib.suppress(Exception):
            await proxy.stop()
        await resolver.stop()
        await upstream.stop()


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError("no VmRSS")


async def test_one_gib_upload_and_download_stream_in_bounded_memory(tmp_path: Path) -> None:
    upstream = await RecordingUpstream().start()
    routes_file = tmp_path / "routes.yaml"
    # A streaming route: request buffering off (a 1 GiB body is past its bound).
    routes_file.write_text(routes_yaml(upstream.port, request_buffering=False))
    resolver = await start_resolver(routes_file)
    proxy, port = await start_proxy(resolver.grpc_address)
    try:
        await wait_ready(proxy)
        assert (await get(port)).startswith(b"HTTP/1.1 200 ")
        baseline = rss_kib(proxy.process.pid)
        peak = baseline

        async def sample() -> None:
            nonlocal peak
            while True:
                peak = max(peak, rss_kib(proxy.process.pid))
                await asyncio.sleep(0.05)

        sampler = asyncio.create_task(sample())
        # Upload: 1 GiB with Content-Length, sent as fast as the proxy takes it.
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /up HTTP/1.1\r\nHost: echo.test\r\nContent-Length: %d\r\n\r\n" % GiB)
        block = b"u" * (1 << 20)
        for _ in range(GiB // len(block)):
            writer.write(block)
            await writer.drain()
        response = await read_response(reader, timeout=60)
        assert body_json(response)["body_length"] == 0 or response.startswith(b"HTTP/1.1 200 ")
        # Download: 1 GiB, read slowly at first so the proxy must pause its upstream.
        writer.write(b"GET /big?n=%d HTTP/1.1\r\nHost: echo.test\r\n\r\n" % GiB)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        assert head.startswith(b"HTTP/1.1 200 ")
        await asyncio.sleep(1.0)
        received = 0
        while received < GiB:
            piece = await asyncio.wait_for(reader.read(1 << 20), 30)
            assert piece, "download cut short"
            received += len(piece)
        writer.close()
        sampler.cancel()
        growth_mib = (peak - baseline) / 1024
        assert received == GiB
        assert growth_mib < 64, f"proxy RSS grew by {growth_mib:.1f} MiB"
    finally:
        await proxy.stop()
        await resolver.stop()
        await upstream.stop()


async def test_workers_share_the_port_and_one_metrics_endpoint(tmp_path: Path) -> None:
    upstream = await RecordingUpstream().start()
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(routes_yaml(upstream.port))
    resolver = await start_resolver(routes_file)
    proxy, port = await start_proxy(resolver.grpc_address, "--workers", "2")
    try:
        await wait_ready(proxy)
        responses = await asyncio.gather(*(get(port) for _ in range(40)))
        assert all(r.startswith(b"HTTP/1.1 200 ") for r in responses)

        workers: set[str] = set()

        async def scraped_total() -> float:
            reader, writer = await asyncio.open_connection("127.0.0.1", proxy.admin_port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            data = (await asyncio.wait_for(reader.read(), 5)).decode()
            writer.close()
            lines = [
                line
                for line in data.splitlines()
                if line.startswith("waygate_proxy_requests_total{")
            ]
            workers.update(re.findall(r'worker="(\w+)"', "\n".join(lines)))
            return sum(float(line.rsplit(" ", 1)[1]) for line in lines)

        deadline = asyncio.get_running_loop().time() + 10
        while await scraped_total() < 40:
            assert asyncio.get_running_loop().time() < deadline, "merged metrics never reached 40"
            await asyncio.sleep(0.2)
        # One worker group for every service (waygate.core.workers): each worker's
        # families, labelled by worker (the kernel may give one worker every request).
        assert workers and workers <= {"0", "1"}, workers
        assert await proxy.stop() == 0
    finally:
        with contextlib.suppress(Exception):
            await proxy.stop()
        await resolver.stop()
        await upstream.stop()
