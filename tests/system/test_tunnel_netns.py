"""An edge host the cloud side cannot route to, reached only through the tunnel.

The edge (a network namespace, `tests.support.netns`) runs the agent and a
backend on its private address; the tunnel server runs on the cloud side
(this namespace), bound to the veth address the edge can dial out to. The
cloud side has no route to the backend, yet a dial through the tunnel
reaches it. A second namespace plays a control-plane host: `waygate tunnel
iptables --apply` there steers its connections to NODE-ADDRESS:PORT into the
tunnel server's front, and removes its rules on SIGTERM.
"""

from __future__ import annotations

import asyncio
import random
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.netns import EdgeHost, edge_host
from tests.support.poll import until
from tests.support.processes import ROOT
from tests.support.tunnel_processes import (
    NODE,
    SERVER_NAME,
    TunnelPKI,
    agent_argv,
    start_server,
)
from waygate.core.grpcclient import ClientTLS
from waygate.tunnel.client import DialFailed, StaticPresence, TunnelClient

pytestmark = pytest.mark.system

TOKEN = b"edge-backend-7f3a"
REQUEST = b"GET / HTTP/1.1\r\nHost: backend\r\nConnection: close\r\n\r\n"

BACKEND = """
import socket, sys
server = socket.socket()
server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
server.bind((sys.argv[1], int(sys.argv[2])))
server.listen(64)
while True:
    conn, _ = server.accept()
    conn.settimeout(5)
    try:
        data = b""
        while b"\\r\\n\\r\\n" not in data:
            more = conn.recv(4096)
            if not more:
                break
            data += more
        body = sys.argv[3].encode()
        conn.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\nConnection: close\\r\\n\\r\\n" % len(body) + body)
    except OSError:
        pass
    finally:
        conn.close()
"""


@pytest.fixture
def edge() -> Iterator[EdgeHost]:
    with edge_host() as host:
        yield host


