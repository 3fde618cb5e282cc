"""TLS end to end (issue 19, bulk): the dialer's TLS session ends at the agent, and the
replica, after authorizing the dial on its own mTLS, copies ciphertext between two
plain TCP sockets (datapath's SPLICE line, `SocketLink.step_out`).

Real replica, agent and dial client in one process, mTLS on every hop, real sockets.
What is checked: the bytes arrive whole both ways with half-closes; the replica sees
only ciphertext; each end presents exactly the certificate the replica authenticated
(a different one, even a valid one for the same identity, is refused); every way the
mode cannot be had falls back to the relay; nothing is left open afterwards.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
import ssl
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY

from tests.integration.tunnel.harness import (
    DIALER,
    NODE,
    Tunnel,
    echo_once,
    echo_server,
    ssl_context,
)
from tests.integration.tunnel.test_leaks import open_fds, settled, tasks
from tests.integration.tunnel.test_parked_dials import packets_to_agent
from tests.support.poll import until
from waygate.tunnel import datapath
from waygate.tunnel.client import DataStream, DialFailed
from waygate.tunnel.relay import end_to_end_context, fingerprint
from waygate.tunnel.server import DataConnection
from waygate.tunnel.v1 import tunnel_pb2 as pb


async def pool_full(tunnel: Tunnel) -> None:
    """Once the agent's pool is whole and parked again after a dial took one (its refill
    comes 50 ms after): the state the fds and tasks are counted in."""
    agent, session = tunnel.agents[0], tunnel.hub.sessions[NODE]
    await until(
        lambda: not session.open_connections() and len(session.parked) >= agent.pool_size,
        "the agent's pool parked again",
    )
    await asyncio.sleep(0.2)  # (the refill's own tasks ending)


def replica_writes(monkeypatch: pytest.MonkeyPatch) -> list[bytes]:
    """Every chunk the replica writes on the plain sockets of an end-to-end splice."""
    written: list[bytes] = []
    original = datapath.plain_link

    def recording(sock: Any) -> Any:
        link = original(sock)
        write = link.write

        def write_recorded(data: Any) -> None:
            written.append(bytes(data))
            write(data)

        link.write = write_recorded  # type: ignore[method-assign]
        return link

    monkeypatch.setattr(datapath, "plain_link", recording)
    return written


@pytest.mark.parametrize("copy", ["kernel", "python"])
async def test_bytes_cross_end_to_end_whole_and_the_replica_sees_only_ciphertext(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch, copy: str
) -> None:
    """Both ways the replica copies: splice(2) (no byte in user space), and, where that
    is not to be had, two plain links (every byte written is recorded here)."""
    assert tunnel.data is not None
    if copy == "python":
        monkeypatch.setattr(tunnel.data, "kernel_copy", False)
    else:
        assert tunnel.data.kernel_copy  # (Linux: the replica's copy of choice, probed at start)
    written = replica_writes(monkeypatch)
    payload = b"SECRET-PAYLOAD-" + os.urandom(4 * 1024 * 1024)
    echo, port = await echo_server()
    async with echo:
        counted = carried("end_to_end")
        stream = await tunnel.client().dial(NODE, port, end_to_end=True)
        assert isinstance(stream, DataStream) and stream.end_to_end
        assert carried("end_to_end") == counted + 1
        # The dialer's session is with the agent: the certificate the replica named.
        agent_der = tunnel.agent_files.cert.read_bytes()
        assert stream.link.get_extra_info("peercert_der") == _der(agent_der)
        session = tunnel.hub.sessions[NODE]
        (connection,) = session.data.values()
        assert isinstance(connection, DataConnection)
        assert connection.end_to_end == fingerprint(_der(agent_der))
        if copy == "kernel":
            assert connection.kernel_relay is not None
        else:
            assert connection.kernel_relay is None
            assert connection.link.context is None  # the replica's side is plain TCP

        async def send() -> None:
            for offset in range(0, len(payload), 256 * 1024):
                await stream.write(payload[offset : offset + 256 * 1024])
            await stream.write_eof()

        sender = asyncio.ensure_future(send())
        received = bytearray()
        while more := await stream.read():  # the echo, then its half-close
            received += more
        await sender
        assert hashlib.sha256(received).digest() == hashlib.sha256(payload).digest()
        assert await stream.wait_closed() is not None
    relayed = b"".join(written)
    if copy == "kernel":
        assert not relayed  # not a byte through Python
    else:
        assert len(relayed) > 2 * len(payload)  # both directions went through the replica
        assert b"SECRET-PAYLOAD-" not in relayed  # as ciphertext only


def _der(pem: bytes) -> bytes:
    return ssl.PEM_cert_to_DER_cert(pem.decode())


async def test_a_dialer_refuses_an_agent_certificate_the_replica_did_not_authenticate(
    tmp_path: Path, tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Another agent certificate for the same node, from the same CA: valid in every
    # way but not the one on the parked connection the replica checked.
    other = tunnel.ca.write_files(tmp_path / "other", dns=[NODE], client_only=True)
    _present_instead(monkeypatch, "waygate.tunnel.agent", other, server_side=True)
    echo, port = await echo_server()
    async with echo:
        with pytest.raises(DialFailed, match="another certificate than the one the replica"):
            await tunnel.client().dial(NODE, port, end_to_end=True)


async def test_an_agent_refuses_a_dialer_certificate_the_replica_did_not_authorize(
    tmp_path: Path, tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The same dialer identity in a second certificate: the agent pins the very one the
    # replica authorized, so the inner session ends before any byte reaches the server.
    other = tunnel.ca.write_files(tmp_path / "other", uris=[DIALER])
    _present_instead(monkeypatch, "waygate.tunnel.client", other, server_side=False)
    received = bytearray()

    async def record(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while data := await reader.read(65536):
            received.extend(data)
        writer.close()

    server = await asyncio.start_server(record, "127.0.0.1", 0)
    async with server:
        port = server.sockets[0].getsockname()[1]
        try:
            stream = await tunnel.client().dial(NODE, port, end_to_end=True)
        except DialFailed:
            pass  # (TLS 1.3: the client may learn of it in the handshake or just after)
        else:
            await stream.write(b"must not arrive")
            with pytest.raises(ConnectionError):
                while await stream.read():
                    pass
        await asyncio.sleep(0.2)
    assert not received


def _present_instead(
    monkeypatch: pytest.MonkeyPatch, module: str, files: Any, *, server_side: bool
) -> None:
    """Make `module`'s inner handshakes present `files`' certificate, not the outer one's."""
    substitute = end_to_end_context(ssl_context(files), server_side=server_side)
    assert substitute is not None

    def other_context(_outer: Any, *, server_side: bool) -> Any:
        return substitute

    monkeypatch.setattr(f"{module}.end_to_end_context", other_context)


