"""The tunnel server: agents' Connect streams, dialers' Dial streams, and the hub between them.

- `Hub`: the registry of the agents this replica holds (node -> `AgentSession`),
  parked connections and dial tokens, whether it is draining, and the replica
  set it tells agents about. Presence reporting (`waygate.tunnel.presence`)
  subscribes to its changes. Which agent takes a dial is `hub.selection`
  (`waygate.tunnel.selection`), apart from the registry.
- `AgentSession`: one agent's Connect stream. One writer task drains its
  outbox (packets for the agent); the handler reads packets and dispatches
  them to the connections. Everything queued is bounded by the connections'
  credit windows (see `waygate.tunnel.mux`).
- `ServerConnection`: one tunnelled TCP connection: credit towards the agent,
  a queue of frames towards the dialer (bounded by the window it granted), and
  `EOF`, `CLOSED`, `LOST`, what it hands the dialer's face besides bytes.
  `DataConnection`: one on its own data connection, shaped the same.
- `AgentTunnelServicer` (port 7003) and `TunnelServicer` (port 7004): the
  gRPC faces. The agent's node comes from its client certificate (exactly
  one DNS SAN), never from what it says; a dialer must match `dialers`.

Lifecycle invariants: a connection is removed from its session in exactly one
place (`ServerConnection.finish`), which also wakes whoever waits on it;
a session ending (agent gone, stream cancelled) finishes every connection on
it, and a Dial stream ending (cancelled dialer) sends CLOSE_REQ to the agent.
Per chunk: no logging, no f-strings, no task.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import random
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable
from datetime import UTC, datetime
from typing import Any, cast

import grpc
from google.protobuf import duration_pb2
from opentelemetry import trace

from waygate.core import errors
from waygate.core.identity import matches
from waygate.tunnel import mux, peers, wire
from waygate.tunnel.early import Unanswered
from waygate.tunnel.kernelsplice import KernelSplice
from waygate.tunnel.mux import (
    MAX_CHUNK,
    ConnectionClosed,
    Credit,
    Outbox,
    ReceiveWindow,
    Refused,
    Silent,
)
from waygate.tunnel.relay import Link, LinkClosed, Stream, fingerprint, splice
from waygate.tunnel.selection import ANSWER_SLACK, AgentSelection
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc

log = logging.getLogger(__name__)

# What a connection's `next_for_dialer` returns besides bytes (the faces that carry a
# connection to its dialer, here, in datapath and in the front, compare by identity).
EOF = object()  # the agent's side half-closed
CLOSED = object()  # the agent closed the connection (CLOSE_REQ), or the dialer did
LOST = object()  # the agent stream ended, or the agent broke the protocol
_STREAM_END = pb.Packet()


def peer_certificate(context: grpc.aio.ServicerContext) -> bytes | None:
    pems = list(context.auth_context().get("x509_pem_cert") or ())
    return pems[0] if pems else None


def peer_certificate_names(context: grpc.aio.ServicerContext) -> tuple[list[str], list[str]]:
    """(URI SANs, DNS SANs) of the client certificate; empty lists without one."""
    return peers.certificate_names(peer_certificate(context))


class ServerConnection:
    """One tunnelled TCP connection as the server sees it."""

    __slots__ = (
        "_ready",
        "close_reason",
        "connect_id",
        "finished",
        "receive",
        "send_credit",
        "session",
        "to_dialer",
    )

    def __init__(self, session: AgentSession, connect_id: int, send_window: int) -> None:
        self.connect_id = connect_id
        self.session = session
        window = session.hub.window  # bytes the agent may send us before a grant
        self.receive = ReceiveWindow(window)
        # Bytes we may still send to the agent: its window, never more than ours
        # (what we queue for a slow agent is bounded by our own setting).
        self.send_credit = Credit(send_window, window)
        self.to_dialer: collections.deque[Any] = collections.deque()
        self._ready: asyncio.Future[None] | None = None
        self.finished = False
        self.close_reason = ""

    # ----------------------------------------------------- from the agent

    def on_data(self, data: pb.Data) -> None:
        payload = data.data
        if payload:
            if not self.receive.received(len(payload)):
                self.session.send(
                    mux.close_request(self.connect_id, "flow control window exceeded")
                )
                self.finish(LOST, "the agent sent beyond its flow-control window")
                return
            self._push(payload)
        if data.eof:
            self._push(EOF)

    def _push(self, item: Any) -> None:
        self.to_dialer.append(item)
        ready = self._ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    async def next_for_dialer(self) -> Any:
        """The next frame for the dialer: a marker, or the queued bytes joined up to `MAX_CHUNK`."""
        queued = self.to_dialer
        while not queued:
            self._ready = asyncio.get_running_loop().create_future()
            try:
                await self._ready
            finally:
                self._ready = None
        item = queued.popleft()
        if item.__class__ is not bytes or not queued:
            return item
        return mux.join_queued(item, queued)

    def delivered(self, size: int) -> None:
        """`size` bytes reached the dialer stream: grant the agent more, half a window at a time."""
        grant = self.receive.consumed(size)
        if grant:
            self.session.send(mux.window_update(self.connect_id, grant))

    # ----------------------------------------------------- towards the agent

    async def send(self, data: bytes) -> None:
        size = len(data)
        if size <= MAX_CHUNK:
            await self.send_credit.take(size)
            self.session.send_data(self.connect_id, data)
            return
        view = memoryview(data)
        while view:
            chunk = view[:MAX_CHUNK]
            await self.send_credit.take(len(chunk))
            self.session.send_data(self.connect_id, bytes(chunk))
            view = view[MAX_CHUNK:]

    def send_eof(self) -> None:
        if not self.finished:
            self.session.send_eof(self.connect_id)

    def finish(self, how: Any, reason: str = "") -> None:
        """Forget the connection (exactly once) and wake its dialer side."""
        if self.finished:
            return
        self.finished = True
        self.close_reason = reason
        self.session.connections.pop(self.connect_id, None)
        self.send_credit.close()
        self._push(how)


class DataConnection:
    """A tunnelled connection on its own data connection from the agent (`relay.Link`).

    Shaped as `ServerConnection` for the faces that consume bytes themselves
    (the gRPC Dial face, the front): `next_for_dialer`/`delivered` read through
    a `relay.Stream` whose queue is bounded, so TCP backs a slow consumer up to
    the destination. A raw dialer skips all of that: `relay_to` splices its
    link to this one. The id is the agent's (its DATA line); the agent ignores
    a CLOSE_REQ for it, which is what the consumers send when they give up: the
    link's reset is what ends it.
    """

    __slots__ = (
        "_eof_given",
        "close_reason",
        "connect_id",
        "end_to_end",
        "finished",
        "kernel_relay",
        "link",
        "session",
        "stream",
    )

    def __init__(
        self, session: AgentSession, connect_id: int, link: Link, end_to_end: str = ""
    ) -> None:
        self.session = session
        self.connect_id = connect_id
        self.link = link
        self.stream: Stream | None = None
        self.finished = False
        self.close_reason = ""
        self._eof_given = False
        # The agent answered a SPLICE: it is leaving TLS on `link` for a session with the
        # dialer (datapath); this is its certificate's fingerprint, for the dialer's pin.
        self.end_to_end = end_to_end
        self.kernel_relay: KernelSplice | None = None  # (`spliced`: `link` is over then)

    def _stream(self) -> Stream:
        stream = self.stream
        if stream is None:
            stream = self.stream = Stream()
            self.link.attach(stream)
            stream.closed.add_done_callback(lambda _done: self._ended(stream.error))
        return stream

    def relay_to(self, dialer: Link) -> asyncio.Future[None]:
        """Splice `dialer` to this connection; done once both are closed."""
        done = splice(dialer, self.link)
        done.add_done_callback(lambda _done: self._ended(None))
        return done

    def spliced(self, relay: KernelSplice) -> asyncio.Future[None]:
        """Carried from now on by `relay` (TLS end to end: the kernel copies the plain
        sockets under both links); done once it is."""
        self.kernel_relay = relay
        relay.done.add_done_callback(lambda _done: self._ended(relay.error))
        return relay.done

    def _ended(self, error: BaseException | None) -> None:
        if not self.finished:
            self.finished = True
            self.close_reason = str(error) if error is not None else ""
            self.session.data.pop(self.connect_id, None)

    async def next_for_dialer(self) -> Any:
        stream = self._stream()
        if not self._eof_given:
            try:
                data = await stream.take()
            except LinkClosed:
                data = None
            if data:
                return data
            if data is not None:
                self._eof_given = True
                return EOF
        await stream.closed
        self._ended(stream.error)
        return LOST if self.close_reason else CLOSED

    def delivered(self, size: int) -> None:
        if self.stream is not None:
            self.stream.delivered(size)

    async def send(self, data: bytes) -> None:
        try:
            await self._stream().write(data)
        except LinkClosed:
            raise ConnectionClosed from None

    def send_eof(self) -> None:
        self._stream().write_eof()

    def finish(self, how: Any, reason: str = "") -> None:
        if self.finished:
            return
        self.finished = True
        self.close_reason = reason
        self.session.data.pop(self.connect_id, None)
        if self.kernel_relay is not None:
            self.kernel_relay.abort()
            return
        link = self.link
        if link.eof_in and link.eof_out:
            link.close()
        else:
            link.abort()


class AgentSession:
    """One agent's Connect stream on this replica."""

    def __init__(
        self,
        hub: Hub,
        node: str,
        agent_id: str,
        remote: str,
        context: grpc.aio.ServicerContext,
    ) -> None:
        self.hub = hub
        self.node = node
        self.agent_id = agent_id
        self.remote = remote
        self.connected_since = datetime.now(UTC)
        self.connections: dict[int, ServerConnection] = {}
        self.data: dict[int, DataConnection] = {}  # connections on their own data connections
        self.draining = False
        self.closed = False
        self._context = context
        self._outbox = Outbox()
        self._dials: dict[int, asyncio.Future[tuple[pb.DialResponse, Any]]] = {}
        self._randoms = itertools.count(random.randrange(1, 1 << 40))
        self.ended = asyncio.Event()
        # The agent's parked data connections (wire's PARK), oldest first, each with
        # the future its listener task waits on: set when a dial takes the connection.
        self.park_key = secrets.token_urlsafe(18)
        self.parked: collections.deque[tuple[Link, asyncio.Future[None]]] = collections.deque()

    # ----------------------------------------------------- packets out

    def send(self, packet: pb.Packet) -> None:
        if self.closed:
            return
        self._outbox.put(packet)

    def send_data(self, connect_id: int, data: bytes) -> None:
        if not self.closed:
            self._outbox.put_data(connect_id, data)

    def send_eof(self, connect_id: int) -> None:
        if not self.closed:
            self._outbox.put_eof(connect_id)

    async def write_loop(self) -> None:
        outbox, context = self._outbox, self._context
        while True:
            packet = await outbox.next()
            if packet is _STREAM_END:
                return
            await context.write(packet)

    # ----------------------------------------------------- packets in

    async def read_loop(self) -> None:
        context = self._context
        connections = self.connections
        while True:
            packet = await context.read()
            if packet is grpc.aio.EOF:
                return
            kind = packet.type
            if kind == pb.DATA:
                data = packet.data
                connection = connections.get(data.connect_id)
                if connection is not None:
                    connection.on_data(data)
            elif kind == pb.WINDOW_UPDATE:
                update = packet.window_update
                connection = connections.get(update.connect_id)
                if connection is not None:
                    connection.send_credit.grant(update.increment)
            elif kind == pb.CLOSE_REQ or kind == pb.CLOSE_RSP:
                connect_id = (
                    packet.close_request.connect_id
                    if kind == pb.CLOSE_REQ
                    else packet.close_response.connect_id
                )
                connection = connections.get(connect_id)
                if connection is not None:
                    connection.finish(
                        CLOSED, packet.close_request.reason if kind == pb.CLOSE_REQ else ""
                    )
            elif kind == pb.DIAL_RSP:
                response = packet.dial_response
                waiter = self._dials.pop(response.random, None)
                if waiter is not None and not waiter.done():
                    # Registered here, before the next packet is read: the agent's
                    # first DATA may follow its DIAL_RSP in the same read burst.
                    connection = None
                    if response.connect_id in connections:
                        # An id already in use would orphan that connection: refuse.
                        response = pb.DialResponse(
                            error="the agent reused a connection id", reason=pb.UNREACHABLE
                        )
                    elif response.connect_id:
                        connection = ServerConnection(
                            self, response.connect_id, response.initial_window
                        )
                        connections[response.connect_id] = connection
                    waiter.set_result((response, connection))
                elif response.connect_id:
                    # The dial timed out here already: the agent must not keep it.
                    self.send(mux.close_request(response.connect_id, "dial timed out"))
            elif kind == pb.DRAIN:
                self.draining = True
                self.hub.changed()

    # ----------------------------------------------------- dials

    def open_connections(self) -> int:
        return len(self.connections) + len(self.data)

    def claim(
        self,
        waiter: asyncio.Future[tuple[pb.DialResponse, Any]],
        link: Link,
        connect_id: int,
        end_to_end: str = "",
    ) -> bool:
        """The agent's data connection for a dial arrived: it carries the connection now.

        `connect_id` is the agent's id for it (from the same counter as its stream's
        connection ids, so one id names one connection in both sides' traces);
        `end_to_end`: the agent is leaving TLS on it (its certificate's fingerprint)."""
        if (
            waiter.done()
            or self.closed
            or connect_id in self.connections
            or connect_id in self.data
        ):
            return False
        connection = DataConnection(self, connect_id, link, end_to_end)
        self.data[connection.connect_id] = connection
        waiter.set_result((pb.DialResponse(connect_id=connection.connect_id), connection))
        return True

    async def dial(
        self,
        address: str,
        timeout: float,
        trace_context: dict[str, str],
        early: bytes = b"",
        replay_safe: bool = False,
        splice_for: str = "",
    ) -> ServerConnection:
        """A connection to `address` through this agent; `Refused` otherwise.

        The result may be a `DataConnection`, which its consumers (the gRPC Dial
        face, the front) use through the same members as a `ServerConnection`
        (typed as one for them). `early`: the dialer's first bytes (a raw dial's
        early data, `waygate.tunnel.early`), on the destination's connection before
        anything else once this returns; none of them sent when it raises `Refused`;
        `early.Unanswered` when they went to the agent and no answer came back.
        `splice_for`: the dialer's certificate fingerprint, for TLS end to end (wire's
        SPLICE), asked of the agent on a parked connection or in the DIAL_REQ; the
        result's `end_to_end` says whether the agent agreed. A parked connection that
        ends at a SPLICE line (an agent from before it drops the line) sends the rest
        of this dial without."""
        if self.draining or self.closed:
            raise Refused(pb.DRAINING, f"the agent for node {self.node} is moving off this replica")
        deadline = time.monotonic() + timeout
        while (link := self._take_parked()) is not None:
            try:
                return await self._dial_parked(
                    link, address, deadline, trace_context, early, replay_safe, splice_for
                )
            except LinkClosed:
                splice_for = ""
                if early and not replay_safe:
                    raise Unanswered(
                        f"node {self.node}'s agent let its data connection go after the dial "
                        f"and {len(early)} bytes of early data were sent, before an answer"
                    ) from None
                if early:
                    # Replay-safe bytes: again, through the stream (DIAL_REQ, the bytes
                    # after the answer), not on the next parked connection: an agent from
                    # before early data drops every such line (it expects four words).
                    break
                # The agent let the connection go (its idle time) before it read the
                # dial: nothing was dialled on it; the next one, or the stream.
                continue
        if self.closed:  # the stream ended while a parked connection was tried
            raise Refused(pb.DRAINING, f"the agent for node {self.node} went away")
        timeout = max(deadline - time.monotonic(), 0.001)
        random_id = next(self._randoms)
        waiter: asyncio.Future[tuple[pb.DialResponse, Any]] = (
            asyncio.get_running_loop().create_future()
        )
        self._dials[random_id] = waiter
        token = ""
        if self.hub.data_address:
            token = secrets.token_urlsafe(18)
            self.hub.tokens[token] = (self, waiter)
        self.send(
            pb.Packet(
                type=pb.DIAL_REQ,
                dial_request=pb.DialRequest(
                    protocol="tcp",
                    address=address,
                    random=random_id,
                    timeout=duration_pb2.Duration(
                        seconds=int(timeout), nanos=int((timeout % 1) * 1e9)
                    ),
                    initial_window=self.hub.window,
                    trace_context=trace_context,
                    data_token=token,
                    splice_for=splice_for if token else "",
                ),
            )
        )
        try:
            response, connection = await asyncio.wait_for(waiter, timeout + ANSWER_SLACK)
        except TimeoutError:
            raise Silent(
                pb.TIMEOUT,
                f"node {self.node} did not answer a dial to {address} within {timeout:g}s",
            ) from None
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                _response, late = waiter.result()
                if late is not None:  # answered as we gave up: the agent must not keep it
                    self.send(mux.close_request(late.connect_id, "dialer went away"))
                    late.finish(CLOSED)
            raise
        finally:
            self._dials.pop(random_id, None)
            if token:
                self.hub.tokens.pop(token, None)
        if connection is None:
            reason = response.reason or pb.UNREACHABLE
            raise Refused(reason, f"node {self.node}: {response.error or 'dial failed'}")
        if connection.finished:
            raise Refused(pb.DRAINING, f"the agent for node {self.node} went away")
        if early:  # the agent answered first here: the bytes go now, ahead of the dialer's
            if isinstance(connection, DataConnection):
                connection.link.write(early)
            else:
                try:
                    await connection.send(early)
                except ConnectionClosed:
                    raise Refused(
                        pb.UNREACHABLE, f"node {self.node}: {address} closed the connection at once"
                    ) from None
        return cast(ServerConnection, connection)

    def park(self, link: Link, taken: asyncio.Future[None]) -> None:
        self.parked.append((link, taken))

    def unpark(self, link: Link) -> None:
        for index, (held, _taken) in enumerate(self.parked):
            if held is link:
                del self.parked[index]
                return

    def _take_parked(self) -> Link | None:
        parked = self.parked
        while parked:
            link, taken = parked.popleft()
            if not taken.done() and not link.is_closing():
                taken.set_result(None)
                return link
        return None

    async def _dial_parked(
        self,
        link: Link,
        address: str,
        deadline: float,
        trace_context: dict[str, str],
        early: bytes = b"",
        replay_safe: bool = False,
        splice_for: str = "",
    ) -> ServerConnection:
        """Dial through a parked data connection: the dial line on it (with the early data,
        in the same write), the agent's answer back (`waygate.tunnel.wire`).
        LinkClosed: it was gone before an answer."""
        left = max(deadline - time.monotonic(), 0.001)
        line = wire.agent_dial(
            address,
            max(int(left * 1000), 1),
            trace_context.get("traceparent", ""),
            len(early),
            splice_for,
        )
        try:
            # The line and the early data in one write (one TLS record, or two).
            link.write_line(line + early if early else line)
            answer = await link.read_line(left + ANSWER_SLACK)
        except TimeoutError:
            link.abort()
            if early and not replay_safe:
                raise Unanswered(
                    f"node {self.node} did not answer a dial with early data within {left:g}s",
                    silent=True,
                ) from None
            raise Silent(
                pb.TIMEOUT, f"node {self.node} did not answer a dial to {address} within {left:g}s"
            ) from None
        except BaseException:
            link.abort()
            raise
        try:
            said = wire.parse_agent_answer(answer, bool(splice_for))
        except wire.Malformed as exc:
            link.abort()
            raise Refused(pb.UNREACHABLE, f"node {self.node}: {exc}") from None
        if isinstance(said, wire.Refusal):
            link.abort()
            raise Refused(
                said.reason or pb.UNREACHABLE, f"node {self.node}: {said.message or 'dial failed'}"
            )
        connect_id = said.connect_id
        if self.closed or connect_id in self.connections or connect_id in self.data:
            link.abort()
            raise Refused(pb.DRAINING, f"the agent for node {self.node} went away")
        agent_certificate = fingerprint(link.get_extra_info("peercert_der")) if said.splice else ""
        connection = DataConnection(self, connect_id, link, agent_certificate)
        self.data[connect_id] = connection
        return cast(ServerConnection, connection)

    def end(self) -> None:
        """The stream is over: every connection and pending dial on it ends now."""
        if self.closed:
            return
        self.closed = True
        while self.parked:
            link, taken = self.parked.popleft()
            taken.cancel()
            link.abort()
        self._outbox.end(_STREAM_END)
        for waiter in self._dials.values():
            if not waiter.done():
                waiter.set_result(
                    (pb.DialResponse(error="the agent went away", reason=pb.DRAINING), None)
                )
        self._dials.clear()
        ending: list[ServerConnection | DataConnection] = [
            *self.connections.values(),
            *self.data.values(),
        ]
        for connection in ending:
            connection.finish(LOST, f"the agent stream of node {self.node} ended")
        self.ended.set()

    def drain(self, grace: float) -> None:
        self.draining = True
        drain = pb.Drain(reason="server shutting down")
        drain.grace.FromNanoseconds(int(grace * 1e9))
        self.send(pb.Packet(type=pb.DRAIN, drain=drain))

    def info(self) -> pb.Agent:
        agent = pb.Agent(
            node=self.node,
            agent_id=self.agent_id,
            remote_address=self.remote,
            open_connections=self.open_connections(),
            draining=self.draining,
        )
        agent.connected_since.FromDatetime(self.connected_since)
        return agent


