"""Early data on a raw dial (issue 19, dial latency): the dialer's first bytes go with its
DIAL line, and the agent writes them to the destination once connected.

Real replicas, agents and dial clients in one process, mTLS on every hop; the
destination is an HTTP backend that records every request head it receives, so
"delivered exactly once" is counted where it matters. The retry rule
(`waygate.tunnel.early`): a refusal means the bytes reached no destination, so the
dial moves on (to another agent, another replica) with the same bytes; a dial that
went unanswered after its early data was sent is not retried unless the caller
declared the bytes replay-safe.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from tests.integration.tunnel.harness import (
    NODE,
    Tunnel,
    credentials,
    http_backend,
    ssl_context,
)
from tests.integration.tunnel.test_parked_dials import packets_to_agent
from tests.support.pki import LocalCA
from tests.support.poll import until
from waygate.tunnel import wire
from waygate.tunnel.client import DataStream, DialFailed, StaticPresence, TunnelClient
from waygate.tunnel.early import EARLY_LIMIT
from waygate.tunnel.relay import Link, LinkClosed, LinkListener, Stream, open_link
from waygate.tunnel.v1 import tunnel_pb2 as pb

REQUEST = b"GET /early HTTP/1.1\r\nHost: backend\r\n\r\n"


async def response(stream: Any) -> bytes:
    received = b""
    while not received.endswith(b"ok"):
        more = await stream.read()
        assert more, f"the response ended early: {received!r}"
        received += more
    return received


@pytest.fixture
def replicas_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    # The client shuffles replicas; these tests need to know which one comes first.
    monkeypatch.setattr("waygate.tunnel.client.random.shuffle", lambda servers: None)


@pytest.mark.parametrize(
    "way", ["parked", "token", "agent-stream", "grpc-dial"], ids=lambda way: way
)
async def test_early_data_reaches_the_destination_once_and_first(
    tmp_path: Path, way: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On every way a dial can go: a parked data connection (the bytes with the DIAL
    line), DIAL_REQ answered on a data connection or on the Connect stream (the replica
    sends them after the agent's answer), and gRPC Tunnel.Dial (the client sends them
    as the first DATA)."""
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        await tunnel.start_agent(park=way == "parked", data_connections=way != "agent-stream")
        sent = packets_to_agent(tunnel.hub.sessions[NODE], monkeypatch)
        backend, port, heads = await http_backend()
        async with backend:
            client = tunnel.client(data_path=way != "grpc-dial")
            stream = await client.dial(NODE, port, early=REQUEST)
            assert isinstance(stream, DataStream) == (way != "grpc-dial")
            assert (await response(stream)).startswith(b"HTTP/1.1 200 OK")
            await stream.aclose()
        assert heads == [REQUEST]
        assert (pb.DIAL_REQ in sent) == (way != "parked")
    finally:
        await tunnel.close()


async def test_bytes_written_after_the_dial_follow_the_early_data(tunnel: Tunnel) -> None:
    backend, port, heads = await http_backend()
    async with backend:
        stream = await tunnel.client().dial(NODE, port, early=b"GET /split HTTP/1.1\r\n")
        await stream.write(b"Host: backend\r\n\r\n")
        assert (await response(stream)).startswith(b"HTTP/1.1 200 OK")
        await stream.aclose()
    assert heads == [b"GET /split HTTP/1.1\r\nHost: backend\r\n\r\n"]


async def test_early_data_over_the_limit_is_refused_before_anything_is_sent(
    tunnel: Tunnel,
) -> None:
    client = tunnel.client()
    with pytest.raises(ValueError, match=f"at most {EARLY_LIMIT} bytes"):
        await client.dial(NODE, 9, early=b"x" * (EARLY_LIMIT + 1))
    # A dialer that claims more on the wire is refused by the replica, as INVALID.
    link = await tunnel.data_link()
    try:
        link.write_line(wire.dial(NODE, "", 9, 1000, early_length=EARLY_LIMIT + 1))
        answer = (await link.read_line(5.0)).decode()
        assert answer.startswith("REFUSED INVALID early data must be 1..16384 bytes"), answer
    finally:
        link.abort()
    assert not tunnel.hub.sessions[NODE].data


