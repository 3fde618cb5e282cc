"""Hot certificate swap on real TLS listeners, in-process on port 0.

A grpc.aio server with `dynamic_server_credentials` and an asyncio TLS server
with `ServerSSLContexts` keep serving client loops across several rotations:
zero failed handshakes or calls, new connections see the new serial, and a
connection opened before the first rotation is still the same connection after
the last (no drop). mTLS refuses a client without a certificate and one from a
foreign CA, and follows the trust bundle (a CA added to it is accepted from
then on). The issuer is `LocalCA`, a real CA that signs with `cryptography`.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import warnings

import grpc
import pytest
from cryptography import x509
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.pki import LocalCA
from waygate.core.grpcserver import GrpcServer, ServiceRegistration
from waygate.core.grpctls import RotatingChannel, client_credentials, dynamic_server_credentials
from waygate.core.rotation import CertificateRotator, HeldCertificate, TrustBundle, TrustStore
from waygate.core.tls import ServerSSLContexts, load_certificate_chain

SERVER_ID = "spiffe://waygate.local/ns/local/sa/resolver"
CLIENT_ID = "spiffe://waygate.local/ns/local/sa/proxy"
SANS = ("dns:resolver.waygate.local", "ip:127.0.0.1")
PEER_SERVICE = "waygate.test.Peer"
ROTATIONS = 4
# A fresh connection per channel: grpc otherwise shares subchannels between
# channels with the same target, and a reused connection proves nothing.
FRESH = [("grpc.use_local_subchannel_pool", 1)]


def serial_of(der_or_pem: bytes) -> str:
    if der_or_pem.startswith(b"-----"):
        cert = x509.load_pem_x509_certificate(der_or_pem)
    else:
        cert = x509.load_der_x509_certificate(der_or_pem)
    return format(cert.serial_number, "x")


async def who_am_i(_request: bytes, context: grpc.aio.ServicerContext) -> bytes:
    """The client's address (same address = same connection) and certificate serial."""
    pems = context.auth_context().get("x509_pem_cert") or [b""]
    serial = serial_of(pems[0]) if pems[0] else "-"
    return f"{context.peer()} {serial}".encode()


def _add_peer(_servicer: object, server: grpc.aio.Server) -> None:
    same = lambda b: b  # noqa: E731
    handler = grpc.unary_unary_rpc_method_handler(
        who_am_i, request_deserializer=same, response_serializer=same
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(PEER_SERVICE, {"WhoAmI": handler}),)
    )


async def ask(channel: grpc.aio.Channel) -> tuple[str, str]:
    method = channel.unary_unary(f"/{PEER_SERVICE}/WhoAmI")
    peer, serial = (await method(b"", timeout=5)).decode().split()
    return peer, serial


@pytest.fixture
async def ca():
    return LocalCA()


@pytest.fixture
async def server_rotator(ca):
    rotator = CertificateRotator(ca, SERVER_ID, SANS)
    await rotator.obtain()
    return rotator


@pytest.fixture
async def client_rotator(ca):
    rotator = CertificateRotator(ca, CLIENT_ID, ["ip:127.0.0.1"])
    await rotator.obtain()
    return rotator


@contextlib.asynccontextmanager
async def grpc_server(credentials: grpc.ServerCredentials):
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(PEER_SERVICE, _add_peer, None)],
        credentials=credentials,
    )
    await server.start()
    await server.set_serving()
    try:
        yield server
    finally:
        await server.stop(0)


async def presented_serial(
    port: int, ca_pem: bytes, client: HeldCertificate | None = None, alpn: str = "h2"
) -> str:
    """Handshake with the listener and return the serial of the certificate it presents."""
    context = ssl.create_default_context(cadata=ca_pem.decode())
    context.set_alpn_protocols([alpn])
    if client is not None:
        _load_client(context, client)
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="resolver.waygate.local"
    )
    try:
        return serial_of(writer.get_extra_info("ssl_object").getpeercert(binary_form=True))
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


def _load_client(context: ssl.SSLContext, held: HeldCertificate) -> None:
    load_certificate_chain(context, held)


async def rotate_and_wait(rotator: CertificateRotator, observed: list[str]) -> str:
    """Renew, then wait until the client loop has seen the new serial."""
    new = (await rotator.renew_once()).serial
    async with asyncio.timeout(10):
        while new not in observed:
            await asyncio.sleep(0.01)
    return new


# ---------------------------------------------------------------- gRPC


