"""Tunnel benchmark: bulk throughput through the tunnel against its peers, dials, latency, memory.

In one run, on loopback, every hop with TLS as in production:
- (a) direct:  1 GiB over one loopback TCP connection to the sink;
- (b) grpc:    1 GiB as 64 KiB chunks on one bare grpc.aio bidi stream (mTLS,
               no interceptors): the transport's own ceiling;
- (c) ssh -R:  1 GiB through OpenSSH remote forwarding, `ssh -R` to a local sshd
               (Debian's openssh-server) started here on a free port with a
               generated host key and authorized key (no system config touched);
- tunnel:      1 GiB dialer -> `waygate tunnel serve` -> `waygate tunnel agent`
               -> sink, mTLS on both tunnel hops, through the dial client library.
- proxy:       the tunnel again as the proxy uses it: its upstream protocol
               attached to the dial's data connection (no socket in between),
               256 KiB writes instead of the 64 KiB writes above.
Each figure is the time from connect until the sink has acknowledged the last
byte (the sink answers the byte count after EOF). The tunnel is reported as a
ratio of (b) (aim >= 0.60), of (c) and of (a).

Also, through the tunnel: dials per second (dial, one request, close; 8
concurrent dialers), the latency an HTTP request on a fresh connection gains
over the same request direct (p50/p99), the same for `ssh -R` (a request on a
fresh connection to its forwarded port; the three taken in turn, 100 ms apart),
and the RSS of server and agent with
1,000 concurrent idle tunnelled connections.

Run: .venv/bin/python -m bench.tunnel [--mib 1024] [--dial-seconds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shutil
import socket
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc

from bench.machine import describe
from bench.tunnel import peers
from tests.support.pki import LocalCA

ROOT = Path(__file__).resolve().parents[2]
CHUNK = 64 * 1024
SEND_BUFFER = 1024 * 1024


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith(("WAYGATE_", "OTEL_"))}


class Child:
    """A peer process; its output goes to a log file, as a container runtime's would."""

    def __init__(self, argv: list[str], log: Path, *, stdin: bool = True) -> None:
        self.argv = argv
        self.log = log
        with log.open("wb") as out:
            self.process = subprocess.Popen(
                argv,
                cwd=ROOT,
                stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=clean_env(),
            )

    def first_line(self, timeout: float = 30) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self.log.read_text().splitlines()
            if lines and lines[0].strip():
                return lines[0]
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"{self.argv[:4]} did not start: {self.log.read_text()[-2000:]}")

    def rss_kib(self) -> int:
        for line in Path(f"/proc/{self.process.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
        return 0

    def stop(self) -> None:
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        if self.process.poll() is None:
            self.process.terminate()
        try:
            self.process.wait(30)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(10)


# ---------------------------------------------------------------- bulk senders


def push_tcp(port: int, total: int) -> float:
    """Seconds to push `total` bytes to 127.0.0.1:port and get the sink's count back."""
    payload = memoryview(b"\x5a" * SEND_BUFFER)
    started = time.perf_counter()
    with socket.create_connection(("127.0.0.1", port), timeout=120) as conn:
        sent = 0
        while sent < total:
            n = min(SEND_BUFFER, total - sent)
            conn.sendall(payload[:n])
            sent += n
        conn.shutdown(socket.SHUT_WR)
        ack = b""
        while len(ack) < 8:
            more = conn.recv(8 - len(ack))
            if not more:
                break
            ack += more
    elapsed = time.perf_counter() - started
    if len(ack) != 8 or struct.unpack(">Q", ack)[0] != total:
        raise RuntimeError(f"sink acknowledged {ack!r}, expected {total} bytes")
    return elapsed


def pull_tcp(port: int, total: int) -> float:
    """Seconds to ask the source at 127.0.0.1:port for `total` bytes and receive them all."""
    buffer = bytearray(SEND_BUFFER)
    started = time.perf_counter()
    received = 0
    with socket.create_connection(("127.0.0.1", port), timeout=120) as conn:
        conn.sendall(struct.pack(">Q", total))
        while True:
            n = conn.recv_into(buffer)
            if not n:
                break
            received += n
    elapsed = time.perf_counter() - started
    if received != total:
        raise RuntimeError(f"the source sent {received} bytes, expected {total}")
    return elapsed


async def pull_grpc(port: int, total: int, credentials: grpc.ChannelCredentials) -> float:
    async with grpc.aio.secure_channel(
        f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as channel:
        await channel.channel_ready()
        pull = channel.stream_stream(
            peers.GRPC_PULL, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        started = time.perf_counter()
        call = pull()
        await call.write(struct.pack(">Q", total))
        await call.done_writing()
        received = 0
        async for chunk in call:
            received += len(chunk)
        elapsed = time.perf_counter() - started
    if received != total // CHUNK * CHUNK:
        raise RuntimeError(f"grpc source sent {received} bytes, expected {total}")
    return elapsed


async def push_grpc(port: int, total: int, credentials: grpc.ChannelCredentials) -> float:
    chunk = b"\x5a" * CHUNK
    count = total // CHUNK

    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(count):
            yield chunk

    async with grpc.aio.secure_channel(
        f"127.0.0.1:{port}", credentials, options=[("grpc.ssl_target_name_override", "localhost")]
    ) as channel:
        await channel.channel_ready()
        push = channel.stream_stream(
            peers.GRPC_METHOD, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        started = time.perf_counter()
        call = push(chunks())
        replies = [r async for r in call]
        elapsed = time.perf_counter() - started
    if replies != [struct.pack(">Q", count * CHUNK)]:
        raise RuntimeError(f"grpc sink acknowledged {replies!r}")
    return elapsed


# ---------------------------------------------------------------- ssh -R


class SshForward:
    """A local sshd on a free port and `ssh -R` to it, forwarding to the sink's three
    listeners (bulk, source and, for the latency peer, HTTP)."""

    def __init__(self, directory: Path, target_port: int, source_port: int, http_port: int) -> None:
        sshd, ssh, keygen = (shutil.which(b) for b in ("sshd", "ssh", "ssh-keygen"))
        if sshd is None:
            sshd = "/usr/sbin/sshd" if Path("/usr/sbin/sshd").exists() else None
        if not (sshd and ssh and keygen):
            subprocess.run(["apt-get", "install", "-y", "-qq", "openssh-server", "openssh-client"],
                           check=True, capture_output=True)  # fmt: skip
            sshd, ssh, keygen = "/usr/sbin/sshd", "ssh", "ssh-keygen"
        directory.mkdir(mode=0o700)
        for name in ("host", "client"):
            subprocess.run(
                [keygen, "-q", "-t", "ed25519", "-N", "", "-f", str(directory / name)], check=True
            )
        (directory / "authorized_keys").write_text((directory / "client.pub").read_text())
        self.port = free_port()
        self.forward_port = free_port()
        self.source_forward_port = free_port()
        self.http_forward_port = free_port()
        config = directory / "sshd_config"
        config.write_text(
            "\n".join(
                [
                    f"Port {self.port}",
                    "ListenAddress 127.0.0.1",
                    f"HostKey {directory / 'host'}",
                    f"AuthorizedKeysFile {directory / 'authorized_keys'}",
                    "PasswordAuthentication no",
                    "KbdInteractiveAuthentication no",
                    "PermitRootLogin prohibit-password",
                    "UsePAM no",
                    "StrictModes no",
                    "AllowTcpForwarding yes",
                    "PidFile none",
                    "",
                ]
            )
        )
        Path("/run/sshd").mkdir(exist_ok=True)  # privilege separation directory
        self.sshd = Child(
            [sshd, "-D", "-e", "-f", str(config)], directory / "sshd.log", stdin=False
        )
        wait_for_port(self.port, self.sshd)
        self.ssh = Child(
            [
                ssh, "-N", "-p", str(self.port), "-i", str(directory / "client"),
                "-o", "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null",
                "-o", "ExitOnForwardFailure=yes", "-o", "BatchMode=yes",
                "-R", f"127.0.0.1:{self.forward_port}:127.0.0.1:{target_port}",
                "-R", f"127.0.0.1:{self.source_forward_port}:127.0.0.1:{source_port}",
                "-R", f"127.0.0.1:{self.http_forward_port}:127.0.0.1:{http_port}",
                f"{os.environ.get('USER', 'root')}@127.0.0.1",
            ],
            directory / "ssh.log",
            stdin=False,
        )  # fmt: skip
        wait_for_port(self.forward_port, self.ssh)
        wait_for_port(self.source_forward_port, self.ssh)
        wait_for_port(self.http_forward_port, self.ssh)
        cipher = subprocess.run([ssh, "-G", "127.0.0.1"], capture_output=True, text=True).stdout
        self.ciphers = next(
            (line.split()[1] for line in cipher.splitlines() if line.startswith("ciphers ")), "?"
        ).split(",")[0]

    def stop(self) -> None:
        self.ssh.stop()
        self.sshd.stop()


def wait_for_port(port: int, child: Child, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), 1):
            return
        if child.process.poll() is not None:
            break
        time.sleep(0.1)
    raise RuntimeError(f"{child.argv[0]} did not listen on {port}: {child.log.read_text()[-2000:]}")


# ---------------------------------------------------------------- helpers


def process_tree(root: int) -> list[int]:
    """`root` and its descendants (sshd serves each session from a child)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        todo += children.get(pid, [])
    return found


def sink_child(directory: Path) -> Child:
    """`bench.tunnel.peers sink` on loopback, logging into `directory`: its first line is
    the ports "BULK HTTP SOURCE"."""
    return Child(
        [sys.executable, "-m", "bench.tunnel.peers", "sink", "127.0.0.1"], directory / "sink.log"
    )


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU of this process and of `pids` so far (Linux /proc)."""
    own = os.times()
    total = own.user + own.system
    for pid in pids:
        with contextlib.suppress(OSError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


def best_of(runs: int, measure: Callable[[], float]) -> float:
    return min(measure() for _ in range(runs))


async def best_of_async(runs: int, measure: Callable[[], Awaitable[float]]) -> float:
    return min([await measure() for _ in range(runs)])


def gbps(total: int, seconds: float) -> float:
    return total / seconds / 1e9


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def http_latencies(open_connection, count: int) -> list[float]:  # type: ignore[no-untyped-def]
    """Seconds per GET on a fresh connection (connect, request, full response, close)."""
    request = b"GET / HTTP/1.1\r\nHost: sink\r\nConnection: close\r\n\r\n"
    results = []
    for _ in range(count):
        started = time.perf_counter()
        reader, writer = await open_connection()
        writer.write(request)
        response = await reader.readuntil(b"ok")
        results.append(time.perf_counter() - started)
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
        if not response.startswith(b"HTTP/1.1 200"):
            raise RuntimeError(f"bad response {response[:40]!r}")
    return results


# ---------------------------------------------------------------- the run


async def run(mib: int, dial_seconds: float) -> str:
    total = mib * 1024 * 1024
    lines = [
        "# Tunnel benchmark",
        "",
        f"Machine: {describe()}; load average {os.getloadavg()[0]:.1f} at start.",
        f"Command: `.venv/bin/python -m bench.tunnel --mib {mib}`; {mib} MiB per transfer and "
        "direction, best of 2; TLS on every hop except (a) and (c)'s own ssh encryption.",
        "",
    ]
    results: dict[tuple[str, str], float] = {}
    cpu: dict[tuple[str, str], float] = {}  # CPU seconds per transfer, every process on the path
    with tempfile.TemporaryDirectory(prefix="bench-tunnel-") as tmp:
        directory = Path(tmp)
        ca = LocalCA()
        from bench.tunnel import tunnel  # (tunnel imports this module's Child)

        server_files, client_files = tunnel.identities(directory, ca)
        sink = sink_child(directory)
        grpc_sink = Child(
            [sys.executable, "-m", "bench.tunnel.peers", "grpc-sink",
             str(server_files.cert), str(server_files.key), str(server_files.ca)],
            directory / "grpc-sink.log",
        )  # fmt: skip
        ssh: SshForward | None = None
        try:
            bulk_port, http_port, source_port = (int(p) for p in sink.first_line().split())
            grpc_port = int(grpc_sink.first_line())
            sink_pids = [sink.process.pid]
            for direction, measure in (("up", push_tcp), ("down", pull_tcp)):
                port = bulk_port if direction == "up" else source_port
                before = cpu_seconds(sink_pids)
                results["direct", direction] = best_of(2, lambda: measure(port, total))  # noqa: B023
                cpu["direct", direction] = (cpu_seconds(sink_pids) - before) / 2
            credentials = grpc.ssl_channel_credentials(
                root_certificates=client_files.ca.read_bytes(),
                private_key=client_files.key.read_bytes(),
                certificate_chain=client_files.cert.read_bytes(),
            )
            for direction, grpc_measure in (("up", push_grpc), ("down", pull_grpc)):
                before = cpu_seconds([grpc_sink.process.pid])
                results["grpc", direction] = await best_of_async(
                    2,
                    lambda: grpc_measure(grpc_port, total, credentials),  # noqa: B023
                )
                cpu["grpc", direction] = (cpu_seconds([grpc_sink.process.pid]) - before) / 2
            try:
                ssh = SshForward(directory / "ssh", bulk_port, source_port, http_port)
                ssh_pids = [*sink_pids, ssh.ssh.process.pid]
                for direction, measure in (("up", push_tcp), ("down", pull_tcp)):
                    port = ssh.forward_port if direction == "up" else ssh.source_forward_port
                    before = cpu_seconds([*ssh_pids, *process_tree(ssh.sshd.process.pid)])
                    results["ssh", direction] = best_of(2, lambda: measure(port, total))  # noqa: B023
                    after = cpu_seconds([*ssh_pids, *process_tree(ssh.sshd.process.pid)])
                    cpu["ssh", direction] = (after - before) / 2
            except (RuntimeError, OSError, subprocess.CalledProcessError) as exc:
                lines.append(f"ssh -R not measured: {exc}")
            ports = {"bulk": bulk_port, "http": http_port, "source": source_port}
            if ssh is not None:  # the latency peer: a request through ssh -R's forward
                ports["ssh-http"] = ssh.http_forward_port
            tunnel_report = await tunnel.measure(
                directory, ca, server_files, client_files, ports,
                total, dial_seconds, sink.process.pid,
            )  # fmt: skip
        finally:
            if ssh is not None:
                ssh.stop()
            sink.stop()
            grpc_sink.stop()
    for key, seconds in tunnel_report.seconds.items():
        path, _, direction = key.rpartition("-")
        results[path or "tunnel", direction] = seconds
        cpu[path or "tunnel", direction] = tunnel_report.cpu[key]
    gib = total / (1 << 30)
    names = {
        "direct": "(a) direct loopback TCP",
        "grpc": "(b) one bare grpc.aio bidi stream, 64 KiB messages, mTLS",
        "ssh": f"(c) ssh -R through a local sshd ({ssh.ciphers if ssh else '?'})",
        "tunnel": "**Waygate tunnel**, dial client stream, 64 KiB writes (dialer -> server -> agent -> sink, mTLS both hops)",
        "proxy": "**Waygate tunnel**, as the proxy: its upstream protocol on the data connection, 256 KiB writes",
        "e2e": "**Waygate tunnel, TLS end to end** (dialer <-> agent, the server copies ciphertext), dial client stream, 64 KiB writes",
        "e2e-proxy": "**Waygate tunnel, TLS end to end**, as the proxy, 256 KiB writes",
    }  # fmt: skip
    lines += [
        "| path | GB/s up | GB/s down | proxy-style tunnel / it, up | down | CPU s per GiB up | down |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for path, label in names.items():
        cells = [label]
        for direction in ("up", "down"):
            took = results.get((path, direction))
            cells.append(f"{gbps(total, took):.2f}" if took else "")
        for direction in ("up", "down"):
            proxy = results.get(("proxy", direction))
            took = results.get((path, direction))
            cells.append(f"{took / proxy:.2f}" if proxy and took and "proxy" not in path else "")
        for direction in ("up", "down"):
            spent = cpu.get((path, direction))
            cells.append(f"{spent / gib:.2f}" if spent is not None else "")
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    kinds = {
        "proxy": "as the proxy",
        "tunnel": "64 KiB writes",
        "e2e-proxy": "end to end, as the proxy",
        "e2e": "end to end, 64 KiB writes",
    }
    for path in kinds:
        for peer, aim in (("ssh", 1.5), ("grpc", None), ("direct", None)):
            ratios = [
                results[peer, d] / results[path, d]
                for d in ("up", "down")
                if (peer, d) in results and (path, d) in results
            ]
            if len(ratios) != 2:
                continue
            verdict = ""
            if aim is not None:
                verdict = f" (aim >= {aim}: {'met' if min(ratios) >= aim else 'not met'})"
            lines.append(
                f"Tunnel ({kinds[path]}) / "
                f"{names[peer].split(' ', 1)[1].split(',')[0]}: **{ratios[0]:.2f}** up, "
                f"**{ratios[1]:.2f}** down{verdict}."
            )
    lines += ["", *tunnel_report.lines]
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tunnel")
    parser.add_argument("--mib", type=int, default=1024, help="MiB per bulk transfer [1024]")
    parser.add_argument("--dial-seconds", type=float, default=5.0, help="seconds of dialing [5]")
    args = parser.parse_args()
    print(asyncio.run(run(args.mib, args.dial_seconds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
