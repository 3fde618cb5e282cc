"""The dialer's warm pool of raw-dial connections and TLS session resumption (issue 19 item 1).

Real server, agent and dial client in one process, mTLS on every hop. The pool
is observed through the client's own objects (which connection a dial took,
what waits idle) and the server through what its data listener saw.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import ssl
from pathlib import Path

import pytest
from cryptography.hazmat.primitives.serialization import Encoding

from tests.integration.tunnel.harness import (
    DIALER,
    NODE,
    Tunnel,
    credentials,
    echo_once,
    echo_server,
    ssl_context,
)
from tests.support.poll import until
from waygate.tunnel import datapath, peers
from waygate.tunnel.client import DataStream, StaticPresence, TunnelClient
from waygate.tunnel.relay import LinkClosed, open_link

_DER = Encoding.DER


def pool_of(client: TunnelClient):  # type: ignore[no-untyped-def]
    (pool,) = client._pools.values()
    return pool


async def test_a_dial_takes_a_warm_connection_and_the_pool_refills(tunnel: Tunnel) -> None:
    client = tunnel.client(pool_size=2)
    echo, port = await echo_server()
    async with echo:
        first = await client.dial(NODE, port)  # cold: its own handshake; the pool starts
        assert isinstance(first, DataStream)
        await first.aclose()
        pool = pool_of(client)
        await until(lambda: len(pool.idle) == 2, "the warm pool to fill")
        warm = {id(link) for link, _opened in pool.idle}
        stream = await client.dial(NODE, port)
        assert isinstance(stream, DataStream)
        assert id(stream.link) in warm  # no handshake of its own
        assert await echo_once(stream, b"through a warm connection") == b"through a warm connection"
        await until(lambda: len(pool.idle) == 2, "the pool to refill")
        assert len(pool.idle) == 2  # bounded by pool_size
        await stream.aclose()


async def test_an_unused_pool_empties_and_stops_refilling(tunnel: Tunnel) -> None:
    # The idle time leaves room for two refill handshakes on a busy 2-core machine.
    client = tunnel.client(pool_size=2, pool_idle=3.0)
    echo, port = await echo_server()
    async with echo:
        await (await client.dial(NODE, port)).aclose()
        pool = pool_of(client)
        await until(lambda: len(pool.idle) == 2, "the warm pool to fill")
        await until(lambda: not pool.idle, "idle connections to expire")
        await asyncio.sleep(6.0)  # two idle times: no refill without dials
        assert not pool.idle
        # It warms again with the next dial.
        await (await client.dial(NODE, port)).aclose()
        await until(lambda: len(pool.idle) == 2, "the pool to fill again")


async def test_a_renewal_replaces_the_pool_and_an_open_transfer_keeps_its_certificate(
    tunnel: Tunnel, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection keeps the certificate it was opened with; new ones (the pool's
    too) present the renewed one, with a full handshake."""
    seen: list[bytes | None] = []  # the dialer certificate of each data connection, in order
    names = peers.certificate_names

    def recording(der: bytes | None) -> tuple[list[str], list[str]]:
        uris, dns_names = names(der)
        if DIALER in uris:
            seen.append(der)
        return uris, dns_names

    monkeypatch.setattr(datapath.peers, "certificate_names", recording)
    before = tunnel.dialer_files
    after = tunnel.ca.write_files(tmp_path / "renewed", uris=[DIALER])
    contexts = [ssl_context(before)]
    client = TunnelClient(
        StaticPresence([f"127.0.0.1:{tunnel.dial_port}"]),
        credentials=lambda: credentials(before),
        server_name="tunnel-server",
        ssl_context=lambda: contexts[-1],
        pool_size=2,
    )
    tunnel.clients.append(client)
    old_der = peers.load(before.cert.read_bytes()).public_bytes(_DER)  # type: ignore[union-attr]
    new_der = peers.load(after.cert.read_bytes()).public_bytes(_DER)  # type: ignore[union-attr]
    echo, port = await echo_server()
    async with echo:
        long_lived = await client.dial(NODE, port)
        assert isinstance(long_lived, DataStream)
        assert await echo_once(long_lived, b"a" * 100_000) == b"a" * 100_000
        old_pool = pool_of(client)
        await until(lambda: len(old_pool.idle) == 2, "the warm pool to fill")
        assert set(seen) == {old_der}

        contexts.append(ssl_context(after))  # the renewal
        renewed_at = len(seen)
        fresh = await client.dial(NODE, port)
        assert isinstance(fresh, DataStream)
        assert not fresh.link.resumed  # a new context: a full handshake, no old session
        assert await echo_once(fresh, b"renewed") == b"renewed"
        assert old_pool.closed and not old_pool.idle  # the old certificate's pool is gone
        await until(lambda: len(pool_of(client).idle) == 2, "the new pool to fill")
        assert seen[renewed_at:] and set(seen[renewed_at:]) == {new_der}
        # The transfer opened before the renewal goes on, on its own connection.
        assert await echo_once(long_lived, b"b" * 100_000) == b"b" * 100_000
        await long_lived.write_eof()
        assert await long_lived.read() == b""
        await fresh.aclose()


async def test_a_resumed_session_is_refused_once_its_certificate_expired(
    tunnel: Tunnel, tmp_path: Path
) -> None:
    """A resumed handshake checks no certificate (and each resumption gets a fresh session
    lifetime from OpenSSL): the data listener refuses one whose certificate has ended."""
    # Long enough for two handshakes on a busy machine, short enough to wait out.
    tunnel.ca.lifetime = dt.timedelta(seconds=8)
    short = tunnel.ca.write_files(tmp_path / "short", uris=[DIALER])
    context = ssl_context(short)

    session: list[ssl.SSLSession] = []

    async def greeting() -> tuple[bool, bytes | LinkClosed]:
        link = await open_link(
            "127.0.0.1",
            tunnel.data_port,
            context,
            server_hostname="tunnel-server",
            timeout=5.0,
            session=session[0] if session else None,
        )
        try:
            return link.resumed, await link.read_line(5.0)
        except LinkClosed as exc:
            return link.resumed, exc
        finally:
            tls = link.get_extra_info("ssl_object")
            if not session and tls.session is not None and tls.session.has_ticket:
                session.append(tls.session)  # (the ticket came with the greeting)
            link.abort()

    resumed, line = await greeting()
    assert not resumed and isinstance(line, bytes) and line.startswith(b"WAYGATE ")
    resumed, line = await greeting()
    # Resumption works while the certificate is valid.
    assert resumed and isinstance(line, bytes) and line.startswith(b"WAYGATE ")
    expires = peers.load(short.cert.read_bytes()).not_valid_after_utc  # type: ignore[union-attr]
    await asyncio.sleep(max(0.0, (expires - dt.datetime.now(dt.UTC)).total_seconds()) + 1.1)
    resumed, line = await greeting()
    assert resumed  # the TLS layer took the session: the listener's own check refused it
    assert isinstance(line, LinkClosed)
