"""The tunnel agent: holds one Connect stream to every server replica and dials for them.

- `Agent`: reaches the servers through one address (a load balancer, a node
  port) and keeps connecting until it holds a stream to every replica id the
  servers report in SERVER_INFO, no more: a stream that lands on a replica it
  already holds is closed at once (and the server closes a second stream
  from the same agent instance itself). Attempts back off exponentially with
  jitter; a new replica gained resets the backoff. Each attempt opens its own
  channel with a local subchannel pool, so it is a new TCP connection the
  balancer may send elsewhere.
- `AgentStream`: one Connect stream: a writer task drains the outbox, the
  caller's task reads packets and dispatches them. The stream itself is a
  `PacketStream` from a `Connector` (over gRPC: `waygate.tunnel.agent_grpc`,
  the boundary): this module never imports grpc.
- `AgentConnection`: one dialled TCP connection, an asyncio Protocol (no
  task per connection or per chunk): it sends only while it holds credit and
  pauses reading when it runs out (`waygate.core.flow`, the one flow-control
  helper); it grants the server more (`mux.ReceiveWindow`, the bookkeeping the
  server keeps too) once bytes are written and the socket's buffer is below
  its high-water mark.

Dials are checked against the allow-list (`waygate.tunnel.allow`) after
resolution; a refused destination answers DIAL_RSP with NOT_ALLOWED.
A dial carries the caller's W3C trace context: the agent's span is its child.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import secrets
import select
import socket
import ssl
import time
from collections.abc import Callable, Iterable
from typing import Any, Protocol

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from waygate.core import tracing
from waygate.core.backoff import Backoff
from waygate.core.flow import FlowControl
from waygate.tunnel import mux, wire
from waygate.tunnel.allow import AllowList
from waygate.tunnel.mux import MAX_CHUNK, Outbox, ReceiveWindow, Refused
from waygate.tunnel.relay import (
    Link,
    LinkClosed,
    SocketLink,
    end_to_end_context,
    open_end_to_end,
    open_link,
    plain_link,
    splice,
    split_address,
)
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.warmpool import WarmPool

log = logging.getLogger(__name__)


class StreamFailed(Exception):
    """The Connect stream failed; the message says how (the status and its details)."""


class PacketStream(Protocol):
    """One Connect stream to a server replica, as the pump uses it (gRPC: `agent_grpc`)."""

    async def read(self) -> pb.Packet | None:
        """The next packet; None once the server ended the stream; StreamFailed."""
        ...

    async def write(self, packet: pb.Packet) -> None: ...

    async def done_writing(self) -> None: ...

    async def close(self) -> None:
        """End the stream and release what it holds, whatever its state."""
        ...


class Connector(Protocol):
    """Opens Connect streams through the servers' one address."""

    def open(self, agent_id: str, node: str, held: Iterable[str] = ()) -> PacketStream:
        """A new stream; `held`: the replica ids this agent holds live streams to."""
        ...


_STREAM_END = pb.Packet()
# Why a destination socket's reading is paused (a `FlowControl` reason of its own):
# bytes read wait for the dial's answer or for the server's credit.
_HELD = 32
_HALF_CLOSE = pb.Packet()  # everything before it written: half-close the stream


# How long past its idle time a parked connection's wait lasts (the pool closes it first).
PARK_SLACK = 5.0


def _literal_address(host: str, port: int) -> list[Any] | None:
    """getaddrinfo's answer for an IP literal, without its thread-pool round trip."""
    for family in (socket.AF_INET, socket.AF_INET6):
        try:
            socket.inet_pton(family, host)
        except OSError:
            continue
        sockaddr = (host, port) if family == socket.AF_INET else (host, port, 0, 0)
        return [(family, socket.SOCK_STREAM, socket.IPPROTO_TCP, "", sockaddr)]
    return None


async def connect_socket(sock: socket.socket, sockaddr: Any, timeout: float) -> None:
    """Connect the non-blocking `sock` to `sockaddr` within `timeout` (TimeoutError; OSError
    when refused or unreachable).

    `loop.sock_connect` always waits a loop turn for writability (uvloop's also
    resolves the address again), though a loopback connect (an agent beside its
    services) has finished by the time connect() returns EINPROGRESS; polling
    the socket once without waiting finds that out. Elsewhere: wait for it to
    become writable, as sock_connect does.
    """
    error = sock.connect_ex(sockaddr)
    if error in (errno.EINPROGRESS, errno.EINTR):
        poller = select.poll()
        poller.register(sock, select.POLLOUT)
        if not poller.poll(0):
            loop = asyncio.get_running_loop()
            writable = loop.create_future()
            loop.add_writer(sock, _set_done, writable)
            try:
                async with asyncio.timeout(timeout):
                    await writable
            finally:
                loop.remove_writer(sock)
        error = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if error:
        raise OSError(error, os.strerror(error))


