"""Real `waygate tunnel serve` / `waygate tunnel agent` processes for system tests.

`TunnelPKI` writes static mTLS files from one `LocalCA`: the servers'
(`dns:tunnel-server`, `ip:127.0.0.1`), the agent's (`dns:NODE`) and a
dialer's (a SPIFFE ID the servers allow). `start_server` and `agent_argv`
build the command lines (every port 0 but where the test chooses); the
server's front port is read from its "tunnel front listening" log line.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.support.pki import IdentityFiles, LocalCA
from tests.support.processes import ROOT, RunningService, child_env, start_service

NODE = "edge-1"
DIALER = "spiffe://waygate.test/ns/t/sa/proxy"
SERVER_NAME = "tunnel-server"


@dataclass
class TunnelPKI:
    ca: LocalCA
    server: IdentityFiles
    agent: IdentityFiles
    dialer: IdentityFiles

    @classmethod
    def create(cls, directory: Path, server_ips: Sequence[str] = ("127.0.0.1",)) -> TunnelPKI:
        ca = LocalCA()
        return cls(
            ca,
            ca.write_files(directory / "server", dns=[SERVER_NAME], ips=list(server_ips)),
            ca.write_files(directory / "agent", dns=[NODE], client_only=True),
            ca.write_files(directory / "dialer", uris=[DIALER]),
        )

    @property
    def ca_file(self) -> Path:
        return self.server.ca


def server_argv(
    pki: TunnelPKI,
    *,
    host: str = "127.0.0.1",
    agent_port: int = 0,
    server_id: str = "replica-a",
    replicas: Sequence[str] = (),
    extra: Sequence[str] = (),
) -> list[str]:
    argv = [
        "waygate", "tunnel", "serve", "--host", host,
        "--grpc-port", str(agent_port), "--dial-port", "0", "--data-port", "0", "--front-port", "0",
        "--admin-port", "0", "--server-id", server_id, "--dialers", DIALER,
        "--tls-cert-file", str(pki.server.cert), "--tls-key-file", str(pki.server.key),
        "--tls-client-ca-file", str(pki.ca_file), "--shutdown-grace", "2s",
    ]  # fmt: skip
    if replicas:
        argv += ["--replicas", ",".join(replicas)]
    return [*argv, *extra]


def agent_argv(
    pki: TunnelPKI, server_address: str, *, allow: str = "127.0.0.0/8:*", python: bool = False
) -> list[str]:
    argv = [
        "waygate", "tunnel", "agent", "--server-address", server_address,
        "--server-name", SERVER_NAME, "--node", NODE, "--admin-port", "0",
        "--tls-cert-file", str(pki.agent.cert), "--tls-key-file", str(pki.agent.key),
        "--tls-client-ca-file", str(pki.ca_file), "--allow", allow,
        "--reconnect-max", "1s",
    ]  # fmt: skip
    return [sys.executable, "-m", *argv] if python else argv


async def start_server(pki: TunnelPKI, **kwargs: object) -> TunnelServer:
    service = await start_service(server_argv(pki, **kwargs))  # type: ignore[arg-type]
    front = next(
        (e.get("front_port") for e in service.logs if e.get("msg") == "tunnel front listening"),
        None,
    )
    return TunnelServer(service, int(front) if front else 0)


@dataclass
class TunnelServer:
    service: RunningService
    front_port: int

    @property
    def agent_port(self) -> int:
        return self.service.grpc_ports[0]

    @property
    def dial_port(self) -> int:
        return self.service.grpc_ports[1]


def agent_process(argv: Sequence[str], log: Path) -> subprocess.Popen[bytes]:
    """A blocking-style agent process (for namespaces: `ip netns exec` in front)."""
    with log.open("wb") as out:
        return subprocess.Popen(
            list(argv), cwd=ROOT, env=child_env(), stdout=out, stderr=subprocess.STDOUT
        )


def stop_process(process: subprocess.Popen[bytes], timeout: float = 10) -> None:
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout)
