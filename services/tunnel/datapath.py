"""The server replica's data listener: agents' data connections and raw dials, on one port.

Every connection is TLS with a client certificate (the same trust as the
gRPC listeners), or plain in the development mode without certificates.
What each line says, its fields and what older peers send is
`waygate.tunnel.wire` (the one codec the dialer, this replica and the agent
use); what this listener does with them:

- The greeting first (`WAYGATE <server-id>`): it tells an agent which replica
  a pooled connection reached (through a load balancer it may not be the one
  it meant) and that its certificate was accepted. One identity holds at most
  `max_idle_per_peer` connections that have not sent their first line yet;
  that line waits up to `idle_timeout`.
- `DATA`: an agent's answer to a DIAL_REQ that carried `data_token`; the
  certificate must name the node of the agent the token was issued to (a
  token is used once: popped before it is honoured).
- `PARK`: an agent's pooled connection, parked until a dial takes it (the key
  is the one this replica gave the agent's Connect stream, and the
  certificate must name that agent's node). A dial for the node takes the
  oldest parked connection before any DIAL_REQ on the stream
  (`server.AgentSession.dial`); one that ends before its answer (the agent's
  pool let it go as the dial arrived) costs a retry on the next one; with none
  left the dial goes to the Connect stream as DIAL_REQ, and the replica sends
  any early data after the agent's answer. After early data went with it, such
  a connection fails the dial unanswered, unless the dialer said `replay`.
  A parked connection waits at most `idle_timeout`, counted against
  `max_idle_per_peer`; the agent's pool closes it sooner.
- `DIAL` / `SPLICE` from a dialer (the proxy, `waygate tunnel dial`): early data
  read first (a close with bytes unread would reset the connection before the
  answer), then the dialer policy, then the target, then the dial through
  `hub.selection` (which agent, and moving on), answered OK or REFUSED. A
  dial whose early data may have reached the destination and whose answer
  went missing gets no answer either: the connection is closed
  (`waygate.tunnel.early`). SPLICE is
  taken only where links can leave TLS (SocketLinks with a certificate); else
  it is refused as an unknown preamble, as a replica from before it does. The
  replica writes SPLICE on a parked connection naming the dialer's
  certificate; an agent that agrees answers `OK <id> SPLICE` and the dialer's
  OK names the agent's certificate. Then each side sends close_notify and
  reads the other's, and the TCP connections under the two TLS sessions are
  spliced as they are: the dialer opens TLS 1.3 with the agent through them,
  each pinning the other's certificate, so the replica copies ciphertext it
  cannot read. Anything else is relayed as DIAL (the dialer tells by the OK).
- Anything else, or a line longer than `wire.PREAMBLE_LIMIT` however it
  arrived, is refused (`REFUSED INVALID <why>`) and the connection closed,
  before anything is dialled.

A raw dial whose agent answered on its own data connection is a splice of
the two links (`relay.splice`); one the agent answered on its Connect stream
(an agent without data connections) is pumped through the server connection;
one spliced end to end is a splice of the two plain sockets under them.

Why the parked path: a dial handed to a parked connection costs one round trip
on a connection that is already open, where DIAL_REQ costs a trip through gRPC
on the Connect stream, then a DATA line the replica matches to its token.

Invariants: no grpc here; one task per connection (never per chunk); every
wait has a timeout; a token is used once (popped before it is honoured).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import ssl
from typing import Any

from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from waygate.core import errors, tracing
from waygate.core.identity import matches
from waygate.core.tls import set_session_cache_size, set_session_timeout
from waygate.tunnel import kernelsplice, mux, peers, wire
from waygate.tunnel.early import Unanswered
from waygate.tunnel.metrics import DIALS_DATA, DIALS_END_TO_END, DIALS_STREAM
from waygate.tunnel.mux import ConnectionClosed, Refused
from waygate.tunnel.relay import (
    SESSION_TIMEOUT,
    LineTooLong,
    Link,
    LinkClosed,
    LinkListener,
    Stream,
    fingerprint,
    on_sockets,
    plain_link,
)
from waygate.tunnel.server import (
    CLOSED,
    EOF,
    LOST,
    AgentSession,
    DataConnection,
    Hub,
    ServerConnection,
)
from waygate.tunnel.v1 import tunnel_pb2 as pb

log = logging.getLogger(__name__)

HANDSHAKE_TIMEOUT = 10.0
SESSION_CACHE = 256
# Each direction of a kernel splice holds at most this much in its pipe. 1 MiB cost
# 0.19 CPU s per GiB, 256 KiB 0.28, 64 KiB 0.35 (bench/RESULTS.md); a replica that is
# not root has fs.pipe-user-pages-soft (64 MiB) for all its pipes: 128 connections at
# 2 x 256 KiB before new pipes get two pages each (slower, still correct).
SPLICE_PIPE_SIZE = 256 * 1024


class DataListener:
    """The data port of one replica (see the module docstring)."""

    def __init__(
        self,
        hub: Hub,
        context: ssl.SSLContext | None,
        *,
        dialers: tuple[str, ...] = (),
        check_dialers: bool = True,
        idle_timeout: float = 300.0,
        max_idle_per_peer: int = 256,
    ) -> None:
        self.hub = hub
        self._context = context
        if context is not None:
            # A new TLS connection per tunnelled connection: keep OpenSSL's server
            # session cache small (its default, 20,480 sessions, was ~120 MB of RSS
            # after 10,000 dials). Resumption is rare here: dialers and agents each
            # hold their own connections.
            set_session_cache_size(context, SESSION_CACHE)
            # Dialers and agents resume their sessions for pool refills (relay.open_link):
            # a resumed handshake checks no certificate, so bound how long a session
            # lives (OpenSSL's default is two hours); one ticket per handshake is enough.
            set_session_timeout(context, SESSION_TIMEOUT)
            context.num_tickets = 1
        self._dialers = dialers
        self._check_dialers = check_dialers and context is not None
        self.idle_timeout = idle_timeout
        self.max_idle_per_peer = max_idle_per_peer
        self._idle: collections.Counter[str] = collections.Counter()
        self._tasks: set[asyncio.Task[None]] = set()
        self._greeting = wire.greeting(hub.server_id)
        self._tracer = tracing.tracer()  # one for every dial: get_tracer costs ~20 us a call
        self._server: asyncio.Server | None = None
        self._listener: LinkListener | None = None
        # End-to-end connections copied by splice(2) (kernelsplice), else through Python;
        # decided by start().
        self.kernel_copy = False
        self.port = 0

    @property
    def _takes_splices(self) -> bool:
        return self._context is not None and self._listener is not None

    async def start(self, host: str, port: int) -> int:
        if on_sockets(self._context):
            # Data connections on their own sockets (relay.SocketLink): OpenSSL reads
            # and writes the kernel socket itself, the relay's cheapest path.
            self._listener = LinkListener(self._context, self._accepted)
            if self._context is not None:
                # Whether end-to-end connections are the kernel's to copy, asked here once
                # (the probe opens a socketpair and a pipe) rather than on the first dial.
                self.kernel_copy = kernelsplice.available()
            self.port = await self._listener.start(host, port)
            return self.port
        loop = asyncio.get_running_loop()
        self._server = await loop.create_server(self._accept, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    def _accept(self) -> Link:
        link = Link(self._context, server_side=True)
        self._accepted(link)
        return link

    def _accepted(self, link: Link) -> None:
        task = asyncio.ensure_future(self._serve(link))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def stop(self) -> None:
        """Stop accepting; every connection still open is cut (after the process's grace)."""
        if self._listener is not None:
            self._listener.close()
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for session in list(self.hub.sessions_all()):
            for connection in list(session.data.values()):
                connection.finish(LOST, "tunnel server stopping")

    # ------------------------------------------------- one connection

    async def _serve(self, link: Link) -> None:
        handed_off = False
        try:
            async with asyncio.timeout(HANDSHAKE_TIMEOUT):
                await link.established
            der = link.get_extra_info("peercert_der")
            if self._context is not None and link.resumed and not peers.current(der):
                # A resumed session checks no certificate: not past its certificate's end.
                link.abort()
                return
            link.write_line(self._greeting)
            uris, dns_names = peers.certificate_names(der)
            who = uris[0] if uris else dns_names[0] if dns_names else "?"
            if self._idle[who] >= self.max_idle_per_peer:
                link.write_line(wire.TOO_MANY_IDLE_LINE)
                link.close()
                return
            self._idle[who] += 1
            try:
                opening = wire.parse_opening(await link.read_line(self.idle_timeout))
                if isinstance(opening, wire.Park):
                    handed_off = await self._park(link, opening.key, uris, dns_names)
                    return
            finally:
                self._idle[who] -= 1
                if not self._idle[who]:
                    del self._idle[who]
            if isinstance(opening, wire.Data):
                handed_off = self._data(link, opening, uris, dns_names)
                if not handed_off:
                    link.abort()
                return
            if isinstance(opening, wire.Dial) and (not opening.splice or self._takes_splices):
                # (TLS end to end needs links that can leave TLS: SocketLinks.)
                handed_off = True
                await self._dial(link, opening, uris, dns_names)
                return
            link.write_line(wire.UNKNOWN_PREAMBLE_LINE)
            link.close()
        except wire.Malformed as exc:
            # Told why, then closed (a line too long or of unknown shape dials nothing).
            link.write_line(wire.refused(pb.INVALID, str(exc)))
            link.close()
        except LineTooLong:
            link.write_line(wire.TOO_LONG_LINE)
            link.close()
        except (LinkClosed, TimeoutError, ConnectionError):
            link.abort()
        except asyncio.CancelledError:
            link.abort()
            raise
        finally:
            if not handed_off and not link.is_closing():
                link.abort()

    def _node_matches(
        self, link: Link, session: AgentSession, uris: list[str], dns_names: list[str]
    ) -> bool:
        """Whether the connection's certificate names the node of `session` (a token or a
        park key is not enough: it must come from that node's agent)."""
        if self._context is None:
            return True
        try:
            node = peers.agent_node(uris, dns_names, link.get_extra_info("peercert_der"))
        except errors.PermissionDenied:
            return False
        if node != session.node:
            log.warning(
                "a data connection presented another node's dial token or park key",
                extra={"node": node, "token_node": session.node},
            )
            return False
        return True

    def _data(self, link: Link, line: wire.Data, uris: list[str], dns_names: list[str]) -> bool:
        pending = self.hub.tokens.pop(line.token, None)
        if pending is None:
            return False  # unknown, used or expired: the dial was answered or gave up
        session, waiter = pending
        if not self._node_matches(link, session, uris, dns_names):
            return False
        # (SPLICE: the agent leaves TLS on it for the dialer's session, which the
        # DIAL_REQ asked for; the dialer pins the certificate it presented here.)
        agent_certificate = fingerprint(link.get_extra_info("peercert_der")) if line.splice else ""
        return session.claim(waiter, link, line.connect_id, agent_certificate)

    async def _park(self, link: Link, key: str, uris: list[str], dns_names: list[str]) -> bool:
        """An agent's idle data connection, parked until a dial takes it (True) or it
        is gone, unused for `idle_timeout`, or refused (False: the caller aborts it)."""
        session = self.hub.parking.get(key)
        if (
            session is None
            or session.closed
            or not self._node_matches(link, session, uris, dns_names)
        ):
            return False
        taken: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        session.park(link, taken)
        try:
            await asyncio.wait(
                (taken, link.gone), timeout=self.idle_timeout, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            if not taken.done():
                taken.cancel()
                session.unpark(link)
        return not taken.cancelled()

    # ------------------------------------------------- raw dials

    def _authorize(self, uris: list[str], dns_names: list[str]) -> None:
        if not self._check_dialers:
            return
        identities = (*uris, *dns_names)
        if any(matches(p, i) for p in self._dialers for i in identities):
            return
        shown = identities[0] if identities else "a client without a certificate"
        raise Refused(
            pb.NOT_ALLOWED,
            f"{errors.excerpt(shown)} is not an allowed dialer of this tunnel server",
        )

    async def _dial(
        self, link: Link, line: wire.Dial, uris: list[str], dns_names: list[str]
    ) -> None:
        hub = self.hub
        early = b""
        if line.early_length:
            # Early data: read it all before any answer (a close with bytes unread would
            # reset the connection, and the dialer might miss the answer).
            early = await link.read_exact(line.early_length, HANDSHAKE_TIMEOUT)
        parent = (
            tracing.extract_context((("traceparent", line.traceparent),))
            if line.traceparent
            else None
        )
        # The span exists before the agent's line (its id travels in that line's
        # traceparent) but is not made the current one (attaching and detaching a
        # context is ~8 us of the dial's); its attributes go in one call once answered.
        span = self._tracer.start_span(
            "waygate.tunnel.data/Tunnel/Dial", context=parent, kind=SpanKind.SERVER
        )
        attributes: dict[str, Any] = {}
        try:
            try:
                self._authorize(uris, dns_names)
                if line.invalid:
                    raise Refused(pb.INVALID, line.invalid)
                address = wire.format_address(line.host or "127.0.0.1", line.port)
                timeout = hub.dial_timeout
                if line.timeout_ms > 0:
                    timeout = min(line.timeout_ms / 1000, timeout)
                attributes = {
                    "waygate.tunnel.node": line.node,
                    "waygate.tunnel.replica": hub.server_id,
                    "waygate.tunnel.address": address,
                }
                splice_for = fingerprint(link.get_extra_info("peercert_der")) if line.splice else ""
                connection = await hub.selection.dial(
                    line.node,
                    address,
                    timeout,
                    early,
                    line.replay,
                    splice_for,
                    trace_context=trace.set_span_in_context(span),
                )
            except Unanswered as exc:
                # The bytes may have reached the destination: no answer to the dialer
                # either (a REFUSED would tell it to send them again elsewhere).
                with trace.use_span(span):
                    log.warning("a dial with early data went unanswered", extra={"error": str(exc)})
                attributes["waygate.tunnel.refusal"] = "UNANSWERED"
                link.abort()
                return
            except Refused as refused:
                link.write_line(wire.refused(refused.reason, str(refused)))
                link.close()
                attributes["waygate.tunnel.refusal"] = mux.reason_name(refused.reason)
                return
            # The answer first; the span's bookkeeping after it (the dialer waits for this).
            carried = connection if isinstance(connection, DataConnection) else None
            end_to_end = carried.end_to_end if carried is not None else ""
            link.write_line(
                wire.accepted(
                    hub.server_id, connection.session.agent_id, connection.connect_id, end_to_end
                )
            )
            attributes["waygate.tunnel.connection_id"] = connection.connect_id
            attributes["waygate.tunnel.end_to_end"] = bool(end_to_end)
        except Exception as exc:  # (recorded as start_as_current_span would)
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            if attributes:
                span.set_attributes(attributes)
            span.end()
        try:
            if carried is not None and end_to_end:
                DIALS_END_TO_END.inc()
                await _splice_end_to_end(link, carried, kernel_copy=self.kernel_copy)
            elif carried is not None:
                DIALS_DATA.inc()
                await carried.relay_to(link)
            else:
                DIALS_STREAM.inc()
                await _pump(link, connection)
        finally:
            if not connection.finished:
                connection.session.send(
                    mux.close_request(connection.connect_id, "dialer went away")
                )
                connection.finish(CLOSED)
            if not link.is_closing():
                link.abort()


async def _splice_end_to_end(
    dialer: Link, connection: DataConnection, *, kernel_copy: bool
) -> None:
    """TLS end to end: both links leave TLS (close_notify each way, the dialer's and the
    agent's at once), then the two TCP sockets are copied into each other as they are:
    the dialer's session with the agent runs through them, which this replica can
    neither read nor alter. Authorization happened before, on this replica's own mTLS
    (the dial's SPLICE line, the parked connection's PARK line). The copy is the
    kernel's (`kernelsplice`: splice(2), no byte in user space) where it can be
    (`kernel_copy`: the listener's probe at start), else `relay.splice` over two plain
    links."""
    try:
        dialer_socket, agent_socket = await asyncio.gather(
            dialer.step_out(HANDSHAKE_TIMEOUT), connection.link.step_out(HANDSHAKE_TIMEOUT)
        )
    except (LinkClosed, TimeoutError):
        dialer.abort()
        connection.link.abort()
        return
    if kernel_copy:
        try:
            relay = kernelsplice.kernel_splice(
                dialer_socket, agent_socket, pipe_size=SPLICE_PIPE_SIZE
            )
        except OSError:  # (no pipe left: the copy through Python below)
            pass
        else:
            await connection.spliced(relay)
            return
    try:
        dialer_link = plain_link(dialer_socket)
    except OSError:
        dialer_socket.close()
        agent_socket.close()
        return
    try:
        connection.link = plain_link(agent_socket)
    except OSError:
        agent_socket.close()
        dialer_link.abort()
        return
    await connection.relay_to(dialer_link)


async def _pump(link: Link, connection: ServerConnection) -> None:
    """A raw dialer and a connection on the agent's Connect stream (an agent without data
    connections): both ways, each bounded (the stream's queue, the connection's credit)."""
    stream = Stream()
    link.attach(stream)

    async def to_agent() -> None:
        try:
            while data := await stream.read():
                await connection.send(data)
        except (LinkClosed, ConnectionClosed):
            return
        connection.send_eof()

    sender = asyncio.ensure_future(to_agent())
    try:
        while True:
            item = await connection.next_for_dialer()
            if item is CLOSED or item is LOST:
                if item is LOST or connection.close_reason:
                    stream.abort()
                else:
                    stream.close()
                return
            if item is EOF:
                stream.write_eof()
                continue
            await stream.write(item)
            connection.delivered(len(item))
    except LinkClosed:
        return
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
