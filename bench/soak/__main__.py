"""`make soak`: the whole stack as processes under steady load and a schedule of faults.

Run: .venv/bin/python -m bench.soak [--minutes 30] [--out bench/soak/out]
Writes the report (table, checks) to OUT/soak.md and the plot to OUT/soak.png;
exits 1 when a check failed. See bench/soak/run.py for the schedule.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

from bench.machine import describe
from bench.soak.run import Soak
from bench.soak.stack import Stack

HERE = Path(__file__).resolve().parent
#: With `HOLD` seconds per phase and a 120 s leaf lifetime the first cycle of
#: faults (steady start and CA rotation included) takes about 7.5 minutes and
#: each later one about 5.7 (the rotations wait for every process to renew;
#: measured 22:01 UTC, round 5, two replicas of resolver and certs): as many
#: whole cycles as fit run (at least one), and steady load fills the rest of
#: `--minutes`.
HOLD = 20.0
LEAF_LIFETIME = 120.0
FIRST_CYCLE_SECONDS = 450.0
CYCLE_SECONDS = 340.0


async def main(minutes: float, out: Path, proxy_args: tuple[str, ...] = ()) -> int:
    out.mkdir(parents=True, exist_ok=True)
    cycles = max(1, 1 + int((minutes * 60 - FIRST_CYCLE_SECONDS) // CYCLE_SECONDS))
    # Kept when the run fails (every process's log is there), removed otherwise.
    directory = Path(tempfile.mkdtemp(prefix="waygate-soak-"))
    stack = Stack(directory, leaf_lifetime=LEAF_LIFETIME, proxy_args=proxy_args)
    soak = Soak(stack, hold=HOLD, cycles=cycles, minimum=minutes * 60)
    began = time.time()
    try:
        await soak.run()
    except BaseException:
        print(f"soak: the processes' logs are kept in {directory}", file=sys.stderr)
        raise
    finally:
        stack.stop_all()
    seconds = time.time() - began
    title = (
        f"waygate soak, {seconds / 60:.0f} min, {cycles} fault cycle{'' if cycles == 1 else 's'}"
    )
    soak.plot(out / "soak.png", title)
    command = f"make soak SOAK_MINUTES={minutes:g}"
    if proxy_args:
        command += ' SOAK_ARGS="' + " ".join(f"--proxy-arg={a}" for a in proxy_args) + '"'
    text = f"# {title}\n\n{describe()}\n\nCommand: `{command}`\n\n{soak.report()}"
    (out / "soak.md").write_text(text)
    print(text)
    if soak.passed:
        shutil.rmtree(directory, ignore_errors=True)
    else:
        print(f"soak: the processes' logs are kept in {directory}", file=sys.stderr)
    return 0 if soak.passed else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--out", type=Path, default=HERE / "out")
    parser.add_argument(
        "--proxy-arg",
        action="append",
        default=[],
        metavar="FLAG",
        help="one more flag for the proxy (repeatable), e.g. --proxy-arg=--tunnel-end-to-end",
    )
    arguments = parser.parse_args()
    sys.exit(asyncio.run(main(arguments.minutes, arguments.out, tuple(arguments.proxy_arg))))
