"""The tunnel's part of the benchmark: server and agent processes, driven by the dial client.

`waygate tunnel serve` and `waygate tunnel agent` run as separate processes
with static mTLS files from the run's CA (TLS on both tunnel hops, as in
production); the dialer is the dial client library in the driver process, as
the proxy uses it. Measured: the bulk transfer, dials per second, the latency
a tunnelled HTTP request adds over a direct one (also with the request sent as
the dial's early data, and against `ssh -R`'s, in one round robin), and server
and agent memory with 1,000 idle tunnelled connections.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc

from tests.support.pki import IdentityFiles, LocalCA
from waygate.tunnel.client import DataStream, DialFailed, StaticPresence, TunnelClient
from waygate.tunnel.relay import client_context

NODE = "edge-bench"
DIALER = "spiffe://bench.local/ns/waygate/sa/waygate-proxy"
CHUNK = 64 * 1024
PROXY_READ = 256 * 1024  # what one socket read of the proxy's client connection gets
IDLE_CONNECTIONS = 1000
LATENCY_SAMPLES = 300
DIAL_PROFILE = 300  # warm dials (each with one HTTP request) under the profiler
SPACING = 0.1  # seconds between spaced requests: the pools' refills (50 ms after a take) are done
HTTP_REQUEST = b"GET / HTTP/1.1\r\nHost: sink\r\nConnection: close\r\n\r\n"


@dataclasses.dataclass
class TunnelReport:
    # Seconds per transfer and CPU seconds per transfer (every process on the path), by
    # row: "up"/"down" (the dial client's stream, 64 KiB writes) and "proxy-up"/
    # "proxy-down" (a protocol on the data connection, as the proxy's upstream).
    seconds: dict[str, float]
    cpu: dict[str, float]
    lines: list[str]


def identities(directory: Path, ca: LocalCA) -> tuple[IdentityFiles, IdentityFiles]:
    """The tunnel server's and the dialer's certificate files, issued by the run's CA."""
    server_files = ca.write_files(
        directory / "server", dns=["localhost"], ips=["127.0.0.1"],
        uris=["spiffe://bench.local/ns/waygate/sa/waygate-tunnel-server"],
    )  # fmt: skip
    return server_files, ca.write_files(directory / "client", uris=[DIALER])


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


def _checked(stream: Any, end_to_end: bool) -> Any:
    """`stream`, once it is known to be what the row says (end to end, or relayed)."""
    if bool(getattr(stream, "end_to_end", False)) != end_to_end:
        stream.close()
        raise RuntimeError(f"the dial was {'relayed' if end_to_end else 'end to end'}")
    return stream


async def _bulk(
    client: TunnelClient,
    port: int,
    total: int,
    chunk_size: int = CHUNK,
    *,
    end_to_end: bool = False,
) -> float:
    chunk = b"\x5a" * chunk_size
    started = time.perf_counter()
    stream = _checked(await client.dial(NODE, port, end_to_end=end_to_end), end_to_end)
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


class _Pusher(asyncio.Protocol):
    """The proxy's side of an upload: what a client socket read gets (256 KiB) written to
    the data connection as its transport, pausing while its buffer is full."""

    def __init__(self) -> None:
        self.writable: asyncio.Future[None] | None = None
        self.received = b""
        self.done = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None and not self.writable.done():
            self.writable.set_result(None)
        self.writable = None

    def data_received(self, data: bytes) -> None:
        self.received += data

    def eof_received(self) -> bool:
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.done.set_result(None)
        self.resume_writing()


