"""HTTP/2 and gRPC benchmark: Waygate beside HAProxy, nginx and a minimal h2 relay.

    python -m bench.h2 [--duration 2] [--repeats 3]     (about 5-6 minutes)

Every proxy forwards to the same upstream, an nginx (1 worker, HTTP/1.1)
serving fixed 64 B and 16 KiB bodies (bench.proxy's upstream). h2load
(Debian's nghttp2-client) drives each proxy over h2c (prior knowledge) and
h2 (TLS, ALPN), 10 connections, with 1 and with 100 concurrent streams per
connection, for each body size. Peers: HAProxy 2.6 (`proto h2` / `alpn h2`
bind, `nbthread 1`), nginx (`http2` listen, 1 worker), and the ceiling: a
minimal h2 -> HTTP/1.1 relay on the same library and loop (bench/h2/minimal.py:
no rules, no limits), and that relay again on the h2 connection Waygate builds
(`minimal --tuned`: Waygate's HPACK block memory and library set-up, h2's own
header checks kept), so that Waygate / tuned relay is the cost of the rules and
the exchange alone. Waygate runs `--workers 1` with every rule on. The
proxy under test is pinned to core 0; h2load, the upstream and the resolver
to core 1. Each proxy takes a 1 s warm-up before its measured run; the
proxies take turns, order rotated per cell and per turn (`--repeats N`: N turns
each, the run with the median req/s kept). Reported: req/s, the proxy's CPU
(user + system) per request, and the ratios Waygate / minimal relay (of the
medians; turn by turn, median and range, each turn's two runs minutes apart at
most; and by CPU per request, which other load moves less), Waygate / HAProxy
and / nginx, and Waygate's HTTP/2 to its own HTTP/1.1 path (h2load --h1, same
connections, one request at a time per connection).

gRPC: a grpcio server (bench/h2/grpc_backend.py, its own process) called
directly and through Waygate (route upstreamProtocol grpc, h2c to the proxy):
unary calls/s with 32 calls in flight on one channel, and server-streaming
messages/s (1,000 small messages per call, 4 calls in flight).

The machine is shared with other work: ratios within one run are the figures
to read, not absolute rates.
"""

from __future__ import annotations

import argparse
import contextlib
import re
import shutil
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
from bench.proxy.__main__ import (
    CLIENT_CORE,
    HOST,
    PROXY_CORE,
    cpu_seconds,
    free_port,
    nginx_conf,
    tree,
    upstream_conf,
)

SIZES = (("64 B", "/64"), ("16 KiB", "/16k"))
STREAMS = (1, 100)
CONNECTIONS = 10
PROTOCOLS = ("h2c", "h2")
WAYGATE = "Waygate"
MINIMAL = "minimal h2 relay"
TUNED = "minimal relay, Waygate's h2 set-up"
HAPROXY = "HAProxy"
NGINX = "nginx"


class Server(Peer):
    """A proxy under test with a port per protocol (ready once each serves a request)."""

    def __init__(
        self,
        name: str,
        argv: list[str],
        ports: dict[str, int],  # protocol -> port
        cores: str,
        log: Path | None = None,
    ) -> None:
        super().__init__(name, argv, cores, log)
        self.ports = ports

    def serving(self) -> str | None:
        for protocol, port in self.ports.items():
            if h2load(port, protocol, "/64", 1, 1, requests=1).ok != 1:
                return f"no answer over {protocol}"
        return None


@dataclass
class Run:
    rps: float
    ok: int
    failed: int
    cpu_us: float = 0.0


