"""The shared test helpers do what they promise: PKI that really chains and handshakes,
poll-until that fails (never hangs) when its condition never holds."""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import random
import ssl
import stat
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from cryptography import x509

from tests.support.pki import IdentityFiles, LocalCA, make_csr, self_signed
from tests.support.poll import until, until_blocking


@contextlib.asynccontextmanager
async def tls_listener(server: IdentityFiles) -> AsyncIterator[int]:
    """A TLS listener on 127.0.0.1 serving `server`'s certificate that says "hi"; its port."""
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    server_context.load_cert_chain(server.cert, server.key)

    async def hello(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"hi")
        await writer.drain()
        writer.close()

    listener = await asyncio.start_server(hello, "127.0.0.1", 0, ssl=server_context)
    try:
        yield listener.sockets[0].getsockname()[1]
    finally:
        listener.close()
        await listener.wait_closed()


async def greeting(port: int, client: ssl.SSLContext) -> bytes:
    reader, writer = await asyncio.wait_for(
        asyncio.open_connection("127.0.0.1", port, ssl=client, server_hostname="svc.test"), 5
    )
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_issued_files_serve_and_verify_a_real_tls_handshake(tmp_path: Path) -> None:
    ca = LocalCA()
    server = ca.write_files(tmp_path, dns=("svc.test",), ips=("127.0.0.1",))
    assert stat.S_IMODE(server.key.stat().st_mode) == 0o600
    async with tls_listener(server) as port:
        assert await greeting(port, ssl.create_default_context(cafile=str(server.ca))) == b"hi"
        # A CA the client does not trust fails the handshake.
        stranger = ssl.create_default_context(cadata=LocalCA(name="other").pem.decode())
        with pytest.raises(ssl.SSLCertVerificationError):
            await greeting(port, stranger)


async def test_a_leaf_verifies_at_once_by_a_clock_a_second_behind_the_issuers(
    tmp_path: Path,
) -> None:
    """OpenSSL and BoringSSL check not_before (whole seconds) against time(2), which lags
    the clock the CA reads by up to a kernel tick: a leaf issued in a second's first
    milliseconds was "not yet valid" to a peer handshaking at once (CI flake of
    test_write_access: UNAVAILABLE "Socket closed"). An issuer clock a whole second ahead
    makes that lag certain here; the default backdate must cover it."""
    ca = LocalCA(lambda: dt.datetime.now(dt.UTC) + dt.timedelta(seconds=1))
    server = ca.write_files(tmp_path, dns=("svc.test",))
    async with tls_listener(server) as port:
        assert await greeting(port, ssl.create_default_context(cafile=str(server.ca))) == b"hi"


def test_signed_csr_carries_its_names_and_self_signed_names_its_host() -> None:
    ca = LocalCA()
    csr, _ = make_csr(["uri:spiffe://waygate.local/ns/a/sa/b", "ip:127.0.0.1"])
    leaf = ca.sign(csr)
    leaf.verify_directly_issued_by(ca.certificate)
    sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert sans.get_values_for_type(x509.UniformResourceIdentifier) == [
        "spiffe://waygate.local/ns/a/sa/b"
    ]
    cert, key = self_signed("api.example.com")
    parsed = x509.load_pem_x509_certificate(cert.encode())
    assert parsed.extensions.get_extension_for_class(
        x509.SubjectAlternativeName
    ).value.get_values_for_type(x509.DNSName) == ["api.example.com"]
    assert key.startswith("-----BEGIN PRIVATE KEY-----")
    with pytest.raises(ValueError, match="unknown SAN kind"):
        make_csr(["smtp:x"])


async def test_until_returns_once_true_and_fails_with_what_it_waited_for() -> None:
    flips = iter([False, False, True])
    await until(lambda: next(flips), timeout=5)
    with pytest.raises(AssertionError, match="waiting for the moon"):
        await until(lambda: False, "the moon", timeout=0.1)


async def test_until_awaits_a_coroutine_check_and_bounds_a_hanging_one() -> None:
    calls = []

    async def check() -> bool:
        calls.append(1)
        return len(calls) == 3

    await until(check, timeout=5)
    assert len(calls) == 3

    async def hangs() -> bool:
        await asyncio.sleep(60)
        return True

    with pytest.raises(AssertionError, match="waiting for an answer"):
        await until(hangs, "an answer", timeout=0.1)


def test_until_blocking_fails_after_its_timeout() -> None:
    flips = iter([False, True])
    until_blocking(lambda: next(flips), timeout=5)
    with pytest.raises(AssertionError, match="timed out after 0.1s"):
        until_blocking(lambda: False, timeout=0.1)


@pytest.mark.parametrize("extra", [0, 17, 99])
def test_an_up_offset_keeps_every_port_below_the_ephemeral_range(
    extra: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An `up` port at 32768+ can be taken by any outgoing connection's local port
    between the check and `up`'s bind (CI saw `up` exit on the HTTPS front's 32780)."""
    from tests.support import processes
    from waygate.components import COMPONENTS, DEMO_PORT
    from waygate.supervisor import STATUS_PORT

    defaults = [port for c in COMPONENTS for _, port in c.ports] + [DEMO_PORT, STATUS_PORT]

    def highest(start: int, stop: int, step: int) -> int:  # the worst draw, every time
        return max(range(start, stop, step))

    monkeypatch.setattr(random, "randrange", highest)
    offset = processes.free_up_offset(extra)
    assert offset % 100 == extra
    assert max(defaults) + offset < processes.EPHEMERAL_START