async def _bulk_transport(
    client: TunnelClient, port: int, total: int, *, end_to_end: bool = False
) -> float:
    """`_bulk` as the proxy sends: 256 KiB writes straight onto the data connection."""
    chunk = b"\x5a" * PROXY_READ
    started = time.perf_counter()
    stream = _checked(await client.dial(NODE, port, end_to_end=end_to_end), end_to_end)
    if not isinstance(stream, DataStream):
        raise RuntimeError("the tunnel answered on the gRPC path, not a data connection")
    pusher = _Pusher()
    stream.link.attach(pusher)
    try:
        sent = 0
        while sent < total:
            stream.link.write(chunk)
            sent += PROXY_READ
            if pusher.writable is not None:
                await pusher.writable
        stream.link.write_eof()
        async with asyncio.timeout(120):
            await pusher.done
    finally:
        stream.link.abort()
    elapsed = time.perf_counter() - started
    if pusher.received[:8] != struct.pack(">Q", total):
        raise RuntimeError(f"sink acknowledged {pusher.received[:8]!r}, expected {total}")
    return elapsed


async def _pull(client: TunnelClient, port: int, total: int, *, end_to_end: bool = False) -> float:
    """Download `total` bytes from the source through the tunnel (the stream's reads)."""
    started = time.perf_counter()
    stream = _checked(await client.dial(NODE, port, end_to_end=end_to_end), end_to_end)
    received = 0
    try:
        await stream.write(struct.pack(">Q", total))
        while more := await stream.read():
            received += len(more)
    finally:
        await stream.aclose()
    elapsed = time.perf_counter() - started
    if received != total:
        raise RuntimeError(f"received {received} bytes through the tunnel, expected {total}")
    return elapsed


class _Counter(asyncio.Protocol):
    def __init__(self) -> None:
        self.count = 0
        self.done = asyncio.get_running_loop().create_future()
        self.ended = "not yet"  # how the transfer ended: said when it came up short

    def data_received(self, data: bytes) -> None:
        self.count += len(data)

    def eof_received(self) -> bool:
        if not self.done.done():
            self.ended = "EOF"
            self.done.set_result(None)
        return True

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.done.done():
            self.ended = f"connection lost: {exc!r}"
            self.done.set_result(None)


async def _pull_transport(
    client: TunnelClient, port: int, total: int, *, end_to_end: bool = False
) -> float:
    """`_pull` as the proxy receives: a protocol on the data connection, no stream."""
    started = time.perf_counter()
    stream = _checked(await client.dial(NODE, port, end_to_end=end_to_end), end_to_end)
    if not isinstance(stream, DataStream):
        raise RuntimeError("the tunnel answered on the gRPC path, not a data connection")
    counter = _Counter()
    stream.link.attach(counter)
    try:
        stream.link.write(struct.pack(">Q", total))
        async with asyncio.timeout(120):
            await counter.done
    finally:
        stream.link.abort()
    elapsed = time.perf_counter() - started
    if counter.count != total:
        raise RuntimeError(
            f"received {counter.count} bytes through the tunnel, expected {total} ({counter.ended})"
        )
    return elapsed


async def _tunnel_request(
    client: TunnelClient, port: int, early: bool = False, end_to_end: bool = False
) -> None:
    """Dial, one HTTP request, the response, close; `early`: the request goes as the
    dial's early data (waygate.tunnel.early) instead of after its answer; `end_to_end`:
    TLS from the dialer to the agent."""
    stream = await client.dial(
        NODE, port, early=HTTP_REQUEST if early else b"", end_to_end=end_to_end
    )
    _checked(stream, end_to_end)
    try:
        if not early:
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


async def _latencies(request, count: int, gap: float = 0.0) -> list[float]:  # type: ignore[no-untyped-def]
    samples = []
    for _ in range(count):
        if gap:
            await asyncio.sleep(gap)
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
    *,
    pool_size: int = 4,
) -> RunningTunnel:
    """Start a tunnel server and an agent for NODE, and return once an HTTP request to
    `http_port` on NODE goes through (the agent connected); stops what it started if not."""
    from bench.tunnel.__main__ import Child

    # The agent role: a clientAuth-only certificate naming the node (waygate.tunnel.peers).
    agent_files = ca.write_files(directory / "agent", dns=[NODE], client_only=True)
    server = Child(
        [sys.executable, "-m", "waygate", "tunnel", "serve", "--grpc-port", "0", "--data-port", "0",
         "--dial-port", "0", "--front-port", "0", "--admin-port", "0", "--server-id", server_id,
         "--dialers", DIALER, "--tls-cert-file", str(server_files.cert),
         "--tls-key-file", str(server_files.key), "--tls-client-ca-file", str(server_files.ca)],
        directory / f"tunnel-server-{server_id}.log",
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
             "--allow", "127.0.0.1/32:*", "--pool-size", str(pool_size)],
            directory / f"tunnel-agent-{server_id}.log",
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
            pool_size=pool_size,  # the dialer's warm pool, as the proxy keeps one
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