async def test_grpc_server_swaps_certificates_with_zero_failed_calls(ca, server_rotator) -> None:
    trust = TrustStore(ca.bundle())
    credentials = dynamic_server_credentials(server_rotator, trust, client_auth=False)
    async with grpc_server(credentials) as server:
        target = f"127.0.0.1:{server.port}"
        ca_creds = grpc.ssl_channel_credentials(ca.pem)
        observed: list[str] = []
        failures: list[BaseException] = []
        calls = 0
        stop = asyncio.Event()
        # Opened before the first rotation and used throughout.
        long_lived = grpc.aio.secure_channel(target, ca_creds, options=FRESH)
        first_peer, _ = await ask(long_lived)

        async def client_loop() -> None:
            nonlocal calls
            while not stop.is_set():
                try:
                    async with grpc.aio.secure_channel(target, ca_creds, options=FRESH) as ch:
                        reply = await health_pb2_grpc.HealthStub(ch).Check(
                            health_pb2.HealthCheckRequest(), timeout=5
                        )
                        assert reply.status == health_pb2.HealthCheckResponse.SERVING
                    peer, _ = await ask(long_lived)
                    assert peer == first_peer, "the long-lived connection was replaced"
                    observed.append(await presented_serial(server.port, ca.pem))
                    calls += 1
                except Exception as exc:
                    failures.append(exc)

        loop = asyncio.create_task(client_loop())
        try:
            serials = [server_rotator.current.serial]
            for _ in range(ROTATIONS):
                serials.append(await rotate_and_wait(server_rotator, observed))
        finally:
            stop.set()
            await loop
            await long_lived.close()
    assert failures == []
    assert calls > ROTATIONS
    assert len(set(serials)) == ROTATIONS + 1
    # Once a rotation is done, new handshakes never see an older certificate.
    assert observed[-1] == serials[-1]
    positions = [observed.index(s) for s in serials[1:]]
    assert positions == sorted(positions)


async def test_grpc_mtls_refuses_no_certificate_and_a_foreign_ca(
    ca, server_rotator, client_rotator
) -> None:
    trust = TrustStore(ca.bundle())
    credentials = dynamic_server_credentials(server_rotator, trust, client_auth=True)
    foreign = LocalCA(name="foreign CA")
    stranger = CertificateRotator(foreign, CLIENT_ID)
    await stranger.obtain()
    async with grpc_server(credentials) as server:
        target = f"127.0.0.1:{server.port}"
        good = client_credentials(client_rotator, trust)
        async with grpc.aio.secure_channel(target, good, options=FRESH) as channel:
            _, serial = await ask(channel)
        assert serial == client_rotator.current.serial

        refused = [
            grpc.ssl_channel_credentials(ca.pem),
            grpc.ssl_channel_credentials(
                ca.pem, stranger.current.key_pem(), stranger.current.chain_pem()
            ),
        ]
        for credentials_ in refused:
            async with grpc.aio.secure_channel(target, credentials_, options=FRESH) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await ask(channel)
                assert caught.value.code() == grpc.StatusCode.UNAVAILABLE

        # certs rotates its CA: once the bundle holds the new CA, its leaves get in.
        trust.update(TrustBundle(version=2, certificates=(ca.certificate, foreign.certificate)))
        async with grpc.aio.secure_channel(target, refused[1], options=FRESH) as channel:
            _, serial = await ask(channel)
        assert serial == stranger.current.serial


async def test_rotating_channel_presents_each_new_client_certificate(
    ca, server_rotator, client_rotator
) -> None:
    trust = TrustStore(ca.bundle())
    credentials = dynamic_server_credentials(server_rotator, trust, client_auth=True)
    async with grpc_server(credentials) as server:
        channels = RotatingChannel(
            f"127.0.0.1:{server.port}",
            lambda: client_credentials(client_rotator, trust),
            (client_rotator.subscribe, trust.subscribe),
            close_grace=0.5,
            options=FRESH,
        )
        async with channels:
            seen = []
            for _ in range(3):
                old = channels.channel()
                _, serial = await ask(old)
                seen.append(serial)
                assert serial == client_rotator.current.serial
                await client_rotator.renew_once()
            # The channel of the last rotation is closed after its grace period.
            async with asyncio.timeout(5):
                while old.get_state() != grpc.ChannelConnectivity.SHUTDOWN:
                    await asyncio.sleep(0.05)
            assert len(set(seen)) == 3
            assert channels.opened == 3


# ---------------------------------------------------------------- asyncio TLS (HTTPS listeners)


async def echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while line := await reader.readline():
            writer.write(line)
            await writer.drain()
    except (ConnectionError, ssl.SSLError):
        pass
    finally:
        writer.close()