def _set_done(future: asyncio.Future[None]) -> None:
    if not future.done():
        future.set_result(None)


class _OnDataConnection:
    """A dial carried on a data connection: no DIAL_RSP (the server learns from the DATA line)."""

    __slots__ = ("connect_id",)

    def __init__(self, connect_id: int) -> None:
        self.connect_id = connect_id


class AgentConnection(asyncio.Protocol):
    """One TCP connection the agent dialled, multiplexed on an `AgentStream`."""

    def __init__(
        self, stream: AgentStream, connect_id: int, send_window: int, recv_window: int
    ) -> None:
        self.stream = stream
        self.connect_id = connect_id
        self.receive = ReceiveWindow(recv_window)  # what the server may send before a grant
        self.credit = send_window  # what we may still send the server
        self.pending: bytes | None = None  # read, waiting for the start or for credit
        self.started = False  # DIAL_RSP is queued: DATA may follow
        self.eof_pending = False
        self.local_eof = False  # the destination half-closed
        self.remote_eof = False  # the dialer half-closed
        self.closed_by_server = False
        self.transport: asyncio.Transport | None = None
        # Reading pauses while bytes are held (`_HELD`); the socket's write buffer
        # above its high-water mark holds back the server's credit (`write_paused`).
        self.flow: FlowControl | None = None

    # ----------------------------------------------------- destination side

    def connection_made(self, transport: Any) -> None:
        # uvloop's transports are not asyncio.Transport subclasses: no isinstance check.
        self.transport = transport
        transport.set_write_buffer_limits(high=self.receive.window >> 1)
        # Nothing goes to the server before DIAL_RSP is queued (`start`): DATA must
        # never reach it ahead of the connection's id. Asking the loop to pause is
        # not enough (uvloop starts reading after connection_made), so bytes that
        # arrive early are held in `pending` and reading pauses after one read.
        self.flow = FlowControl(transport)
        self._hold()

    def _hold(self) -> None:
        """Stop reading the destination while bytes wait (for the start or for credit)."""
        assert self.flow is not None
        self.flow.pause(_HELD)
        # Again even when already held: uvloop may have started reading after
        # connection_made, whatever was asked there.
        self.flow.transport.pause_reading()

    def start(self) -> None:
        self.started = True
        self._flush()

    def data_received(self, data: bytes) -> None:
        if self.pending is not None or not self.started:
            self.pending = data if self.pending is None else self.pending + data
            self._hold()
            return
        size = len(data)
        if size <= self.credit and size <= MAX_CHUNK:
            self.credit -= size
            self.stream.send_data(self.connect_id, data)
            return
        self._send_what_credit_allows(data)

    def _send_what_credit_allows(self, data: bytes) -> None:
        credit = self.credit
        if credit <= 0:
            # Nothing can go: hold the chunk as it is (no copy) until credit comes.
            self.pending = data
            self._hold()
            return
        view = memoryview(data)
        send, connect_id = self.stream.send_data, self.connect_id
        while view and credit > 0:
            chunk = bytes(view[: min(MAX_CHUNK, credit)])
            credit -= len(chunk)
            send(connect_id, chunk)
            view = view[len(chunk) :]
        self.credit = credit
        if view:
            self.pending = bytes(view)
            self._hold()

    def _flush(self) -> None:
        """Send what waited (for the start or for credit); then read again, or pass on EOF."""
        pending = self.pending
        if pending is not None:
            self.pending = None
            self._send_what_credit_allows(pending)
            if self.pending is not None:
                return  # still short of credit: the next WINDOW_UPDATE flushes again
        if self.eof_pending:
            self.eof_pending = False
            self.stream.send_eof(self.connect_id)
            self._close_if_done()
        elif self.flow is not None:
            self.flow.resume(_HELD)  # never resumes a closing transport

    def eof_received(self) -> bool:
        self.local_eof = True
        if self.pending is not None or not self.started:
            self.eof_pending = True
        else:
            self.stream.send_eof(self.connect_id)
            self._close_if_done()
        return True  # keep the write side open: TCP half-close

    def pause_writing(self) -> None:
        if self.flow is not None:
            self.flow.pause_writing()

    def resume_writing(self) -> None:
        if self.flow is not None:
            self.flow.resume_writing()
        grant = self.receive.owed_now()
        if grant:
            self.stream.send(mux.window_update(self.connect_id, grant))

    def connection_lost(self, exc: Exception | None) -> None:
        self.stream.connections.pop(self.connect_id, None)
        # Before `start` the server does not know this id yet: the dial is refused instead.
        if not self.closed_by_server and self.started:
            self.stream.send(mux.close_request(self.connect_id, str(exc) if exc else ""))
        self.stream.leave_if_drained()

    def _close_if_done(self) -> None:
        if self.local_eof and self.remote_eof and self.transport is not None:
            self.transport.close()

    # ----------------------------------------------------- server side

    def on_data(self, data: pb.Data) -> None:
        transport = self.transport
        assert transport is not None
        payload = data.data
        if payload:
            size = len(payload)
            if not self.receive.received(size):
                self.closed_by_server = True
                self.stream.send(mux.close_request(self.connect_id, "flow control window exceeded"))
                transport.abort()
                return
            transport.write(payload)
            # Granted once written and the socket's buffer is below its high-water mark.
            flow = self.flow
            assert flow is not None  # set with the transport
            grant = self.receive.consumed(size, hold=flow.write_paused)
            if grant:
                self.stream.send(mux.window_update(self.connect_id, grant))
        if data.eof:
            self.remote_eof = True
            if transport.can_write_eof():
                transport.write_eof()
            self._close_if_done()

    def on_window_update(self, increment: int) -> None:
        self.credit += increment
        if self.pending is not None and self.started:
            self._flush()

    def on_close(self) -> None:
        self.closed_by_server = True
        if self.transport is not None:
            if self.local_eof and self.remote_eof:
                # Both sides ended cleanly: deliver what is still buffered, then close.
                self.transport.close()
            else:
                self.transport.abort()


