"""The resolver under a watcher storm (issue 18 item 5).

Setup, all real processes on loopback, plaintext:
- `waygate resolver serve` on a routes file of 1,000 services x 100 endpoints
  (100,000 endpoints in the store);
- 1,000 Watch streams, each on its own connection, in 4 processes
  (bench.resolver_storm.clients), all opened at once: the snapshot storm;
- this driver, which then makes changes through a real ReportTunnels stream
  (one tunnel-presence change each) and measures, per change, the time from
  sending it to the moment the last of the 1,000 streams has it (the fan-out).
Reported: how long until every stream had its snapshot, streams lost (ended
with an error), the fan-out p50/p99/max, and the resolver's peak RSS (VmHWM)
and RSS after the storm.

Run: .venv/bin/python -m bench.resolver_storm [--streams 1000] [--changes 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from bench.machine import describe
from bench.resolver.__main__ import load, start, stop
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

SERVICES, ENDPOINTS_PER_SERVICE = 1000, 100
PROCESSES = 4
CHANGE_SPACING = 0.05


def routes_file(path: Path) -> None:
    lines = ["services:"]
    for s in range(SERVICES):
        lines += [
            "  - namespace: storm",
            f"    name: svc-{s}",
            "    ports: [{name: http, port: 80, targetPort: 8080}]",
            "    endpoints:",
        ]
        lines += [
            f"      - {{address: 10.{s // 250}.{s % 250}.{e + 1}, zone: z{e % 3}}}"
            for e in range(ENDPOINTS_PER_SERVICE)
        ]
    path.write_text("\n".join(lines) + "\n")


def memory(pid: int) -> tuple[int, int]:
    """(peak RSS, RSS) of a process, bytes."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


async def snapshot_bytes(address: str) -> tuple[int, int]:
    """What one full snapshot serializes to, and in how many events (one probe stream),
    once the resolver has loaded the whole routes file."""
    options = [("grpc.max_receive_message_length", 64 * 1024 * 1024)]
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        while True:
            total, events, endpoints = 0, 0, 0
            call = resolver_pb2_grpc.ResolverStub(channel).Watch(pb.WatchRequest())
            async for event in call:
                total += event.ByteSize()
                events += 1
                endpoints += len(event.snapshot.endpoints)
                if event.HasField("snapshot") and not event.snapshot.more:
                    call.cancel()
                    break
            if endpoints == SERVICES * ENDPOINTS_PER_SERVICE:
                return total, events
            await asyncio.sleep(0.5)


async def main(args: argparse.Namespace) -> str:
    load_before = load()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "routes.yaml"
        routes_file(path)
        resolver, line = await start(
            [
                "waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
                "--routes-file", str(path),
                # Every watcher is a plaintext client on 127.0.0.1: one peer to the caps.
                "--max-streams", "4000", "--max-unauthenticated-streams", "2000",
                "--max-streams-per-peer", "2000", "--max-streams-per-unauthenticated-peer", "2000",
            ],
            "listening",
        )  # fmt: skip
        try:
            address = f"127.0.0.1:{json.loads(line)['grpc_ports'][0]}"
            size, chunks = await snapshot_bytes(address)
            rss_before = memory(resolver.pid)[1]
            per = args.streams // PROCESSES
            began = time.monotonic()
            workers = await asyncio.gather(
                *(
                    start(
                        [
                            "bench.resolver_storm.clients",
                            address,
                            str(per),
                            str(size),
                            str(args.changes),
                        ],
                        "ready",
                    )
                    for _ in range(PROCESSES)
                )
            )
            storm = time.monotonic() - began
            lost_in_storm = sum(int(line.split()[2]) for _, line in workers)
            peak_after_storm, rss_after_storm = memory(resolver.pid)
            await asyncio.sleep(2)
            sent: list[float] = []
            queue: asyncio.Queue[pb.TunnelReport | None] = asyncio.Queue()

            async def reports():  # type: ignore[no-untyped-def]
                while (report := await queue.get()) is not None:
                    yield report

            async with grpc.aio.insecure_channel(address) as channel:
                call = resolver_pb2_grpc.ResolverStub(channel).ReportTunnels(reports())
                for i in range(args.changes):
                    sent.append(time.monotonic())
                    queue.put_nowait(
                        pb.TunnelReport(
                            server=pb.TunnelServer(id="storm-ts", address="127.0.0.1:7004"),
                            nodes=[f"storm-node-{i}"],
                        )
                    )
                    await asyncio.sleep(CHANGE_SPACING)
                results = []
                for process, _ in workers:
                    assert process.stdout is not None
                    out = await asyncio.wait_for(process.stdout.readline(), 300)
                    results.append(json.loads(out))
                    await stop(process)
                queue.put_nowait(None)
                await call
            peak, rss_end = memory(resolver.pid)
        finally:
            await stop(resolver)
    lost = sum(r["lost_count"] for r in results)
    reasons = sorted({reason for r in results for reason in r["lost"]})
    delays, complete = [], 0
    live = args.streams - lost
    for i in range(args.changes):
        arrivals = [r["seen"][str(i)] for r in results if str(i) in r["seen"]]
        if sum(a[1] for a in arrivals) == live:
            complete += 1
            delays.append((max(a[0] for a in arrivals) - sent[i]) * 1000)
    delays.sort()
    p50 = statistics.median(delays) if delays else float("nan")
    p99 = delays[min(len(delays) - 1, int(len(delays) * 0.99))] if delays else float("nan")
    mib = 1024 * 1024
    return "\n".join(
        [
            "# resolver watcher storm",
            "",
            f"Command: `.venv/bin/python -m bench.resolver_storm --streams {args.streams} "
            f"--changes {args.changes}`",
            "",
            f"Machine: {describe()}",
            "",
            f"Store: {SERVICES * ENDPOINTS_PER_SERVICE:,} endpoints; one snapshot is "
            f"{size / mib:.1f} MiB in {chunks} events. {args.streams} Watch streams, each on "
            f"its own connection, in {PROCESSES} processes, opened at once; resolver, "
            "watchers and driver share the machine.",
            "",
            f"Load average before / after: {load_before} / {load()}.",
            "",
            "| figure | value |",
            "|---|---|",
            f"| every stream had its snapshot after | {storm:.1f} s |",
            f"| streams lost (ended with an error) | {lost_in_storm} in the storm, {lost} in all"
            + (f" ({'; '.join(reasons)[:300]})" if reasons else "")
            + " |",
            f"| change -> all live streams, p50 | {p50:.1f} ms |",
            f"| change -> all live streams, p99 | {p99:.1f} ms (aim < 100 ms) |",
            f"| change -> all live streams, max | {delays[-1] if delays else float('nan'):.1f} ms |",
            f"| changes that reached every live stream | {complete} of {args.changes} |",
            f"| events per stream after its snapshot (coalescing: fewer than the changes) | "
            f"{sum(r['events'] for r in results) / max(1, args.streams - lost):.1f} |",
            f"| resolver RSS before the storm | {rss_before / mib:.0f} MiB |",
            f"| resolver peak RSS (VmHWM) in the storm / in all | "
            f"{peak_after_storm / mib:.0f} / {peak / mib:.0f} MiB |",
            f"| resolver RSS after the storm / at the end | {rss_after_storm / mib:.0f} / "
            f"{rss_end / mib:.0f} MiB |",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.resolver_storm")
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--changes", type=int, default=100)
    print(asyncio.run(main(parser.parse_args())))
