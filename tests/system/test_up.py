"""`waygate up` as a user runs it: real child processes, restart, clean stop, no orphans."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT, child_env, free_up_offset, http_get
from waygate.components import COMPONENTS, DEMO_PORT

pytestmark = pytest.mark.system

IMPLEMENTED = [c for c in COMPONENTS if c.implemented]


def children_of(pid: int) -> set[int]:
    found: set[int] = set()
    for task in Path(f"/proc/{pid}/task").iterdir():
        # A thread may end between listing and reading.
        with contextlib.suppress(FileNotFoundError, ProcessLookupError):
            found |= {int(p) for p in (task / "children").read_text().split()}
    return found


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (FileNotFoundError, IndexError):
        return False
    return state != "Z"


class Up:
    def __init__(self, tmp_path: Path, *extra_args: str, stderr: Path | None = None) -> None:
        # Ports 17001..32005: above the defaults, below Linux's ephemeral range
        # (32768+), so no outgoing connection can be holding one of them.
        self.offset = free_up_offset()
        self.state_dir = tmp_path / "state"
        self.lines: list[str] = []
        self.process: asyncio.subprocess.Process | None = None
        self.extra_args = extra_args
        # Where up's stderr (its own and its children's log lines) goes; None: nowhere.
        self.stderr = stderr

    async def start(self) -> None:
        # up gets its own descriptor of the file; ours is closed once it has started.
        log = self.stderr.open("ab") if self.stderr is not None else None
        try:
            self.process = await self._spawn(log)
        finally:
            if log is not None:
                log.close()
        await self.wait_for_line("waygate up: all services started", timeout=90)

    async def _spawn(self, log) -> asyncio.subprocess.Process:
        return await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "waygate",
            "up",
            "--port-offset",
            str(self.offset),
            "--state-dir",
            str(self.state_dir),
            *self.extra_args,
            cwd=ROOT,
            env=child_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL if log is None else log,
        )

    async def wait_for_line(self, text: str, timeout: float) -> None:
        assert self.process is not None and self.process.stdout is not None
        async with asyncio.timeout(timeout):
            while not any(text in line for line in self.lines):
                raw = await self.process.stdout.readline()
                if not raw:
                    raise AssertionError(f"up exited before {text!r}: {self.lines}")
                self.lines.append(raw.decode().rstrip())

    def admin_port(self, component) -> int:
        return component.port("admin_port") + self.offset


@pytest.fixture
async def up(tmp_path):
    if not IMPLEMENTED:
        pytest.fail("no component is implemented: waygate up has nothing to run")
    instance = Up(tmp_path)
    yield instance
    if instance.process is not None and instance.process.returncode is None:
        instance.process.kill()
        await instance.process.wait()


async def test_up_prints_addresses_serves_and_stops_with_no_child_left(up):
    await up.start()
    output = "\n".join(up.lines)
    for component in IMPLEMENTED:
        for field, _label in component.port_labels:
            assert f"127.0.0.1:{component.port(field) + up.offset}" in output
        assert await http_get(up.admin_port(component), "/readyz") == (200, "ready\n")
    missing = [c.name for c in COMPONENTS if not c.implemented]
    if missing:
        assert "not implemented yet: " + ", ".join(missing) in output
    # The demo backend runs beside the services and echoes what it received.
    demo_port = DEMO_PORT + up.offset
    assert f"demo-backend   127.0.0.1:{demo_port}" in output
    reader, writer = await asyncio.open_connection("127.0.0.1", demo_port)
    writer.write(b"GET /hello?x=1 HTTP/1.1\r\nHost: demo\r\nConnection: close\r\n\r\n")
    answer = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 ") and json.loads(body)["path"] == "/hello"

    children = children_of(up.process.pid)
    assert len(children) == len(IMPLEMENTED) + 1  # the services and the demo backend
    up.process.send_signal(signal.SIGTERM)
    await up.wait_for_line("waygate up: stopped", timeout=60)
    assert await asyncio.wait_for(up.process.wait(), 30) == 0
    assert not [pid for pid in children if alive(pid)]


async def test_a_crashed_child_is_restarted(up):
    await up.start()
    component = IMPLEMENTED[0]
    before = children_of(up.process.pid)
    command = "\x00" + "\x00".join(component.command) + "\x00"
    victim = next(pid for pid in before if command in Path(f"/proc/{pid}/cmdline").read_text())
    os.kill(victim, signal.SIGKILL)
    async with asyncio.timeout(60):
        while True:
            now = children_of(up.process.pid)
            if len(now) == len(before) and victim not in now:
                break
            await asyncio.sleep(0.2)
        while True:
            with contextlib.suppress(OSError):  # refused until the new child has bound
                if (await http_get(up.admin_port(component), "/readyz"))[0] == 200:
                    break
            await asyncio.sleep(0.2)
    up.process.send_signal(signal.SIGINT)
    assert await asyncio.wait_for(up.process.wait(), 60) == 0


async def test_children_die_with_a_killed_supervisor(up):
    await up.start()
    children = children_of(up.process.pid)
    up.process.kill()  # no chance to clean up: the kernel's PDEATHSIG must do it
    await up.process.wait()
    async with asyncio.timeout(20):
        while [pid for pid in children if alive(pid)]:
            await asyncio.sleep(0.1)