async def test_an_agent_that_refuses_passes_the_same_bytes_to_one_that_serves(
    tmp_path: Path,
) -> None:
    """Two agents for the node; the newest (tried first) refuses the destination after
    it read the early data. The replica moves on with the same bytes: one delivery."""
    tunnel = Tunnel(tmp_path)
    await tunnel.start_server()
    try:
        await tunnel.start_agent()
        refusing = await tunnel.start_agent(allow=("10.0.0.0/8:*",))
        await until(lambda: len(tunnel.hub.agents(NODE)) == 2, "both agents held")
        (session,) = (s for s in tunnel.hub.sessions_all() if s.agent_id == refusing.agent_id)
        backend, port, heads = await http_backend()
        async with backend:
            stream = await tunnel.client().dial(NODE, port, early=REQUEST)
            assert (await response(stream)).startswith(b"HTTP/1.1 200 OK")
            await stream.aclose()
        assert tunnel.hub.selection.refused_lately(session, f"127.0.0.1:{port}")  # asked first
        assert heads == [REQUEST]
    finally:
        await tunnel.close()


@pytest.fixture
async def two_replicas(tmp_path: Path) -> AsyncIterator[tuple[Tunnel, Tunnel]]:
    """Replicas a and b (one CA), each with an agent of its own for the node."""
    ca = LocalCA()
    a = Tunnel(tmp_path / "a", server_id="replica-a", ca=ca)
    b = Tunnel(tmp_path / "b", server_id="replica-b", ca=ca)
    try:
        for replica in (a, b):
            await replica.start_server()
            await replica.start_agent()
        yield a, b
    finally:
        await a.close()
        await b.close()


def client_for(a: Tunnel, b: Tunnel) -> TunnelClient:
    """A raw-dial client that tries replica a first, then b."""
    context = ssl_context(a.dialer_files)
    client = TunnelClient(
        StaticPresence([f"127.0.0.1:{a.dial_port}", f"127.0.0.1:{b.dial_port}"]),
        credentials=lambda: credentials(a.dialer_files),
        ssl_context=lambda: context,
        server_name="tunnel-server",
    )
    a.clients.append(client)
    return client


@pytest.mark.usefixtures("replicas_in_order")
async def test_a_refusing_replica_sends_the_dialer_on_with_the_same_bytes(
    two_replicas: tuple[Tunnel, Tunnel],
) -> None:
    a, b = two_replicas
    a.hub.drain(30.0)  # a refuses with DRAINING, which another replica may answer
    backend, port, heads = await http_backend()
    async with backend:
        stream = await client_for(a, b).dial(NODE, port, early=REQUEST)
        assert stream.server_id == "replica-b"
        assert (await response(stream)).startswith(b"HTTP/1.1 200 OK")
        await stream.aclose()
    assert heads == [REQUEST]