def _spy() -> str | None:
    """py-spy, installed into this environment when missing (the benchmark's own setup)."""
    found = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(found).exists():
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "py-spy"],
                       check=False, capture_output=True)  # fmt: skip
    return found if Path(found).exists() else None


def _top_frames(raw: Path, count: int = 8) -> list[tuple[float, str]]:
    """The functions with the most samples of their own in a py-spy raw profile."""
    own: collections.Counter[str] = collections.Counter()
    total = 0
    with contextlib.suppress(OSError):
        for line in raw.read_text().splitlines():
            stack, _, samples = line.rpartition(" ")
            if not samples.isdigit():
                continue
            total += int(samples)
            frame = stack.rsplit(";", 1)[-1]
            own[frame.split(" (")[0] + " (" + frame.rsplit("/", 1)[-1]] += int(samples)
    return [(100 * n / total, name) for name, n in own.most_common(count)] if total else []


async def _profiled(
    directory: Path, pids: dict[str, int], transfer: Any
) -> tuple[float, dict[str, list[tuple[float, str]]]]:
    """Run `transfer()` with py-spy recording each process in `pids`."""
    spy = _spy()
    spies = []
    directory.mkdir(parents=True, exist_ok=True)
    if spy is not None:
        for name, pid in pids.items():
            argv = [spy, "record", "--rate", "100", "--format", "raw", "--native",
                    "--pid", str(pid), "--output", str(directory / f"{name}.txt")]  # fmt: skip
            spies.append(
                subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            )
        await asyncio.sleep(1.0)
    try:
        seconds = await transfer()
    finally:
        for process in spies:
            process.send_signal(signal.SIGINT)
        for process in spies:
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(30)
    return seconds, {name: _top_frames(directory / f"{name}.txt") for name in pids}


async def _spaced(requests: dict[str, Any], count: int, gap: float) -> dict[str, list[float]]:
    """Milliseconds per request of each kind, `gap` seconds before every request, the kinds
    taken in turn (round robin): a busy spell on the shared machine falls on all of them."""
    samples: dict[str, list[float]] = {name: [] for name in requests}
    for _ in range(count):
        for name, request in requests.items():
            await asyncio.sleep(gap)
            started = time.perf_counter()
            await request()
            samples[name].append((time.perf_counter() - started) * 1000)
    return samples


def _added(samples: list[float], base: list[float]) -> tuple[float, float]:
    """p50 and p99 of `samples` minus those of `base` (the same request, direct)."""
    return _pct(samples, 0.5) - _pct(base, 0.5), _pct(samples, 0.99) - _pct(base, 0.99)