@contextlib.asynccontextmanager
async def tls_server(contexts: ServerSSLContexts):
    server = await asyncio.start_server(echo, "127.0.0.1", 0, ssl=contexts.context)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()
        await server.wait_closed()


async def test_ssl_context_provider_swaps_with_zero_failed_handshakes(ca, server_rotator) -> None:
    contexts = ServerSSLContexts(server_rotator, alpn_protocols=("http/1.1",))
    async with tls_server(contexts) as port:
        observed: list[str] = []
        failures: list[BaseException] = []
        stop = asyncio.Event()
        client_context = ssl.create_default_context(cadata=ca.pem.decode())
        # One connection kept open across every rotation.
        kept_reader, kept_writer = await asyncio.open_connection(
            "127.0.0.1", port, ssl=client_context, server_hostname="127.0.0.1"
        )
        kept_serial = serial_of(
            kept_writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        )

        async def client_loop() -> None:
            names = ("resolver.waygate.local", "127.0.0.1")  # with SNI, and without (an IP)
            n = 0
            while not stop.is_set():
                n += 1
                try:
                    reader, writer = await asyncio.open_connection(
                        "127.0.0.1", port, ssl=client_context, server_hostname=names[n % 2]
                    )
                    writer.write(b"ping\n")
                    assert await reader.readline() == b"ping\n"
                    der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
                    observed.append(serial_of(der))
                    writer.close()
                    await writer.wait_closed()
                    kept_writer.write(f"{n}\n".encode())
                    assert await kept_reader.readline() == f"{n}\n".encode()
                except Exception as exc:
                    failures.append(exc)

        loop = asyncio.create_task(client_loop())
        try:
            serials = [server_rotator.current.serial]
            for _ in range(ROTATIONS):
                serials.append(await rotate_and_wait(server_rotator, observed))
        finally:
            stop.set()
            await loop
            kept_writer.close()
    assert failures == []
    assert kept_serial == serials[0]
    assert observed[-1] == serials[-1]
    assert len(set(serials)) == ROTATIONS + 1
    assert contexts.current.minimum_version == ssl.TLSVersion.TLSv1_2
    assert contexts.context.minimum_version == ssl.TLSVersion.TLSv1_2


async def _echo_once(port: int, context: ssl.SSLContext) -> bytes:
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="127.0.0.1"
    )
    try:
        writer.write(b"hello\n")
        await writer.drain()
        # Under TLS 1.3 a refused client certificate shows up here, after the handshake.
        return await asyncio.wait_for(reader.readline(), 5)
    finally:
        writer.close()
        with contextlib.suppress(ssl.SSLError, ConnectionError):
            await writer.wait_closed()


async def test_ssl_context_provider_mtls_follows_the_trust_bundle(
    ca, server_rotator, client_rotator
) -> None:
    trust = TrustStore(ca.bundle())
    contexts = ServerSSLContexts(server_rotator, trust, client_auth=True)
    foreign = LocalCA(name="foreign CA")
    stranger = CertificateRotator(foreign, CLIENT_ID)
    await stranger.obtain()

    def client(held: HeldCertificate | None) -> ssl.SSLContext:
        context = ssl.create_default_context(cadata=ca.pem.decode())
        if held is not None:
            _load_client(context, held)
        return context

    async with tls_server(contexts) as port:
        assert await _echo_once(port, client(client_rotator.current)) == b"hello\n"
        for refused in (None, stranger.current):
            with pytest.raises((ssl.SSLError, ConnectionError)):
                reply = await _echo_once(port, client(refused))
                # A closed connection without an alert reads as b"": still refused.
                if reply == b"":
                    raise ConnectionError("closed")
        trust.update(TrustBundle(version=2, certificates=(ca.certificate, foreign.certificate)))
        assert await _echo_once(port, client(stranger.current)) == b"hello\n"
    contexts.close()


async def test_tls_below_1_2_is_refused(ca, server_rotator) -> None:
    contexts = ServerSSLContexts(server_rotator)
    old = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    old.load_verify_locations(cadata=ca.pem.decode())
    with contextlib.suppress(ValueError, ssl.SSLError):
        old.set_ciphers("ALL:@SECLEVEL=0")  # let the client offer TLS 1.1 at all
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # naming old versions is the point
        old.minimum_version = ssl.TLSVersion.TLSv1
        old.maximum_version = ssl.TLSVersion.TLSv1_1
    async with tls_server(contexts) as port:
        with pytest.raises((ssl.SSLError, ConnectionError)):
            await _echo_once(port, old)
        # The same client allowed TLS 1.2 gets in: the refusal was the version.
        old.maximum_version = ssl.TLSVersion.TLSv1_2
        assert await _echo_once(port, old) == b"hello\n"