def agents_lose_their_first_answer(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The first time an agent answers OK on a data connection (after it wrote the early
    data to the destination), the connection breaks instead: the answer is lost."""
    lost: list[int] = []
    write_line = Link.write_line

    def answer_or_break(link: Link, line: bytes) -> None:
        if line.startswith(b"OK ") and line.count(b" ") == 1 and not lost:  # the agent's OK <id>
            lost.append(1)
            link.abort()
            return
        write_line(link, line)

    monkeypatch.setattr(Link, "write_line", answer_or_break)
    return lost


@pytest.mark.usefixtures("replicas_in_order")
async def test_a_dial_unanswered_after_its_early_data_is_not_retried(
    two_replicas: tuple[Tunnel, Tunnel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replica a's agent delivers the bytes and its answer is lost: neither a (another
    parked connection) nor the dialer (replica b) tries again, and the error says why."""
    a, b = two_replicas
    lost = agents_lose_their_first_answer(monkeypatch)
    backend, port, heads = await http_backend()
    async with backend:
        with pytest.raises(DialFailed) as failed:
            await client_for(a, b).dial(NODE, port, early=REQUEST)
        assert lost
        assert not failed.value.retryable
        assert "may have reached the destination" in str(failed.value)
        assert "replay_safe" in str(failed.value)
        await until(lambda: heads == [REQUEST], "the one delivery")
    assert not b.hub.sessions[NODE].data  # b was never dialled


@pytest.mark.usefixtures("replicas_in_order")
async def test_replay_safe_early_data_is_sent_again_after_a_lost_answer(
    two_replicas: tuple[Tunnel, Tunnel], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The caller said the bytes may be delivered twice: the replica dials again through
    the agent's stream (DIAL_REQ, the bytes after the answer), and the dial succeeds (the
    destination saw the bytes twice)."""
    a, b = two_replicas
    lost = agents_lose_their_first_answer(monkeypatch)
    sent = packets_to_agent(a.hub.sessions[NODE], monkeypatch)
    backend, port, heads = await http_backend()
    async with backend:
        stream = await client_for(a, b).dial(NODE, port, early=REQUEST, replay_safe=True)
        assert sent.count(pb.DIAL_REQ) == 1
        assert lost
        assert stream.server_id == "replica-a"
        assert (await response(stream)).startswith(b"HTTP/1.1 200 OK")
        await stream.aclose()
        await until(lambda: len(heads) == 2, "both deliveries")
    assert heads == [REQUEST, REQUEST]


@pytest.fixture(params=["memory-bio", "socket"])
async def link_pair(request: pytest.FixtureRequest) -> AsyncIterator[tuple[Link, Link]]:
    """A plain client link and the server side of it, either kind of `Link` the data
    listener makes (the memory-BIO `Link` on a loop server, `SocketLink` on its own)."""
    accepted: asyncio.Queue[Link] = asyncio.Queue()
    closers: list[Any] = []
    if request.param == "socket":
        listener = LinkListener(None, accepted.put_nowait)
        port = await listener.start("127.0.0.1", 0)
        closers.append(listener.close)
    else:

        def made() -> Link:
            link = Link(None, server_side=True)
            accepted.put_nowait(link)
            return link

        server = await asyncio.get_running_loop().create_server(made, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        closers.append(server.close)
    client = await open_link("127.0.0.1", port, None, server_hostname=None, timeout=5.0)
    served = await asyncio.wait_for(accepted.get(), 5.0)
    await served.established
    try:
        yield client, served
    finally:
        client.abort()
        served.abort()
        for close in closers:
            close()


async def test_read_exact_takes_its_bytes_and_leaves_the_rest_to_the_next_user(
    link_pair: tuple[Link, Link],
) -> None:
    """More than the preamble bound in two writes (the holder pauses reading past it):
    exactly the early bytes come back, and what followed reaches whoever attaches."""
    client, served = link_pair
    early = bytes(range(256)) * 40  # 10 KiB
    client.write(b"DIAL x 1\n" + early[:5000])
    assert await served.read_line(5.0) == b"DIAL x 1"
    client.write(early[5000:] + b"after")
    assert await served.read_exact(len(early), 5.0) == early
    stream = Stream()
    served.attach(stream)
    rest = b""
    while len(rest) < 5:
        more = await asyncio.wait_for(stream.read(), 5.0)
        assert more, "the bytes after the early data were lost"
        rest += more
    assert rest == b"after"


async def test_read_exact_fails_when_the_link_ends_first(link_pair: tuple[Link, Link]) -> None:
    client, served = link_pair
    client.write(b"DIAL x 1\n" + b"y" * 100)
    client.write_eof()
    assert await served.read_line(5.0) == b"DIAL x 1"
    with pytest.raises(LinkClosed, match="before its early data"):
        await served.read_exact(200, 5.0)


async def test_preamble_reads_time_out_and_a_later_read_still_gets_its_bytes(
    link_pair: tuple[Link, Link],
) -> None:
    """`read_line` and `read_exact` raise TimeoutError at their deadline (a timer of
    their own, not asyncio.timeout); what arrives afterwards waits for the next read,
    and a read whose bytes are in already needs no wait at all (a zero timeout)."""
    client, served = link_pair
    with pytest.raises(TimeoutError):
        await served.read_line(0.05)
    client.write(b"DIAL x")
    with pytest.raises(TimeoutError):
        await served.read_line(0.05)  # half a line: still waiting for its LF
    client.write(b" 1\nearly")
    assert await served.read_line(5.0) == b"DIAL x 1"
    with pytest.raises(TimeoutError):
        await served.read_exact(10, 0.05)  # five of ten bytes
    client.write(b" data")
    assert await served.read_exact(10, 5.0) == b"early data"
    client.write(b"OK 1\nabc")
    await asyncio.sleep(0.05)
    assert await served.read_line(0) == b"OK 1"
    assert await served.read_exact(3, 0) == b"abc"


async def test_a_replica_from_before_early_data_gets_the_bytes_after_its_answer(
    tunnel: Tunnel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A replica that does not know the longer DIAL line refuses it as INVALID "unknown
    preamble" (nothing dialled): the client dials again with the line alone, sends the
    bytes after the answer, and does so from then on for that listener."""
    listener = tunnel.data
    assert listener is not None
    dial = type(listener)._dial
    refused: list[int] = []

    async def as_before(self: Any, link: Link, line: wire.Dial, *rest: Any) -> None:
        if line.early_length:  # the eight-word DIAL line this replica does not know
            refused.append(8)
            link.write_line(wire.UNKNOWN_PREAMBLE_LINE)
            link.close()
            return
        await dial(self, link, line, *rest)

    monkeypatch.setattr(type(listener), "_dial", as_before)
    client = tunnel.client()
    backend, port, heads = await http_backend()
    async with backend:
        for _ in range(2):
            stream = await client.dial(NODE, port, early=REQUEST)
            assert (await response(stream)).startswith(b"HTTP/1.1 200 OK")
            await stream.aclose()
    assert heads == [REQUEST, REQUEST]
    assert refused == [8]  # refused once; the second dial sent the line alone


async def test_a_raw_dial_is_one_trace_from_the_dialer_through_the_replica_to_the_agent(
    tunnel: Tunnel,
) -> None:
    """The dialer's span, the replica's (its parent: the DIAL line's traceparent) and the
    agent's (the parked connection's DIAL line), with their attributes, for a dial with
    early data and for one the agent refuses (spans recorded by an SDK provider of the
    test's own, not the process's global one)."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    assert tunnel.data is not None
    tunnel.data._tracer = tracer
    tunnel.agents[0].tracer = tracer
    client = tunnel.client(pool_size=2)
    client._tracer = tracer
    backend, port, _heads = await http_backend()
    async with backend:
        stream = await client.dial(NODE, port, early=REQUEST)
        assert (await response(stream)).startswith(b"HTTP/1.1 200 OK")
        await stream.aclose()
        with pytest.raises(DialFailed):
            await client.dial(NODE, port, host="192.0.2.1")  # outside the allow-list
    await until(lambda: len(exporter.get_finished_spans()) == 6)
    spans = exporter.get_finished_spans()
    for refused in (False, True):
        trace_ids = {s.context.trace_id for s in spans}
        assert len(trace_ids) == 2
        dialer = [s for s in spans if s.name == "waygate.tunnel.v1.Tunnel/Dial"][refused]
        chain = [s for s in spans if s.context.trace_id == dialer.context.trace_id]
        by_name = {s.name: s for s in chain}
        replica = by_name["waygate.tunnel.data/Tunnel/Dial"]
        agent = by_name["waygate.tunnel.agent/Dial"]
        assert replica.parent is not None and replica.parent.span_id == dialer.context.span_id
        assert agent.parent is not None and agent.parent.span_id == replica.context.span_id
        attributes = dict(replica.attributes or {})
        assert attributes["waygate.tunnel.node"] == NODE
        assert attributes["waygate.tunnel.replica"] == tunnel.hub.server_id
        if refused:
            assert attributes["waygate.tunnel.refusal"] == "NOT_ALLOWED"
            assert dict(agent.attributes or {})["waygate.tunnel.refusal"] == "NOT_ALLOWED"
        else:
            assert attributes["waygate.tunnel.address"] == f"127.0.0.1:{port}"
            assert attributes["waygate.tunnel.connection_id"] > 0
            assert attributes["waygate.tunnel.end_to_end"] is False
            assert dict(agent.attributes or {})["waygate.tunnel.connection_id"] > 0
            assert dict(dialer.attributes or {})["waygate.tunnel.replica"] == tunnel.hub.server_id
