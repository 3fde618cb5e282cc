"""Dials through a real tunnel (server + agent + client in one loop, real mTLS)."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.integration.tunnel.harness import NODE, Tunnel, credentials, echo_server
from tests.support.poll import until
from waygate.tunnel import mux
from waygate.tunnel.client import DialFailed, bridged_socket
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc


async def test_bytes_both_ways_with_half_close(tunnel: Tunnel) -> None:
    server, port = await echo_server()
    async with server:
        stream = await tunnel.client().dial(NODE, port)
        payload = os.urandom(3 * 1024 * 1024 + 17)  # many windows' worth
        received = bytearray()

        async def reader() -> None:
            while data := await stream.read():
                received.extend(data)

        reading = asyncio.ensure_future(reader())
        await stream.write(payload)
        await stream.write_eof()
        await asyncio.wait_for(reading, 20)
        assert bytes(received) == payload
        assert await asyncio.wait_for(stream.wait_closed(), 5) == grpc.StatusCode.OK
    await until(
        lambda: not tunnel.hub.sessions[NODE].open_connections(), "the connection to be released"
    )
    assert not tunnel.agents[0].open_connections()


async def test_an_agent_window_larger_than_the_servers_does_not_stall(tmp_path: Path) -> None:
    # The server sends at most its own window (1 MiB); an agent that granted only
    # once owed half of its own 8 MiB would never grant: the echo hung.
    # Windows are the Connect stream's (the fallback path): no data connections.
    tunnel = Tunnel(tmp_path, window=1024 * 1024, data_path=False)
    await tunnel.start_server()
    await tunnel.start_agent(window=8 * 1024 * 1024)
    try:
        server, port = await echo_server()
        async with server:
            stream = await tunnel.client().dial(NODE, port)
            payload = os.urandom(4 * 1024 * 1024)
            received = bytearray()

            async def reader() -> None:
                while data := await stream.read():
                    received.extend(data)

            reading = asyncio.ensure_future(reader())
            await asyncio.wait_for(stream.write(payload), 20)
            await stream.write_eof()
            await asyncio.wait_for(reading, 20)
            assert bytes(received) == payload
    finally:
        await tunnel.close()


async def test_coalesced_data_stays_within_the_credit_and_in_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small windows (160 KiB) against 64 KiB writes: DATA packets on the agent
    # stream are coalesced while they wait, yet none may exceed what the peer
    # granted (the receiver would drop the connection), and the echo comes back
    # whole and in order, its EOF after the data.
    window = 160 * 1024
    sizes: list[int] = []
    next_packet = mux.Outbox.next

    async def recording_next(self: mux.Outbox) -> object:
        packet = await next_packet(self)
        if isinstance(packet, pb.Packet) and packet.type == pb.DATA:
            sizes.append(len(packet.data.data))
        return packet

    monkeypatch.setattr(mux.Outbox, "next", recording_next)
    tunnel = Tunnel(tmp_path, window=window, data_path=False)  # the Connect stream's packets
    await tunnel.start_server()
    await tunnel.start_agent(window=window)
    try:
        server, port = await echo_server()
        async with server:
            stream = await tunnel.client().dial(NODE, port)
            chunks = [os.urandom(64 * 1024) for _ in range(48)]
            received = bytearray()

            async def reader() -> None:
                while data := await stream.read():
                    received.extend(data)

            reading = asyncio.ensure_future(reader())
            for chunk in chunks:
                await asyncio.wait_for(stream.write(chunk), 20)
            await stream.write_eof()
            await asyncio.wait_for(reading, 20)
            assert bytes(received) == b"".join(chunks)
            assert await asyncio.wait_for(stream.wait_closed(), 5) == grpc.StatusCode.OK
    finally:
        await tunnel.close()
    assert sum(sizes) == 2 * len(chunks) * 64 * 1024  # both directions, every byte once
    assert max(sizes) <= min(window, mux.MAX_CHUNK)


async def test_no_agent_for_node_is_refused_with_its_reason(tunnel: Tunnel) -> None:
    with pytest.raises(DialFailed) as failed:
        await tunnel.client().dial("edge-unknown", 80)
    assert failed.value.reason == pb.NO_AGENT
    assert "no agent for node edge-unknown" in str(failed.value)


async def test_destination_outside_the_allow_list_is_not_allowed(tmp_path: Path) -> None:
    t = Tunnel(tmp_path, allow=("127.0.0.1/32:1",))
    await t.start_server()
    await t.start_agent()
    try:
        server, port = await echo_server()
        async with server:
            with pytest.raises(DialFailed) as failed:
                await t.client().dial(NODE, port)
        assert failed.value.reason == pb.NOT_ALLOWED
        assert not failed.value.retryable
    finally:
        await t.close()


async def test_unreachable_destination(tunnel: Tunnel) -> None:
    server, port = await echo_server()
    server.close()
    await server.wait_closed()
    with pytest.raises(DialFailed) as failed:
        await tunnel.client().dial(NODE, port)
    assert failed.value.reason == pb.UNREACHABLE
    assert "refused" in str(failed.value).lower()


async def test_dialer_not_allowed_by_policy(tunnel: Tunnel) -> None:
    stranger = tunnel.ca.write_files(
        tunnel.directory, uris=["spiffe://waygate.test/ns/t/sa/stranger"], prefix="stranger-"
    )
    with pytest.raises(DialFailed) as failed:
        await tunnel.client(stranger).dial(NODE, 80)
    assert failed.value.reason == pb.NOT_ALLOWED
    assert "stranger" in str(failed.value)


async def test_a_destination_that_speaks_first_loses_nothing(tunnel: Tunnel) -> None:
    async def greeter(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        writer.write(b"220 hello\r\n" + b"." * 200_000)  # before the dial is even answered
        writer.close()

    server = await asyncio.start_server(greeter, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        for _ in range(20):
            stream = await tunnel.client().dial(NODE, port)
            await stream.write_eof()
            data = b""
            while chunk := await stream.read():
                data += chunk
            assert data == b"220 hello\r\n" + b"." * 200_000


def test_a_destination_that_speaks_first_loses_nothing_under_uvloop(tmp_path: Path) -> None:
    """The processes run uvloop, which starts reading a socket after connection_made
    whatever the protocol asked: early bytes must wait for DIAL_RSP, not vanish."""
    import uvloop

    async def scenario() -> None:
        t = Tunnel(tmp_path)
        await t.start_server()
        await t.start_agent()
        try:
            await test_a_destination_that_speaks_first_loses_nothing(t)
        finally:
            await t.close()

    uvloop.run(scenario())


@pytest.mark.parametrize("park", [True, False], ids=["parked", "control-stream"])
async def test_a_dial_pending_when_the_agent_goes_away_is_refused_as_retryable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, park: bool
) -> None:
    """On both dial paths: a dial written on a parked data connection, and a DIAL_REQ
    on the agent's stream (an agent that parks nothing, as before parking)."""
    from waygate.tunnel.agent import AgentStream

    reached = asyncio.Event()

    async def never_connects(self: AgentStream, address: str, timeout: float) -> Any:
        reached.set()
        await asyncio.sleep(60)
        raise AssertionError("unreachable")

    monkeypatch.setattr(AgentStream, "_open_destination", never_connects)
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        await tunnel.start_agent(park=park)
        session = tunnel.hub.sessions[NODE]
        assert bool(session.parked) is park
        dialing = asyncio.ensure_future(tunnel.client().dial(NODE, 9))
        await asyncio.wait_for(reached.wait(), 10)
        assert bool(session._dials) is not park  # the dial took the path meant
        await tunnel.stop_agent(tunnel.agents[0])
        with pytest.raises(DialFailed) as refused:
            await asyncio.wait_for(dialing, 10)
        assert refused.value.reason == pb.DRAINING
        assert refused.value.retryable
    finally:
        await tunnel.close()


