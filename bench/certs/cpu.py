"""Certify's server CPU per call, alone: the quick probe behind a per-call CPU change.

`python -m bench.certs` measures everything side by side; this measures one
figure, the certs group's CPU time (user + system, /proc/PID/stat) per Certify
under the same load (8 callers, pre-made P-256 CSRs, plaintext loopback), which
moves far less than calls/s when other work shares the machine. Run it
alternately against two trees (A/B) to see a change. `--profile FILE` also
records the serving process with py-spy (`--gil --threads`, raw collapsed
stacks) over the measured seconds.

Run: .venv/bin/python -m bench.certs.cpu [--workers 1] [--seconds 5] [--rounds 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.certs.__main__ import (
    CONCURRENCY,
    CSR_POOL,
    certify_rate,
    group_pids,
    make_csr,
    start_certs,
    stop,
)


async def one_round(workers: int, seconds: float, profile: str | None) -> str:
    csrs = [make_csr() for _ in range(CSR_POOL)]
    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        (work / "logs").mkdir()
        (work / "ca").mkdir()
        certs, port = await start_certs(work / "ca", work / "logs", workers)
        spy = None
        try:
            pids = group_pids(certs)
            if profile:
                py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
                spy = subprocess.Popen(
                    [py_spy, "record", "--pid", str(pids[-1]), "--gil", "--threads",
                     "--rate", "100", "--duration", str(int(seconds) + 1),
                     "--format", "raw", "--output", profile],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                )  # fmt: skip
            measured = await certify_rate([port] * CONCURRENCY, csrs, seconds, pids)
            if spy is not None:
                spy.wait(60)
        finally:
            await stop(certs)
    return (
        f"Certify, --workers {workers}: {measured.rate:,.0f} calls/s, "
        f"{measured.server_cpu_us:,.0f} us of server CPU per call "
        f"(load average {os.getloadavg()[0]:.1f})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.certs.cpu")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--profile", help="py-spy raw output file (last round)")
    args = parser.parse_args()
    for index in range(args.rounds):
        last = index == args.rounds - 1
        print(asyncio.run(one_round(args.workers, args.seconds, args.profile if last else None)))


if __name__ == "__main__":
    main()
