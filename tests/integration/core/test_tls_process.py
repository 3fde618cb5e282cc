"""`ServiceProcess.server_credentials`, `server_ssl_context` and `client_channel`
through a whole process life.

In-process `ServiceProcess.run` with a real gRPC listener on port 0: once with
static tls_* files (what existed before certs), once with certificates from a
running certs (`certs_address`). In both, a client presenting a certificate
gets in through mTLS, a client without one is refused, and stopping the
process closes its channels and background tasks.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from pathlib import Path

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.pki import LocalCA
from waygate.certs.client import start_process_certificates
from waygate.core.errors import FailedPrecondition
from waygate.core.grpcserver import GrpcServer
from waygate.core.rotation import CertificateRotator, HeldCertificate, save_certificate
from waygate.core.runtime import ServiceProcess
from waygate.core.settings import GrpcServerSettings, load_settings

from .test_rotation_certs import RESOLVER, Certs, settings_for


async def run_process(settings: GrpcServerSettings, body) -> dict:
    """Run a process whose setup serves Health with mTLS, call `body(process, port)`, stop."""
    process = ServiceProcess("tls-test", settings, certificate_source=start_process_certificates)
    result: dict = {}

    async def setup(p: ServiceProcess) -> None:
        server = GrpcServer.from_settings(
            settings, [], credentials=await p.server_credentials(client_auth=True)
        )
        p.add_grpc_server(server)
        await p.mark_ready()

        async def drive() -> None:
            while not server.port:
                await asyncio.sleep(0.01)
            try:
                result.update(await body(p, server.port))
            finally:
                p.request_stop()

        p.spawn(drive(), "drive")

    assert await asyncio.wait_for(process.run(setup), 60) == 0
    return result


async def check(channel: grpc.aio.Channel) -> int:
    reply = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=5
    )
    return reply.status


async def refused(port: int, ca_pem: bytes) -> bool:
    credentials = grpc.ssl_channel_credentials(ca_pem)
    async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
        try:
            await check(channel)
        except grpc.aio.AioRpcError as exc:
            return exc.code() == grpc.StatusCode.UNAVAILABLE
    return False


async def static_tls(
    tmp_path: Path, identity: str, *, client_ca: bool = True
) -> tuple[LocalCA, HeldCertificate, GrpcServerSettings]:
    """A CA, a certificate from it in key.pem/cert.pem, and settings serving them."""
    ca = LocalCA()
    held = await CertificateRotator(ca, identity, ["ip:127.0.0.1"]).obtain()
    save_certificate(held, tmp_path / "key.pem", tmp_path / "cert.pem")
    (tmp_path / "ca.pem").write_bytes(ca.pem)
    flags = {
        "tls_cert_file": str(tmp_path / "cert.pem"),
        "tls_key_file": str(tmp_path / "key.pem"),
        "shutdown_grace": "1s",
    }
    if client_ca:
        flags["tls_client_ca_file"] = str(tmp_path / "ca.pem")
    return ca, held, load_settings(GrpcServerSettings, flags=flags, env={})


async def test_static_tls_files_still_serve_mtls(tmp_path: Path) -> None:
    ca, _, settings = await static_tls(tmp_path, "resolver.waygate.local")

    async def body(process: ServiceProcess, port: int) -> dict:
        channels = await process.client_channel(f"127.0.0.1:{port}")
        return {
            "with": await check(channels.channel()),
            "refused": await refused(port, ca.pem),
            "channel": channels.channel(),
        }

    result = await run_process(settings, body)
    assert result["with"] == health_pb2.HealthCheckResponse.SERVING
    assert result["refused"]
    # Stopping the process closed the channel it handed out.
    assert result["channel"].get_state() == grpc.ChannelConnectivity.SHUTDOWN


@pytest.fixture
async def certs(tmp_path):
    running = Certs(tmp_path)
    await running.start()
    yield running
    await running.stop()


async def test_certificates_from_certs_serve_mtls_and_call_out(certs) -> None:
    settings = settings_for(certs, shutdown_grace="1s")

    async def body(process: ServiceProcess, port: int) -> dict:
        first = await process.certificates()
        assert first is not None and await process.certificates() is first  # one per process
        channels = await process.client_channel(f"127.0.0.1:{port}")
        statuses = [await check(channels.channel())]
        await first.rotator.renew_once()  # the next channel presents the new certificate
        statuses.append(await check(channels.channel()))
        return {
            "statuses": statuses,
            "opened": channels.opened,
            "refused": await refused(port, certs.bundle_file.read_bytes()),
            "issued": len(certs.authority.list_issued(identity=RESOLVER, include_expired=False)),
            "tasks": sorted(t.get_name() for t in process._tasks),
        }

    result = await run_process(settings, body)
    assert result["statuses"] == [health_pb2.HealthCheckResponse.SERVING] * 2
    assert result["opened"] == 2
    assert result["refused"]
    assert result["issued"] == 2
    assert {"certificate-rotation", "trust-bundle-watch"} <= set(result["tasks"])


async def presented(port: int, ca_pem: bytes) -> str:
    context = ssl.create_default_context(cadata=ca_pem.decode())
    _, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        return format(x509.load_der_x509_certificate(der).serial_number, "x")
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


async def serve_tls(context: ssl.SSLContext) -> asyncio.Server:
    async def hang_up(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.close()

    return await asyncio.start_server(hang_up, "127.0.0.1", 0, ssl=context)


async def test_https_listener_context_follows_the_certificate_from_certs(certs) -> None:
    settings = settings_for(certs, shutdown_grace="1s")

    async def body(process: ServiceProcess, _port: int) -> dict:
        context = await process.server_ssl_context(alpn_protocols=("http/1.1",))
        certificates = await process.certificates()
        assert context is not None and certificates is not None
        server = await serve_tls(context)
        port = server.sockets[0].getsockname()[1]
        try:
            bundle = certs.bundle_file.read_bytes()
            seen = [await presented(port, bundle)]
            renewed = await certificates.rotator.renew_once()
            seen.append(await presented(port, bundle))
        finally:
            server.close()
            await server.wait_closed()
        return {"seen": seen, "renewed": renewed.serial, "minimum": context.minimum_version}

    result = await run_process(settings, body)
    assert result["seen"][1] == result["renewed"] != result["seen"][0]
    assert result["minimum"] == ssl.TLSVersion.TLSv1_2


async def test_https_listener_context_from_static_files(tmp_path: Path) -> None:
    ca, held, settings = await static_tls(tmp_path, "proxy.waygate.local")

    async def body(process: ServiceProcess, _port: int) -> dict:
        context = await process.server_ssl_context()
        assert context is not None
        server = await serve_tls(context)
        try:
            return {"seen": await presented(server.sockets[0].getsockname()[1], ca.pem)}
        finally:
            server.close()
            await server.wait_closed()

    assert (await run_process(settings, body))["seen"] == held.serial


async def test_static_tls_without_a_client_ca_refuses_to_serve_a_client_auth_service(
    tmp_path: Path,
) -> None:
    """mTLS is never dropped silently: a service that requires client certificates
    and has no CA to check them against does not start."""
    _, _, settings = await static_tls(tmp_path, "resolver.waygate.local", client_ca=False)
    process = ServiceProcess("resolver", settings)

    async def setup(p: ServiceProcess) -> None:
        await p.server_credentials(client_auth=True)

    with pytest.raises(FailedPrecondition, match="resolver requires client certificates"):
        await asyncio.wait_for(process.run(setup), 30)


async def test_static_https_without_a_client_ca_refuses_like_grpc(tmp_path: Path) -> None:
    """The HTTPS path refuses exactly as the gRPC path does (it used to serve
    without client authentication when no client CA was set)."""
    _, _, settings = await static_tls(tmp_path, "proxy.waygate.local", client_ca=False)
    process = ServiceProcess("front", settings)

    async def setup(p: ServiceProcess) -> None:
        await p.server_ssl_context(client_auth=True)

    with pytest.raises(FailedPrecondition, match="front requires client certificates"):
        await asyncio.wait_for(process.run(setup), 30)
