"""`waygate up` never lies (issue 17 item 7), and what a user does next to it works
without flags (items 1-3): real processes, ports offset into a free range.

- a taken port fails `up` at once, naming the port, the holder and a free offset;
- a child that keeps crashing stops `up` with exit 1 and the child's last error;
- a SIGSTOPped (hung) child is killed and restarted by the liveness probe;
- from a subdirectory, `waygate routes`, `waygate check` and `waygate cert status`
  find the state directory and the addresses `up` recorded (no --addr);
- a route to a missing service is explained by `waygate check` and the 503 page;
- the README's example requests answer the status its comments name (issue 29
  finding 5: an unknown host is 404 under `up`, not 503);
- a second `up` in the same directory is refused, naming the running one, and
  changes none of its files (finding 2); the command its hint prints starts a
  second copy beside the first, which keeps working.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import signal
import socket
import sys
from pathlib import Path

import pytest

from tests.support.processes import ROOT, child_env, free_up_offset, run_cli
from waygate.components import DEMO_PORT

pytestmark = pytest.mark.system


def readme_client_examples() -> list[list[str]]:
    """The README's client examples (the `waygate` lines of its marked block)."""
    text = (ROOT / "README.md").read_text()
    block = text.split("<!-- client-examples:", 1)[1].split("<!-- end client-examples -->")[0]
    lines = [shlex.split(line, comments=True) for line in block.splitlines()]
    return [words for words in lines if words and words[0] == "waygate"]


def readme_answer_examples() -> list[tuple[list[str], int]]:
    """The README's example requests (the curl lines of its marked blocks), each with
    the status its comment names."""
    text = (ROOT / "README.md").read_text()
    blocks = [
        part.split("<!-- end answer-examples -->")[0]
        for part in text.split("<!-- answer-examples:")[1:]
    ]
    found = []
    for line in "\n".join(blocks).splitlines():
        command, _, comment = line.partition(" # ")
        words = shlex.split(command)
        if words and words[0] == "curl":
            found.append((words, int(comment.split()[0].rstrip(":"))))
    return found


async def curl_status(words: list[str], offset: int, cwd: Path) -> int:
    """Run a README curl line against an `up` at `offset` (its ports moved), the
    status code only."""
    moved = [
        w.replace(":8080/", f":{8080 + offset}/").replace(":8443", f":{8443 + offset}")
        for w in words
        if w != "-i"
    ]
    process = await asyncio.create_subprocess_exec(
        *moved, "-s", "-o", "/dev/null", "-w", "%{http_code}", "--max-time", "10",
        cwd=cwd, stdout=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, _ = await asyncio.wait_for(process.communicate(), 20)
    return int(out or b"0")


def free_offset() -> int:
    # Ports 17001..32005: above the defaults, below Linux's ephemeral range.
    return free_up_offset()


async def start_up(cwd: Path, *args: str, env: dict[str, str] | None = None):  # type: ignore[no-untyped-def]
    return await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "waygate",
        "up",
        *args,
        cwd=cwd,
        env=child_env(env),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )


async def test_a_taken_port_fails_up_at_once_naming_port_holder_and_offset(
    tmp_path: Path,
) -> None:
    offset = free_offset()
    port = 7001 + offset
    with socket.socket() as squatter:
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind(("127.0.0.1", port))
        squatter.listen()
        up = await start_up(tmp_path, "--port-offset", str(offset))
        _, err = await asyncio.wait_for(up.communicate(), 30)
    text = err.decode()
    assert up.returncode == 2, text
    assert f"port {port} (resolver gRPC" in text
    assert f"taken by pid {os.getpid()} (" in text, "the holder, found through /proc"
    assert "--port-offset" in text
    assert not (tmp_path / ".waygate" / "up.json").exists(), "nothing started"