class Hub:
    """The registry of the agents this replica holds (konnectivity's BackendStorage), and
    what it tells agents and presence about itself. Which agent takes a dial is not its
    business: `selection` (an `AgentSelection` over this registry) decides that."""

    def __init__(
        self,
        server_id: str,
        *,
        replicas: Iterable[str] = (),
        window: int = mux.DEFAULT_WINDOW,
        dial_timeout: float = 10.0,
    ) -> None:
        self.server_id = server_id
        self.replicas = tuple(sorted({server_id, *replicas}))
        self.window = window
        self.dial_timeout = dial_timeout
        self.draining = False
        # node -> its newest agent session (dials try every agent: `selection`)
        self.sessions: dict[str, AgentSession] = {}
        self._by_agent: dict[tuple[str, str], AgentSession] = {}
        self._listeners: list[Callable[[], None]] = []
        # The data listener's address for agents (ServerInfo.data_address); empty: none.
        self.data_address = ""
        # Single-use tokens of dials waiting for the agent's data connection.
        self.tokens: dict[
            str, tuple[AgentSession, asyncio.Future[tuple[pb.DialResponse, Any]]]
        ] = {}
        # park key -> the session whose agent may park data connections with it.
        self.parking: dict[str, AgentSession] = {}
        # The dial rules over this registry, one for every face that dials.
        self.selection = AgentSelection(self)

    def subscribe(self, listener: Callable[[], None]) -> None:
        self._listeners.append(listener)

    def changed(self) -> None:
        for listener in self._listeners:
            listener()

    def nodes(self) -> list[str]:
        """The nodes this replica can dial: those with an agent not moving off it."""
        return sorted({s.node for s in self._by_agent.values() if not s.draining and not s.closed})

    def server_info(self, session: AgentSession) -> pb.Packet:
        return pb.Packet(
            type=pb.SERVER_INFO,
            server_info=pb.ServerInfo(
                server_id=self.server_id,
                replica_ids=self.replicas,
                data_address=self.data_address,
                park_key=session.park_key if self.data_address else "",
            ),
        )

    def set_replicas(self, replicas: Iterable[str]) -> None:
        updated = tuple(sorted({self.server_id, *replicas}))
        if updated == self.replicas:
            return
        self.replicas = updated
        for session in list(self._by_agent.values()):
            session.send(self.server_info(session))

    def register(self, session: AgentSession, held: frozenset[str] | None = None) -> None:
        """Add `session`. An older stream of the same agent instance is refused with
        ALREADY_EXISTS when the agent says it holds this replica (`held`, its
        `mux.HELD_METADATA`; None: an agent that does not say), else it is stale
        (the agent lost it before we noticed) and the new one replaces it."""
        key = (session.node, session.agent_id)
        old = self._by_agent.get(key)
        if old is not None:
            if held is None or self.server_id in held:
                raise errors.AlreadyExists(
                    f"agent {session.agent_id} for node {session.node} already holds a stream "
                    f"to replica {self.server_id}; connect to another replica"
                )
            log.info(
                "an agent's new stream replaces one it lost",
                extra={"node": session.node, "agent_id": session.agent_id},
            )
            old.end()
            self.unregister(old)
        self._by_agent[key] = session
        self.parking[session.park_key] = session
        # The newest agent instance for a node serves new dials (a restarted agent
        # replaces its predecessor, whose stream dies with its process).
        self.sessions[session.node] = session
        self.changed()

    def unregister(self, session: AgentSession) -> None:
        key = (session.node, session.agent_id)
        if self._by_agent.get(key) is session:
            del self._by_agent[key]
        self.parking.pop(session.park_key, None)
        if self.sessions.get(session.node) is session:
            del self.sessions[session.node]
            for other in self._by_agent.values():
                if other.node == session.node:
                    self.sessions[session.node] = other
        self.changed()

    def sessions_all(self) -> list[AgentSession]:
        return list(self._by_agent.values())

    def held(self, node: str) -> list[AgentSession]:
        """The live agent sessions of `node`, oldest first (which one takes a dial is
        `selection.AgentSelection`'s rule, not the registry's)."""
        return [s for s in self._by_agent.values() if s.node == node and not s.closed]

    def drain(self, grace: float) -> None:
        """No new dials; every agent is told to move; open connections get `grace`."""
        self.draining = True
        for session in list(self._by_agent.values()):
            session.drain(grace)
        self.changed()

    def agents(self, node: str = "") -> list[pb.Agent]:
        return [s.info() for s in self._by_agent.values() if not node or s.node == node]


