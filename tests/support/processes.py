"""Run real Waygate processes in tests and read their JSON logs.

`start_service` launches a process that binds port 0 and waits for its
"listening" log line, which carries the ports it really bound. The process's
stderr is collected line by line so a test can assert on what it logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class RunningService:
    process: asyncio.subprocess.Process
    grpc_ports: list[int] = field(default_factory=list)
    admin_port: int = 0
    logs: list[dict] = field(default_factory=list)
    _reader: asyncio.Task | None = None

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_ports[0]}"

    def logged(self, msg: str) -> bool:
        return any(entry.get("msg") == msg for entry in self.logs)

    async def stop(self, sig: int | None = signal.SIGTERM, timeout: float = 20.0) -> int:
        """Send `sig` (None: the test already signalled it) and wait for the exit code."""
        if sig is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)
        try:
            code = await asyncio.wait_for(self.process.wait(), timeout)
        except TimeoutError:
            self.process.kill()
            await self.process.wait()
            raise AssertionError(f"process did not stop within {timeout}s after {sig!r}") from None
        if self._reader is not None:
            await asyncio.wait_for(self._reader, 5)
        return code


async def _collect(
    service: RunningService, stream: asyncio.StreamReader, listening: asyncio.Future
) -> None:
    async for raw in stream:
        line = raw.decode(errors="replace").strip()
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            entry = {"msg": line, "level": "raw"}
        service.logs.append(entry)
        if entry.get("msg") == "listening" and not listening.done():
            listening.set_result(entry)
    if not listening.done():
        listening.set_exception(
            AssertionError(f"process exited before listening: {service.logs[-5:]}")
        )


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WAYGATE_", "OTEL_"))}
    env.update(extra or {})
    return env


async def start_service(
    argv: Sequence[str], env: dict[str, str] | None = None, timeout: float = 30.0
) -> RunningService:
    """Start `python -m <argv...>` and wait until it logs "listening"."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", *argv, cwd=ROOT, env=child_env(env), stderr=asyncio.subprocess.PIPE
    )
    service = RunningService(process)
    listening: asyncio.Future = asyncio.get_running_loop().create_future()
    assert process.stderr is not None
    service._reader = asyncio.create_task(_collect(service, process.stderr, listening))
    try:
        entry = await asyncio.wait_for(listening, timeout)
    except BaseException:
        process.kill()
        await process.wait()
        raise
    service.grpc_ports = list(entry.get("grpc_ports", []))
    service.admin_port = int(entry.get("admin_port", 0))
    return service


def resolver_serve_argv(routes: Path, *extra: str) -> list[str]:
    """`waygate resolver serve` on port 0 over ROUTES, polled every 100 ms (tests edit it)."""
    return [
        "waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
        "--routes-file", str(routes), "--routes-poll-interval", "100ms", *extra,
    ]  # fmt: skip


def certs_serve_argv(
    directory: Path,
    tokens: Sequence[dict[str, object]],
    *extra: str,
    ca_dir: Path | None = None,
) -> list[str]:
    """`waygate certs serve` on port 0 with a tokens file (0600) holding `tokens`
    (entries of `name`, `token`, `allowed` or `admin`), its CA in DIRECTORY/ca."""
    tokens_file = directory / "tokens.yaml"
    tokens_file.write_text(yaml.safe_dump({"tokens": list(tokens)}))
    tokens_file.chmod(0o600)
    return [
        "waygate", "certs", "serve", "--grpc-port", "0", "--admin-port", "0",
        "--ca-dir", str(ca_dir or directory / "ca"), "--tokens-file", str(tokens_file), *extra,
    ]  # fmt: skip


async def run_cli(
    *args: str, env: dict[str, str] | None = None, cwd: Path = ROOT, timeout: float = 60.0
) -> tuple[int, str, str]:
    """Run `waygate ARGS...` as a subprocess; returns (exit code, stdout, stderr)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "waygate",
        *args,
        cwd=cwd,
        env=child_env(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise AssertionError(f"waygate {' '.join(args)} did not finish within {timeout}s") from None
    return process.returncode or 0, out.decode(), err.decode()


async def http_get(port: int, path: str) -> tuple[int, str]:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n\r\n".encode())
    data = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body.decode()


EPHEMERAL_START = 32768  # Linux's default ip_local_port_range starts here


def free_up_offset(extra: int = 0) -> int:
    """A `waygate up --port-offset` whose every port is free right now.

    Every port above the defaults and below Linux's ephemeral range (32768+), so no
    outgoing connection can take one between this check and `up`'s bind: the
    offset's ceiling comes from the highest default port (the HTTPS front's 10263
    once put `up` at 32780, where a connection's local port had landed). Other
    tests on this machine start their own `up`s: an offset is drawn until all of
    its ports bind, since `up` refuses to start on a taken port.
    """
    import random

    from waygate.components import COMPONENTS, DEMO_PORT
    from waygate.core.portholder import port_free
    from waygate.supervisor import STATUS_PORT

    defaults = [port for c in COMPONENTS for _, port in c.ports] + [DEMO_PORT, STATUS_PORT]
    ceiling = EPHEMERAL_START - max(defaults) - extra  # the highest port stays below it
    for _ in range(50):
        offset = random.randrange(10000, ceiling, 100) + extra
        if all(port_free("127.0.0.1", port + offset) for port in defaults):
            return offset
    raise AssertionError("no free port offset for `waygate up` after 50 draws")


async def proxy_get(port: int, host: str, path: str = "/") -> tuple[int, bytes]:
    """GET `path` with this Host on a fresh connection: (status, body)."""
    reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body