def h2load(
    port: int,
    protocol: str,
    path: str,
    streams: int,
    seconds: float,
    *,
    requests: int,
    cores: str = CLIENT_CORE,
) -> Run:
    scheme = "https" if protocol == "h2" else "http"
    connections = 1 if requests == 1 else CONNECTIONS
    argv = ["h2load", "-c", str(connections), "-t", "1", "-m", str(streams),
            "-H", f":authority: {HOST}", "-n", str(requests)]  # fmt: skip
    if protocol == "h1":
        argv.append("--h1")
    argv.append(f"{scheme}://127.0.0.1:{port}{path}")
    try:
        out = subprocess.run(
            pinned(cores, argv), capture_output=True, text=True, timeout=seconds * 5 + 60
        ).stdout
    except subprocess.TimeoutExpired:
        return Run(0.0, 0, 0)
    rate = re.search(r"finished in [\d.]+m?s, ([\d.]+) req/s", out)
    counts = re.search(r"(\d+) succeeded, (\d+) failed", out)
    if rate is None or counts is None:
        return Run(0.0, 0, 0)
    return Run(float(rate.group(1)), int(counts.group(1)), int(counts.group(2)))


# ---------------------------------------------------------------- configurations


def certificate(directory: Path) -> tuple[Path, Path, Path]:
    """A self-signed certificate for every TLS listener: cert, key, and both in one file."""
    cert, key, both = directory / "cert.pem", directory / "key.pem", directory / "both.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-days", "2", "-subj", f"/CN={HOST}", "-addext", f"subjectAltName=DNS:{HOST}",
         "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    key.chmod(0o600)
    both.write_bytes(cert.read_bytes() + key.read_bytes())
    return cert, key, both


def haproxy_h2_conf(directory: Path, ports: dict[str, int], upstream: int, both: Path) -> Path:
    path = directory / "haproxy-h2.cfg"
    path.write_text(
        textwrap.dedent(
            f"""\
            global
              nbthread 1
              maxconn 8000
            defaults
              mode http
              option http-keep-alive
              option forwardfor
              http-reuse safe
              timeout connect 5s
              timeout client 30s
              timeout server 30s
            frontend h2c
              bind 127.0.0.1:{ports["h2c"]} proto h2
              default_backend upstream
            frontend h2
              bind 127.0.0.1:{ports["h2"]} ssl crt {both} alpn h2,http/1.1
              default_backend upstream
            backend upstream
              server up 127.0.0.1:{upstream}
            """
        )
    )
    return path


def nginx_h2_conf(
    directory: Path, ports: dict[str, int], upstream: int, cert: Path, key: Path
) -> Path:
    location = """
            location / {
              proxy_pass http://up;
              proxy_http_version 1.1;
              proxy_set_header Connection "";
              proxy_set_header Host $host;
              proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;
            }"""
    return nginx_conf(
        directory / "nginx-h2.conf",
        directory,
        workers=1,
        http=f"upstream up {{ server 127.0.0.1:{upstream}; keepalive 1024; }}\n"
        f"server {{ listen 127.0.0.1:{ports['h2']} ssl http2; ssl_certificate {cert}; "
        f"ssl_certificate_key {key}; {location} }}",
        server=f"listen 127.0.0.1:{ports['h2c']} http2; {location}",
    )


