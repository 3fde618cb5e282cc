"""TLS passthrough over real sockets: the backend terminates TLS itself and its
certificate reaches the client unchanged; a ClientHello split across records
and reads still finds its route; other names are terminated with the default
certificate; what is not TLS is closed and counted; nothing leaks."""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from tests.integration.proxy.test_reencrypt import TlsBackend
from tests.support.pki import LocalCA
from tests.support.proxyharness import endpoint, route, running_proxy
from waygate.proxy.passthrough import TLS_CONNECTIONS, TlsFront
from waygate.proxy.routing import Defaults
from waygate.proxy.tls import DefaultCertificate, EdgeCertificates
from waygate.proxy.view import HTTPS_FRONT, passthrough_table
from waygate.resolver.model import RouteTLS, TLSTermination

PASSTHROUGH = RouteTLS(termination=TLSTermination.PASSTHROUGH)


@contextlib.asynccontextmanager
async def front_to(
    backend_port: int, tmp_path: Path, ca: LocalCA, *, dialer: Any = None, **endpoint_kw: Any
) -> AsyncIterator[TlsFront]:
    """The HTTPS front with one passthrough route to the backend (`endpoint_kw`: a
    tunnelled one, with the `dialer` that reaches it)."""
    routes = [route("pass.test", [("web", 100)], name="pass", tls=PASSTHROUGH)]
    endpoints = [endpoint("web", backend_port, **endpoint_kw)]
    files = ca.write_files(tmp_path, dns=["proxy.waygate.local"], prefix="default-")
    async with running_proxy(**({"dialer": dialer} if dialer else {})) as (server, _):
        front = TlsFront(
            server,
            EdgeCertificates(DefaultCertificate.from_files(files.cert, files.key)),
            "127.0.0.1",
            0,
        )
        grouped = {("demo", "web"): tuple(endpoints)}
        table = passthrough_table(
            {r.key: r for r in routes},
            grouped,
            {},
            defaults=Defaults(),
            cookie_key=b"k" * 32,
            previous=None,
        )
        server.set_view(server.view.replace(passthrough={HTTPS_FRONT: table}))
        await front.start()
        try:
            yield front
        finally:
            await front.drain(1.0)


async def tls_get(port: int, name: str, cafile: bytes) -> tuple[bytes, bytes]:
    """(the certificate presented, the response) of GET / over TLS with this SNI."""
    context = ssl.create_default_context(cadata=cafile.decode())
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname=name
    )
    try:
        der = writer.get_extra_info("ssl_object").getpeercert(binary_form=True)
        writer.write(b"GET / HTTP/1.1\r\nHost: " + name.encode() + b"\r\n\r\n")
        async with asyncio.timeout(5):
            head = await reader.readuntil(b"\r\n\r\n")
            body = await reader.readexactly(8) if b"Content-Length: 8" in head else b""
        return der, head + body
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()


def outcome(name: str) -> float:
    return TLS_CONNECTIONS.labels(name)._value.get()


async def test_passthrough_relays_the_backends_own_tls(tmp_path: Path) -> None:
    backend_ca = LocalCA(name="Backend CA")
    certificate = backend_ca.issue(dns=["pass.test"])
    backend = await TlsBackend(certificate).start()
    before = outcome("passthrough")
    try:
        async with front_to(backend.port, tmp_path, LocalCA()) as front:
            der, response = await tls_get(front.bound_port, "pass.test", backend_ca.pem)
            # Byte for byte the backend's certificate: the proxy decrypted nothing.
            assert ssl.DER_cert_to_PEM_cert(der).encode() == certificate[0]
            assert response.startswith(b"HTTP/1.1 200") and response.endswith(b"secured\n")
            # The backend saw the request exactly as sent: no proxy headers added.
            assert backend.requests == [b"GET / HTTP/1.1\r\nHost: pass.test\r\n\r\n"]
            assert outcome("passthrough") == before + 1
            await asyncio.sleep(0.1)
            assert not front.relays  # the relay went with the connection
    finally:
        await backend.stop()


