"""Issue 8 and 9: what a process writes on stderr stays structured and bounded.

- A TLS scan (300 failed handshakes against the TLS gRPC listener of a real
  certs process) used to make gRPC core print one unstructured absl line per
  connection (883 from one scan). Now at most a handful of non-JSON lines.
  The test removes GRPC_VERBOSITY from the child's environment: the process
  must quiet grpc core itself, not inherit it from the test runner.
- `--log-format text` prints one readable line per record; the default (auto)
  is JSON when stderr is not a terminal.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT, certs_serve_argv, child_env, start_service
from waygate.resolver.filesource import EXAMPLE_ROUTES

pytestmark = pytest.mark.system

SCAN_CONNECTIONS = 300
#: "A handful": a start-up warning or two is fine, one line per handshake is not.
MAX_RAW_LINES = 5


async def failed_handshake(port: int) -> None:
    """What a scanner does: connect, speak plain HTTP to a TLS port, read what comes, leave."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(b"GET / HTTP/1.1\r\nHost: scan\r\n\r\n")
        with contextlib.suppress(ConnectionError, TimeoutError):
            await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_a_tls_scan_writes_no_flood_of_unstructured_lines(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GRPC_VERBOSITY", raising=False)
    argv = certs_serve_argv(
        tmp_path, [],
        "--serving-identity", "spiffe://waygate.local/ns/local/sa/certs",
        "--serving-sans", "ip:127.0.0.1",
    )  # fmt: skip
    certs = await start_service(argv)
    try:
        raw_before = sum(1 for e in certs.logs if e.get("level") == "raw")
        for start in range(0, SCAN_CONNECTIONS, 50):
            await asyncio.gather(
                *(failed_handshake(certs.grpc_ports[0]) for _ in range(start, start + 50))
            )
        await asyncio.sleep(1.0)  # let the last lines (if any) arrive through the pipe
        raw = [e["msg"] for e in certs.logs if e.get("level") == "raw"]
        assert len(raw) - raw_before <= MAX_RAW_LINES, raw[:10]
    finally:
        assert await certs.stop() == 0


async def test_text_log_format_prints_one_readable_line_per_record(tmp_path: Path) -> None:
    routes = tmp_path / "routes.yaml"
    shutil.copyfile(EXAMPLE_ROUTES, routes)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "waygate", "resolver", "serve", "--grpc-port", "0",
        "--admin-port", "0", "--routes-file", str(routes), "--log-format", "text",
        cwd=ROOT, env=child_env(), stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert process.stderr is not None
    lines: list[str] = []
    try:
        async with asyncio.timeout(30):
            while not any(" listening " in line for line in lines):
                raw = await process.stderr.readline()
                assert raw, f"exited early: {lines}"
                lines.append(raw.decode().rstrip("\n"))
    finally:
        process.terminate()
        rest, _ = await asyncio.wait_for(process.communicate(), 20)
    lines += rest.decode().splitlines() if rest else []
    listening = next(line for line in lines if " listening " in line)
    assert " INFO " in listening and " resolver " in listening and "grpc_ports=[" in listening
    for line in lines:
        with pytest.raises(json.JSONDecodeError):
            json.loads(line)
    assert process.returncode == 0
