"""`waygate up` runs TLS everywhere, and client commands work next to it without flags.

Real processes: `waygate up` in a scratch directory (its state in ./.waygate),
then `waygate health` run from that directory as a user would. Checks: every
gRPC listener speaks TLS with a certificate from certs, a plaintext client is
refused, mTLS listeners (the resolver) refuse a client without a certificate,
the secrets `up` writes are 0600, the user's client certificate verifies with
openssl against the bundle, and SIGTERM leaves no child behind.
"""

from __future__ import annotations

import asyncio
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.processes import child_env, free_up_offset
from waygate.components import COMPONENTS

from .test_up import alive, children_of

pytestmark = pytest.mark.system

BY_NAME = {c.name: c for c in COMPONENTS if c.implemented}
# Listeners that require a client certificate under `up` (docs/architecture.md).
MTLS = {"resolver", "tunnel-server"}
# Port fields of gRPC listeners (the others are admin HTTP or proxy traffic).
GRPC_PORTS = {"grpc_port", "dial_port"}


class UpTLS:
    def __init__(self, directory: Path) -> None:
        self.directory = directory
        # Below Linux's ephemeral range (32768+), as in test_up.py, on other offsets.
        self.offset = free_up_offset(17)
        self.lines: list[str] = []
        self.process: asyncio.subprocess.Process | None = None

    @property
    def state(self) -> Path:
        return self.directory / ".waygate"

    def address(self, name: str, field: str = "grpc_port") -> str:
        return f"127.0.0.1:{BY_NAME[name].port(field) + self.offset}"

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "waygate",
            "up",
            "--port-offset",
            str(self.offset),
            cwd=self.directory,
            env=child_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
        )
        assert self.process.stdout is not None
        async with asyncio.timeout(90):
            while not any("all services started" in line for line in self.lines):
                raw = await self.process.stdout.readline()
                if not raw:
                    raise AssertionError(f"up exited early: {self.lines}")
                self.lines.append(raw.decode().rstrip())

    async def waygate(self, *args: str) -> tuple[int, str, str]:
        """Run a client command from the directory `up` runs in, with no TLS flags."""
        child = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "waygate",
            *args,
            "--timeout",
            "5s",
            cwd=self.directory,
            env=child_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(child.communicate(), 60)
        assert child.returncode is not None
        return child.returncode, out.decode(), err.decode()


@pytest.fixture
async def up(tmp_path):
    if "certs" not in BY_NAME:
        pytest.fail("certs is not implemented: `waygate up` cannot run TLS")
    instance = UpTLS(tmp_path)
    yield instance
    if instance.process is not None and instance.process.returncode is None:
        instance.process.kill()
        await instance.process.wait()


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


async def test_up_serves_tls_everywhere_and_clients_need_no_flags(up) -> None:
    await up.start()
    assert up.process is not None
    listeners = [
        (name, field) for name, c in BY_NAME.items() for field, _ in c.ports if field in GRPC_PORTS
    ]

    # What `up` wrote for the clients, and the secrets it keeps private.
    assert (up.state / "ca.pem").is_file()
    assert mode(up.state / "client" / "key.pem") == 0o600
    assert mode(up.state / "tokens.yaml") == 0o600
    assert all(mode(p) == 0o600 for p in (up.state / "tokens").iterdir())
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(up.state / "ca.pem"), "-purpose", "sslclient",
         str(up.state / "client" / "cert.pem")],
        capture_output=True, text=True, check=False,
    )  # fmt: skip
    assert verify.returncode == 0, verify.stdout + verify.stderr

    for name, field in listeners:
        address = up.address(name, field)
        # No flags: ./.waygate/ca.pem and the client certificate are found.
        code, out, err = await up.waygate("health", address)
        assert (code, out.strip()) == (0, "SERVING"), f"{name} {field}: {err}"
        # A plaintext client gets nowhere on a TLS listener.
        code, _, err = await up.waygate("health", "--plaintext", address)
        assert code == 2 and "UNAVAILABLE" in err, f"{name} {field} answered plaintext: {err}"
        if name in MTLS:
            # Server verified, but no client certificate: refused.
            code, _, err = await up.waygate(
                "health", "--ca-file", str(up.state / "ca.pem"), address
            )
            assert code != 0, f"{name} {field} accepted a client without a certificate"

    children = children_of(up.process.pid)
    assert len(children) == len(BY_NAME) + 1  # the services and the demo backend
    up.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(up.process.wait(), 60) == 0
    assert [pid for pid in children if alive(pid)] == []


async def test_certs_refuses_a_client_that_does_not_trust_its_ca(up, tmp_path) -> None:
    await up.start()
    foreign = tmp_path / "foreign.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-nodes", "-keyout", str(tmp_path / "foreign.key"), "-out", str(foreign),
         "-subj", "/CN=foreign", "-days", "1"],
        check=True, capture_output=True,
    )  # fmt: skip
    code, _, err = await up.waygate("health", "--ca-file", str(foreign), up.address("certs"))
    assert code == 2 and "UNAVAILABLE" in err