# ---------------------------------------------------------------- gRPC faces


class AgentTunnelServicer(tunnel_pb2_grpc.AgentTunnelServicer):
    def __init__(self, hub: Hub, *, require_certificate: bool = True) -> None:
        self._hub = hub
        self._require_certificate = require_certificate

    def _node_of(self, context: grpc.aio.ServicerContext) -> str:
        certificate = peer_certificate(context)
        if certificate is None and not self._require_certificate:
            for key, value in context.invocation_metadata() or ():
                if key == "waygate-node" and isinstance(value, str) and value:
                    return value
        uris, dns_names = peers.certificate_names(certificate)
        return peers.agent_node(uris, dns_names, certificate)

    async def Connect(
        self, request_iterator: AsyncIterator[pb.Packet], context: grpc.aio.ServicerContext
    ) -> None:
        hub = self._hub
        node = self._node_of(context)
        agent_id = ""
        held: frozenset[str] | None = None
        for key, value in context.invocation_metadata() or ():
            if key == mux.AGENT_ID_METADATA and isinstance(value, str):
                agent_id = value[:64]
            elif key == mux.HELD_METADATA and isinstance(value, str):
                held = frozenset(value[:4096].split(",")) if value else frozenset()
        if not agent_id:
            raise errors.InvalidArgument(f"the {mux.AGENT_ID_METADATA} metadata is required")
        if not wire.is_word(agent_id):  # it is a word of every OK line a dialer reads
            raise errors.InvalidArgument(
                f"the {mux.AGENT_ID_METADATA} metadata must be one word, without spaces"
            )
        if hub.draining:
            raise errors.Unavailable(f"tunnel server {hub.server_id} is draining")
        session = AgentSession(hub, node, agent_id, context.peer(), context)
        hub.register(session, held)
        trace.get_current_span().set_attributes(
            {"waygate.tunnel.node": node, "waygate.tunnel.replica": hub.server_id}
        )
        log.info("agent connected", extra={"node": node, "agent_id": agent_id})
        session.send(hub.server_info(session))
        writer = asyncio.ensure_future(session.write_loop())
        reader = asyncio.ensure_future(session.read_loop())
        try:
            await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            session.end()
            hub.unregister(session)
            for task in (reader, writer):
                task.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            log.info("agent disconnected", extra={"node": node, "agent_id": agent_id})


