"""Resolver benchmark: change propagation to 100 watchers, and Resolve throughput.

Setup, all real processes on loopback:
- `waygate resolver serve` on a routes file of 1,000 services x 10 endpoints
  (10,000 endpoints in the store);
- 100 Watch clients, each on its own connection, split over two processes;
- this driver, which makes changes through a real ReportTunnels stream (one
  tunnel-presence change per report) and measures, per change, the time from
  sending the report to the moment the last of the 100 clients has it
  (CLOCK_MONOTONIC is shared by processes on one host). The figure therefore
  includes the report's own trip to the resolver: it overstates, never flatters.
- Resolve calls/s (32 concurrent callers on one connection, random service of
  the 1,000) as a ratio of a bare grpc.aio unary echo server measured the same
  way in the same run (no interceptors, health or reflection on the echo).

Run: .venv/bin/python -m bench.resolver [--changes 200] [--clients 100]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import grpc

from bench.machine import describe
from bench.resolver.common import ChangeReporter, fanout, routes_file, snapshot_bytes
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
SERVICES, ENDPOINTS_PER_SERVICE = 1000, 10
WATCH_PROCESSES = 2
CHANGE_SPACING = 0.025
THROUGHPUT_SECONDS = 5.0
CONCURRENCY = 32
PREFIX = "bench-node-"
# Log readers of running processes (held so they are not garbage-collected).
DRAINS: set[asyncio.Task[None]] = set()


async def start(argv: list[str], ready: str) -> tuple[asyncio.subprocess.Process, str]:
    """Start a process; return it and the first stdout/stderr line containing `ready`."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        *argv,
        cwd=ROOT,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    stream = process.stderr if ready == "listening" else process.stdout
    assert stream is not None
    async with asyncio.timeout(300):
        while True:
            line = (await stream.readline()).decode()
            if not line:
                raise RuntimeError(f"{argv} exited before {ready!r}")
            if ready in line:
                break
    if ready == "listening":
        # Keep reading its log so the pipe never fills and blocks the resolver.
        DRAINS.add(asyncio.create_task(drain(stream)))
    return process, line


async def drain(stream: asyncio.StreamReader) -> None:
    while await stream.readline():
        pass


async def stop(process: asyncio.subprocess.Process) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.terminate()
        try:
            await asyncio.wait_for(process.wait(), 20)
        except TimeoutError:
            process.kill()
            await process.wait()


async def propagation(address: str, clients: int, changes: int) -> dict[str, float]:
    per_process = clients // WATCH_PROCESSES
    size, _ = await snapshot_bytes(address, SERVICES * ENDPOINTS_PER_SERVICE)
    workers = [
        await start(
            ["bench.resolver.watchers", address, str(per_process), str(size), str(changes), PREFIX],
            "ready",
        )
        for _ in range(WATCH_PROCESSES)
    ]
    # Let the snapshot burst (100 x 10,000 endpoints) settle before measuring.
    await asyncio.sleep(2)
    async with ChangeReporter(address, PREFIX) as reporter:
        for i in range(changes):
            reporter.send(i)
            await asyncio.sleep(CHANGE_SPACING)
        results = []
        for process, _ in workers:
            assert process.stdout is not None
            line = await asyncio.wait_for(process.stdout.readline(), 120)
            results.append(json.loads(line))
            await stop(process)
    lost = sum(r["lost_count"] for r in results)
    return {
        "changes": changes,
        **fanout(results, reporter.sent, per_process * WATCH_PROCESSES - lost),
    }


async def throughput(call: callable, make_request: callable) -> float:  # type: ignore[valid-type]
    done = 0
    deadline = time.monotonic() + THROUGHPUT_SECONDS

    async def caller() -> None:
        nonlocal done
        while time.monotonic() < deadline:
            await call(make_request(), timeout=10)
            done += 1

    # Warm up the connection and code paths first.
    for _ in range(50):
        await call(make_request(), timeout=10)
    started = time.monotonic()
    await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
    return done / (time.monotonic() - started)


