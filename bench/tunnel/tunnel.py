"""The tunnel's part of the benchmark: server and agent processes, driven by the dial client.

`waygate tunnel serve` and `waygate tunnel agent` run as separate processes
with static mTLS files from the run's CA (TLS on both tunnel hops, as in
production); the dialer is the dial client library in the driver process, as
the proxy uses it. Measured: the bulk transfer, dials per second, the latency
a tunnelled HTTP request adds over a direct one, and server and agent memory
with 1,000 idle tunnelled connections.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import socket
import struct
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from tests.support.pki import IdentityFiles, LocalCA
from waygate.tunnel.client import DialFailed, StaticPresence, TunnelClient, bridged_socket
from waygate.tunnel.relay import client_context

NODE = "edge-bench"
DIALER = "spiffe://bench.local/ns/waygate/sa/waygate-proxy"
CHUNK = 64 * 1024
IDLE_CONNECTIONS = 1000
LATENCY_SAMPLES = 300
HTTP_REQUEST = b"GET / HTTP/1.1\r\nHost: sink\r\nConnection: close\r\n\r\n"


@dataclasses.dataclass
class TunnelReport:
    bulk_seconds: float | None
    lines: list[str]
    bulk_cpu: float | None = None  # CPU seconds per transfer: driver, server, agent, sink
    # The same transfer with the dialer writing a socket bridged to the stream (as the proxy).
    bridged_seconds: float | None = None
    bridged_cpu: float | None = None


def _log_entry(log: Path, message: str) -> dict | None:  # type: ignore[type-arg]
    for line in log.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            entry = json.loads(line)
            if isinstance(entry, dict) and entry.get("msg") == message:
                return entry
    return None


async def _wait_log(child, message: str, timeout: float = 60) -> dict:  # type: ignore[no-untyped-def, type-arg]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        entry = _log_entry(child.log, message)
        if entry is not None:
            return entry
        if child.process.poll() is not None:
            break
        await asyncio.sleep(0.05)
    raise RuntimeError(
        f"{child.argv[2:5]} never logged {message!r}: {child.log.read_text()[-2000:]}"
    )


async def _bulk(client: TunnelClient, port: int, total: int, chunk_size: int = CHUNK) -> float:
    chunk = b"\x5a" * chunk_size
    started = time.perf_counter()
    stream = await client.dial(NODE, port)
    try:
        sent = 0
        while sent < total:
            await stream.write(chunk)
            sent += chunk_size
        await stream.write_eof()
        ack = b""
        while len(ack) < 8:
            more = await stream.read()
            if not more:
                break
            ack += more
    finally:
        await stream.aclose()
    elapsed = time.perf_counter() - started
    if ack[:8] != struct.pack(">Q", total):
        raise RuntimeError(f"sink acknowledged {ack!r} through the tunnel, expected {total}")
    return elapsed


async def _bulk_bridged(client: TunnelClient, port: int, total: int) -> float:
    """`_bulk` as the proxy sends: a socket written in 1 MiB calls, bridged to the stream.

    The bridge (`waygate.tunnel.client.bridged_socket`) sends what each socket
    read gets (up to 256 KiB, joined up to MAX_CHUNK), so the dialer's frames
    are as large as the proxy's would be for a client uploading in bulk.
    """
    loop = asyncio.get_running_loop()
    payload = memoryview(b"\x5a" * (1024 * 1024))
    started = time.perf_counter()
    stream = await client.dial(NODE, port)
    sock = await bridged_socket(stream)
    try:
        sent = 0
        while sent < total:
            size = min(len(payload), total - sent)
            await loop.sock_sendall(sock, payload[:size])
            sent += size
        sock.shutdown(socket.SHUT_WR)
        ack = b""
        while len(ack) < 8:
            more = await asyncio.wait_for(loop.sock_recv(sock, 8 - len(ack)), 120)
            if not more:
                break
            ack += more
    finally:
        sock.close()
    elapsed = time.perf_counter() - started
    if ack[:8] != struct.pack(">Q", total):
        raise RuntimeError(f"sink acknowledged {ack!r} through the bridge, expected {total}")
    return elapsed


async def _tunnel_request(client: TunnelClient, port: int) -> None:
    stream = await client.dial(NODE, port)
    try:
        await stream.write(HTTP_REQUEST)
        received = b""
        while not received.endswith(b"ok"):
            more = await stream.read()
            if not more:
                raise RuntimeError(f"tunnelled request ended early: {received[:80]!r}")
            received += more
    finally:
        await stream.aclose()


async def _direct_request(port: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(HTTP_REQUEST)
    await reader.readuntil(b"ok")
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()


async def _latencies(request, count: int) -> list[float]:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(count):
        started = time.perf_counter()
        await request()
        samples.append((time.perf_counter() - started) * 1000)
    return samples


def _pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _dials_per_second(client: TunnelClient, port: int, seconds: float) -> float:
    done = 0
    stop_at = time.perf_counter() + seconds

    async def worker() -> None:
        nonlocal done
        while time.perf_counter() < stop_at:
            await _tunnel_request(client, port)
            done += 1

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(8)))
    return done / (time.perf_counter() - started)


@dataclasses.dataclass
class RunningTunnel:
    """`tunnel serve` and `tunnel agent` (mTLS both hops) and a dial client through them."""

    server: Any  # bench.tunnel.__main__.Child
    agent: Any
    client: TunnelClient

    async def stop(self) -> None:
        await self.client.close()
        self.agent.stop()
        self.server.stop()


async def start_tunnel(
    directory: Path,
    ca: LocalCA,
    server_files: IdentityFiles,
    client_files: IdentityFiles,
    http_port: int,
    server_id: str,
) -> RunningTunnel:
    """Start a tunnel server and an agent for NODE, and return once an HTTP request to
    `http_port` on NODE goes through (the agent connected); stops what it started if not."""
    from bench.tunnel.__main__ import Child

    agent_files = ca.write_files(directory / "agent", dns=[NODE])
    server = Child(
        [sys.executable, "-m", "waygate", "tunnel", "serve", "--grpc-port", "0", "--data-port", "0",
         "--dial-port", "0", "--front-port", "0", "--admin-port", "0", "--server-id", server_id,
         "--dialers", DIALER, "--tls-cert-file", str(server_files.cert),
         "--tls-key-file", str(server_files.key), "--tls-client-ca-file", str(server_files.ca)],
        directory / "tunnel-server.log",
    )  # fmt: skip
    agent = None
    client = None
    try:
        listening = await _wait_log(server, "listening")
        agent_port, dial_port = listening["grpc_ports"][:2]
        agent = Child(
            [sys.executable, "-m", "waygate", "tunnel", "agent", "--server-address",
             f"127.0.0.1:{agent_port}", "--server-name", "localhost", "--node", NODE,
             "--admin-port", "0", "--tls-cert-file", str(agent_files.cert),
             "--tls-key-file", str(agent_files.key), "--tls-client-ca-file", str(agent_files.ca),
             "--allow", "127.0.0.1/32:*"],
            directory / "tunnel-agent.log",
        )  # fmt: skip
        credentials = grpc.ssl_channel_credentials(
            root_certificates=client_files.ca.read_bytes(),
            private_key=client_files.key.read_bytes(),
            certificate_chain=client_files.cert.read_bytes(),
        )
        # Raw dials on the data listener (the data path); Tunnel.Dial only as fallback.
        context = client_context(
            client_files.ca.read_bytes(),
            client_files.cert.read_bytes(),
            client_files.key.read_bytes(),
        )
        client = TunnelClient(
            StaticPresence([f"127.0.0.1:{dial_port}"]),
            credentials=lambda: credentials,
            server_name="localhost",
            ssl_context=lambda: context,
        )
        deadline = time.monotonic() + 60
        while True:
            try:
                await _tunnel_request(client, http_port)
                return RunningTunnel(server, agent, client)
            except DialFailed:
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"the agent never connected: {agent.log.read_text()[-2000:]}"
                    ) from None
                await asyncio.sleep(0.2)
    except BaseException:
        if client is not None:
            await client.close()
        if agent is not None:
            agent.stop()
        server.stop()
        raise


async def measure(
    directory: Path,
    ca: LocalCA,
    server_files: IdentityFiles,
    client_files: IdentityFiles,
    bulk_port: int,
    http_port: int,
    total: int,
    dial_seconds: float,
    sink_pid: int,
) -> TunnelReport:
    tunnel = await start_tunnel(
        directory, ca, server_files, client_files, http_port, server_id="bench-0"
    )
    server, agent, client = tunnel.server, tunnel.agent, tunnel.client
    lines: list[str] = []
    try:
        from bench.tunnel.__main__ import cpu_seconds

        pids = [server.process.pid, agent.process.pid, sink_pid]
        before = [cpu_seconds([p]) - cpu_seconds([]) for p in pids], cpu_seconds([])
        bulk = min([await _bulk(client, bulk_port, total) for _ in range(2)])
        after = [cpu_seconds([p]) - cpu_seconds([]) for p in pids], cpu_seconds([])
        split = [(a - b) / 2 for a, b in zip(after[0], before[0], strict=True)]
        driver = (after[1] - before[1]) / 2
        bulk_cpu = sum(split) + driver
        gib = total / (1 << 30)
        lines += [
            "CPU per GiB through the tunnel, by process: dialer (dial client, in the driver) "
            f"{driver / gib:.2f} s, server {split[0] / gib:.2f} s, agent {split[1] / gib:.2f} s, "
            f"sink {split[2] / gib:.2f} s.",
            "",
        ]
        before = [cpu_seconds([p]) - cpu_seconds([]) for p in pids], cpu_seconds([])
        bridged = min([await _bulk_bridged(client, bulk_port, total) for _ in range(2)])
        after = [cpu_seconds([p]) - cpu_seconds([]) for p in pids], cpu_seconds([])
        bridged_split = [(a - b) / 2 for a, b in zip(after[0], before[0], strict=True)]
        bridged_driver = (after[1] - before[1]) / 2
        bridged_cpu = sum(bridged_split) + bridged_driver
        lines += [
            "The same transfer with the dialer as the proxy sends (a socket written in 1 MiB "
            "calls, bridged to the stream by `waygate.tunnel.client.bridged_socket`: frames of "
            f"up to 256 KiB): {total / bridged / 1e9:.2f} GB/s; CPU per GiB: dialer "
            f"{bridged_driver / gib:.2f} s, server {bridged_split[0] / gib:.2f} s, agent "
            f"{bridged_split[1] / gib:.2f} s, sink {bridged_split[2] / gib:.2f} s.",
            "",
        ]
        rate = await _dials_per_second(client, http_port, dial_seconds)
        direct = await _latencies(lambda: _direct_request(http_port), LATENCY_SAMPLES)
        tunnelled = await _latencies(lambda: _tunnel_request(client, http_port), LATENCY_SAMPLES)

        rss_before = (server.rss_kib(), agent.rss_kib())
        streams = []
        for _ in range(IDLE_CONNECTIONS):
            streams.append(await client.dial(NODE, bulk_port))
        await asyncio.sleep(1.0)
        rss_idle = (server.rss_kib(), agent.rss_kib())
        for stream in streams:
            await stream.aclose()

        lines += [
            "| through the tunnel | figure |",
            "|---|---:|",
            f"| dials per second (dial, one HTTP request, close; 8 concurrent) | {rate:,.0f} |",
            f"| HTTP request on a fresh connection, direct: p50 / p99 | {_pct(direct, 0.5):.2f} / {_pct(direct, 0.99):.2f} ms |",
            f"| the same through the tunnel: p50 / p99 | {_pct(tunnelled, 0.5):.2f} / {_pct(tunnelled, 0.99):.2f} ms |",
            f"| **added by the tunnel: p50 / p99** | **{_pct(tunnelled, 0.5) - _pct(direct, 0.5):.2f} / {_pct(tunnelled, 0.99) - _pct(direct, 0.99):.2f} ms** |",
            f"| RSS server / agent, no connection | {rss_before[0] / 1024:.0f} / {rss_before[1] / 1024:.0f} MiB |",
            f"| RSS server / agent, {IDLE_CONNECTIONS:,} idle tunnelled connections | {rss_idle[0] / 1024:.0f} / {rss_idle[1] / 1024:.0f} MiB |",
            f"| per idle connection, server / agent | {(rss_idle[0] - rss_before[0]) / IDLE_CONNECTIONS:.1f} / {(rss_idle[1] - rss_before[1]) / IDLE_CONNECTIONS:.1f} KiB |",
        ]  # fmt: skip
        return TunnelReport(bulk, lines, bulk_cpu, bridged, bridged_cpu)
    finally:
        await tunnel.stop()