def routes(path: Path, upstream: int, grpc_port: int) -> Path:
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
              - namespace: bench
                name: grpc
                ports:
                  - {{name: grpc, port: 80, targetPort: {grpc_port}, appProtocol: grpc}}
                endpoints:
                  - address: 127.0.0.1
            routes:
              - namespace: bench
                name: upstream
                host: {HOST}
                to: upstream
                targetPort: http
              - namespace: bench
                name: grpc
                host: grpc.{HOST}
                to: grpc
                targetPort: grpc
            """
        )
    )
    return path


# ---------------------------------------------------------------- measuring


def rotated(items: list[Server], turn: int) -> Iterator[Server]:
    for index in range(len(items)):
        yield items[(index + turn) % len(items)]


# Each cell's runs of every server, turn by turn (see `paired`).
TURNS: dict[tuple[str, str, int], dict[str, list[Run]]] = {}


def measure(
    servers: list[Server], seconds: float, repeats: int = 1
) -> dict[tuple[str, str, int], dict[str, Run]]:
    """Each cell: every server takes `repeats` turns (order rotated per turn), and its
    run with the median req/s is kept (its CPU per request goes with it): one run of a
    proxy on a shared machine moves by a factor of two. Every run is kept in TURNS."""
    table: dict[tuple[str, str, int], dict[str, Run]] = {}
    turn = 0
    cells = [(p, s, m) for p in PROTOCOLS for s in SIZES for m in STREAMS]
    cells += [("h1", s, 1) for s in SIZES]
    for protocol, (label, path), streams in cells:
        runs: dict[str, list[Run]] = {}
        for repeat in range(repeats):
            for server in rotated(servers, turn + repeat):
                port = server.ports.get(protocol)
                if port is None:
                    continue
                # Warm-up, which also sizes the measured run to about `seconds`
                # (h2load's own -D duration mode miscounts its rate).
                warm = h2load(port, protocol, path, streams, 0, requests=1000)
                count = max(1000, int(warm.rps * seconds))
                pids = tree(server.pid)
                before = cpu_seconds(pids)
                run = h2load(port, protocol, path, streams, seconds, requests=count)
                run.cpu_us = (cpu_seconds(pids) - before) / max(run.ok, 1) * 1e6
                runs.setdefault(server.name, []).append(run)
        TURNS[(protocol, label, streams)] = runs
        table[(protocol, label, streams)] = {
            name: sorted(taken, key=lambda run: run.rps)[len(taken) // 2]
            for name, taken in runs.items()
        }
        turn += 1
        turns = {
            other: " ".join(
                f"{a.rps / b.rps:.2f}/{b.cpu_us / a.cpu_us if a.cpu_us else 0:.2f}"
                for a, b in zip(runs.get(WAYGATE, []), runs.get(other, []), strict=False)
                if b.rps
            )
            for other in (MINIMAL, TUNED)
        }
        print(
            f"bench.h2: {protocol} {label} x{streams} done; by turn (req/s / CPU): "
            f"Waygate / minimal {turns[MINIMAL]}; Waygate / tuned {turns[TUNED]}",
            file=sys.stderr,
            flush=True,
        )
    return table


def cpu_ratio(a: Run | None, b: Run | None) -> str:
    """`a` against `b` by CPU per request (b's CPU / a's: 1.00 costs the same)."""
    if a is None or b is None or not a.cpu_us:
        return "-"
    return f"{b.cpu_us / a.cpu_us:.2f}"


def paired(cell: tuple[str, str, int], other: str = MINIMAL) -> str:
    """Waygate / `other` by req/s turn by turn (the two ran minutes apart at most,
    so a change in the machine's load moves both): the median of the turns'
    ratios and their range."""
    runs = TURNS.get(cell, {})
    ratios = sorted(
        a.rps / b.rps
        for a, b in zip(runs.get(WAYGATE, []), runs.get(other, []), strict=False)
        if b.rps
    )
    if not ratios:
        return "-"
    if len(ratios) == 1:
        return f"{ratios[0]:.2f}"
    return f"{ratios[len(ratios) // 2]:.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def ratio(a: Run | None, b: Run | None) -> str:
    if a is None or b is None or not b.rps:
        return "-"
    return f"{a.rps / b.rps:.2f}"


def render(table: dict[tuple[str, str, int], dict[str, Run]]) -> list[str]:
    names = [WAYGATE, MINIMAL, TUNED, HAPROXY, NGINX]
    lines = [
        "| protocol | body | streams/conn | "
        + " | ".join(f"{n} req/s (CPU µs/req)" for n in names)
        + " | Waygate / minimal | Waygate / minimal, turn by turn | Waygate / minimal, by CPU"
        + " | Waygate / tuned, turn by turn | Waygate / tuned, by CPU"
        + " | Waygate / HAProxy | Waygate / nginx |",
        "|---|---|---|" + "---|" * (len(names) + 7),
    ]
    for (protocol, label, streams), cell in table.items():
        if protocol == "h1":
            continue
        shown = [
            f"{cell[n].rps:,.0f} ({cell[n].cpu_us:.0f})"
            + (f", {cell[n].failed} failed" if cell[n].failed else "")
            if n in cell
            else "-"
            for n in names
        ]
        lines.append(
            f"| {protocol} | {label} | {streams} | " + " | ".join(shown)
            + f" | {ratio(cell.get(WAYGATE), cell.get(MINIMAL))}"
            + f" | {paired((protocol, label, streams))}"
            + f" | {cpu_ratio(cell.get(WAYGATE), cell.get(MINIMAL))}"
            + f" | {paired((protocol, label, streams), TUNED)}"
            + f" | {cpu_ratio(cell.get(WAYGATE), cell.get(TUNED))}"
            + f" | {ratio(cell.get(WAYGATE), cell.get(HAPROXY))}"
            + f" | {ratio(cell.get(WAYGATE), cell.get(NGINX))} |"
        )  # fmt: skip
    lines += ["", "Waygate's HTTP/2 against its own HTTP/1.1 path (same 10 connections, "
              "1 request at a time per connection):", "",
              "| body | h1 req/s (CPU µs/req) | h2c x1 req/s | h2c / h1 | h2 (TLS) x1 / h1 |",
              "|---|---|---|---|---|"]  # fmt: skip
    for label, _ in SIZES:
        h1 = table.get(("h1", label, 1), {}).get(WAYGATE)
        h2c = table.get(("h2c", label, 1), {}).get(WAYGATE)
        h2 = table.get(("h2", label, 1), {}).get(WAYGATE)
        if h1 is not None:
            lines.append(
                f"| {label} | {h1.rps:,.0f} ({h1.cpu_us:.0f}) | {h2c.rps if h2c else 0:,.0f} | "
                f"{ratio(h2c, h1)} | {ratio(h2, h1)} |"
            )
    return lines


def grpc_rates(target: str, authority: str, seconds: float) -> tuple[float, float]:
    """Unary calls/s and streamed messages/s (bench/h2/grpc_client.py, pinned beside
    the backend on the client core, so the proxy's core is its own)."""
    out = subprocess.run(
        pinned(CLIENT_CORE, [sys.executable, "-m", "bench.h2.grpc_client", target, authority,
                             str(seconds)]),
        cwd=ROOT, capture_output=True, text=True, timeout=seconds * 4 + 120, check=True,
    ).stdout.split()  # fmt: skip
    return float(out[0]), float(out[1])


def main(args: argparse.Namespace) -> str:
    missing = [c for c in ("h2load", "haproxy", "nginx", "openssl") if shutil.which(c) is None]
    if missing:
        raise SystemExit(
            f"bench.h2: missing {', '.join(missing)} (apt-get install nghttp2-client haproxy nginx)"
        )
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="waygate-bench-h2-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)
        cert, key, both = certificate(directory)
        big = directory / "big.bin"
        big.write_bytes(b"")
        upstream_port = free_port()
        upstream = subprocess.Popen(
            pinned(CLIENT_CORE, ["nginx", "-e", "stderr", "-c",
                                 str(upstream_conf(directory, upstream_port, big))]),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        grpc_port = free_port()
        grpc_backend = subprocess.Popen(
            pinned(CLIENT_CORE, [sys.executable, "-m", "bench.h2.grpc_backend", str(grpc_port)]),
            cwd=ROOT, stdin=subprocess.PIPE,
        )  # fmt: skip
        resolver_port = free_port()
        resolver = subprocess.Popen(
            pinned(CLIENT_CORE, [sys.executable, "-m", "waygate", "resolver", "serve",
                                 "--grpc-port", str(resolver_port), "--admin-port", "0",
                                 "--routes-file", str(routes(directory / "routes.yaml", upstream_port, grpc_port))]),
            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        ports = {
            name: {"h2c": free_port(), "h2": free_port()}
            for name in (WAYGATE, MINIMAL, TUNED, HAPROXY, NGINX)
        }
        waygate_ports = {**ports[WAYGATE], "h1": ports[WAYGATE]["h2c"]}
        servers = [
            Server(WAYGATE, [sys.executable, "-m", "waygate", "proxy", "serve",
                             "--http-port", str(ports[WAYGATE]["h2c"]), "--https-port", str(ports[WAYGATE]["h2"]),
                             "--admin-port", "0", "--resolver-address", f"127.0.0.1:{resolver_port}",
                             "--default-certificate", str(cert), "--default-key", str(key),
                             "--upstream-max-idle", "1024"],
                   waygate_ports, PROXY_CORE, log=directory / "waygate.log"),
            Server(MINIMAL, [sys.executable, "-m", "bench.h2.minimal", str(ports[MINIMAL]["h2c"]),
                             str(upstream_port), str(ports[MINIMAL]["h2"]), str(cert), str(key)],
                   ports[MINIMAL], PROXY_CORE),
            Server(TUNED, [sys.executable, "-m", "bench.h2.minimal", "--tuned", str(ports[TUNED]["h2c"]),
                           str(upstream_port), str(ports[TUNED]["h2"]), str(cert), str(key)],
                   ports[TUNED], PROXY_CORE),
            Server(HAPROXY, ["haproxy", "-db", "-f", str(haproxy_h2_conf(directory, ports[HAPROXY], upstream_port, both))],
                   ports[HAPROXY], PROXY_CORE),
            Server(NGINX, ["nginx", "-e", "stderr", "-c", str(nginx_h2_conf(directory, ports[NGINX], upstream_port, cert, key))],
                   ports[NGINX], PROXY_CORE),
        ]  # fmt: skip
        try:
            for server in servers:
                server.start()
            table = measure(servers, args.duration, args.repeats)
            grpc_direct = grpc_rates(f"127.0.0.1:{grpc_port}", "-", args.duration)
            grpc_proxied = grpc_rates(
                f"127.0.0.1:{ports[WAYGATE]['h2c']}", f"grpc.{HOST}", args.duration
            )
        finally:
            for server in servers:
                server.stop()
            for process in (resolver, grpc_backend, upstream):
                with contextlib.suppress(OSError):
                    process.stdin.close()  # type: ignore[union-attr]
                process.terminate()
                process.wait(20)
    lines = [
        "# HTTP/2 and gRPC benchmark",
        "",
        f"`python -m bench.h2 --duration {args.duration:g} --repeats {args.repeats}`, {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, "
        f"{time.monotonic() - started:.0f} s. {describe()} Shared machine: read the ratios.",
        "",
        f"h2load, {CONNECTIONS} connections, 1 thread; proxies pinned to core 0, h2load, upstream "
        "and resolver to core 1.",
        "",
        *render(table),
        "",
        "gRPC (grpcio client and server, h2c to the proxy, HTTP/2 to the backend):",
        "",
        "| | unary calls/s (32 in flight) | streamed messages/s |",
        "|---|---|---|",
        f"| direct | {grpc_direct[0]:,.0f} | {grpc_direct[1]:,.0f} |",
        f"| through Waygate | {grpc_proxied[0]:,.0f} | {grpc_proxied[1]:,.0f} |",
        f"| through / direct | {grpc_proxied[0] / grpc_direct[0]:.2f} | {grpc_proxied[1] / grpc_direct[1]:.2f} |",
    ]  # fmt: skip
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.h2", description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=2.0, help="seconds per measured run")
    parser.add_argument(
        "--repeats", type=int, default=3, help="turns per proxy and cell (the median run is kept)"
    )
    print(main(parser.parse_args()))
