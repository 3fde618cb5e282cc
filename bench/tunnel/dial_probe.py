"""Where a warm dial's time goes without the process hops: server, agent and dialer on one loop.

`python -m bench.tunnel` runs the dialer, `tunnel serve` and `tunnel agent` as
three processes, so its latency rows pay each hop's wake-up on a shared CPU.
This probe runs the same three (the test harness's in-process tunnel: mTLS on
both hops, warm pools of 4, the agent parking its connections) on one uvloop
loop, with an HTTP backend and the requests in turn 100 ms apart: a direct
request on a fresh connection, the tunnelled one (dial, then the request), the
tunnelled one with the request as the dial's early data. What it reports is the
three parties' own work per dial with no process hop (one loop runs it all),
which no cut of wake-ups removes; the bench's figure minus this one is what the
hops cost.

Run: .venv/bin/python -m bench.tunnel.dial_probe [--samples 200]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from bench.machine import describe
from tests.integration.tunnel.harness import NODE, Tunnel, http_backend
from waygate.tunnel.client import TunnelClient

REQUEST = b"GET / HTTP/1.1\r\nHost: backend\r\n\r\n"
GAP = 0.1


async def _read_response(reader: object) -> None:
    received = b""
    while not received.endswith(b"ok"):
        more = await reader.read()  # type: ignore[attr-defined]
        if not more:
            raise RuntimeError(f"the response ended early: {received[:80]!r}")
        received += more


async def _direct(port: int) -> tuple[float, float]:
    started = time.perf_counter()
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    connected = time.perf_counter()
    writer.write(REQUEST)
    await reader.readuntil(b"ok")
    done = time.perf_counter()
    writer.close()
    with contextlib.suppress(Exception):
        await writer.wait_closed()
    return connected - started, done - started


async def _tunnelled(client: TunnelClient, port: int, early: bool) -> tuple[float, float]:
    started = time.perf_counter()
    stream = await client.dial(NODE, port, early=REQUEST if early else b"")
    dialled = time.perf_counter()
    try:
        if not early:
            await stream.write(REQUEST)
        await _read_response(stream)
    finally:
        await stream.aclose()
    return dialled - started, time.perf_counter() - started


def _p50(values: list[float]) -> float:
    return sorted(values)[len(values) // 2] * 1000


async def run(samples: int) -> str:
    with tempfile.TemporaryDirectory(prefix="bench-dial-probe-") as tmp:
        tunnel = Tunnel(Path(tmp))
        await tunnel.start_server()
        try:
            await tunnel.start_agent()
            client = tunnel.client(pool_size=4)
            backend, port, _heads = await http_backend()
            async with backend:
                kinds = {
                    "direct": lambda: _direct(port),
                    "tunnel": lambda: _tunnelled(client, port, early=False),
                    "early": lambda: _tunnelled(client, port, early=True),
                }
                figures: dict[str, list[tuple[float, float]]] = {name: [] for name in kinds}
                for _ in range(samples):
                    for name, request in kinds.items():
                        await asyncio.sleep(GAP)
                        figures[name].append(await request())
        finally:
            await tunnel.close()
    direct = _p50([total for _, total in figures["direct"]])
    lines = [
        "# Warm dials on one loop (no process hops)",
        "",
        f"Machine: {describe()}. Command: `.venv/bin/python -m bench.tunnel.dial_probe "
        f"--samples {samples}`; requests in turn, {GAP * 1000:.0f} ms apart.",
        "",
        "| request on a fresh connection | connect or dial, p50 | whole request, p50 | added, p50 |",
        "|---|---:|---:|---:|",
    ]
    for name, label in (
        ("direct", "direct"),
        ("tunnel", "tunnelled, the request after the dial's OK"),
        ("early", "tunnelled, the request as the dial's early data"),
    ):
        first = _p50([part for part, _ in figures[name]])
        whole = _p50([total for _, total in figures[name]])
        added = "" if name == "direct" else f"{whole - direct:.2f} ms"
        lines.append(f"| {label} | {first:.2f} ms | {whole:.2f} ms | {added} |")
    return "\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.tunnel.dial_probe")
    parser.add_argument("--samples", type=int, default=200, help="requests of each kind [200]")
    args = parser.parse_args()
    print(uvloop.run(run(args.samples)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
