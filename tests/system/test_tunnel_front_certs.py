"""The front with certificates from certs, as in a cluster: it serves the tunnel server's
rotating certificate, and trusts clients from its own CA (`--front-client-ca-file`).

Leaves live 12 s, so the server renews several times during the test; every
request before, during and after the renewals is served, and the front's
certificate changes under the same listener.
"""

from __future__ import annotations

import asyncio
import os
import ssl
from pathlib import Path

import pytest
import yaml
from cryptography import x509

from tests.support.pki import LocalCA
from tests.support.poll import until
from tests.support.processes import start_service

pytestmark = pytest.mark.system

NODE = "edge-1"
SERVER_ID = "spiffe://waygate.test/ns/t/sa/tunnel-server"
TOKENS = {
    "tunnel-server": [f"uri:{SERVER_ID}", "ip:127.0.0.1"],
    "tunnel-agent": [f"dns:{NODE}"],
}


async def backend() -> tuple[asyncio.Server, int]:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await reader.readuntil(b"\r\n\r\n")
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\npong")
            await writer.drain()
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def request(port: int, context: ssl.SSLContext, backend_port: int) -> tuple[bytes, int]:
    """One request through the front; the response and the serial of the front's certificate."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.write(f"GET / HTTP/1.1\r\nHost: 127.0.0.1:{backend_port}\r\n\r\n".encode())
        response = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return response, x509.load_der_x509_certificate(der).serial_number


async def test_front_serves_the_rotating_certificate_and_trusts_its_own_client_ca(
    tmp_path: Path,
) -> None:
    tokens = []
    for name, allowed in TOKENS.items():
        secret = os.urandom(24).hex()
        (tmp_path / f"{name}.token").write_text(secret + "\n")
        (tmp_path / f"{name}.token").chmod(0o600)
        tokens.append({"token": secret, "name": name, "allowed": allowed})
    (tmp_path / "tokens.yaml").write_text(yaml.safe_dump({"tokens": tokens}))
    (tmp_path / "tokens.yaml").chmod(0o600)
    front_ca = LocalCA()
    (tmp_path / "front-ca.pem").write_bytes(front_ca.pem)
    client = front_ca.write_files(tmp_path / "apiserver", uris=["spiffe://k/ns/k/sa/apiserver"])
    bundle = tmp_path / "bundle.pem"
    services = []
    web, web_port = await backend()
    try:
        certs = await start_service(
            [
                "waygate", "certs", "serve", "--grpc-port", "0", "--admin-port", "0",
                "--ca-dir", str(tmp_path / "ca"), "--tokens-file", str(tmp_path / "tokens.yaml"),
                "--bundle-file", str(bundle), "--trust-domain", "waygate.test",
                "--serving-identity", "spiffe://waygate.test/ns/t/sa/certs",
                # Short leaves; backdated 1 s, not 0, for time(2)'s lag (tests/support/pki.py).
                "--serving-sans", "ip:127.0.0.1", "--leaf-lifetime", "12s", "--clock-skew", "1",
            ]
        )  # fmt: skip
        services.append(certs)
        server = await start_service(
            [
                "waygate", "tunnel", "serve", "--grpc-port", "0", "--dial-port", "0", "--data-port", "0",
                "--front-port", "0", "--admin-port", "0", "--server-id", "replica-a",
                "--certs-address", certs.grpc_address,
                "--certs-token-file", str(tmp_path / "tunnel-server.token"),
                "--certs-ca-file", str(bundle), "--cert-identity", SERVER_ID,
                "--cert-sans", "ip:127.0.0.1",
                "--front-client-ca-file", str(tmp_path / "front-ca.pem"),
                "--front-node-addresses", f"127.0.0.1={NODE}",
            ]
        )  # fmt: skip
        services.append(server)
        front_port = next(
            e["front_port"] for e in server.logs if e.get("msg") == "tunnel front listening"
        )
        agent = await start_service(
            [
                "waygate", "tunnel", "agent", "--admin-port", "0",
                "--server-address", f"127.0.0.1:{server.grpc_ports[0]}",
                "--certs-address", certs.grpc_address,
                "--certs-token-file", str(tmp_path / "tunnel-agent.token"),
                "--certs-ca-file", str(bundle), "--cert-identity", NODE,
                "--allow", f"127.0.0.1/32:{web_port}", "--reconnect-max", "1s",
            ]
        )  # fmt: skip
        services.append(agent)
        await until(lambda: server.logged("agent connected"), "the agent's stream", timeout=20)

        context = ssl.create_default_context(cafile=str(bundle))
        context.load_cert_chain(client.cert, client.key)
        serials = set()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 30
        while loop.time() < deadline and len(serials) < 3:
            response, serial = await request(front_port, context, web_port)
            assert response.startswith(b"HTTP/1.1 200 OK") and response.endswith(b"pong")
            serials.add(serial)
            await asyncio.sleep(0.5)
        assert len(serials) >= 2, "the front's certificate never changed across renewals"

        # A client certificate from certs' CA is not one from the front's CA.
        other = LocalCA().write_files(tmp_path / "stranger", uris=["spiffe://x/ns/x/sa/x"])
        stranger = ssl.create_default_context(cafile=str(bundle))
        stranger.load_cert_chain(other.cert, other.key)
        with pytest.raises((ssl.SSLError, ConnectionError, AssertionError)):
            response, _ = await request(front_port, stranger, web_port)
            assert response, "closed without a response"
    finally:
        for service in reversed(services):
            if service.process.returncode is None:
                await service.stop()
        web.close()