@pytest.mark.parametrize("park", [True, False], ids=["parked", "control-stream"])
async def test_a_dial_the_agent_does_not_answer_in_time_is_refused_with_timeout(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, park: bool
) -> None:
    from waygate.tunnel.agent import AgentStream

    async def slow(self: AgentStream, address: str, timeout: float) -> Any:
        await asyncio.sleep(30)
        raise AssertionError("unreachable")

    monkeypatch.setattr(AgentStream, "_open_destination", slow)
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        await tunnel.start_agent(park=park)
        session = tunnel.hub.sessions[NODE]
        parked = len(session.parked)
        started = asyncio.get_running_loop().time()
        with pytest.raises(DialFailed) as refused:
            await tunnel.client().dial(NODE, 9, timeout=0.5)
        assert refused.value.reason == pb.TIMEOUT
        assert not refused.value.retryable
        assert asyncio.get_running_loop().time() - started < 10
        # The pending dial left nothing behind on the server: no pending DIAL_REQ, and
        # the parked connection it took is gone (the refill parks a new one).
        await until(lambda: not session._dials, "the pending dial to go")
        assert not session.data
        if park:
            await until(lambda: len(session.parked) == parked, "the pool to park a new one")
    finally:
        await tunnel.close()


async def test_bridge_delivers_an_upload_to_a_destination_that_half_closed_first(
    tunnel: Tunnel,
) -> None:
    # The destination half-closes at once and reads slowly: when the bridge has seen
    # both directions end, megabytes are still buffered on the agent's side. They
    # must all arrive (the bridge used to cancel the stream, the agent to abort).
    received = 0
    finished = asyncio.get_running_loop().create_future()

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        writer.write_eof()
        try:
            while data := await reader.read(65536):
                received += len(data)
                await asyncio.sleep(0.005)
        finally:
            writer.close()
            finished.set_result(None)

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        stream = await tunnel.client().dial(NODE, port)
        sock = await bridged_socket(stream)
        reader, writer = await asyncio.open_connection(sock=sock)
        size = 8 * 1024 * 1024
        writer.write(os.urandom(size))
        await asyncio.wait_for(writer.drain(), 30)
        writer.write_eof()
        assert await asyncio.wait_for(reader.read(), 30) == b""
        await asyncio.wait_for(finished, 30)
        writer.close()
        assert received == size