async def test_a_fragmented_client_hello_still_reaches_its_route(tmp_path: Path) -> None:
    backend_ca = LocalCA(name="Backend CA")
    backend = await TlsBackend(backend_ca.issue(dns=["pass.test"])).start()
    try:
        async with front_to(backend.port, tmp_path, LocalCA()) as front:
            context = ssl.create_default_context(cadata=backend_ca.pem.decode())
            incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
            tls = context.wrap_bio(incoming, outgoing, server_hostname="pass.test")
            with contextlib.suppress(ssl.SSLWantReadError):
                tls.do_handshake()
            hello = outgoing.read()
            body = hello[5:]
            records = b"".join(
                b"\x16\x03\x01" + len(body[i : i + 40]).to_bytes(2, "big") + body[i : i + 40]
                for i in range(0, len(body), 40)
            )
            reader, writer = await asyncio.open_connection("127.0.0.1", front.bound_port)
            for i in range(0, len(records), 33):  # reads that do not line up with records
                writer.write(records[i : i + 33])
                await writer.drain()
                await asyncio.sleep(0.01)
            async with asyncio.timeout(10):
                while True:
                    try:
                        tls.do_handshake()
                        break
                    except ssl.SSLWantReadError:
                        if outgoing.pending:
                            writer.write(outgoing.read())
                        data = await reader.read(65536)
                        assert data, "closed during the handshake"
                        incoming.write(data)
            if outgoing.pending:
                writer.write(outgoing.read())
            names = tls.getpeercert()["subjectAltName"]
            assert names == (("DNS", "pass.test"),)
            writer.close()
    finally:
        await backend.stop()


async def test_other_names_are_terminated_and_what_is_not_tls_is_closed(tmp_path: Path) -> None:
    proxy_ca = LocalCA()
    backend = await TlsBackend(LocalCA().issue(dns=["pass.test"])).start()
    terminated, not_tls = outcome("terminated"), outcome("not_tls")
    try:
        async with front_to(backend.port, tmp_path, proxy_ca) as front:
            context = ssl.create_default_context(cadata=proxy_ca.pem.decode())
            context.check_hostname = False
            _, writer = await asyncio.open_connection(
                "127.0.0.1", front.bound_port, ssl=context, server_hostname="other.test"
            )
            der = writer.get_extra_info("ssl_object").getpeercert()
            assert der["subjectAltName"] == (("DNS", "proxy.waygate.local"),)
            writer.close()
            reader, writer = await asyncio.open_connection("127.0.0.1", front.bound_port)
            writer.write(b"GET / HTTP/1.1\r\nHost: pass.test\r\n\r\n")
            async with asyncio.timeout(5):
                # Closed with our request unread: a reset is a close too.
                with contextlib.suppress(ConnectionResetError):
                    assert await reader.read() == b""
            writer.close()
        assert outcome("terminated") == terminated + 1
        assert outcome("not_tls") == not_tls + 1
        assert not backend.requests
    finally:
        await backend.stop()


async def test_connections_of_every_kind_leave_no_fd_task_or_relay_behind(tmp_path: Path) -> None:
    import os

    proxy_ca, backend_ca = LocalCA(), LocalCA(name="Backend CA")
    backend = await TlsBackend(backend_ca.issue(dns=["pass.test"])).start()
    try:
        async with front_to(backend.port, tmp_path, proxy_ca) as front:
            await tls_get(front.bound_port, "pass.test", backend_ca.pem)  # warm up
            await asyncio.sleep(0.2)
            fds = len(os.listdir("/proc/self/fd"))
            tasks = len(asyncio.all_tasks())
            for _ in range(15):
                await tls_get(front.bound_port, "pass.test", backend_ca.pem)
                context = ssl.create_default_context(cadata=proxy_ca.pem.decode())
                context.check_hostname = False
                _, writer = await asyncio.open_connection(
                    "127.0.0.1", front.bound_port, ssl=context, server_hostname="other.test"
                )
                writer.close()
                # Garbage, and a client that leaves half-way through its ClientHello.
                _, writer = await asyncio.open_connection("127.0.0.1", front.bound_port)
                writer.write(b"\x16\x03\x01\x02\x00\x01\x00\x01")
                writer.close()
                _, writer = await asyncio.open_connection("127.0.0.1", front.bound_port)
                writer.write(b"not tls at all\r\n")
                writer.close()
            async with asyncio.timeout(10):
                while (
                    front.relays
                    or front.pending
                    or front.server.connections
                    or len(os.listdir("/proc/self/fd")) > fds
                    or len(asyncio.all_tasks()) > tasks
                ):
                    await asyncio.sleep(0.05)
    finally:
        await backend.stop()