async def test_without_parked_connections_the_dial_request_asks_for_it(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An agent that parks nothing gets the dial on its Connect stream (DIAL_REQ with
    `splice_for`) and answers on a data connection of its own, end to end all the same."""
    await tunnel.stop_agent(tunnel.agents[0])
    await tunnel.start_agent(park=False)
    session = tunnel.hub.sessions[NODE]
    sent = packets_to_agent(session, monkeypatch)
    echo, port = await echo_server()
    async with echo:
        stream = await tunnel.client().dial(NODE, port, end_to_end=True)
        assert isinstance(stream, DataStream) and stream.end_to_end
        assert pb.DIAL_REQ in sent
        agent_der = _der(tunnel.agent_files.cert.read_bytes())
        assert stream.link.get_extra_info("peercert_der") == agent_der
        assert await echo_once(stream, b"through a DATA line") == b"through a DATA line"
        await stream.aclose()


def carried(how: str) -> float:
    value = REGISTRY.get_sample_value("waygate_tunnel_server_raw_dials_total", {"carried": how})
    return value or 0.0


async def test_an_agent_without_data_connections_relays_on_its_stream(tunnel: Tunnel) -> None:
    await tunnel.stop_agent(tunnel.agents[0])
    await tunnel.start_agent(data_connections=False)
    echo, port = await echo_server()
    before = {how: carried(how) for how in ("end_to_end", "data", "stream")}
    async with echo:
        stream = await tunnel.client().dial(NODE, port, end_to_end=True)
        assert isinstance(stream, DataStream) and not stream.end_to_end
        assert await echo_once(stream, b"relayed") == b"relayed"
        await stream.aclose()
    # The replica's metric tells an operator the dial asked for more than it got.
    assert carried("stream") == before["stream"] + 1
    assert carried("end_to_end") == before["end_to_end"]


async def test_an_agent_that_cannot_leave_tls_answers_a_relayed_dial(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    # No certificate for the inner session (as an agent without one): a plain OK.
    monkeypatch.setattr("waygate.tunnel.agent.end_to_end_context", lambda *_a, **_k: None)
    echo, port = await echo_server()
    async with echo:
        stream = await tunnel.client().dial(NODE, port, end_to_end=True)
        assert isinstance(stream, DataStream) and not stream.end_to_end
        assert await echo_once(stream, b"relayed") == b"relayed"
        await stream.aclose()


async def test_a_replica_that_takes_no_splice_line_gets_a_dial_line(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert tunnel.data is not None
    monkeypatch.setattr(type(tunnel.data), "_takes_splices", property(lambda _self: False))
    client = tunnel.client(pool_size=2)
    echo, port = await echo_server()
    async with echo:
        for _ in range(2):  # the second one goes straight to DIAL (remembered)
            stream = await client.dial(NODE, port, end_to_end=True)
            assert isinstance(stream, DataStream) and not stream.end_to_end
            assert await echo_once(stream, b"relayed") == b"relayed"
            await stream.aclose()
    assert len(client._no_splice) == 1


async def test_a_dialer_the_replica_does_not_allow_is_refused_before_any_splice(
    tmp_path: Path, tunnel: Tunnel
) -> None:
    stranger = tunnel.ca.write_files(tmp_path / "s", uris=["spiffe://waygate.test/ns/x/sa/y"])
    with pytest.raises(DialFailed) as refused:
        await tunnel.client(stranger).dial(NODE, 9, end_to_end=True)
    assert refused.value.reason == pb.NOT_ALLOWED


async def test_early_data_is_not_sent_end_to_end(tunnel: Tunnel) -> None:
    with pytest.raises(ValueError, match="not sent end to end"):
        await tunnel.client().dial(NODE, 9, early=b"x", end_to_end=True)


@pytest.mark.parametrize("pooled", [False, True], ids=["new", "pooled"])
async def test_end_to_end_dials_leave_no_descriptor_or_task_behind(
    tunnel: Tunnel, pooled: bool
) -> None:
    echo, port = await echo_server()
    async with echo:
        client = tunnel.client(pool_size=2 if pooled else 0)
        stream = await client.dial(NODE, port, end_to_end=True)  # warms what stays warm
        assert await echo_once(stream, b"warm") == b"warm"
        await stream.aclose()
        await pool_full(tunnel)
        fds, running = open_fds(), tasks()
        for round_number in range(40):
            # Back to back: parked connections while they last, then DIAL_REQs.
            stream = await client.dial(NODE, port, end_to_end=True)
            assert isinstance(stream, DataStream) and stream.end_to_end
            payload = b"cycle %d" % round_number
            await stream.write(payload)
            await stream.write_eof()
            assert await stream.read() == payload
            assert await stream.read() == b""
            await stream.wait_closed()
        await settled(fds, running, tunnel)


async def test_a_dialer_cancelled_mid_step_out_releases_everything(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    echo, port = await echo_server()
    async with echo:
        client = tunnel.client()
        stream = await client.dial(NODE, port, end_to_end=True)  # (its channel stays open)
        assert await echo_once(stream, b"warm") == b"warm"
        await stream.aclose()
        await pool_full(tunnel)
        fds, running = open_fds(), tasks()
        monkeypatch.setattr("waygate.tunnel.client.open_end_to_end", _never)
        dial = asyncio.ensure_future(client.dial(NODE, port, end_to_end=True))
        await asyncio.sleep(0.3)
        dial.cancel()
        await asyncio.gather(dial, return_exceptions=True)
        await settled(fds, running, tunnel)


async def _never(sock: Any, *_args: Any, **_kwargs: Any) -> Any:
    try:
        await asyncio.Event().wait()
    finally:
        sock.close()
