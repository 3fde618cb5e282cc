"""Proxy benchmark: Waygate's HTTP proxy beside HAProxy, nginx and a minimal Python relay.

    python -m bench.proxy [--duration 5] [--skip-big]

Every proxy forwards to the same upstream, an nginx (1 worker) serving fixed
64 B and 16 KiB bodies from a tmpfs directory and a 1 GiB sparse file (C speed,
sendfile: far faster than any proxy here, which the "upstream direct" row shows).
Peers come from Debian's packages (`apt-get install -y haproxy nginx wrk curl`
when missing).

Round 1, one core each: the proxy under test is pinned to core 0 (taskset);
wrk (1 thread), the upstream and Waygate's resolver (its control plane,
idle while measuring) to core 1. Waygate `--workers 1`, HAProxy `nbthread 1`,
nginx `worker_processes 1`, and the minimal uvloop + httptools relay
(bench/proxy/minimal.py). Round 2: the same with 2 workers / threads, every
process on both cores (a 2-core machine has no third core to keep apart).
For each response size (64 B, 16 KiB) and connection count (50, 200), the
proxies take turns (order rotated per cell), each with 1 s of warm-up before
its measured run (the headline cell, 64 B at 50 connections, three turns, each
proxy's median kept); req/s and p99 latency from wrk, and ratios to HAProxy (and
Waygate to the minimal relay), plus each proxy's CPU time (user + system of all
its processes, from /proc) per request, which other work on the machine moves
much less than req/s. Then one 1 GiB response through each proxy with
curl: GB/s and the proxy's peak RSS during the transfer (VmHWM reset before it,
summed over the proxy's processes).

Every proxy adds X-Forwarded-For (Waygate does by default; HAProxy `option
forwardfor`, nginx `proxy_set_header`), keeps up to 512 idle upstream
connections alive (Waygate `--upstream-max-idle 512`, nginx `keepalive 512`;
HAProxy keeps them all), and logs nothing per request (Waygate's access log is
sampled).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from bench.machine import describe
from bench.peer import ROOT, Peer, pinned

HOST = "bench.local"  # the route's host; HAProxy and nginx ignore it
PROXY_CORE = "0"
CLIENT_CORE = "1"
BOTH_CORES = "0,1"
SIZES = (("64 B", "/64", 64), ("16 KiB", "/16k", 16 * 1024))
CONNECTIONS = (50, 200)
BIG = 1 << 30
DIRECT = "upstream direct (no proxy)"
MINIMAL = "minimal uvloop+httptools"
HEADLINE = ("64 B", 50)  # the floor: Waygate at least 0.45 of HAProxy here
HEADLINE_REPEATS = 3
PEERS = {"haproxy": "haproxy", "nginx": "nginx", "wrk": "wrk", "curl": "curl"}


def install_peers(modules: dict[str, str] | None = None) -> None:
    """Debian's packages for the peers missing here; `modules`: also these (file that
    must exist -> package), e.g. an nginx module."""
    missing = [package for command, package in PEERS.items() if shutil.which(command) is None]
    missing += [package for path, package in (modules or {}).items() if not Path(path).exists()]
    if not missing:
        return
    print(f"bench.proxy: installing {' '.join(missing)}", file=sys.stderr, flush=True)
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env)
    subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def tree(pid: int) -> list[int]:
    """`pid` and its descendants (nginx's workers, Waygate's worker processes)."""
    found = [pid]
    for task in Path(f"/proc/{pid}/task").glob("*"):
        with contextlib.suppress(OSError):
            for child in (task / "children").read_text().split():
                found += tree(int(child))
    return found


def status_kib(pid: int, key: str) -> int:
    with contextlib.suppress(OSError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def http_status(port: int, path: str) -> int:
    with (
        contextlib.suppress(OSError, ValueError, IndexError),
        socket.create_connection(("127.0.0.1", port), timeout=2) as conn,
    ):
        conn.sendall(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
        return int(conn.recv(64).split(b" ", 2)[1])
    return 0


class Proxy(Peer):
    """A proxy under test, serving plain HTTP/1.1 on `port` (ready once /64 is a 200)."""

    def __init__(
        self, name: str, argv: list[str], port: int, cores: str, log: Path | None = None
    ) -> None:
        super().__init__(name, argv, cores, log)
        self.port = port

    def serving(self) -> str | None:
        status = http_status(self.port, "/64")
        return None if status == 200 else f"last status {status}"


# ---------------------------------------------------------------- configurations


def upstream_conf(directory: Path, port: int, big: Path) -> Path:
    (directory / "www").mkdir()
    (directory / "www" / "64").write_bytes(b"x" * 63 + b"\n")
    (directory / "www" / "16k").write_bytes(b"y" * (16 * 1024 - 1) + b"\n")
    return nginx_conf(
        directory / "upstream.conf",
        directory,
        workers=1,
        server=f"""
            listen 127.0.0.1:{port} backlog=4096;
            root {directory / "www"};
            location = /big {{ alias {big}; }}
        """,
    )


def nginx_conf(
    path: Path, directory: Path, *, workers: int, server: str, http: str = "", main: str = ""
) -> Path:
    """An nginx configuration; `main`: directives of the main context (load_module)."""
    temp = directory / f"{path.stem}-temp"
    temp.mkdir()
    temp.chmod(0o777)
    path.write_text(
        main
        + textwrap.dedent(
            f"""\
            worker_processes {workers};
            daemon off;
            pid {directory / path.stem}.pid;
            error_log {directory / path.stem}-error.log warn;
            events {{ worker_connections 8192; }}
            http {{
              access_log off;
              default_type application/octet-stream;
              sendfile on;
              tcp_nopush on;
              keepalive_requests 10000000;
              keepalive_timeout 300s;
              client_body_temp_path {temp}/body;
              proxy_temp_path {temp}/proxy;
              fastcgi_temp_path {temp}/fastcgi;
              uwsgi_temp_path {temp}/uwsgi;
              scgi_temp_path {temp}/scgi;
              {http}
              server {{
                {server}
              }}
            }}
            """
        )
    )
    return path


def nginx_proxy_conf(directory: Path, port: int, upstream: int, workers: int) -> Path:
    return nginx_conf(
        directory / f"nginx-proxy-{workers}.conf",
        directory,
        workers=workers,
        http=f"upstream up {{ server 127.0.0.1:{upstream}; keepalive 512; }}",
        server=f"""
            listen 127.0.0.1:{port} backlog=4096;
            location / {{
              proxy_pass http://up;
              proxy_http_version 1.1;
              proxy_set_header Connection "";
              proxy_set_header Host $host;
              proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            }}
            location = /big {{
              proxy_pass http://up;
              proxy_http_version 1.1;
              proxy_set_header Connection "";
              proxy_buffering off;
            }}
        """,
    )


def haproxy_conf(directory: Path, port: int, upstream: int, threads: int) -> Path:
    path = directory / f"haproxy-{threads}.cfg"
    path.write_text(
        textwrap.dedent(
            f"""\
            global
              nbthread {threads}
              maxconn 8000
            defaults
              mode http
              option http-keep-alive
              option forwardfor
              http-reuse safe
              timeout connect 5s
              timeout client 30s
              timeout server 30s
            frontend bench
              bind 127.0.0.1:{port}
              default_backend upstream
            backend upstream
              server up 127.0.0.1:{upstream}
            """
        )
    )
    return path


def routes_file(path: Path, upstream: int, *, edge_tls: bool = False) -> Path:
    """The benchmark's one route to the upstream; `edge_tls` makes it an edge route
    that still serves plain HTTP (the HTTPS benchmark's)."""
    tls = (
        "    tls:\n      termination: edge\n      insecureEdgeTerminationPolicy: Allow\n"
        if edge_tls
        else ""
    )
    path.write_text(
        textwrap.dedent(
            f"""\
            services:
              - namespace: bench
                name: upstream
                ports:
                  - {{name: http, port: 80, targetPort: {upstream}}}
                endpoints:
                  - address: 127.0.0.1
            routes:
              - namespace: bench
                name: upstream
                host: {HOST}
                to: upstream
                targetPort: http
            """
        )
        + tls
    )
    return path


# ---------------------------------------------------------------- measuring


@dataclass
class Run:
    rps: float
    p99_ms: float
    errors: str
    cpu_us: float = 0.0  # the proxy's CPU (user + system, all its processes) per request


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds used so far by these processes."""
    ticks = os.sysconf("SC_CLK_TCK")
    total = 0
    for pid in pids:
        with contextlib.suppress(OSError, IndexError, ValueError):
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / ticks


def _ms(text: str) -> float:
    number, unit = re.fullmatch(r"([\d.]+)(us|ms|s)", text).groups()  # type: ignore[union-attr]
    return float(number) * {"us": 0.001, "ms": 1.0, "s": 1000.0}[unit]


def wrk(
    port: int,
    path: str,
    connections: int,
    seconds: float,
    cores: str,
    host: str = HOST,
    headers: tuple[str, ...] = (),
) -> Run:
    """wrk's closed loop (1 thread) on `path`; `headers`: more request lines ("Name: value")."""
    extra = [arg for header in headers for arg in ("-H", header)]
    result = subprocess.run(
        pinned(
            cores,
            ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s", "--latency", "-H", f"Host: {host}",
             *extra, f"http://127.0.0.1:{port}{path}"],
        ),
        capture_output=True, text=True, timeout=seconds + 60,
    )  # fmt: skip
    out = result.stdout
    rps = float(re.search(r"Requests/sec:\s+([\d.]+)", out).group(1))  # type: ignore[union-attr]
    p99 = _ms(re.search(r"\s99%\s+(\S+)", out).group(1))  # type: ignore[union-attr]
    errors = []
    if match := re.search(r"Non-2xx or 3xx responses: (\d+)", out):
        errors.append(f"{match.group(1)} non-2xx")
    if match := re.search(r"Socket errors: (.*)", out):
        errors.append(match.group(1))
    return Run(rps, p99, "; ".join(errors))


