"""Run issue 31's attacks against a real proxy, timed by a bystander.

    python -m bench.attacks [--seconds 30] [--kinds open-window,tiny-data,settings-flood,slow-upload]
                            [--proxy-flags "--h2-control-frames 1000"]
    python -m bench.attacks attack KIND --port P [--seconds S] [--connections N]

slow-upload (finding 9: 300 POSTs declaring 10 MB, a byte every 5 s, reopened
when cut) is timed by a bystander POSTing to the same backend
(`bench.attacks.slowupload`); run it with the demo's slots, e.g.
`--kinds slow-upload --proxy-flags "--max-connections-per-endpoint 256"`.

The first form starts a stack (bench.attacks.stack) and, for each attack,
reports the bystander's success rate, p50 and p99 during it, the proxy's CPU
seconds and resident memory (before, peak) and the attacker's CPU seconds, as
one JSON line per attack. The second runs one attack against a proxy already
listening (what the stack and the hostile system tests start).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import resource
import sys
import tempfile
from pathlib import Path
from typing import Any

from bench.attacks import slowupload
from bench.attacks.stack import AUTHORITY, BYSTANDER, ProcessFigures, proxy_stack, run_attack
from tests.support import h2attack

KINDS = ("open-window", "tiny-data", "settings-flood", "slow-upload")
# The attacks' shapes as the audit measured them: connections at once.
CONNECTIONS = {"open-window": 4, "tiny-data": 1, "settings-flood": 8, "slow-upload": 300}


async def attack(
    kind: str,
    port: int,
    seconds: float,
    connections: int,
    size: int,
    interval: float = 5.0,
    declared: int = 10_000_000,
) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + seconds
    authority = AUTHORITY.encode()
    if kind == "open-window":
        path = b"/big?n=%d" % size
        runs = [
            h2attack.open_window_hog(port, authority, path, deadline) for _ in range(connections)
        ]
    elif kind == "slow-upload":
        runs = [slowupload.slow_uploads(port, authority, deadline, connections, interval, declared)]
    elif kind == "tiny-data":
        runs = [h2attack.tiny_data(port, authority, deadline) for _ in range(connections)]
    else:
        runs = [h2attack.settings_flood(port, deadline) for _ in range(connections)]
    results = await asyncio.gather(*runs)
    usage = resource.getrusage(resource.RUSAGE_SELF)
    report: dict[str, Any] = {"kind": kind, "cpu_s": round(usage.ru_utime + usage.ru_stime, 2)}
    for result in results:
        for key, value in result.items():
            report[key] = report.get(key, 0) + value
    print(json.dumps(report), flush=True)


async def measured(
    port: int, pid: int, kind: str, seconds: float, connections: int
) -> dict[str, Any]:
    """One attack against the stack's proxy, with the bystander timing it."""
    figures = ProcessFigures(pid)
    cpu_before = figures.cpu_seconds()
    bystander: Any = (
        slowupload.PostBystander(port, AUTHORITY)  # the attacked backend's own clients
        if kind == "slow-upload"
        else h2attack.Bystander(port, BYSTANDER)
    )
    async with figures.peak_rss() as rss:
        attacker, _ = await asyncio.gather(
            run_attack(kind, port, seconds, connections), bystander.run(seconds)
        )
    return {
        "attack": kind,
        "seconds": seconds,
        "connections": connections,
        "bystander": bystander.report(),
        "proxy_cpu_s": round(figures.cpu_seconds() - cpu_before, 2),
        "proxy_rss_mib": {"before": round(rss[0]), "peak": round(rss[1])},
        "attacker": attacker,
    }


async def run(kinds: list[str], seconds: float, proxy_flags: list[str]) -> None:
    with tempfile.TemporaryDirectory() as directory:
        async with proxy_stack(Path(directory), *proxy_flags) as stack:
            quiet = await h2attack.Bystander(stack.http_port, BYSTANDER).run(3)
            print(json.dumps({"attack": None, "bystander": quiet.report()}), flush=True)
            for kind in kinds:
                report = await measured(
                    stack.http_port, stack.pid, kind, seconds, CONNECTIONS[kind]
                )
                print(json.dumps(report), flush=True)
                await asyncio.sleep(2)  # what the attack held is let go


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.attacks")
    sub = parser.add_subparsers(dest="command")
    one = sub.add_parser("attack", help="run one attack against a listening proxy")
    one.add_argument("kind", choices=KINDS)
    one.add_argument("--port", type=int, required=True)
    one.add_argument("--seconds", type=float, default=10)
    one.add_argument("--connections", type=int, default=1)
    one.add_argument("--size", type=int, default=512 * 1024 * 1024, help="open-window body bytes")
    one.add_argument("--interval", type=float, default=5.0, help="slow-upload: s between bytes")
    one.add_argument("--declared", type=int, default=10_000_000, help="slow-upload: body bytes")
    parser.add_argument("--seconds", type=float, default=30)
    parser.add_argument("--kinds", default=",".join(KINDS))
    parser.add_argument(
        "--proxy-flags", default="", help="more flags for waygate proxy serve, space-separated"
    )
    args = parser.parse_args(argv)
    if args.command == "attack":
        asyncio.run(
            attack(
                args.kind,
                args.port,
                args.seconds,
                args.connections,
                args.size,
                args.interval,
                args.declared,
            )
        )
        return 0
    kinds = [k for k in args.kinds.split(",") if k]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown:
        parser.error(f"unknown attack {', '.join(unknown)}; have {', '.join(KINDS)}")
    asyncio.run(run(kinds, args.seconds, args.proxy_flags.split()))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
