"""Issue 31 finding 9 against a real proxy process: slow uploads cannot hold a backend's slots.

The audit's attack, scaled down to run in about 20 s: ATTACKERS clients POST
/upload declaring 10 MB and trickle a byte every half second (cut by the
proxy at its minimum body rate, reopened at once), while a bystander POSTs
small bodies to the same host and backend, whose connection slots are few
(`--max-connections-per-endpoint 8`, `--endpoint-queue 8`). The backend
(`bench.attacks.backend`) answers an upload once it has read its body, as an
application does. Everything runs in its own process (`bench.attacks.stack`:
resolver, `waygate proxy serve`, backends; the attack through `python -m
bench.attacks attack slow-upload`).

Measured here (12 s attack, two loaded cores):

    before (the body streamed: every upload holds a slot)   after (request buffering)
    bystander 464 POSTs, 5.0% success (503: the endpoint's   481 POSTs, 100%, p99 30 ms; 360
    slots and queue full of uploads)                         uploads, 312 cut at the rate,
                                                             60 temporary files at the peak

The trickled bodies spill to unnamed temporary files (`--request-buffer-memory 1`):
files are open during the attack, and every one of them, and every socket the
attackers held, is gone once they vanish. `python -m bench.attacks --kinds
slow-upload` runs the audit's full shape (300 uploads, a byte every 5 s).
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest

from bench.attacks.slowupload import PostBystander
from bench.attacks.stack import AUTHORITY, proxy_stack, run_attack

pytestmark = pytest.mark.system

ATTACK_SECONDS = 12.0
ATTACKERS = 60
SLOTS = 8
# The bystander during the attack: (almost) every POST answered, none slow.
MIN_SUCCESS = 0.95
MIN_ATTEMPTS = 40
MAX_P99 = 1.5  # seconds (its timeout is 3 s)


def _fds(pid: int) -> list[str]:
    out = []
    for name in os.listdir(f"/proc/{pid}/fd"):
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{name}"))
        except OSError:
            continue  # closed meanwhile
    return out


async def test_slow_uploads_hold_no_backend_slot_and_leave_nothing_behind(tmp_path: Path):
    buffers = tmp_path / "buffers"
    buffers.mkdir()
    flags = (
        "--max-connections-per-endpoint", str(SLOTS), "--endpoint-queue", str(SLOTS),
        "--request-body-grace", "2s",
        "--request-buffer-memory", "1", "--request-buffer-dir", str(buffers),
    )  # fmt: skip
    async with proxy_stack(tmp_path, *flags) as stack:
        pid = stack.pid
        baseline = len(_fds(pid))
        spilled = 0

        async def watch_files() -> None:
            nonlocal spilled
            while True:
                files = sum(1 for link in _fds(pid) if link.startswith(str(buffers)))
                spilled = max(spilled, files)
                await asyncio.sleep(0.25)

        watcher = asyncio.get_running_loop().create_task(watch_files())
        bystander = PostBystander(stack.http_port, AUTHORITY)
        try:
            attacker, _ = await asyncio.gather(
                run_attack(
                    "slow-upload",
                    stack.http_port,
                    ATTACK_SECONDS,
                    ATTACKERS,
                    interval=0.5,
                    declared=10_000_000,
                ),
                bystander.run(ATTACK_SECONDS),
            )
        finally:
            watcher.cancel()
        report = bystander.report()
        # The attack ran: its uploads were cut at the minimum rate and reopened.
        assert attacker["uploads"] >= ATTACKERS and attacker["cut"] >= ATTACKERS, attacker
        assert bystander.attempts >= MIN_ATTEMPTS, report
        assert bystander.success >= MIN_SUCCESS, report
        assert bystander.quantile(0.99) < MAX_P99, report
        # The trickled bodies were in temporary files (unnamed: nothing in the directory).
        assert spilled >= 1
        assert list(buffers.iterdir()) == []
        # The attackers are gone: their sockets and files with them (the pool may
        # keep up to SLOTS idle upstream connections from the bystander's POSTs).
        for _ in range(50):
            links = _fds(pid)
            held_files = [link for link in links if link.startswith(str(buffers))]
            if not held_files and len(links) <= baseline + SLOTS:
                break
            await asyncio.sleep(0.1)
        assert held_files == []
        assert len(links) <= baseline + SLOTS, (baseline, links)