def load() -> str:
    one, five, _ = os.getloadavg()
    return f"{one:.1f} (1 min) / {five:.1f} (5 min)"


async def main(args: argparse.Namespace) -> str:
    load_before = load()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "routes.yaml"
        routes_file(path, "bench", SERVICES, ENDPOINTS_PER_SERVICE)
        resolver, line = await start(
            [
                "waygate",
                "resolver",
                "serve",
                "--grpc-port",
                "0",
                "--admin-port",
                "0",
                "--routes-file",
                str(path),
                "--log-level",
                "info",
                # Every watcher here is a plaintext client on 127.0.0.1, one peer to
                # the per-peer stream caps (64 unauthenticated by default): give that
                # one peer room (the unauthenticated cap may not exceed the other).
                "--max-streams-per-peer",
                "1000",
                "--max-streams-per-unauthenticated-peer",
                "1000",
            ],
            "listening",
        )
        echo, port_line = await start(["bench.echo"], "")
        try:
            address = f"127.0.0.1:{json.loads(line)['grpc_ports'][0]}"
            echo_address = f"127.0.0.1:{int(port_line)}"
            watch = await propagation(address, args.clients, args.changes)
            rng = random.Random(1)
            async with grpc.aio.insecure_channel(address) as channel:
                stub = resolver_pb2_grpc.ResolverStub(channel)
                resolve_rate = await throughput(
                    stub.Resolve,
                    lambda: pb.ResolveRequest(
                        namespace="bench", name=f"svc-{rng.randrange(SERVICES)}", port="http"
                    ),
                )
            payload = pb.ResolveRequest(
                namespace="bench", name="svc-1", port="http"
            ).SerializeToString()
            async with grpc.aio.insecure_channel(echo_address) as channel:
                echo_call = channel.unary_unary("/bench.Echo/Echo")
                echo_rate = await throughput(echo_call, lambda: payload)
        finally:
            await stop(echo)
            await stop(resolver)
    return "\n".join(
        [
            "# resolver benchmark",
            "",
            "Command: `.venv/bin/python -m bench.resolver"
            + (f" --changes {args.changes}" if args.changes != 200 else "")
            + (f" --clients {args.clients}" if args.clients != 100 else "")
            + "`",
            "",
            f"Machine: {describe()}",
            "",
            f"Store: {SERVICES * ENDPOINTS_PER_SERVICE:,} endpoints ({SERVICES:,} services x "
            f"{ENDPOINTS_PER_SERVICE}); {args.clients} Watch clients on their own connections "
            f"in {WATCH_PROCESSES} processes; resolver, watchers and driver share the machine.",
            "",
            f"Load average of the machine before / after the run: {load_before} / {load()} "
            f"(other work on the machine shows up in the tail figures).",
            "",
            "| figure | value |",
            "|---|---|",
            f"| change -> all {args.clients} watchers, p50 | {watch['p50']:.1f} ms |",
            f"| change -> all {args.clients} watchers, p99 | {watch['p99']:.1f} ms (aim < 50 ms) |",
            f"| change -> all {args.clients} watchers, max | {watch['max']:.1f} ms |",
            f"| changes measured (reached every watcher) | {watch['complete']} of {watch['changes']} |",
            f"| Resolve calls/s ({CONCURRENCY} concurrent, one connection) | {resolve_rate:,.0f} |",
            f"| bare grpc.aio unary echo calls/s (same client) | {echo_rate:,.0f} |",
            f"| Resolve / echo | {resolve_rate / echo_rate:.2f} |",
            "",
            "A change is one ReportTunnels report (one tunnel-presence change); the delay runs "
            f"from sending it to the last watcher receiving it; changes {CHANGE_SPACING * 1000:.0f} ms apart.",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.resolver")
    parser.add_argument("--changes", type=int, default=200)
    parser.add_argument("--clients", type=int, default=100)
    print(asyncio.run(main(parser.parse_args())))