async def _dial_figures(
    client: TunnelClient,
    http_port: int,
    dial_seconds: float,
    label: str,
    ssh_port: int | None = None,
    end_to_end: bool = False,
) -> list[str]:
    """Dial rate and latency rows; with `ssh_port` (the HTTP port forwarded by `ssh -R`)
    also the latency `ssh -R` adds, measured in the same round robin as the tunnel's."""
    rate = await _dials_per_second(client, http_port, dial_seconds)
    direct = await _latencies(lambda: _direct_request(http_port), LATENCY_SAMPLES)
    tunnelled = await _latencies(lambda: _tunnel_request(client, http_port), LATENCY_SAMPLES)
    kinds: dict[str, Any] = {
        "direct": lambda: _direct_request(http_port),
        "tunnel": lambda: _tunnel_request(client, http_port),
        "early": lambda: _tunnel_request(client, http_port, early=True),
    }
    if end_to_end:  # (needs the agent's parked connections: warm pools only)
        kinds["e2e"] = lambda: _tunnel_request(client, http_port, end_to_end=True)
    if ssh_port is not None:
        kinds["ssh"] = lambda: _direct_request(ssh_port)
    spaced = await _spaced(kinds, LATENCY_SAMPLES // 3, SPACING)

    def shown(added: tuple[float, float]) -> str:
        return f"{added[0]:.2f} / {added[1]:.2f} ms"

    gap = f"{SPACING * 1000:.0f} ms apart"
    tunnel_added = _added(spaced["tunnel"], spaced["direct"])
    early_added = _added(spaced["early"], spaced["direct"])

    rows = [
        f"| {label}: dials per second (dial, one HTTP request, close; 8 concurrent) | {rate:,.0f} |",
        f"| {label}: HTTP request on a fresh connection, direct / tunnelled, p50 | {_pct(direct, 0.5):.2f} / {_pct(tunnelled, 0.5):.2f} ms |",
        f"| **{label}: latency added, requests back to back: p50 / p99** | **{shown(_added(tunnelled, direct))}** |",
        f"| **{label}: latency added, requests {gap} (the pools refilled between): p50 / p99** | **{shown(tunnel_added)}** |",
        f"| **{label}: the same with the request as the dial's early data: p50 / p99** | **{shown(early_added)}** |",
    ]  # fmt: skip
    if "e2e" in spaced:
        rows.append(
            f"| {label}: the same, TLS end to end (a handshake with the agent per dial): "
            f"p50 / p99 | {shown(_added(spaced['e2e'], spaced['direct']))} |"
        )
    if "ssh" in spaced:
        ssh_added = _added(spaced["ssh"], spaced["direct"])

        def ratio(added: tuple[float, float]) -> str:
            return f"{added[0] / ssh_added[0]:.2f}" if ssh_added[0] > 0 else "n/a"

        rows += [
            f"| ssh -R: latency added, requests {gap} (a fresh connection to the forwarded port), p50 / p99 | {shown(ssh_added)} |",
            f"| **{label}: latency added at p50 / ssh -R's, {gap}: without / with early data** | **{ratio(tunnel_added)} / {ratio(early_added)}** |",
        ]  # fmt: skip
    return rows


async def measure(
    directory: Path,
    ca: LocalCA,
    server_files: IdentityFiles,
    client_files: IdentityFiles,
    ports: dict[str, int],
    total: int,
    dial_seconds: float,
    sink_pid: int,
) -> TunnelReport:
    from bench.tunnel.__main__ import cpu_seconds

    bulk_port, http_port, source_port = ports["bulk"], ports["http"], ports["source"]
    seconds: dict[str, float] = {}
    cpu: dict[str, float] = {}
    split: dict[str, list[float]] = {}
    lines: list[str] = []
    profiles: dict[str, dict[str, list[tuple[float, str]]]] = {}
    tunnel = await start_tunnel(
        directory, ca, server_files, client_files, http_port, server_id="bench-0"
    )
    server, agent, client = tunnel.server, tunnel.agent, tunnel.client
    pids = [server.process.pid, agent.process.pid, sink_pid]
    try:
        transfers = {
            "up": lambda: _bulk(client, bulk_port, total),
            "down": lambda: _pull(client, source_port, total),
            "proxy-up": lambda: _bulk_transport(client, bulk_port, total),
            "proxy-down": lambda: _pull_transport(client, source_port, total),
            # TLS end to end (dialer <-> agent, the server copying ciphertext).
            "e2e-up": lambda: _bulk(client, bulk_port, total, end_to_end=True),
            "e2e-down": lambda: _pull(client, source_port, total, end_to_end=True),
            "e2e-proxy-up": lambda: _bulk_transport(client, bulk_port, total, end_to_end=True),
            "e2e-proxy-down": lambda: _pull_transport(client, source_port, total, end_to_end=True),
        }
        for key, transfer in transfers.items():
            before = [cpu_seconds([p]) - cpu_seconds([]) for p in pids], cpu_seconds([])
            seconds[key] = min([await transfer() for _ in range(2)])
            after = [cpu_seconds([p]) - cpu_seconds([]) for p in pids], cpu_seconds([])
            split[key] = [
                *((a - b) / 2 for a, b in zip(after[0], before[0], strict=True)),
                (after[1] - before[1]) / 2,
            ]
            cpu[key] = sum(split[key])
        gib = total / (1 << 30)
        lines += [
            "CPU per GiB through the tunnel, by process (server / agent / sink or source / "
            "the dialer, in the driver):",
            "",
            *(
                f"- {key}: {' / '.join(f'{v / gib:.2f}' for v in values)} s"
                for key, values in split.items()
            ),
            "",
        ]
        relays = {"server": server.process.pid, "agent": agent.process.pid}
        for key in ("up", "proxy-up", "proxy-down", "e2e-proxy-up"):
            # The 64 KiB-writes upload with the dialer too (this process): that cell is
            # the one that lagged the proxy-style one.
            _elapsed, profiles[key] = await _profiled(
                directory / f"profile-{key}",
                {**relays, "dialer": os.getpid()} if key == "up" else relays,
                transfers[key],
            )

        async def warm_dials() -> float:
            # Spaced so the pools refill between: the dial path itself, not the refills.
            await _latencies(lambda: _tunnel_request(client, http_port), DIAL_PROFILE, gap=0.02)
            return 0.0

        _elapsed, profiles["warm dials"] = await _profiled(
            directory / "profile-dials", relays, warm_dials
        )
        lines += ["Where the time goes (py-spy --native, 100 Hz, one transfer each, and "
                  f"{DIAL_PROFILE} warm dials 20 ms apart; the functions with the most samples "
                  "of their own, idle waits included):", ""]  # fmt: skip
        for key, by_process in profiles.items():
            for name, frames in by_process.items():
                shown = "; ".join(f"{share:.0f}% {frame}" for share, frame in frames[:6])
                lines.append(f"- {key}, {name}: {shown or 'no samples'}")
        lines.append("")

        table = ["| through the tunnel | figure |", "|---|---:|"]
        table += await _dial_figures(
            client,
            http_port,
            dial_seconds,
            "warm pools (4 each)",
            ports.get("ssh-http"),
            end_to_end=True,
        )

        rss_before = (server.rss_kib(), agent.rss_kib())
        streams = []
        for _ in range(IDLE_CONNECTIONS):
            streams.append(await client.dial(NODE, bulk_port))
        await asyncio.sleep(1.0)
        rss_idle = (server.rss_kib(), agent.rss_kib())
        for stream in streams:
            await stream.aclose()
        table += [
            f"| RSS server / agent, no connection | {rss_before[0] / 1024:.0f} / {rss_before[1] / 1024:.0f} MiB |",
            f"| RSS server / agent, {IDLE_CONNECTIONS:,} idle tunnelled connections | {rss_idle[0] / 1024:.0f} / {rss_idle[1] / 1024:.0f} MiB |",
            f"| **per idle tunnelled connection, server / agent** | **{(rss_idle[0] - rss_before[0]) / IDLE_CONNECTIONS:.1f} / {(rss_idle[1] - rss_before[1]) / IDLE_CONNECTIONS:.1f} KiB** |",
        ]  # fmt: skip
    finally:
        await tunnel.stop()
    # Cold: no pool on either side (agent --pool-size 0, dialer pool 0): every dial pays
    # both handshakes, as before the pools.
    cold = await start_tunnel(
        directory, ca, server_files, client_files, http_port, server_id="bench-cold", pool_size=0
    )
    try:
        table += await _dial_figures(cold.client, http_port, dial_seconds, "no pools (cold)")
    finally:
        await cold.stop()
    return TunnelReport(seconds, cpu, [*lines, *table])