class DataPool(WarmPool):
    """Idle data connections to one server replica, TLS done, so a dial needs no handshake.

    A `WarmPool` of `agent.pool_size`, each closed after `agent.pool_idle` (the
    server drops unclaimed ones later than that, and a renewed certificate
    reaches new connections only), always kept full. When the replica gave
    the stream a park key (`ServerInfo.park_key`), every pooled connection is
    parked on the replica ("PARK <key>"): the replica writes a dial on it
    itself (`AgentStream._serve_parked`), with no round trip on the Connect
    stream; a dial that comes as DIAL_REQ (the replica had no parked
    connection left) then opens a new connection. Without a key the pool's
    connections wait here for DIAL_REQs that carry a token. A connection that
    a load balancer sent to another replica goes to that replica's pool when
    it has room, else it is closed.
    """

    def __init__(self, stream: AgentStream, host: str, port: int, park_key: str) -> None:
        agent = stream.agent
        super().__init__(
            self._open_pooled,
            size=agent.pool_size,
            idle=agent.pool_idle,
            on_failure=self._failed,
        )
        self.stream = stream
        self.agent = agent
        self.host, self.port = host, port
        self.park_key = park_key
        self.parked: set[asyncio.Task[None]] = set()

    def _failed(self, exc: Exception) -> None:
        log.warning(
            "cannot open a data connection to the tunnel server",
            extra={"server_id": self.stream.server_id, "error": str(exc)},
        )

    async def _open_pooled(self) -> Link | None:
        link = await self.open()
        if link is not None:
            self._park(link)
        return link

    def _park(self, link: Link) -> None:
        if not self.park_key:
            return
        link.write_line(wire.park(self.park_key))
        task = asyncio.ensure_future(self.stream._serve_parked(link, self))
        self.parked.add(task)
        task.add_done_callback(self.parked.discard)

    def adopt(self, link: Link) -> bool:
        """A connection that reached this replica while another pool was filling."""
        if not self.add(link):
            return False
        self._park(link)
        return True

    async def open(self) -> Link | None:
        """A new data connection to this replica (None: it reached another one, which kept it)."""
        agent = self.agent
        link = await open_link(
            self.host,
            self.port,
            agent.data_context(),
            server_hostname=agent.data_server_name(self.host),
            timeout=agent.dial_timeout,
        )
        try:
            server_id = wire.parse_greeting(await link.read_line(agent.dial_timeout))
        except wire.Malformed as exc:
            link.abort()
            raise LinkClosed(str(exc)) from None
        except BaseException:
            link.abort()
            raise
        if server_id == self.stream.server_id:
            return link
        other = agent.streams.get(server_id)
        if other is not None and other.pool is not None and other.pool.adopt(link):
            return None
        link.abort()
        raise LinkClosed(f"the data connection reached replica {server_id}, not the one meant")

    async def link_for_dial(self, timeout: float) -> Link:
        """A connection for a DIAL_REQ's token: an idle one (not parked), or a new one."""
        link = None if self.park_key else self.take()
        if link is not None:
            return link
        async with asyncio.timeout(timeout):
            while True:
                opened = await self.open()
                if opened is not None:
                    return opened

    async def aclose(self) -> None:
        self.close()
        for task in list(self.parked):
            task.cancel()
        await asyncio.gather(*self.parked, return_exceptions=True)
        await self.wait_closed()