async def test_dialers_cancelling_around_the_accept_leave_no_connection(tunnel: Tunnel) -> None:
    # Cancelled at every moment of the dial, the DialAccepted write included: each
    # connection the agent opened must be released on both sides.
    server, port = await echo_server()
    async with server:
        client = tunnel.client()
        await (await client.dial(NODE, port)).aclose()  # channel up: the dials below race
        for attempt in range(60):
            dialing = asyncio.ensure_future(client.dial(NODE, port))
            await asyncio.sleep(attempt * 0.0002)
            dialing.cancel()
            results = await asyncio.gather(dialing, return_exceptions=True)
            if not isinstance(results[0], BaseException):
                await results[0].aclose()
        await until(
            lambda: not tunnel.hub.sessions[NODE].open_connections(),
            "the server's connections to go",
        )
        await until(lambda: not tunnel.agents[0].open_connections(), "the agent's to go")


async def test_a_workload_certificate_cannot_register_as_an_agent(tunnel: Tunnel) -> None:
    # Any ServiceAccount can be issued its SPIFFE URI plus dns:NAME.NS.svc: one DNS
    # name, but a workload's. Agents carry dns:NODE only; a URI SAN is refused.
    workload = tunnel.ca.write_files(
        tunnel.directory,
        uris=["spiffe://waygate.test/ns/t/sa/web"],
        dns=["web.t.svc"],
        prefix="workload-",
    )
    channel = grpc.aio.secure_channel(
        f"127.0.0.1:{tunnel.agent_port}",
        credentials(workload),
        options=[("grpc.ssl_target_name_override", "tunnel-server")],
    )
    try:
        call = tunnel_pb2_grpc.AgentTunnelStub(channel).Connect(
            metadata=((mux.AGENT_ID_METADATA, "impostor"),)
        )
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await asyncio.wait_for(call.read(), 10)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "URI" in (refused.value.details() or "")
        assert "web.t.svc" not in tunnel.hub.sessions
    finally:
        await channel.close()


def test_a_destination_that_resets_at_once_leaves_no_orphan_under_uvloop(tmp_path: Path) -> None:
    """A destination that resets before the agent answered the dial: the agent must not
    answer with a connection it already lost (the server would hold it forever)."""
    import socket
    import struct
    import threading

    import uvloop

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.2)
    port = listener.getsockname()[1]
    stop = threading.Event()

    def reset_every_connection() -> None:
        # A thread of its own: the reset lands while the agent is still setting up.
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except TimeoutError:
                continue
            conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    async def scenario() -> None:
        t = Tunnel(tmp_path)
        await t.start_server()
        await t.start_agent()
        try:
            client = t.client()
            for _ in range(40):
                try:
                    stream = await client.dial(NODE, port)
                except DialFailed:
                    continue  # refused, or lost right after the answer: both fine
                await asyncio.wait_for(stream.wait_closed(), 10)
            await until(lambda: not t.hub.sessions[NODE].connections, "no connection left")
            assert not t.agents[0].open_connections()
        finally:
            await t.close()

    thread = threading.Thread(target=reset_every_connection, daemon=True)
    thread.start()
    try:
        uvloop.run(scenario())
    finally:
        stop.set()
        thread.join(5)
        listener.close()


class MovingPresence:
    """Presence whose replica addresses a test changes."""

    def __init__(self, addresses: list[str]) -> None:
        self.current = addresses

    def servers_for(self, node: str) -> list[str]:
        return list(self.current)

    def addresses(self) -> set[str]:
        return set(self.current)


async def test_channels_to_replicas_that_left_presence_are_closed_when_idle(
    tunnel: Tunnel,
) -> None:
    from waygate.tunnel.client import TunnelClient

    server, port = await echo_server()
    async with server:
        presence = MovingPresence([f"127.0.0.1:{tunnel.dial_port}"])
        client = TunnelClient(
            presence,
            credentials=lambda: credentials(tunnel.dialer_files),
            server_name="tunnel-server",
        )
        tunnel.clients.append(client)
        client.PRUNE_INTERVAL = 0.0
        held = await client.dial(NODE, port)
        presence.current = []
        with pytest.raises(DialFailed):
            await client.dial(NODE, port)
        assert client._channels, "a channel under an open stream is kept"
        await held.aclose()
        await until(lambda: not client._streams, "the stream to end")
        with pytest.raises(DialFailed):
            await client.dial(NODE, port)
        assert not client._channels


async def test_the_bridge_lets_go_when_the_proxy_closes_its_end(tunnel: Tunnel) -> None:
    # A destination that never closes: only the proxy's close can end the connection.
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(hold, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    async with server:
        stream = await tunnel.client().dial(NODE, port)
        sock = await bridged_socket(stream)
        await until(lambda: tunnel.agents[0].open_connections() == 1, "the connection")
        sock.close()  # a full close, not a half-close
        await until(
            lambda: not tunnel.hub.sessions[NODE].open_connections(), "the server to let go"
        )
        await until(lambda: not tunnel.agents[0].open_connections(), "the agent to let go")
        for writer in held:
            writer.close()
