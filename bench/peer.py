"""A benchmark's peer process (a proxy under test, a reference server): started pinned
to cores, waited for until it serves, and stopped. Used by bench.proxy and bench.h2.

`Peer.start` runs the command (stdin a pipe, so a Python peer can serve until it
closes; output to `log` when given), then polls `serving()` (what a subclass
says: None once the peer answers as it should) for up to 120 s, which a busy
machine needs to start Python; a peer that exits or never serves raises with
its log's tail. `stop` closes stdin, sends SIGTERM, and kills what has not exited
20 s later.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
START_TIMEOUT = 120.0
STOP_TIMEOUT = 20.0


def pinned(cores: str, argv: list[str]) -> list[str]:
    """`argv` run on `cores` only (taskset)."""
    return ["taskset", "-c", cores, *argv]


class Peer:
    """One peer; subclasses say how to tell it serves (`serving`)."""

    def __init__(self, name: str, argv: list[str], cores: str, log: Path | None = None) -> None:
        self.name = name
        self.argv = argv
        self.cores = cores
        self.log = log
        self.processes: list[subprocess.Popen[bytes]] = []

    def serving(self) -> str | None:
        """None once the peer serves; else what it answered instead (for the error)."""
        raise NotImplementedError

    def start(self) -> None:
        out = open(self.log, "wb") if self.log else subprocess.DEVNULL  # noqa: SIM115
        self.processes.append(
            subprocess.Popen(
                pinned(self.cores, self.argv),
                cwd=ROOT,
                stdin=subprocess.PIPE,
                stdout=out,
                stderr=subprocess.STDOUT if self.log else subprocess.DEVNULL,
            )
        )
        deadline = time.monotonic() + START_TIMEOUT
        while (problem := self.serving()) is not None:
            code = self.processes[-1].poll()
            if code is not None or time.monotonic() > deadline:
                tail = self.log.read_text()[-2000:] if self.log else ""
                raise RuntimeError(
                    f"{self.name} does not serve ({problem}; exit code {code}):\n{tail}"
                )
            time.sleep(0.2)

    @property
    def pid(self) -> int:
        return self.processes[-1].pid

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                with contextlib.suppress(OSError):
                    process.stdin.close()  # type: ignore[union-attr]
                process.send_signal(signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(STOP_TIMEOUT)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