class AgentStream:
    """One Connect stream to one server replica."""

    def __init__(self, agent: Agent, io: PacketStream) -> None:
        self.agent = agent
        self.window = agent.window
        self.connections: dict[int, AgentConnection] = {}
        self.server_id = ""
        self.draining = False
        self._io = io
        self._outbox = Outbox()
        self._ids = itertools.count(1)
        self._dials: set[asyncio.Task[None]] = set()
        self._closed = False
        self._leaving = False
        self.pool: DataPool | None = None  # once the replica names its data listener
        self.relays: dict[asyncio.Future[None], tuple[Link, Any]] = {}  # data connections

    def send(self, packet: pb.Packet) -> None:
        if self._closed:
            return
        self._outbox.put(packet)

    def send_data(self, connect_id: int, data: bytes) -> None:
        if not self._closed:
            self._outbox.put_data(connect_id, data)

    def send_eof(self, connect_id: int) -> None:
        if not self._closed:
            self._outbox.put_eof(connect_id)

    async def write_loop(self) -> None:
        outbox, io = self._outbox, self._io
        while True:
            packet = await outbox.next()
            if packet is _STREAM_END:
                return
            if packet is _HALF_CLOSE:
                # The server reads our CLOSE_REQs, then EOF, and ends the stream;
                # the reader sees that end.
                await io.done_writing()
                return
            await io.write(packet)

    async def read_loop(self) -> None:
        io, connections = self._io, self.connections
        while True:
            packet = await io.read()
            if packet is None:
                return
            kind = packet.type
            if kind == pb.DATA:
                connection = connections.get(packet.data.connect_id)
                if connection is not None:
                    connection.on_data(packet.data)
            elif kind == pb.WINDOW_UPDATE:
                connection = connections.get(packet.window_update.connect_id)
                if connection is not None:
                    connection.on_window_update(packet.window_update.increment)
            elif kind == pb.CLOSE_REQ:
                connection = connections.pop(packet.close_request.connect_id, None)
                if connection is not None:
                    connection.on_close()
            elif kind == pb.DIAL_REQ:
                task = asyncio.ensure_future(self._dial(packet.dial_request))
                self._dials.add(task)
                task.add_done_callback(self._dials.discard)
            elif kind == pb.SERVER_INFO:
                self.agent.learn_replicas(packet.server_info.replica_ids)
                self.learn_data_address(
                    packet.server_info.data_address, packet.server_info.park_key
                )
            elif kind == pb.DRAIN:
                self.draining = True
                log.info(
                    "server replica is draining; connecting to the others",
                    extra={"server_id": self.server_id},
                )
                self.agent.stream_draining(self)
                self.leave_if_drained()

    def _span(self, parent: Any, address: str) -> Any:
        """The agent's span of one dial, a child of the dialer's trace context."""
        span = self.agent.tracer.start_as_current_span(
            "waygate.tunnel.agent/Dial",
            context=parent,
            kind=SpanKind.CLIENT,
            record_exception=False,
            set_status_on_exception=False,
        )
        return span

    def _parked_span(
        self, traceparent: str, address: str, started: int, connect_id: int = 0
    ) -> Any:
        """The span of a dial on a parked connection, made once its answer is out (a span
        costs tens of microseconds the dial need not wait for); it starts at `started`.
        `connect_id`: the connection's, once connected (0: refused)."""
        parent = (
            tracing.extract_context((("traceparent", traceparent),)) if traceparent != "-" else None
        )
        attributes: dict[str, Any] = {
            "waygate.tunnel.node": self.agent.node,
            "waygate.tunnel.replica": self.server_id,
            "waygate.tunnel.address": address,
            "waygate.tunnel.data_connection": True,
        }
        if connect_id:
            attributes["waygate.tunnel.connection_id"] = connect_id
        return self.agent.tracer.start_span(
            "waygate.tunnel.agent/Dial",
            context=parent,
            kind=SpanKind.CLIENT,
            start_time=started,
            attributes=attributes,
        )

    async def _dial(self, request: pb.DialRequest) -> None:
        parent = tracing.extract_context(request.trace_context.items())
        with self._span(parent, request.address) as span:
            span.set_attribute("waygate.tunnel.node", self.agent.node)
            span.set_attribute("waygate.tunnel.replica", self.server_id)
            span.set_attribute("waygate.tunnel.address", request.address)
            try:
                response = await self._connect(request)
            except Exception as exc:  # a bug must cost this dial, never the stream
                log.exception("dial failed unexpectedly", extra={"address": request.address})
                response = pb.DialResponse(
                    random=request.random, error=f"agent error: {exc!r}", reason=pb.UNREACHABLE
                )
            if isinstance(response, _OnDataConnection):
                span.set_attribute("waygate.tunnel.connection_id", response.connect_id)
                span.set_attribute("waygate.tunnel.data_connection", True)
                return
            if response.connect_id:
                span.set_attribute("waygate.tunnel.connection_id", response.connect_id)
            else:
                span.set_status(Status(StatusCode.ERROR, response.error))
                span.set_attribute("waygate.tunnel.refusal", mux.reason_name(response.reason))
        if response.connect_id and response.connect_id not in self.connections:
            # The destination went away before we answered (connection_lost ran): a
            # successful answer would leave the server a connection nobody closes.
            response = pb.DialResponse(
                random=request.random,
                error=f"{request.address} closed the connection at once",
                reason=pb.UNREACHABLE,
            )
        self.send(pb.Packet(type=pb.DIAL_RSP, dial_response=response))
        connection = self.connections.get(response.connect_id)
        if connection is not None:
            connection.start()

    async def _serve_parked(self, link: Link, pool: DataPool) -> None:
        """A parked data connection: wait for the replica's dial on it, then carry it.

        The replica writes a DIAL line (with early data) or a SPLICE line (TLS end to
        end), answered OK or REFUSED (`waygate.tunnel.wire` has the grammar); after an
        OK that says SPLICE both sides leave this TLS session and the dialer opens its
        own with this agent, presenting the certificate the replica authorized
        (`_answer_parked`). The pool closes an unused one after its idle time, which
        ends this wait too.
        """
        try:
            line = await link.read_line(self.agent.pool_idle + PARK_SLACK)
        except (LinkClosed, TimeoutError):
            pool.discard(link)
            link.abort()
            return
        # Out of the pool at once (its idle time no longer applies); the refill's task
        # is woken REFILL_DELAY later (a timer, not a wake-up on this dial's path).
        pool.discard(link)
        await self._answer_parked(link, line)

    async def _answer_parked(self, link: Link, line: bytes) -> None:
        started = time.time_ns()
        try:
            dial = wire.parse_agent_dial(line)
        except wire.Malformed as exc:
            # Not answered: the replica treats a dropped line as a dial this agent cannot
            # read (an older agent's behaviour; `wire`) and carries it on the stream.
            log.warning("tunnel server wrote a malformed dial", extra={"error": str(exc)})
            link.abort()
            return
        address, traceparent = dial.address, dial.traceparent
        spliced = bool(dial.dialer_sha256)
        # TLS end to end only where this link can leave TLS and has a certificate to
        # present inside; otherwise a plain OK and the replica relays as for DIAL.
        inner = (
            end_to_end_context(link.context, server_side=True)
            if spliced and isinstance(link, SocketLink)
            else None
        )
        timeout = dial.timeout_ms / 1000 or self.agent.dial_timeout
        early = b""
        try:
            if dial.early_length:  # early data (waygate.tunnel.early): first
                early = await link.read_exact(dial.early_length, timeout)
            connect_id, sock = await self._open_destination(address, timeout)
        except asyncio.CancelledError:
            link.abort()  # the stream is closing: the replica hears it at once
            raise
        except (LinkClosed, TimeoutError) as exc:
            # The dial's own bytes never came whole: no destination was dialled.
            log.warning("tunnel server wrote a malformed dial", extra={"error": str(exc)})
            link.abort()
            return
        except Exception as exc:
            span = self._parked_span(traceparent, address, started)
            refused = exc if isinstance(exc, Refused) else None
            if refused is None:  # a bug must cost this dial, never the stream
                with trace.use_span(span):
                    log.exception("dial failed unexpectedly", extra={"address": address})
                refused = Refused(pb.UNREACHABLE, f"agent error: {exc!r}")
            link.write_line(wire.refused(refused.reason, str(refused)))
            link.close()
            span.set_status(Status(StatusCode.ERROR, str(refused)))
            span.set_attribute("waygate.tunnel.refusal", mux.reason_name(refused.reason))
            span.end()
            return
        if early:
            if link.is_closing() or link.eof_in:
                # The replica gave up on this dial (its timeout) and may have told the
                # dialer so: the early data must not reach the destination now.
                sock.close()
                link.abort()
                return
            try:
                sent = sock.send(early)  # a new socket's buffer takes 16 KiB at once
            except BlockingIOError:
                sent = 0
            except OSError as exc:
                sock.close()
                link.write_line(wire.refused(pb.UNREACHABLE, f"writing to {address}: {exc}"))
                link.close()
                return
            early = early[sent:]  # what the socket did not take: the transport's first write
        if inner is not None:
            link.write_line(wire.agent_accepted(connect_id, splice=True))
            dialers = await _end_to_end(link, inner, dial.dialer_sha256, sock, timeout)
            if dialers is None:
                return
            link = dialers
        else:
            # The answer before the transport is made: the replica (and the dialer) hear
            # it one loop turn sooner; what the destination sends meanwhile is held.
            link.write_line(wire.agent_accepted(connect_id))
        try:
            await self._relay(link, sock, early=early)
        finally:
            self._parked_span(traceparent, address, started, connect_id).end()

    def learn_data_address(self, address: str, park_key: str = "") -> None:
        if self.pool is not None or not address or not self.agent.data_connections:
            return
        try:
            host, port = split_address(address if not address.startswith(":") else "x" + address)
        except ValueError:
            log.warning("tunnel server named a malformed data address", extra={"address": address})
            return
        if address.startswith(":"):
            host = split_address(self.agent.server_address)[0]
        self.pool = DataPool(self, host, port, park_key if self.agent.park else "")
        if not self._closed:
            self.pool.start()

    async def _on_data_connection(
        self, request: pb.DialRequest, sock: socket.socket, token: str, connect_id: int
    ) -> bool:
        """Carry the dial on a data connection: True when it does (the server learns of
        the success from the DATA line); False: answer on the stream instead."""
        pool = self.pool
        if pool is None:
            return False
        timeout = request.timeout.ToNanoseconds() / 1e9 or self.agent.dial_timeout
        try:
            link = await pool.link_for_dial(timeout)
        except (OSError, LinkClosed, TimeoutError, ValueError) as exc:
            log.warning(
                "no data connection for a dial; carrying it on the stream",
                extra={"server_id": self.server_id, "error": str(exc)},
            )
            return False
        inner = (
            end_to_end_context(link.context, server_side=True)
            if request.splice_for and isinstance(link, SocketLink)
            else None
        )
        if inner is None:
            await self._relay(link, sock, wire.data(token, connect_id))
            return True
        # TLS end to end (the DIAL_REQ's splice_for): as a parked connection's SPLICE.
        link.write_line(wire.data(token, connect_id, splice=True))
        dialers = await _end_to_end(link, inner, request.splice_for, sock, timeout)
        if dialers is not None:
            await self._relay(dialers, sock)
        return True

    async def _relay(
        self,
        link: Link,
        sock: socket.socket,
        line: bytes = b"",
        early: bytes = b"",
    ) -> bool:
        """Answer `line` on `link` (empty: the answer is out already) and splice it to the
        destination socket `sock` (both are aborted instead when the stream closed
        meanwhile); `early`: what of the dial's early data is still to be written to
        the destination, ahead of everything else."""
        try:
            transport = plain_link(sock)  # (its own socket: the relay's fewest copies)
        except OSError:
            link.close()
            sock.close()
            raise
        if self._closed:
            link.abort()
            transport.abort()
            return False
        if early:
            transport.write(early)
        # The line goes before the splice: a destination that speaks first (held by
        # `Pending`) must not get its bytes ahead of it.
        if line:
            link.write_line(line)
        done = splice(link, transport)
        self.relays[done] = (link, transport)
        done.add_done_callback(self._relay_done)
        return True

    def _relay_done(self, done: asyncio.Future[None]) -> None:
        self.relays.pop(done, None)
        self.leave_if_drained()

    async def _open_destination(self, address: str, timeout: float) -> tuple[int, socket.socket]:
        """Connect to `address` if the allow-list lets us: (connection id, socket);
        `Refused` otherwise."""
        try:
            host, port = wire.parse_address(address)
        except wire.Malformed as exc:
            raise Refused(pb.INVALID, str(exc)) from None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            infos = _literal_address(host, port)
            if infos is None:
                async with asyncio.timeout(timeout):
                    infos = await loop.getaddrinfo(host, port, type=socket.SOCK_STREAM)
            allowed = [i for i in infos if self.agent.allow.allows(str(i[4][0]), port)]
            if not allowed:
                raise Refused(
                    pb.NOT_ALLOWED, f"destination {address} is not in the agent's allow-list"
                )
            connect_id = next(self._ids)
            family, _type, proto, _name, sockaddr = allowed[0]
            sock = socket.socket(family, socket.SOCK_STREAM, proto)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                await connect_socket(sock, sockaddr, deadline - loop.time())
            except BaseException:
                sock.close()
                raise
        except TimeoutError:
            raise Refused(pb.TIMEOUT, f"connecting to {address} timed out") from None
        except OSError as exc:
            raise Refused(
                pb.UNREACHABLE,
                f"connecting to {address}: "
                + (os.strerror(exc.errno) if exc.errno else str(exc)).lower(),
            ) from None
        if self._closed:
            sock.close()
            raise Refused(pb.DRAINING, "stream closed")
        return connect_id, sock

    async def _connect(self, request: pb.DialRequest) -> pb.DialResponse | _OnDataConnection:
        timeout = request.timeout.ToNanoseconds() / 1e9 or self.agent.dial_timeout
        try:
            connect_id, sock = await self._open_destination(request.address, timeout)
        except Refused as refused:
            return pb.DialResponse(random=request.random, error=str(refused), reason=refused.reason)
        if request.data_token and await self._on_data_connection(
            request, sock, request.data_token, connect_id
        ):
            return _OnDataConnection(connect_id)
        send_window = request.initial_window or self.window
        # The server caps what it sends at its own window, and we grant once owed
        # half of ours: a window larger than the server's would never be granted
        # (the connection stalls). Use and advertise the smaller of the two.
        recv_window = min(self.window, send_window)
        connection = AgentConnection(self, connect_id, send_window, recv_window)
        self.connections[connect_id] = connection
        try:
            await asyncio.get_running_loop().connect_accepted_socket(lambda: connection, sock)
        except OSError as exc:
            self.connections.pop(connect_id, None)
            sock.close()
            return pb.DialResponse(random=request.random, error=str(exc), reason=pb.UNREACHABLE)
        return pb.DialResponse(
            random=request.random, connect_id=connect_id, initial_window=recv_window
        )

    def leave_if_drained(self) -> None:
        """A draining replica's stream ends once its last connection has: the server
        need not wait out its grace for an idle agent stream."""
        if (
            self.draining
            and not self.connections
            and not self.relays
            and not self._dials
            and not self._leaving
        ):
            self._leaving = True
            self.send(_HALF_CLOSE)

    async def close(self) -> None:
        """End the stream: every connection on it is aborted, pending dials cancelled."""
        self._closed = True
        self._outbox.end(_STREAM_END)
        for task in list(self._dials):
            task.cancel()
        await asyncio.gather(*self._dials, return_exceptions=True)
        for connection in list(self.connections.values()):
            connection.on_close()
        self.connections.clear()
        for link, transport in list(self.relays.values()):
            link.abort()
            transport.abort()
        self.relays.clear()
        if self.pool is not None:
            await self.pool.aclose()
        await self._io.close()


