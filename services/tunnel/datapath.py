"""The server replica's data listener: agents' data connections and raw dials, on one port.

Every connection is TLS with a client certificate (the same trust as the
gRPC listeners), or plain in the development mode without certificates.
The server speaks first, once the handshake is done:

    server:  WAYGATE <server-id>

which tells an agent which replica a pooled connection reached (through a
load balancer it may not be the one it meant) and that its certificate was
accepted. Then the client sends one preamble line (`relay.read_line`):

    DATA <token> <connection-id> [SPLICE]
        an agent's answer to a DIAL_REQ that carried `data_token`: this
        connection now carries that tunnelled connection (SPLICE: end to end,
        as a parked connection's answer to SPLICE below, when the DIAL_REQ
        carried `splice_for`). The certificate must
        name the node of the agent the token was issued to. An agent may open
        the connection long before (its pool): the line then waits up to
        `idle_timeout`, and one identity holds at most `max_idle_per_peer`
        connections that have not sent their line yet.
    PARK <park-key>
        an agent's pooled data connection, parked until a dial takes it. The
        key is the one this replica gave the agent's Connect stream
        (ServerInfo.park_key), and the certificate must name that agent's
        node. A dial for the node takes the oldest parked connection (before
        any DIAL_REQ on the stream) and the replica writes on it
            DIAL <host:port> <timeout-ms> <traceparent|-> [<early-length>]
        (with a length, exactly that many bytes of the dialer's early data
        follow in the same write: the agent writes them to the destination once
        connected), which the agent answers, within the timeout (plus a
        second), with
            OK <connection-id>                (then the bytes flow)
            REFUSED <REASON> <message>        (then the connection closes)
        A parked connection that ends before its answer (the agent's pool let
        it go as the dial arrived) costs a retry on the next one; with none
        left the dial goes to the Connect stream as DIAL_REQ, and the replica
        sends any early data after the agent's answer. After early data went
        with it, such a connection fails the dial unanswered, unless the dialer
        said `replay`: then it goes straight to DIAL_REQ (an agent from before
        early data drops every such line). One parked
        connection waits at most `idle_timeout` and counts against
        `max_idle_per_peer` while it waits; the agent closes it sooner (its
        pool's idle time). Every line here is bounded by relay.PREAMBLE_LIMIT.
    DIAL <node> <host|-> <port> <timeout-ms> <traceparent|-> [<early-length> <once|replay>]
        a dialer (the proxy, `waygate tunnel dial`): checked against the
        dialer policy, then dialled like `Tunnel.Dial`; answered with
            OK <server-id> <agent-id> <connection-id>
            REFUSED <REASON> <message>       (REASON: a RefusalReason name)
        after which the connection is closed. After OK the bytes flow. With
        an early length (1..early.EARLY_LIMIT), exactly that many bytes follow
        the line: the dialer's first bytes, delivered with the dial instead of
        after its answer. REFUSED: none of them reached a destination (retry
        elsewhere with the same bytes); OK: they went first; no answer (the
        agent's went missing): unknown, and the replica closes the connection
        without one. `replay` lets the replica dial again (DIAL_REQ) after an
        unanswered one (`waygate.tunnel.early` has the rule). A replica from
        before early data answers `REFUSED INVALID unknown preamble`; the
        client then dials that listener with the line alone and sends the
        bytes after the answer.

    SPLICE <node> <host|-> <port> <timeout-ms> <traceparent|->
        a dialer asking for TLS end to end (`TunnelClient.dial(end_to_end=True)`):
        checked as DIAL; the replica then writes on a parked connection
            SPLICE <host:port> <timeout-ms> <traceparent|-> <dialer-sha256>
        naming the SHA-256 of the certificate the dialer presented here. An agent
        that can leave TLS answers `OK <connection-id> SPLICE`, and the dialer gets
            OK <server-id> <agent-id> <connection-id> <agent-sha256>
        (the certificate the agent presented on its PARK connection). Then each
        side sends close_notify and reads the other's, and the TCP connections
        under the two TLS sessions are spliced as they are: the dialer opens TLS
        1.3 with the agent through them, each pinning the other's certificate to
        the one named above, so the replica copies ciphertext it cannot read.
        With no parked connection the DIAL_REQ carries `splice_for` and the
        agent's DATA line says SPLICE. Anything else is relayed as DIAL: an
        agent that answers on its Connect stream, one that answers a plain
        `OK <connection-id>` (no certificate for it, or a link that cannot leave
        TLS), a parked connection that ends at the line (an agent from before
        SPLICE drops it: the rest of that dial goes as DIAL); the dialer tells
        by the four-word OK. A replica that cannot leave TLS (no certificate, or
        memory-BIO links) answers `REFUSED INVALID unknown preamble`, as one from
        before SPLICE does; the client then sends DIAL. No early data with it.

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
from waygate.tunnel import early as early_data
from waygate.tunnel import kernelsplice, mux, peers
from waygate.tunnel.early import Unanswered
from waygate.tunnel.metrics import DIALS_DATA, DIALS_END_TO_END, DIALS_STREAM
from waygate.tunnel.mux import ConnectionClosed, Refused
from waygate.tunnel.relay import (
    SESSION_TIMEOUT,
    Link,
    LinkClosed,
    LinkListener,
    Stream,
    fingerprint,
    on_sockets,
    plain_link,
)
from waygate.tunnel.server import (
    _CLOSED,
    _EOF,
    _LOST,
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


def format_address(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


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
        self._tracer = tracing.tracer()  # one for every dial: get_tracer costs ~20 us a call
        self._server: asyncio.Server | None = None
        self._listener: LinkListener | None = None
        self.port = 0

    @property
    def _takes_splices(self) -> bool:
        return self._context is not None and self._listener is not None

    async def start(self, host: str, port: int) -> int:
        if on_sockets(self._context):
            # Data connections on their own sockets (relay.SocketLink): OpenSSL reads
            # and writes the kernel socket itself, the relay's cheapest path.
            self._listener = LinkListener(self._context, self._accepted)
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
                connection.finish(_LOST, "tunnel server stopping")

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
            link.write_line("WAYGATE", self.hub.server_id)
            uris, dns_names = peers.certificate_names(der)
            who = uris[0] if uris else dns_names[0] if dns_names else "?"
            if self._idle[who] >= self.max_idle_per_peer:
                link.write_line("REFUSED", "INVALID", "too many idle data connections")
                link.close()
                return
            self._idle[who] += 1
            try:
                line = await link.read_line(self.idle_timeout)
                words = line.decode("ascii").split(" ")
                if words[0] == "PARK" and len(words) == 2:
                    handed_off = await self._park(link, words[1], uris, dns_names)
                    return
            finally:
                self._idle[who] -= 1
                if not self._idle[who]:
                    del self._idle[who]
            if (
                words[0] == "DATA"
                and (len(words) == 3 or (len(words) == 4 and words[3] == "SPLICE"))
                and words[2].isdigit()
            ):
                handed_off = self._data(
                    link, words[1], int(words[2]), uris, dns_names, len(words) == 4
                )
                if not handed_off:
                    link.abort()
                return
            if (words[0] == "DIAL" and len(words) in (6, 8)) or (
                # TLS end to end needs links that can leave TLS (SocketLinks).
                words[0] == "SPLICE" and len(words) == 6 and self._takes_splices
            ):
                handed_off = True
                await self._dial(link, words, uris, dns_names)
                return
            link.write_line("REFUSED", "INVALID", "unknown preamble")
            link.close()
        except (LinkClosed, TimeoutError, UnicodeDecodeError, ValueError, ConnectionError):
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

    def _data(
        self,
        link: Link,
        token: str,
        connect_id: int,
        uris: list[str],
        dns_names: list[str],
        spliced: bool = False,
    ) -> bool:
        pending = self.hub.tokens.pop(token, None)
        if pending is None:
            return False  # unknown, used or expired: the dial was answered or gave up
        session, waiter = pending
        if not self._node_matches(link, session, uris, dns_names):
            return False
        # (SPLICE: the agent leaves TLS on it for the dialer's session, which the
        # DIAL_REQ asked for; the dialer pins the certificate it presented here.)
        agent_certificate = fingerprint(link.get_extra_info("peercert_der")) if spliced else ""
        return session.claim(waiter, link, connect_id, agent_certificate)

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
        self, link: Link, words: list[str], uris: list[str], dns_names: list[str]
    ) -> None:
        hub = self.hub
        _verb, node, host, port_text, timeout_text, traceparent = words[:6]
        early = b""
        replay_safe = False
        if len(words) == 8:
            # Early data: read it all before any answer (a close with bytes unread would
            # reset the connection, and the dialer might miss the answer).
            try:
                size = early_data.parse_length(words[6])
                if words[7] not in ("once", "replay"):
                    raise ValueError(f"early data is 'once' or 'replay', not {words[7][:12]!r}")
            except ValueError as exc:
                link.write_line("REFUSED", "INVALID", str(exc))
                link.close()
                return
            early = await link.read_exact(size, HANDSHAKE_TIMEOUT)
            replay_safe = words[7] == "replay"
        parent = (
            tracing.extract_context((("traceparent", traceparent),)) if traceparent != "-" else None
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
                if not port_text.isdigit() or not 0 < int(port_text) < 65536 or not node:
                    raise Refused(pb.INVALID, "a dial target needs a node and a port 1..65535")
                if not timeout_text.isdigit():
                    raise Refused(pb.INVALID, "the dial timeout must be milliseconds")
                host = "127.0.0.1" if host == "-" else host
                address = format_address(host, int(port_text))
                timeout = hub.dial_timeout
                if int(timeout_text) > 0:
                    timeout = min(int(timeout_text) / 1000, timeout)
                attributes = {
                    "waygate.tunnel.node": node,
                    "waygate.tunnel.replica": hub.server_id,
                    "waygate.tunnel.address": address,
                }
                splice_for = (
                    fingerprint(link.get_extra_info("peercert_der")) if words[0] == "SPLICE" else ""
                )
                connection = await hub.dial(
                    node,
                    address,
                    timeout,
                    early,
                    replay_safe,
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
                link.write_line("REFUSED", mux.reason_name(refused.reason), str(refused))
                link.close()
                attributes["waygate.tunnel.refusal"] = mux.reason_name(refused.reason)
                return
            # The answer first; the span's bookkeeping after it (the dialer waits for this).
            answer = ["OK", hub.server_id, connection.session.agent_id, str(connection.connect_id)]
            end_to_end = isinstance(connection, DataConnection) and connection.end_to_end
            if end_to_end:
                answer.append(connection.end_to_end)
            link.write_line(*answer)
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
            if end_to_end:
                DIALS_END_TO_END.inc()
                await _splice_end_to_end(link, connection)
            elif isinstance(connection, DataConnection):
                DIALS_DATA.inc()
                await connection.relay_to(link)
            else:
                DIALS_STREAM.inc()
                await _pump(link, connection)
        finally:
            if not connection.finished:
                connection.session.send(
                    mux.close_request(connection.connect_id, "dialer went away")
                )
                connection.finish(_CLOSED)
            if not link.is_closing():
                link.abort()


async def _splice_end_to_end(dialer: Link, connection: DataConnection) -> None:
    """TLS end to end: both links leave TLS (close_notify each way, the dialer's and the
    agent's at once), then the two TCP sockets are copied into each other as they are:
    the dialer's session with the agent runs through them, which this replica can
    neither read nor alter. Authorization happened before, on this replica's own mTLS
    (the dial's SPLICE line, the parked connection's PARK line). The copy is the
    kernel's (`kernelsplice`: splice(2), no byte in user space) where it can be, else
    `relay.splice` over two plain links."""
    try:
        dialer_socket, agent_socket = await asyncio.gather(
            dialer.step_out(HANDSHAKE_TIMEOUT), connection.link.step_out(HANDSHAKE_TIMEOUT)
        )
    except (LinkClosed, TimeoutError):
        dialer.abort()
        connection.link.abort()
        return
    if kernelsplice.available():
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
            if item is _CLOSED or item is _LOST:
                if item is _LOST or connection.close_reason:
                    stream.abort()
                else:
                    stream.close()
                return
            if item is _EOF:
                stream.write_eof()
                continue
            await stream.write(item)
            connection.delivered(len(item))
    except LinkClosed:
        return
    finally:
        sender.cancel()
        await asyncio.gather(sender, return_exceptions=True)
