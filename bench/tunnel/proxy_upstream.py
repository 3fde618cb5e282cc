"""Reencrypt through the tunnel: the proxy's TLS to a backend on the tunnelled connection
itself, against the socketpair bridge it replaced, side by side in one run.

The proxy (a `ProxyServer` in this process, uvloop) serves plain HTTP on a local port
with one reencrypt route to a TLS backend on edge node NODE, reached through `waygate
tunnel serve` and `waygate tunnel agent` (subprocesses, mTLS on both hops, as
`python -m bench.tunnel` starts them). The backend (a subprocess) answers
`GET /big?n=N` with N bytes over TLS; curl (a subprocess) downloads them through the
proxy. Two ways for the proxy's dialer, alternating round by round:

- transport:  as shipped (`tunnel.client.transport_dialer`): the backend's TLS runs
              inside the data connection (`Dialled.start_tls`), no socketpair;
- socketpair: the dial spliced to one end of a socketpair (`bridged_socket`) and the
              backend's TLS over that socket (the loop's TLS transport): the proxy's
              path for reencrypt before the change.

Each round downloads `--mib` MiB on a fresh upstream connection (the pool is emptied
between rounds); reported: the best and every throughput, and the proxy process's CPU
seconds per GiB (dial client included), per way, and their ratio.

Run: .venv/bin/python -m bench.tunnel.proxy_upstream [--mib 512] [--rounds 3]
     [--only transport|socketpair]   (one way, e.g. under `py-spy record --pid`)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import ssl
import sys
import tempfile
from pathlib import Path
from typing import Any

import uvloop

from bench.machine import describe
from bench.tunnel.__main__ import Child, cpu_seconds, gbps, sink_child
from bench.tunnel.tunnel import DIALER, NODE, RunningTunnel, start_tunnel
from tests.support.pki import LocalCA

BLOCK = 256 * 1024


# ---------------------------------------------------------------- the TLS backend (a subprocess)


class _Big(asyncio.Protocol):
    """Answers each `GET /big?n=N` head with N bytes, written as the socket takes them."""

    def __init__(self) -> None:
        self.transport: Any = None
        self.head = b""
        self.left = 0
        self.paused = False
        self.block = b"x" * BLOCK

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.head += data
        if b"\r\n\r\n" not in self.head:
            return
        line = self.head.split(b"\r\n", 1)[0]
        self.head = b""
        self.left = int(line.split(b"n=", 1)[1].split(b" ", 1)[0])
        self.transport.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % self.left)
        self._send()

    def _send(self) -> None:
        while self.left and not self.paused:
            piece = self.block if self.left >= BLOCK else self.block[: self.left]
            self.left -= len(piece)
            self.transport.write(piece)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        self._send()


async def _backend(cert: str, key: str) -> None:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server = await asyncio.get_running_loop().create_server(_Big, "127.0.0.1", 0, ssl=context)
    print(server.sockets[0].getsockname()[1], flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)


# ---------------------------------------------------------------- the proxy (this process)


def _proxy(tunnel: RunningTunnel, backend_port: int, ca: LocalCA) -> Any:
    from waygate.proxy.metrics import ProxyMetrics
    from waygate.proxy.routing import Defaults, build_table
    from waygate.proxy.server import ProxyServer
    from waygate.proxy.upstream import Dialer
    from waygate.resolver.model import (
        Endpoint,
        EndpointPort,
        InsecureEdgePolicy,
        Route,
        RouteBackend,
        RouteTLS,
        TLSTermination,
    )

    route = Route(
        namespace="demo",
        name="secure",
        host="edge.test",
        path="/",
        backends=(RouteBackend(service="edge", weight=1),),
        tls=RouteTLS(
            termination=TLSTermination.REENCRYPT,
            destination_ca_certificate=ca.pem.decode(),
            insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW,
        ),
    )
    endpoint = Endpoint(
        namespace="demo",
        service="edge",
        address="127.0.0.1",
        ports=(EndpointPort(name="", port=backend_port),),
        tunnel=True,
        node_name=NODE,
    )
    server = ProxyServer(
        defaults=Defaults(),
        dialer=Dialer(),
        metrics=ProxyMetrics(),
        cookie_key=b"k" * 32,
        max_connections=1000,
    )
    server.set_table(
        build_table(
            {route.key: route},
            {("demo", "edge"): (endpoint,)},
            {},
            defaults=Defaults(),
            cookie_key=b"k" * 32,
            previous=None,
        )
    )
    return server


def _ways(client: Any) -> dict[str, Any]:
    from waygate.proxy.upstream import ConnectError
    from waygate.tunnel.client import bridged_socket, transport_dialer

    async def socketpair(target: Any, timeout: float, trace_context: str | None) -> Any:
        stream = await client.dial(
            target.node, target.port, target.address, timeout=timeout, trace_context=trace_context
        )
        return await bridged_socket(stream)

    return {"transport": transport_dialer(client, ConnectError), "socketpair": socketpair}


async def _curl(port: int, size: int) -> float:
    process = await asyncio.create_subprocess_exec(
        "curl", "-s", "-o", "/dev/null", "-w", "%{time_total} %{size_download} %{http_code}",
        "-H", "Host: edge.test", f"http://127.0.0.1:{port}/big?n={size}",
        stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await process.communicate()
    seconds, got, code = out.decode().split()
    if code != "200" or int(got) != size:
        raise RuntimeError(f"curl got HTTP {code}, {got} of {size} bytes")
    return float(seconds)


async def run(mib: int, rounds: int, only: str = "") -> None:
    from waygate.proxy.upstream_tls import UpstreamTLS

    if shutil.which("curl") is None:
        raise SystemExit("curl is needed (apt-get install curl)")
    total = mib * 1024 * 1024
    print(describe())
    with tempfile.TemporaryDirectory(prefix="bench-tunnel-reencrypt-") as tmp:
        directory = Path(tmp)
        ca = LocalCA()
        server_files = ca.write_files(directory / "server", dns=["localhost"], ips=["127.0.0.1"])
        client_files = ca.write_files(directory / "client", uris=[DIALER])
        backend_files = ca.write_files(directory / "backend", dns=["edge.demo.svc"])
        sink = sink_child(directory)
        backend = Child(
            [sys.executable, "-m", "bench.tunnel.proxy_upstream", "backend",
             str(backend_files.cert), str(backend_files.key)],
            directory / "backend.log",
        )  # fmt: skip
        tunnel: RunningTunnel | None = None
        server = None
        try:
            _sink_port, http_port, _source = (int(p) for p in sink.first_line().split())
            backend_port = int(backend.first_line())
            tunnel = await start_tunnel(
                directory, ca, server_files, client_files, http_port, server_id="r-0"
            )
            server = _proxy(tunnel, backend_port, ca)
            port = await server.start("127.0.0.1", 0)
            server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
            ways = _ways(tunnel.client)
            if only:
                ways = {only: ways[only]}
            seconds: dict[str, list[float]] = {name: [] for name in ways}
            cpu: dict[str, float] = dict.fromkeys(ways, 0.0)
            load = os.getloadavg()[0]
            for dialer in ways.values():  # one warm-up download each
                server.dialer.tunnel = dialer
                server.pool.close_all()
                await _curl(port, 1 << 20)
            for _ in range(rounds):
                for name, dialer in ways.items():
                    server.dialer.tunnel = dialer
                    server.pool.close_all()
                    before = cpu_seconds([])
                    seconds[name].append(await _curl(port, total))
                    cpu[name] += cpu_seconds([]) - before
            load = max(load, os.getloadavg()[0])
            gib = total * rounds / (1 << 30)
            for name in ways:
                figures = ", ".join(f"{gbps(total, t):.3f}" for t in seconds[name])
                print(
                    f"{name:>10}: best {gbps(total, min(seconds[name])):.3f} GB/s "
                    f"(all: {figures}); proxy CPU {cpu[name] / gib:.2f} s/GiB"
                )
            if only:
                return
            ratio = min(seconds["socketpair"]) / min(seconds["transport"])
            print(
                f"transport / socketpair: {ratio:.2f}x throughput (best of {rounds}), "
                f"{cpu['socketpair'] / cpu['transport']:.2f}x less proxy CPU per GiB; "
                f"{mib} MiB per download, load {load:.1f}"
            )
        finally:
            if server is not None:
                await server.drain(1.0)
            if tunnel is not None:
                await tunnel.stop()
            backend.stop()
            sink.stop()


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] == "backend":
        uvloop.run(_backend(sys.argv[2], sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=512, help="MiB per download [512]")
    parser.add_argument("--rounds", type=int, default=3, help="downloads per way [3]")
    parser.add_argument(
        "--only", choices=("transport", "socketpair"), default="", help="one way (to profile)"
    )
    args = parser.parse_args()
    uvloop.run(run(args.mib, args.rounds, args.only))
    return 0


if __name__ == "__main__":
    sys.exit(main())