async def test_a_crash_looping_child_stops_up_with_its_last_error(tmp_path: Path) -> None:
    # Every service refuses to start with a config file that does not exist.
    missing = tmp_path / "missing.yaml"
    up = await start_up(
        tmp_path,
        "--port-offset",
        str(free_offset()),
        "--max-restarts",
        "2",
        env={"WAYGATE_CONFIG": str(missing)},
    )
    _, err = await asyncio.wait_for(up.communicate(), 240)
    text = err.decode()
    assert up.returncode == 1, text
    last = text.strip().splitlines()[-1]
    assert last.startswith("waygate up: stopped: certs keeps crashing: it exited 3 times"), last
    assert f"cannot read config file {missing}" in last


async def read_until(
    stream: asyncio.StreamReader, text: str, seen: list[str], timeout: float
) -> None:
    async with asyncio.timeout(timeout):
        while not any(text in line for line in seen):
            raw = await stream.readline()
            if not raw:
                raise AssertionError(f"up ended before {text!r}: {seen[-20:]}")
            seen.append(raw.decode("utf-8", "replace").rstrip())


async def http(port: int, host: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(f"GET / HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
    try:
        return await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()


async def test_next_to_up_commands_need_no_flags_and_explain_a_broken_route(
    tmp_path: Path,
) -> None:
    offset = free_offset()
    up = await start_up(
        tmp_path,
        "--port-offset",
        str(offset),
        "--liveness-interval",
        "0.5",
        "--liveness-failures",
        "2",
    )
    assert up.stdout is not None and up.stderr is not None
    out: list[str] = []
    err: list[str] = []
    drain = asyncio.ensure_future(read_until(up.stderr, "\0never", err, 600))
    try:
        await read_until(up.stdout, "waygate up: all services started", out, 240)
        below = tmp_path / "a" / "b"
        below.mkdir(parents=True)
        code, text, problem = await run_cli("routes", cwd=below)
        assert code == 0, problem
        assert text.splitlines()[0].startswith(
            f"routes file {tmp_path / '.waygate' / 'routes.yaml'}: valid"
        )
        assert "echo.localtest.me" in text
        code, text, problem = await run_cli("check", cwd=below)
        assert code == 0, text + problem
        assert "✖" not in text and "Status check results are ✔" in text
        assert "edge node edge-local: agent connected" in text
        assert "✔ proxy: certificate identity spiffe://waygate.local/ns/local/sa/proxy" in text
        assert "✔ proxy: serving certificate valid" in text
        assert "✔ your client certificate valid" in text
        code, text, problem = await run_cli("cert", "status", cwd=below)
        assert code == 0, problem
        assert "active" in text and "spiffe://waygate.local/ns/local/sa/proxy" in text

        # The README's client examples, literally, from the directory `up` runs in.
        examples = readme_client_examples()
        assert len(examples) >= 8
        for words in examples:
            code, text, problem = await run_cli(*words[1:], cwd=tmp_path)
            assert code == 0, f"{shlex.join(words)}: {problem or text}"
        assert (tmp_path / "me" / "cert.pem").is_file()

        # The README's example requests answer what their comments say.
        answers = readme_answer_examples()
        assert len(answers) >= 6 and any(code == 404 for _, code in answers)
        for words, expected in answers:
            got = 0
            for _ in range(25):  # the tunnel agent may still be connecting
                got = await curl_status(words, offset, tmp_path)
                if got == expected:
                    break
                await asyncio.sleep(0.2)
            assert got == expected, f"{shlex.join(words)}: {got}, README says {expected}"

        await second_up_cannot_touch_the_first(tmp_path, offset, up.pid)

        # A route to nowhere: check fails and says why; the proxy's 503 names it.
        ghost = tmp_path / "ghost.yaml"
        ghost.write_text(
            "namespace: mine\nname: ghost\nhost: ghost.localtest.me\nto: doesnotexist\n"
        )
        code, _, problem = await run_cli("routes", "apply", "-f", str(ghost), cwd=below)
        assert code == 0, problem
        code, text, _ = await run_cli("check", cwd=below)
        assert code == 1
        assert "✖ route mine/ghost: ServiceNotFound: service mine/doesnotexist not found" in text
        expected = b"route mine/ghost: service mine/doesnotexist not found"
        answer = b""
        for _ in range(50):  # the proxy's view follows the resolver's within moments
            answer = await http(8080 + offset, "ghost.localtest.me")
            if expected in answer:
                break
            await asyncio.sleep(0.2)
        assert answer.startswith(b"HTTP/1.1 503 ") and expected in answer, answer[:400]

        # A hung child (SIGSTOP) is killed and restarted by the liveness probe.
        demo_port = DEMO_PORT + offset
        victim = next(
            int(p.name)
            for p in Path("/proc").iterdir()
            if p.name.isdigit() and f"--http-port\0{demo_port}\0" in _cmdline(p)
        )
        os.kill(victim, signal.SIGSTOP)
        async with asyncio.timeout(60):
            while not any("demo-backend did not answer /healthz" in line for line in err):
                await asyncio.sleep(0.2)
            while True:
                with contextlib.suppress(OSError, asyncio.TimeoutError):
                    if (await http(demo_port, "demo")).startswith(b"HTTP/1.1 200"):
                        break
                await asyncio.sleep(0.2)
        assert not Path(f"/proc/{victim}").exists() or _state(victim) == "Z"
    finally:
        up.send_signal(signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(up.wait(), 60)
        if up.returncode is None:
            up.kill()
            await up.wait()
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
    assert up.returncode == 0


async def second_up_cannot_touch_the_first(tmp_path: Path, offset: int, first: int) -> None:
    state = tmp_path / ".waygate"
    kept = ["up.json", "tokens.yaml", "tokens/proxy.token", "tokens/user.token", "ca.pem"]
    before = {name: (state / name).read_bytes() for name in kept}
    # Again here, with the same offset and with another one: refused either way.
    for args in ((), ("--port-offset", str(offset)), ("--port-offset", str(free_offset()))):
        second = await start_up(tmp_path, *args)
        _, err = await asyncio.wait_for(second.communicate(), 60)
        text = err.decode()
        assert second.returncode == 2, text
        assert f"state directory {state} is in use by a running `waygate up` (pid {first}" in text
        hint = text.split("run a copy beside it: ", 1)[1].splitlines()[0]
        assert hint.startswith("waygate up --state-dir .waygate-"), hint
    assert {name: (state / name).read_bytes() for name in kept} == before
    code, text, problem = await run_cli("cert", "status", cwd=tmp_path)
    assert code == 0, problem

    # The hint, run as printed (from the same directory): a second copy beside the first.
    words = shlex.split(hint)
    assert words[:2] == ["waygate", "up"]
    copy = await start_up(tmp_path, *words[2:])
    assert copy.stdout is not None and copy.stderr is not None
    out: list[str] = []
    drain = asyncio.ensure_future(read_until(copy.stderr, "\0never", [], 600))
    try:
        await read_until(copy.stdout, "waygate up: all services started", out, 240)
        other = tmp_path / words[words.index("--state-dir") + 1]
        code, text, problem = await run_cli("check", "--state-dir", str(other), cwd=tmp_path)
        assert code == 0, text + problem
    finally:
        copy.send_signal(signal.SIGTERM)
        await asyncio.wait_for(copy.wait(), 60)
        drain.cancel()
        await asyncio.gather(drain, return_exceptions=True)
    assert {name: (state / name).read_bytes() for name in kept} == before
    code, text, problem = await run_cli("check", cwd=tmp_path)
    assert code == 0, text + problem
    code, text, problem = await run_cli("cert", "status", cwd=tmp_path)
    assert code == 0, problem


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_text()
    except OSError:
        return ""


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1][0]
    except (OSError, IndexError):
        return "gone"