class TunnelServicer(tunnel_pb2_grpc.TunnelServicer):
    def __init__(
        self,
        hub: Hub,
        *,
        dialers: tuple[str, ...] = (),
        check_dialers: bool = True,
    ) -> None:
        self._hub = hub
        self._dialers = dialers
        self._check_dialers = check_dialers

    def _authorize(self, context: grpc.aio.ServicerContext) -> None:
        if not self._check_dialers:
            return
        uris, dns_names = peer_certificate_names(context)
        identities = (*uris, *dns_names)
        if any(matches(p, i) for p in self._dialers for i in identities):
            return
        shown = identities[0] if identities else "a client without a certificate"
        raise Refused(
            pb.NOT_ALLOWED,
            f"{errors.excerpt(shown)} is not an allowed dialer of this tunnel server",
        )

    async def Dial(
        self, request_iterator: AsyncIterator[pb.DialFrame], context: grpc.aio.ServicerContext
    ) -> None:
        hub = self._hub
        span = trace.get_current_span()
        try:
            # The target is read before the policy is applied, so a refusal never
            # races the dialer's first write (an unread frame turns the refusal into
            # a transport error on the client).
            first = await asyncio.wait_for(context.read(), hub.dial_timeout)
            self._authorize(context)
            if first is grpc.aio.EOF or first.WhichOneof("frame") != "target":
                raise Refused(pb.INVALID, "the first frame of a Dial must be a target")
            target = first.target
            if not target.node or not 0 < target.port < 65536:
                raise Refused(pb.INVALID, "a dial target needs a node and a port 1..65535")
            address = wire.format_address(target.host or "127.0.0.1", target.port)
            timeout = hub.dial_timeout
            if target.HasField("connect_timeout"):
                asked = target.connect_timeout.ToNanoseconds() / 1e9
                if asked > 0:
                    timeout = min(asked, timeout)
            span.set_attributes(
                {
                    "waygate.tunnel.node": target.node,
                    "waygate.tunnel.replica": hub.server_id,
                    "waygate.tunnel.address": address,
                }
            )
            connection = await hub.selection.dial(target.node, address, timeout)
            session = connection.session
        except Refused as refused:
            await context.write(
                pb.DialFrame(
                    refused=pb.DialRefused(
                        reason=refused.reason,
                        message=str(refused),
                        server_id=hub.server_id,
                    )
                )
            )
            raise
        except TimeoutError:
            raise Refused(pb.INVALID, "no dial target within the dial timeout") from None
        reader: asyncio.Future[None] | None = None
        # Everything from here is inside the try: a dialer that cancels while its
        # DialAccepted is written must still release the agent's connection.
        try:
            span.set_attribute("waygate.tunnel.connection_id", connection.connect_id)
            await context.write(
                pb.DialFrame(
                    accepted=pb.DialAccepted(
                        server_id=hub.server_id,
                        agent_id=session.agent_id,
                        connect_id=connection.connect_id,
                    )
                )
            )
            reader = asyncio.ensure_future(_from_dialer(connection, context))
            how = await _to_dialer(connection, context)
        finally:
            if not connection.finished:
                session.send(mux.close_request(connection.connect_id, "dialer went away"))
                connection.finish(CLOSED)
            if reader is not None:
                reader.cancel()
                await asyncio.gather(reader, return_exceptions=True)
        if how is LOST or connection.close_reason:
            raise errors.Unavailable(
                f"tunnelled connection to {address} on node {target.node} ended: "
                f"{connection.close_reason or 'lost'}"
            )

    async def Describe(
        self, request: pb.DescribeRequest, context: grpc.aio.ServicerContext
    ) -> pb.ServerDescription:
        # Not behind the dialer policy: where the data listener is says nothing the
        # address does not, and a refused dialer then hears why from the listener.
        return pb.ServerDescription(
            server_id=self._hub.server_id, data_address=self._hub.data_address
        )

    async def ListAgents(
        self, request: pb.ListAgentsRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListAgentsResponse:
        self._authorize(context)
        return pb.ListAgentsResponse(
            server_id=self._hub.server_id, agents=self._hub.agents(request.node)
        )


async def _from_dialer(connection: ServerConnection, context: grpc.aio.ServicerContext) -> None:
    """Dialer -> agent, credit permitting; ends at the dialer's half-close or the connection's end."""
    while not connection.finished:
        frame = await context.read()
        if frame is grpc.aio.EOF:
            connection.send_eof()
            return
        which = frame.WhichOneof("frame")
        if which == "data":
            try:
                await connection.send(frame.data)
            except ConnectionClosed:
                return
        elif which == "eof":
            connection.send_eof()
            return


async def _to_dialer(connection: ServerConnection, context: grpc.aio.ServicerContext) -> object:
    """Agent -> dialer until the connection ends; returns how it ended (CLOSED or LOST)."""
    eof_frame = pb.DialFrame(eof=True)
    while True:
        item = await connection.next_for_dialer()
        if item is CLOSED or item is LOST:
            return item
        if item is EOF:
            await context.write(eof_frame)
            continue
        await context.write(pb.DialFrame(data=item))
        connection.delivered(len(item))