def big_transfer(proxy: Proxy, cores: str) -> tuple[float, float]:
    """GB/s of one 1 GiB response through `proxy`, and its peak RSS (MiB) meanwhile."""
    pids = tree(proxy.pid)
    for pid in pids:
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")  # reset VmHWM to the current RSS
    result = subprocess.run(
        pinned(
            cores,
            ["curl", "-s", "-o", "/dev/null", "-H", f"Host: {HOST}", "-w",
             "%{http_code} %{size_download} %{time_total}", f"http://127.0.0.1:{proxy.port}/big"],
        ),
        capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    code, size, seconds = result.stdout.split()
    if code != "200" or int(size) != BIG:
        raise RuntimeError(f"{proxy.name}: 1 GiB transfer got {code} with {size} bytes")
    peak = sum(status_kib(pid, "VmHWM") for pid in pids) / 1024
    return BIG / float(seconds) / 1e9, peak


# ---------------------------------------------------------------- the run


def start_proxies(
    directory: Path, upstream: int, resolver_address: str, workers: int, cores: str
) -> list[Proxy]:
    ports = [free_port() for _ in range(4)]
    waygate = [
        sys.executable, "-m", "waygate", "proxy", "serve", "--http-port", str(ports[0]),
        "--https-port", "0", "--admin-port", "0", "--resolver-address", resolver_address,
        "--workers", str(workers),
        # Up to 512 idle upstream connections, as nginx's `keepalive 512` (HAProxy keeps
        # every idle one): with the default 64, 200 clients churn upstream connections.
        "--upstream-max-idle", "512",
    ]  # fmt: skip
    proxies = [
        Proxy(f"Waygate ({workers} worker{'s' * (workers > 1)})", waygate, ports[0], cores,
              log=directory / f"waygate-{workers}.log"),
        Proxy(f"HAProxy (nbthread {workers})",
              ["haproxy", "-db", "-f", str(haproxy_conf(directory, ports[1], upstream, workers))],
              ports[1], cores),
        Proxy(f"nginx ({workers} worker{'s' * (workers > 1)})",
              ["nginx", "-e", "stderr", "-c", str(nginx_proxy_conf(directory, ports[2], upstream, workers))],
              ports[2], cores),
    ]  # fmt: skip
    if workers == 1:
        proxies.append(
            Proxy(MINIMAL, [sys.executable, "-m", "bench.proxy.minimal",
                  str(ports[3]), str(upstream)], ports[3], cores)
        )  # fmt: skip
    try:
        for proxy in proxies:
            proxy.start()
    except BaseException:
        for proxy in proxies:  # the one that failed too: it may still be running
            proxy.stop()
        raise
    return proxies


def rotated(items: list[Proxy], turn: int) -> Iterator[Proxy]:
    for index in range(len(items)):
        yield items[(index + turn) % len(items)]


def measure_round(
    proxies: list[Proxy], seconds: float, client_cores: str, upstream: int
) -> dict[tuple[str, int], dict[str, Run]]:
    table: dict[tuple[str, int], dict[str, Run]] = {}
    turn = 0
    for label, path, _size in SIZES:
        for connections in CONNECTIONS:
            runs: dict[str, list[Run]] = {proxy.name: [] for proxy in proxies}
            # The headline cell (the floor) takes turns three times, order
            # rotated each time, and keeps each proxy's median run: one 5 s run of
            # HAProxy moves by a third between runs on this VM.
            for repeat in range(HEADLINE_REPEATS if (label, connections) == HEADLINE else 1):
                for proxy in rotated(proxies, turn + repeat):
                    wrk(proxy.port, path, connections, 1, client_cores)  # warm-up
                    pids = tree(proxy.pid)
                    before = cpu_seconds(pids)
                    run = wrk(proxy.port, path, connections, seconds, client_cores)
                    run.cpu_us = (cpu_seconds(pids) - before) / max(run.rps * seconds, 1) * 1e6
                    runs[proxy.name].append(run)
            cell = {proxy.name: median_run(runs[proxy.name]) for proxy in proxies}  # row order
            wrk(upstream, path, connections, 1, client_cores)
            cell[DIRECT] = wrk(upstream, path, connections, seconds, client_cores)
            table[(label, connections)] = cell
            turn += 1
            print(f"bench.proxy: {label} x {connections} done", file=sys.stderr, flush=True)
    return table


def median_run(runs: list[Run]) -> Run:
    """The run with the median req/s (its own p99 and CPU go with it)."""
    return sorted(runs, key=lambda run: run.rps)[len(runs) // 2]


def render_round(title: str, table: dict[tuple[str, int], dict[str, Run]]) -> list[str]:
    lines = [f"## {title}", "",
             "| response | conns | proxy | req/s | p99 | / HAProxy | / minimal | CPU per request "
             "| HAProxy's CPU / this | errors |",
             "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]  # fmt: skip
    for (label, connections), cell in table.items():
        haproxy = next(run for name, run in cell.items() if name.startswith("HAProxy"))
        minimal = cell.get(MINIMAL)
        for name, run in cell.items():
            versus_minimal = (
                f"{run.rps / minimal.rps:.2f}" if minimal and name.startswith("Waygate") else ""
            )
            bold = "**" if name.startswith("Waygate") else ""
            versus_haproxy = "" if name == DIRECT else f"{bold}{run.rps / haproxy.rps:.2f}{bold}"
            cpu = f"{run.cpu_us:.0f} µs" if run.cpu_us else ""
            cpu_ratio = (
                f"{haproxy.cpu_us / run.cpu_us:.2f}" if run.cpu_us and haproxy.cpu_us else ""
            )
            lines.append(
                f"| {label} | {connections} | {bold}{name}{bold} | {run.rps:,.0f} | {run.p99_ms:.1f} ms"
                f" | {versus_haproxy} | {versus_minimal} | {cpu} | {cpu_ratio} | {run.errors} |"
            )  # fmt: skip
    return [*lines, ""]


def headline(table: dict[tuple[str, int], dict[str, Run]]) -> list[str]:
    """The issue's yardstick: 64 B at 50 connections, one worker."""
    cell = table[(SIZES[0][0], CONNECTIONS[0])]
    waygate = next(run for name, run in cell.items() if name.startswith("Waygate"))
    haproxy = next(run for name, run in cell.items() if name.startswith("HAProxy"))
    minimal = cell[MINIMAL]
    return [
        f"**64 B, 50 connections, one worker: Waygate / HAProxy = {waygate.rps / haproxy.rps:.2f}** "
        f"(target at least 0.45, aim 0.55); minimal relay / HAProxy = "
        f"{minimal.rps / haproxy.rps:.2f}; Waygate / minimal = {waygate.rps / minimal.rps:.2f}. "
        f"By CPU per request (steadier on a busy machine): HAProxy's / Waygate's = "
        f"{haproxy.cpu_us / max(waygate.cpu_us, 1e-9):.2f}, minimal's / Waygate's = "
        f"{minimal.cpu_us / max(waygate.cpu_us, 1e-9):.2f}.",
        "",
    ]  # fmt: skip


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min) / {five:.1f} (5 min)"


def main(args: argparse.Namespace, failures: list[str]) -> str:
    """The report; what could not be measured is named in it and added to `failures`."""
    install_peers()
    load_before = load()
    started = time.monotonic()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="waygate-bench-proxy-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)  # nginx workers run as nobody
        shm = Path("/dev/shm") if Path("/dev/shm").is_dir() else directory
        big = shm / f"waygate-bench-{os.getpid()}.bin"
        with open(big, "wb") as f:
            f.truncate(BIG)  # sparse: reads as zeros, costs no memory
        big.chmod(0o644)
        upstream_port = free_port()
        upstream = Proxy(
            "upstream nginx",
            ["nginx", "-e", "stderr", "-c", str(upstream_conf(directory, upstream_port, big))],
            upstream_port, CLIENT_CORE,
        )  # fmt: skip
        resolver_port = free_port()
        resolver = Proxy(
            "resolver",
            ["waygate", "resolver", "serve", "--grpc-port", str(resolver_port), "--admin-port", "0",
             "--routes-file", str(routes_file(directory / "routes.yaml", upstream_port))],
            0, CLIENT_CORE, log=directory / "resolver.log",
        )  # fmt: skip
        resolver.argv = [sys.executable, "-m", *resolver.argv]
        try:
            upstream.start()
            resolver.processes.append(
                subprocess.Popen(
                    pinned(CLIENT_CORE, resolver.argv), cwd=ROOT, stdin=subprocess.PIPE,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )
            )  # fmt: skip
            address = f"127.0.0.1:{resolver_port}"
            rounds = []
            for workers, proxy_cores, client_cores in ((1, PROXY_CORE, CLIENT_CORE),
                                                       (2, BOTH_CORES, BOTH_CORES)):  # fmt: skip
                title = (
                    "Round 1: one worker, proxy on core 0; wrk and upstream on core 1"
                    if workers == 1
                    else "Round 2: two workers / threads; every process on both cores"
                )
                try:
                    proxies = start_proxies(directory, upstream_port, address, workers, proxy_cores)
                except RuntimeError as exc:
                    # One round failing to start keeps what the others measured.
                    failures.append(f"{title}: {exc}")
                    rounds += [f"## {title}", "", f"Not measured: {str(exc).splitlines()[0]}", ""]
                    continue
                try:
                    table = measure_round(proxies, args.duration, client_cores, upstream_port)
                    big_rows = []
                    if workers == 1 and not args.skip_big:
                        for proxy in proxies:
                            rate, peak = big_transfer(proxy, CLIENT_CORE)
                            big_rows.append(f"| {proxy.name} | {rate:.2f} GB/s | {peak:,.0f} MiB |")
                finally:
                    for proxy in proxies:
                        proxy.stop()
                if workers == 1:
                    rounds += headline(table)
                rounds += render_round(title, table)
                if big_rows:
                    rounds += ["## 1 GiB response through each proxy (curl on core 1)", "",
                               "| proxy | throughput | peak RSS during the transfer |",
                               "|---|---:|---:|", *big_rows, ""]  # fmt: skip
        finally:
            resolver.stop()
            upstream.stop()
            big.unlink(missing_ok=True)
    # The Python work per request alone (bench/proxy/hotpath.py: no sockets, no loop).
    hotpath = subprocess.run(
        [sys.executable, "-m", "bench.proxy.hotpath", "--requests", "20000"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    rounds += [
        "## Waygate's Python work per request, without sockets",
        "",
        "`python -m bench.proxy.hotpath` (the same GET and 64-byte nginx answer, handed to "
        "the protocol objects over in-memory transports): "
        + (hotpath.stdout.strip() or f"not measured ({hotpath.stderr.strip()[-200:]})"),
        "",
    ]
    if not args.skip_tls:
        from bench.proxy import tls  # HTTPS: Waygate's listener beside HAProxy's

        try:
            rounds += tls.main(args.duration).splitlines()
        except (RuntimeError, OSError) as exc:
            failures.append(f"HTTPS round: {exc}")
            rounds += ["## HTTPS", "", f"Not measured: {str(exc).splitlines()[0]}", ""]
    lines += [
        "# proxy benchmark",
        "",
        "Command: `.venv/bin/python -m bench.proxy"
        + (f" --duration {args.duration:g}" if args.duration != 5 else "")
        + (" --skip-big" if args.skip_big else "")
        + "`",
        "",
        f"Machine: {describe()}",
        "",
        f"Load average before / after: {load_before} / {load()}; run took "
        f"{time.monotonic() - started:.0f} s. wrk -t1, {args.duration:g} s per figure after 1 s "
        "of warm-up; upstream: nginx (1 worker) serving fixed bodies.",
        "",
        *rounds,
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.proxy")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per figure")
    parser.add_argument("--skip-big", action="store_true", help="skip the 1 GiB transfers")
    parser.add_argument("--skip-tls", action="store_true", help="skip the HTTPS round")
    failures: list[str] = []
    report = main(parser.parse_args(), failures)
    (Path(__file__).parent / "RESULTS-latest.md").write_text(report + "\n")
    print(report)
    for failure in failures:
        print(f"bench.proxy: {failure}", file=sys.stderr)
    sys.exit(1 if failures else 0)