def start_edge(edge: EdgeHost, pki: TunnelPKI, agent_port: int, tmp_path: Path) -> int:
    """Backend on the edge's private address, and the agent; returns the backend port."""
    backend_port = random.randrange(20000, 30000)
    script = tmp_path / "backend.py"
    script.write_text(BACKEND)
    log = (tmp_path / "backend.log").open("wb")
    edge.popen(
        [sys.executable, str(script), edge.private_ip, str(backend_port), TOKEN.decode()],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    agent_log = (tmp_path / "agent.log").open("wb")
    edge.popen(
        agent_argv(
            pki,
            f"{edge.host_ip}:{agent_port}",
            allow=f"{edge.private_ip}/32:{backend_port}",
            python=True,
        ),
        cwd=ROOT,
        stdout=agent_log,
        stderr=subprocess.STDOUT,
    )
    return backend_port


def dialer(pki: TunnelPKI, address: str) -> TunnelClient:
    return TunnelClient(
        StaticPresence([address]),
        credentials=lambda: ClientTLS(pki.ca_file, pki.dialer.cert, pki.dialer.key).credentials(),
        server_name=SERVER_NAME,
        dial_timeout=5.0,
    )


async def fetch_through_tunnel(client: TunnelClient, host: str, port: int) -> bytes:
    stream = await client.dial(NODE, port, host)
    try:
        await stream.write(REQUEST)
        received = b""
        async with asyncio.timeout(10):
            while chunk := await stream.read():
                received += chunk
        return received
    finally:
        await stream.aclose()


async def wait_for_agent(client: TunnelClient, host: str, port: int, tmp_path: Path) -> bytes:
    """The first answer through the tunnel, once the agent in the namespace is connected."""
    deadline = asyncio.get_running_loop().time() + 30
    while True:
        try:
            return await fetch_through_tunnel(client, host, port)
        except DialFailed as failed:
            if asyncio.get_running_loop().time() > deadline:
                agent_log = (tmp_path / "agent.log").read_text()[-2000:]
                raise AssertionError(
                    f"no tunnel to the edge: {failed}; agent: {agent_log}"
                ) from None
            await asyncio.sleep(0.2)


async def test_the_edge_backend_is_reachable_only_through_the_tunnel(
    edge: EdgeHost, tmp_path: Path
) -> None:
    pki = TunnelPKI.create(tmp_path)
    server = await start_server(pki, host=edge.host_ip)
    client = dialer(pki, f"{edge.host_ip}:{server.dial_port}")
    try:
        backend_port = start_edge(edge, pki, server.agent_port, tmp_path)
        response = await wait_for_agent(client, edge.private_ip, backend_port, tmp_path)
        assert response.startswith(b"HTTP/1.1 200 OK") and response.endswith(TOKEN)
        # The cloud side itself cannot reach the backend...
        assert not edge.cloud_reaches(edge.private_ip, backend_port, REQUEST, TOKEN)
        # ...while the edge can (the backend is up), and the tunnel keeps working.
        probe = edge.run(
            [sys.executable, "-c",
             "import socket,sys; s=socket.create_connection((sys.argv[1], int(sys.argv[2])), 5);"
             f"s.sendall({REQUEST!r}); print(s.recv(4096))",
             edge.private_ip, str(backend_port)],
        )  # fmt: skip
        assert TOKEN.decode() in probe.stdout, probe.stderr
        for _ in range(5):
            assert (await fetch_through_tunnel(client, edge.private_ip, backend_port)).endswith(
                TOKEN
            )
        # A destination the agent's allow-list does not name is refused, not dialed.
        with pytest.raises(DialFailed) as refused:
            await fetch_through_tunnel(client, edge.private_ip, backend_port + 1)
        assert "NOT_ALLOWED" in str(refused.value) or refused.value.reason == 1
    finally:
        await client.close()
        assert await server.service.stop() == 0


CLIENT = """
import socket, ssl, sys
address, port, ca, cert, key, name = sys.argv[1:7]
context = ssl.create_default_context(cafile=ca)
context.load_cert_chain(cert, key)
raw = socket.create_connection((address, int(port)), timeout=10)
with context.wrap_socket(raw, server_hostname=name) as conn:
    conn.sendall(b"GET /containerLogs/ns/pod/c HTTP/1.1\\r\\nHost: %s:%s\\r\\n\\r\\n" % (address.encode(), port.encode()))
    data = b""
    while True:
        more = conn.recv(65536)
        if not more:
            break
        data += more
sys.stdout.write(data.decode(errors="replace"))
"""


def nat_rules(host: EdgeHost) -> str:
    return host.run(["iptables", "-w", "-t", "nat", "-S"]).stdout


async def test_iptables_steers_node_traffic_into_the_front_and_removes_its_rules(
    edge: EdgeHost, tmp_path: Path
) -> None:
    if shutil.which("iptables") is None:
        pytest.skip("iptables is not installed (Debian: apt-get install iptables)")
    pki = TunnelPKI.create(tmp_path)
    front_client = pki.ca.write_files(tmp_path / "apiserver", uris=["spiffe://t/ns/k/sa/apiserver"])
    server = await start_server(
        pki, host=edge.host_ip, extra=["--front-node-addresses", f"{edge.private_ip}={NODE}"]
    )
    client = dialer(pki, f"{edge.host_ip}:{server.dial_port}")
    try:
        backend_port = start_edge(edge, pki, server.agent_port, tmp_path)
        await wait_for_agent(client, edge.private_ip, backend_port, tmp_path)
        script = tmp_path / "client.py"
        script.write_text(CLIENT)
        with edge_host() as control_plane:
            fetch = [
                sys.executable, str(script), edge.private_ip, str(backend_port), str(pki.ca_file),
                str(front_client.cert), str(front_client.key), SERVER_NAME,
            ]  # fmt: skip
            # Without the rules the control plane cannot reach the node's address.
            before = control_plane.run(fetch, timeout=30)
            assert TOKEN.decode() not in before.stdout
            rules = control_plane.popen(
                [
                    sys.executable, "-m", "waygate", "tunnel", "iptables", "--apply",
                    "--node-addresses", edge.private_ip, "--node-ports", str(backend_port),
                    "--front", f"{edge.host_ip}:{server.front_port}", "--hooks", "OUTPUT",
                ],
                cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
            # The chain appears (-N) before its rule is appended (-A): wait for the rule.
            rule = (
                f"-A WAYGATE-TUNNEL -d {edge.private_ip}/32 -p tcp -m tcp --dport {backend_port} "
                f"-j DNAT --to-destination {edge.host_ip}:{server.front_port}"
            )
            await until(lambda: rule in nat_rules(control_plane), "the DNAT rule")
            after = await asyncio.to_thread(control_plane.run, fetch, 30)
            assert after.stdout.startswith("HTTP/1.1 200 OK"), after.stdout + after.stderr
            assert after.stdout.endswith(TOKEN.decode())
            rules.send_signal(signal.SIGTERM)
            output, _ = rules.communicate(timeout=20)
            assert rules.returncode == 0, output
            assert "rules removed" in output
            assert "WAYGATE" not in nat_rules(control_plane)
    finally:
        await client.close()
        assert await server.service.stop() == 0