async def _end_to_end(
    link: Link, inner: ssl.SSLContext, pin: str, destination: socket.socket, timeout: float
) -> Link | None:
    """After the answer that says SPLICE: leave the replica's TLS on `link` and serve the
    dialer's session through it, requiring the certificate the replica authorized
    (`pin`); None when that failed (`destination`, connected already, is closed then:
    nothing reached it)."""
    try:
        return await open_end_to_end(
            await link.step_out(timeout), inner, server_side=True, pin=pin, timeout=timeout
        )
    except (LinkClosed, TimeoutError, OSError) as exc:
        log.warning("TLS end to end with a dialer failed", extra={"error": str(exc)})
        destination.close()
        return None
    except BaseException:
        destination.close()
        raise


class Agent:
    """Holds a stream to every server replica; reconnects with backoff and jitter."""

    def __init__(
        self,
        *,
        node: str,
        server_address: str,
        connector: Connector,
        allow: AllowList,
        server_name: str | None = None,
        window: int = mux.DEFAULT_WINDOW,
        dial_timeout: float = 10.0,
        backoff: Backoff | None = None,
        agent_id: str | None = None,
        ssl_context: Callable[[], ssl.SSLContext | None] | None = None,
        data_connections: bool = True,
        pool_size: int = 4,
        pool_idle: float = 60.0,
        park: bool = True,
    ) -> None:
        self.node = node
        self.server_address = server_address
        self.allow = allow
        self.window = window
        self.dial_timeout = dial_timeout
        self.agent_id = agent_id or secrets.token_hex(8)
        self._connector = connector
        self._server_name = server_name
        # Data connections (relay.py): TLS from `ssl_context` (None: plaintext, as the
        # stream without credentials), a pool of `pool_size` per replica.
        self._ssl_context = ssl_context or (lambda: None)
        self.data_connections = data_connections
        self.pool_size = pool_size
        self.pool_idle = pool_idle
        # Park pooled connections on replicas that take them (dials without a round
        # trip on the Connect stream); False behaves as an agent before parking.
        self.park = park
        # One tracer for every dial (get_tracer costs ~20 us per call).
        self.tracer = tracing.tracer()
        self._backoff = backoff or Backoff(initial=0.2, maximum=10.0)
        self.streams: dict[str, AgentStream] = {}  # server id -> stream
        self.replicas: frozenset[str] = frozenset()
        self._changed = asyncio.Event()
        self._tasks: set[asyncio.Task[None]] = set()
        self.connected = asyncio.Event()  # set once the first stream is held
        # Called with the number of streams held whenever it changes (readiness).
        self.on_streams: Callable[[int], None] | None = None

    def data_context(self) -> ssl.SSLContext | None:
        return self._ssl_context()

    def data_server_name(self, host: str) -> str | None:
        if self._ssl_context() is None:
            return None
        return self._server_name or host

    def learn_replicas(self, replica_ids: Any) -> None:
        replicas = frozenset(replica_ids)
        if replicas != self.replicas:
            self.replicas = replicas
            self._changed.set()
            if replicas:
                for server_id, stream in self.streams.items():
                    if server_id not in replicas and not stream.draining:
                        # That replica left the set: move off it as a drain does (its
                        # stream ends once its last connection has).
                        stream.draining = True
                        stream.leave_if_drained()

    def stream_draining(self, _stream: AgentStream) -> None:
        self._changed.set()

    def wants_stream(self) -> bool:
        """True while a reported replica has no stream, or no live stream is held at all."""
        if not any(not stream.draining for stream in self.streams.values()):
            return True
        return bool(self.replicas - self.streams.keys())

    async def run(self) -> None:
        try:
            while True:
                if not self.wants_stream():
                    self._changed.clear()
                    await self._changed.wait()
                    continue
                if await self.attempt():
                    self._backoff.reset()
                    continue
                await asyncio.sleep(self._backoff.next_delay())
        finally:
            await self.close()

    async def attempt(self) -> bool:
        """One new stream through the servers' address; True when it gained a replica."""
        holding = sorted(i for i, s in self.streams.items() if not s.draining)
        io = self._connector.open(self.agent_id, self.node, holding)
        stream = AgentStream(self, io)
        try:
            first = await asyncio.wait_for(io.read(), 10.0)
        except (StreamFailed, TimeoutError) as exc:
            detail = str(exc) if isinstance(exc, StreamFailed) else "no answer within 10s"
            if detail.startswith("ALREADY_EXISTS"):
                # The balancer sent this attempt to a replica we hold (the one we
                # want is down, or unlucky): expected while a replica restarts.
                log.info(
                    "the attempt reached a replica already held; trying again",
                    extra={"server": self.server_address, "held": holding},
                )
            else:
                log.warning(
                    "cannot connect to the tunnel server",
                    extra={"server": self.server_address, "error": detail},
                )
            await stream.close()
            return False
        except asyncio.CancelledError:
            await stream.close()
            raise
        if first is None or first.type != pb.SERVER_INFO:
            log.warning("tunnel server did not introduce itself; closing the stream")
            await stream.close()
            return False
        server_id = first.server_info.server_id
        self.learn_replicas(first.server_info.replica_ids)
        held = self.streams.get(server_id)
        if held is not None and not held.draining:
            await stream.close()  # the balancer sent us to a replica we hold
            return False
        stream.server_id = server_id
        stream.learn_data_address(first.server_info.data_address, first.server_info.park_key)
        if held is not None:
            # A draining stream to the same id (a restarted replica): the new one serves.
            self.streams.pop(server_id, None)
        self.streams[server_id] = stream
        log.info(
            "holding a stream to tunnel server replica",
            extra={"server_id": server_id, "replicas": sorted(self.replicas)},
        )
        task = asyncio.ensure_future(self._serve(stream))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        self.connected.set()
        if self.on_streams is not None:
            self.on_streams(len(self.streams))
        return True

    async def _serve(self, stream: AgentStream) -> None:
        writer = asyncio.ensure_future(stream.write_loop())
        reader = asyncio.ensure_future(stream.read_loop())
        try:
            await asyncio.wait({writer, reader}, return_when=asyncio.FIRST_COMPLETED)
            if writer.done() and not writer.cancelled() and writer.exception() is None:
                # Half-closed after draining: the server's end of the stream follows.
                await asyncio.wait({reader}, timeout=30.0)
            for task in (reader, writer):
                if task.done() and not task.cancelled() and task.exception() is not None:
                    exc = task.exception()
                    detail = str(exc) if isinstance(exc, StreamFailed) else repr(exc)
                    log.warning(
                        "stream to tunnel server replica ended",
                        extra={"server_id": stream.server_id, "error": detail},
                    )
        finally:
            reader.cancel()
            writer.cancel()
            await asyncio.gather(reader, writer, return_exceptions=True)
            if self.streams.get(stream.server_id) is stream:
                del self.streams[stream.server_id]
            await stream.close()
            self._changed.set()
            if self.on_streams is not None:
                self.on_streams(len(self.streams))

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in list(self.streams.values()):
            await stream.close()
        self.streams.clear()

    def open_connections(self) -> int:
        return sum(len(s.connections) + len(s.relays) for s in self.streams.values())
