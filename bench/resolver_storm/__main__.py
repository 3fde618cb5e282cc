"""The resolver under a watcher storm (issue 18 item 5).

Setup, all real processes on loopback, plaintext:
- `waygate resolver serve` on a routes file of 1,000 services x 100 endpoints
  (100,000 endpoints in the store);
- 1,000 Watch streams, each on its own connection, in 4 processes
  (bench.resolver.watchers), all opened at once: the snapshot storm;
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
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import describe
from bench.resolver.__main__ import load, start, stop
from bench.resolver.common import ChangeReporter, fanout, routes_file, snapshot_bytes

SERVICES, ENDPOINTS_PER_SERVICE = 1000, 100
PROCESSES = 4
CHANGE_SPACING = 0.05
PREFIX = "storm-node-"


def cpu_seconds(pid: int) -> float:
    """User + system CPU a process has used so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def memory(pid: int) -> tuple[int, int]:
    """(peak RSS, RSS) of a process, bytes."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["VmHWM"].split()[0]) * 1024, int(fields["VmRSS"].split()[0]) * 1024


async def profiler(pid: int, output: Path, native: bool) -> asyncio.subprocess.Process:
    """py-spy recording the resolver (raw collapsed stacks, Python frames, not pausing it
    ) until SIGINT: the fan-out phase only, not the routes-file load."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    process = await asyncio.create_subprocess_exec(
        spy, "record", "--pid", str(pid), "--format", "raw", "--rate", "250",
        "--threads", "--nonblocking", *(["--native"] if native else []), "--output", str(output),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    await asyncio.sleep(1)  # attached before the first change
    return process


async def main(args: argparse.Namespace) -> str:
    load_before = load()
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "routes.yaml"
        routes_file(path, "storm", SERVICES, ENDPOINTS_PER_SERVICE)
        command = (
            [
                "waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
                "--routes-file", str(path),
                # Every watcher is a plaintext client on 127.0.0.1: one peer to the caps.
                "--max-streams", "4000", "--max-unauthenticated-streams", "2000",
                "--max-streams-per-peer", "2000", "--max-streams-per-unauthenticated-peer", "2000",
            ]
            if args.server == "resolver"
            else ["bench.resolver_storm.bare", str(SERVICES * ENDPOINTS_PER_SERVICE)]
        )  # fmt: skip
        resolver, line = await start(command, "listening")
        try:
            address = f"127.0.0.1:{json.loads(line)['grpc_ports'][0]}"
            size, chunks = await snapshot_bytes(address, SERVICES * ENDPOINTS_PER_SERVICE)
            rss_before = memory(resolver.pid)[1]
            per = args.streams // PROCESSES
            began = time.monotonic()
            workers = await asyncio.gather(
                *(
                    start(
                        [
                            "bench.resolver.watchers",
                            address,
                            str(per),
                            str(size),
                            str(args.changes),
                            PREFIX,
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
            spy = await profiler(resolver.pid, args.profile, args.native) if args.profile else None
            pids = [resolver.pid] + [process.pid for process, _ in workers]
            cpu_before = [cpu_seconds(pid) for pid in pids]
            async with ChangeReporter(address, PREFIX) as reporter:
                for i in range(args.changes):
                    reporter.send(i)
                    await asyncio.sleep(CHANGE_SPACING)
                # Once every stream has the last change (the watchers report then).
                results = []
                for process, _ in workers:
                    assert process.stdout is not None
                    out = await asyncio.wait_for(process.stdout.readline(), 300)
                    results.append(json.loads(out))
                cpu = [
                    cpu_seconds(pid) - before for pid, before in zip(pids, cpu_before, strict=True)
                ]
                for process, _ in workers:
                    await stop(process)
            if spy is not None:
                spy.send_signal(signal.SIGINT)
                await spy.wait()
            peak, rss_end = memory(resolver.pid)
        finally:
            await stop(resolver)
    lost = sum(r["lost_count"] for r in results)
    reasons = sorted({reason for r in results for reason in r["lost"]})
    watch = fanout(results, reporter.sent, args.streams - lost)
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
            f"Server: {args.server}"
            + (
                " (bench/resolver_storm/bare.py: grpc.aio alone, the floor)"
                if args.server == "bare"
                else ""
            )
            + ".",
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
            f"| change -> all live streams, p50 | {watch['p50']:.1f} ms |",
            f"| change -> all live streams, p99 | {watch['p99']:.1f} ms (aim < 100 ms) |",
            f"| change -> all live streams, max | {watch['max']:.1f} ms |",
            f"| changes that reached every live stream | {watch['complete']} of {args.changes} |",
            f"| events per stream after its snapshot (coalescing: fewer than the changes) | "
            f"{sum(r['events'] for r in results) / max(1, args.streams - lost):.1f} |",
            f"| CPU per change, resolver / all watcher processes | {cpu[0] / args.changes * 1000:.1f}"
            f" / {sum(cpu[1:]) / args.changes * 1000:.1f} ms |",
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
    parser.add_argument(
        "--server", choices=("resolver", "bare"), default="resolver",
        help="bare: the grpc.aio-only peer (bench/resolver_storm/bare.py)",
    )  # fmt: skip
    parser.add_argument("--profile", type=Path, help="py-spy the resolver's fan-out phase here")
    parser.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    print(asyncio.run(main(parser.parse_args())))
