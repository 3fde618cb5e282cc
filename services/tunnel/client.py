"""The dial client: a byte stream to a port on an edge node, through a replica that holds it.

    client = TunnelClient(presence, credentials=lambda: creds)
    stream = await client.dial("edge-1", 10250)           # host defaults to the agent's 127.0.0.1
    await stream.write(b"GET / HTTP/1.1\\r\\n...");  await stream.write_eof()
    data = await stream.read()                             # b"" once the remote side half-closed
    await stream.aclose()

- Where: `presence` maps a node to the dialer addresses of the replicas that
  hold it (`ViewPresence` reads the resolver's tunnel presence from a
  `ResolverWatch`; `StaticPresence` is a fixed list, for `waygate tunnel
  dial --addr`). Replicas are tried in random order.
- Retries: a dial is retried on the next replica only when the refusal says
  another replica could answer (NO_AGENT, DRAINING, or the replica did not
  answer at all) and no byte was sent; NOT_ALLOWED, UNREACHABLE, TIMEOUT and
  INVALID are final (`DialFailed.reason`).
- Early data (`dial(..., early=b"...")`, at most `EARLY_LIMIT`): the first
  bytes go with the DIAL line, so they do not wait for the answer's round
  trip. A refusal means none of them reached a destination, so the retry
  above resends the same bytes; a replica that took them and never answered
  (lost connection, no answer in time) fails the dial for good, since they
  may have arrived, unless the caller passed `replay_safe=True`
  (`waygate.tunnel.early` has the rule).
- Cost per stream: the Dial calls go over channels without the tracing
  interceptors (grpc.aio runs an interceptor pipeline, and our client
  interceptor a task, per call: measured in bench/tunnel); the W3C context
  is put in the call's metadata here instead, from the caller's span or the
  `trace_context` given.
- Errors: `dial` raises `DialFailed` (`reason`, `retryable`); once open, a
  connection the agent or server lost makes `read` raise grpc.aio.AioRpcError
  (UNAVAILABLE, with the reason) on the gRPC Dial path, or `TunnelLost` on the
  raw data path (a reset of the data connection), and `wait_closed` returns the
  final status.
  A clean end is: both sides half-close (`write_eof`, then `read` returns b"").
- Warm pool (`pool_size` > 0, the proxy): per replica data listener a
  bounded `DialPool` of connections whose TLS handshake and greeting are
  done, so a dial costs its preamble round trip; refilled in the background
  while dials come (50 ms after a take), expired after `pool_idle`. One-shot
  dialers (`waygate tunnel dial`) keep 0.
- `transport_dialer` is the proxy's upstream step: a raw dial comes back as
  its data connection (`Dialled`), which the proxy's protocol uses directly,
  TLS to the backend included (`Dialled.start_tls`, TLS inside the data
  connection's). `bridged_socket` gives callers that need a socket one end
  of a socketpair whose other end is spliced to the data connection (or
  bridged to a Tunnel.Dial stream, `SocketBridge`, one task each way, bounded
  buffers); `process_client` builds a client with a ServiceProcess's TLS,
  renewed with its certificate.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import random
import socket
import ssl
import time
from collections.abc import Callable, Sequence
from typing import Any

import grpc
from google.protobuf import duration_pb2
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from waygate.core import flow, tracing
from waygate.core.grpcclient import KEEPALIVE_OPTIONS
from waygate.tunnel import mux, wire
from waygate.tunnel.early import EARLY_LIMIT
from waygate.tunnel.mux import MAX_CHUNK, join_queued
from waygate.tunnel.relay import (
    Link,
    LinkClosed,
    Pending,
    Stream,
    client_context,
    end_to_end_context,
    open_end_to_end,
    open_link,
    rotating_client_context,
    splice,
    split_address,
)
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc
from waygate.tunnel.warmpool import WarmPool

log = logging.getLogger(__name__)

Credentials = Callable[[], grpc.ChannelCredentials | None]
_EOF_FRAME = pb.DialFrame(eof=True)


class DialFailed(Exception):
    """No replica opened the stream; `reason` is a RefusalReason (0: no replica answered)."""

    def __init__(self, message: str, reason: int = 0, *, retryable: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.retryable = retryable  # True: nothing reached the node; another target may do


class StaticPresence:
    """The same dialer addresses for every node."""

    def __init__(self, addresses: Sequence[str]) -> None:
        self._addresses = list(addresses)

    def servers_for(self, node: str) -> list[str]:
        return list(self._addresses)

    def addresses(self) -> set[str]:
        return set(self._addresses)


class TunnelStream:
    """One open tunnelled connection. Not safe for concurrent writers (or readers)."""

    def __init__(self, call: Any, server_id: str, connect_id: int) -> None:
        self._call = call
        self.server_id = server_id
        self.connect_id = connect_id
        self._remote_eof = False

    async def read(self) -> bytes:
        """The next bytes; b"" once the remote side half-closed or the stream ended."""
        if self._remote_eof:
            return b""
        while True:
            frame = await self._call.read()
            if frame is grpc.aio.EOF:
                self._remote_eof = True
                return b""
            which = frame.WhichOneof("frame")
            if which == "data":
                return frame.data  # type: ignore[no-any-return]
            if which == "eof":
                self._remote_eof = True
                return b""

    async def write(self, data: bytes) -> None:
        if len(data) <= MAX_CHUNK:
            await self._call.write(pb.DialFrame(data=data))
            return
        view = memoryview(data)
        while view:
            await self._call.write(pb.DialFrame(data=bytes(view[:MAX_CHUNK])))
            view = view[MAX_CHUNK:]

    async def write_eof(self) -> None:
        """Half-close: the remote side reads EOF; reading here goes on."""
        await self._call.done_writing()

    async def wait_closed(self) -> grpc.StatusCode:
        """The stream's final status (OK for a clean close)."""
        return await self._call.code()  # type: ignore[no-any-return]

    def close(self) -> None:
        """Abort the connection at once (the agent closes its socket)."""
        self._call.cancel()

    async def aclose(self) -> None:
        self._call.cancel()


class TunnelLost(ConnectionError):
    """A tunnelled connection on a data connection ended before both sides finished."""


class DataStream:
    """One tunnelled connection on its own data connection (`relay.Link` to the replica).

    The same surface as `TunnelStream`; `link` is the transport itself, for callers
    that relay bytes without a stream in between (the proxy). `end_to_end`: its TLS
    session is with the agent, the replica copying ciphertext (`TunnelClient.dial`).
    Not safe for concurrent writers (or readers)."""

    def __init__(
        self, link: Link, server_id: str, connect_id: int, *, end_to_end: bool = False
    ) -> None:
        self.link = link
        self.server_id = server_id
        self.connect_id = connect_id
        self.end_to_end = end_to_end
        self._stream: Stream | None = None

    def _attached(self) -> Stream:
        if self._stream is None:
            self._stream = Stream()
            self.link.attach(self._stream)
        return self._stream

    async def read(self) -> bytes:
        """The next bytes; b"" once the remote side half-closed; TunnelLost if it broke."""
        try:
            return await self._attached().read()
        except LinkClosed as exc:
            raise TunnelLost(f"the tunnelled connection ended: {exc}") from None

    async def write(self, data: bytes) -> None:
        try:
            await self._attached().write(data)
        except LinkClosed as exc:
            raise TunnelLost(f"the tunnelled connection ended: {exc}") from None

    async def write_eof(self) -> None:
        self._attached().write_eof()

    async def wait_closed(self) -> grpc.StatusCode:
        """OK once both sides finished; UNAVAILABLE when the connection broke."""
        stream = self._attached()
        await stream.closed
        return grpc.StatusCode.OK if stream.error is None else grpc.StatusCode.UNAVAILABLE

    def close(self) -> None:
        """Abort the connection at once (the agent closes its socket)."""
        self.link.abort()

    async def aclose(self) -> None:
        self.link.abort()


class _Target:
    """What one dial asks for, in the form each way of dialling needs it (built lazily:
    the raw dial needs only its preamble line, not the gRPC frame)."""

    __slots__ = (
        "early",
        "end_to_end",
        "host",
        "node",
        "port",
        "replay_safe",
        "timeout",
        "traceparent",
    )

    def __init__(
        self,
        node: str,
        host: str,
        port: int,
        timeout: float,
        early: bytes = b"",
        replay_safe: bool = False,
        end_to_end: bool = False,
    ) -> None:
        self.node, self.host, self.port, self.timeout = node, host, port, timeout
        self.early, self.replay_safe = early, replay_safe
        self.end_to_end = end_to_end
        self.traceparent = ""

    def preamble(self, timeout: float, early: bool = True, splice: bool = False) -> bytes:
        """The DIAL line, and the early data after it (one write, one TLS record or two);
        `early` False: the line alone (a replica from before early data). `splice`: the
        SPLICE line instead (TLS end to end; never with early data). `wire.Malformed`
        for a node or host that is not one word."""
        with_early = bool(self.early) and early and not splice
        line = wire.dial(
            self.node,
            self.host,
            self.port,
            int(timeout * 1000),
            self.traceparent,
            len(self.early) if with_early else 0,
            self.replay_safe,
            splice,
        )
        return line + self.early if with_early else line

    def unanswered(self, address: str, what: str) -> DialFailed:
        """The dial's failure once its early data went out with no answer back: retried
        elsewhere only when the caller declared the bytes replay-safe."""
        if self.replay_safe:
            return DialFailed(f"tunnel server {address}: {what}", retryable=True)
        return DialFailed(
            f"tunnel server {address}: {what}, after {len(self.early)} bytes of early data "
            "went with the dial: they may have reached the destination, so the dial is not "
            "retried (replay_safe=True allows it)",
            retryable=False,
        )

    def frame(self) -> pb.DialFrame:
        timeout = self.timeout
        target = pb.DialTarget(node=self.node, host=self.host, port=self.port)
        target.connect_timeout.CopyFrom(
            duration_pb2.Duration(seconds=int(timeout), nanos=int(timeout % 1 * 1e9))
        )
        return pb.DialFrame(target=target)


# At most this many warm pools (one per replica data listener a dialer uses).
MAX_POOLS = 64


class DialPool(WarmPool):
    """Warm raw-dial connections to one replica's data listener: TLS done, greeting read.

    A dial takes one and sends only its preamble line (a round trip, not a TLS
    handshake). A `WarmPool` (bounded by `client.pool_size`, each closed after
    `client.pool_idle`) that refills only while dials come: a dialer that
    stopped dialling keeps no connections and makes no handshakes. Every
    connection in it was opened with `context`; after a renewal the client
    replaces the whole pool (`TunnelClient._pool`), so new dials present the
    renewed certificate and open ones keep theirs.
    """

    def __init__(
        self,
        client: TunnelClient,
        address: str,
        where: tuple[str, int],
        context: ssl.SSLContext | None,
    ) -> None:
        super().__init__(
            self._open,
            size=client.pool_size,
            idle=client.pool_idle,
            on_demand=True,
            on_failure=_warm_dial_failed,
        )
        self.client = client
        self.address = address
        self.where = where
        self.context = context

    async def _open(self) -> Link:
        client = self.client
        link, _server_id = await client._greeted_link(
            self.address, self.where, self.context, client.dial_timeout
        )
        return link


def _warm_dial_failed(exc: Exception) -> None:
    log.debug("cannot open a warm dial connection", extra={"error": str(exc)})


# How long a replica's Describe answer (where its data listener is) is trusted.
DESCRIBE_TTL = 60.0


class TunnelClient:
    def __init__(
        self,
        presence: Any,
        *,
        credentials: Credentials,
        server_name: str | None = None,
        dial_timeout: float = 10.0,
        ssl_context: Callable[[], ssl.SSLContext | None] | None = None,
        data_path: bool = True,
        pool_size: int = 0,
        pool_idle: float = 30.0,
        end_to_end: bool = False,
    ) -> None:
        self._presence = presence
        # What `dial` does when its caller does not say (`dial(end_to_end=...)`).
        self.end_to_end = end_to_end
        self._credentials = credentials
        self._server_name = server_name
        self.dial_timeout = dial_timeout
        # Raw dials on the replicas' data listeners (TLS from `ssl_context`; without
        # one only when the channels are plaintext too); else, or where a replica
        # has none, Tunnel.Dial streams.
        self._ssl_context = ssl_context
        self.data_path = data_path and (ssl_context is not None or credentials() is None)
        self._described: dict[str, tuple[float, tuple[str, int] | None]] = {}
        # Data listeners that refused a DIAL line with early data, or a SPLICE line
        # (from before them, or a replica that cannot leave TLS).
        self._no_early: set[tuple[str, int]] = set()
        self._no_splice: set[tuple[str, int]] = set()
        # Warm raw-dial connections per data listener (`DialPool`): `pool_size` each,
        # kept `pool_idle` seconds; 0 turns pooling off (a one-shot dialer).
        if not 0 <= pool_size <= 256:
            raise ValueError(f"pool_size must lie between 0 and 256, not {pool_size}")
        if pool_idle <= 0:
            raise ValueError(f"pool_idle must be positive, not {pool_idle}")
        self.pool_size = pool_size
        self.pool_idle = pool_idle
        self._pools: dict[tuple[str, int], DialPool] = {}
        self._channels: dict[str, grpc.aio.Channel] = {}
        self._streams: dict[grpc.aio.Channel, int] = {}  # open Dial calls per channel
        self._retired: set[grpc.aio.Channel] = set()  # replaced, closed at their last stream
        self._closing: set[asyncio.Task[None]] = set()
        self._tracer = tracing.tracer()
        self._pruned_at = time.monotonic()

    def channel(self, address: str) -> grpc.aio.Channel:
        channel = self._channels.get(address)
        if channel is None:
            options: list[tuple[str, Any]] = [*KEEPALIVE_OPTIONS, ("grpc.enable_retries", 0)]
            if self._server_name:
                options.append(("grpc.ssl_target_name_override", self._server_name))
            credentials = self._credentials()
            channel = (
                grpc.aio.insecure_channel(address, options=options)
                if credentials is None
                else grpc.aio.secure_channel(address, credentials, options=options)
            )
            self._channels[address] = channel
        return channel

    # How often a dial looks for channels to replicas that left presence.
    PRUNE_INTERVAL = 30.0

    def _prune_channels(self) -> None:
        """Close idle channels to addresses no node's presence names any more
        (replicas come and go: without this, one channel per address ever seen)."""
        addresses = getattr(self._presence, "addresses", None)
        if addresses is None:
            return
        known = addresses()
        for where, pool in list(self._pools.items()):
            if pool.address not in known:
                del self._pools[where]
                pool.close()
        for address, channel in list(self._channels.items()):
            if address not in known and not self._streams.get(channel):
                del self._channels[address]
                self._close_later(channel)

    def renew_channels(self) -> None:
        """After a certificate renewal: new streams use new channels; open ones keep theirs.

        A replaced channel is closed once its last stream has ended (never
        under an open stream: that would cut a long-lived connection).
        """
        old, self._channels = self._channels, {}
        for channel in old.values():
            if self._streams.get(channel):
                self._retired.add(channel)
            else:
                self._close_later(channel)

    def _close_later(self, channel: grpc.aio.Channel) -> None:
        task = asyncio.ensure_future(channel.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    def _stream_started(self, channel: grpc.aio.Channel, call: Any) -> None:
        self._streams[channel] = self._streams.get(channel, 0) + 1
        call.add_done_callback(lambda _call: self._stream_ended(channel))

    def _stream_ended(self, channel: grpc.aio.Channel) -> None:
        left = self._streams[channel] - 1
        if left:
            self._streams[channel] = left
            return
        del self._streams[channel]
        if channel in self._retired:
            self._retired.discard(channel)
            self._close_later(channel)

    async def dial(
        self,
        node: str,
        port: int,
        host: str = "",
        *,
        timeout: float | None = None,
        trace_context: str | None = None,
        early: bytes = b"",
        replay_safe: bool = False,
        end_to_end: bool | None = None,
    ) -> TunnelStream | DataStream:
        """A stream to `host` (the agent's 127.0.0.1 when empty) port `port` on `node`.

        `early`: the first bytes to send, at most `EARLY_LIMIT` (ValueError beyond),
        sent with the dial on a raw dial, so the request does not wait for the answer's
        round trip (on the gRPC path they are the first DATA after the answer). Once
        this returns they went to the destination ahead of anything written on the
        stream. A refusal means none of them did (another replica gets the same bytes);
        a replica that took them and never answered fails the dial (DialFailed, not
        retryable), unless `replay_safe` says delivering them twice is harmless.

        `end_to_end`: TLS from here to the agent, the replica copying the ciphertext
        (wire's SPLICE): the replica never decrypts or re-encrypts the bytes, the
        cheapest path for bulk transfers, at the cost of a TLS handshake per dial.
        Where it cannot be had (no certificate, a replica or agent from before it, an
        agent without parked data connections) the dial is relayed as usual; the
        stream's `end_to_end` says which. Not with `early` (ValueError). None: the
        client's own `end_to_end`.
        """
        if end_to_end is None:
            end_to_end = self.end_to_end
        if early and end_to_end:
            raise ValueError("early data is not sent end to end: dial, then write")
        if len(early) > EARLY_LIMIT:
            raise ValueError(
                f"early data is at most {EARLY_LIMIT} bytes, not {len(early)}: "
                "write the rest on the stream once it is open"
            )
        timeout = self.dial_timeout if timeout is None else timeout
        now = time.monotonic()
        if now - self._pruned_at >= self.PRUNE_INTERVAL:
            self._pruned_at = now
            self._prune_channels()
        servers = self._presence.servers_for(node)
        if not servers:
            raise DialFailed(
                f"no tunnel server holds an agent for node {node}", pb.NO_AGENT, retryable=True
            )
        random.shuffle(servers)
        if trace_context is not None:
            parent = tracing.extract_context((("traceparent", trace_context),))
        else:
            parent = None
        span = self._tracer.start_span(
            "waygate.tunnel.v1.Tunnel/Dial",
            context=parent,
            kind=SpanKind.CLIENT,
            attributes={"waygate.tunnel.node": node},
        )
        carrier: dict[str, str] = {}
        tracing.inject_context(carrier, trace.set_span_in_context(span))
        metadata = tuple(carrier.items())
        target = _Target(node, host, port, timeout, bytes(early), replay_safe, end_to_end)
        target.traceparent = carrier.get("traceparent", "")
        last: DialFailed | None = None
        try:
            for address in servers:
                try:
                    stream = await self._dial_one(address, target, metadata, timeout)
                except DialFailed as failed:
                    last = failed
                    if not failed.retryable:
                        break  # another replica would answer the same
                    continue
                span.set_attributes(
                    {
                        "waygate.tunnel.replica": stream.server_id,
                        "waygate.tunnel.connection_id": stream.connect_id,
                    }
                )
                return stream
            assert last is not None
            span.set_status(Status(StatusCode.ERROR, str(last)))
            raise last
        finally:
            span.end()

    async def _data_address(self, address: str, timeout: float) -> tuple[str, int] | None:
        """Where the replica at `address` takes raw dials (cached); None: it takes none."""
        now = time.monotonic()
        known = self._described.get(address)
        if known is not None and now - known[0] < DESCRIBE_TTL:
            return known[1]
        where: tuple[str, int] | None = None
        try:
            reply = await tunnel_pb2_grpc.TunnelStub(self.channel(address)).Describe(
                pb.DescribeRequest(), timeout=timeout
            )
        except grpc.aio.AioRpcError as exc:
            if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                raise DialFailed(
                    f"tunnel server {address}: {exc.code().name}: {exc.details()}",
                    retryable=True,
                ) from None
        else:
            if reply.data_address:
                host, port = split_address(
                    "x" + reply.data_address
                    if reply.data_address.startswith(":")
                    else reply.data_address
                )
                if reply.data_address.startswith(":"):
                    host = split_address(address)[0]
                where = (host, port)
        if len(self._described) >= 1024:
            self._described.clear()
        self._described[address] = (now, where)
        return where

    async def _greeted_link(
        self, address: str, where: tuple[str, int], context: ssl.SSLContext | None, timeout: float
    ) -> tuple[Link, str]:
        """A new connection to the data listener at `where`, its greeting read (the
        replica accepted our certificate): (link, the replica's server id)."""
        host, port = where
        try:
            link = await open_link(
                host,
                port,
                context,
                server_hostname=(self._server_name or host) if context is not None else None,
                timeout=timeout,
            )
        except (OSError, LinkClosed, TimeoutError) as exc:
            self._described.pop(address, None)
            raise DialFailed(
                f"tunnel server {address}: data listener {host}:{port}: {exc}", retryable=True
            ) from None
        try:
            server_id = wire.parse_greeting(await link.read_line(timeout))
        except (LinkClosed, TimeoutError, wire.Malformed) as exc:
            link.abort()
            raise DialFailed(f"tunnel server {address}: {exc}", retryable=True) from None
        except BaseException:
            link.abort()
            raise
        return link, server_id

    def _pool(
        self, address: str, where: tuple[str, int], context: ssl.SSLContext | None
    ) -> DialPool | None:
        """The warm pool for the data listener at `where` (None: pooling is off). A pool
        opened with another TLS context (before a renewal) is closed and replaced."""
        if self.pool_size <= 0:
            return None
        pool = self._pools.get(where)
        if pool is not None and pool.context is not context:
            pool.close()
            pool = None
        if pool is None:
            if len(self._pools) >= MAX_POOLS:
                oldest = min(self._pools, key=lambda key: self._pools[key].used_at)
                self._pools.pop(oldest).close()
            pool = self._pools[where] = DialPool(self, address, where, context)
        return pool

    async def _dial_raw(
        self,
        address: str,
        where: tuple[str, int],
        target: _Target,
        timeout: float,
    ) -> DataStream:
        context = self._ssl_context() if self._ssl_context is not None else None
        # Early data with the line, unless this replica is known to predate it (then
        # the bytes go after the answer, as on the fallback paths).
        early = target.early if where not in self._no_early else b""
        splice = target.end_to_end and context is not None and where not in self._no_splice
        try:
            preamble = target.preamble(timeout, early=bool(early), splice=splice)
        except wire.Malformed as exc:
            raise DialFailed(str(exc), pb.INVALID) from None
        pool = self._pool(address, where, context)
        pooled = pool.take() if pool is not None else None
        while True:
            link = pooled or (await self._greeted_link(address, where, context, timeout))[0]
            try:
                # The replica answers a dial within timeout + 1 s (TIMEOUT); a little more here.
                link.write_line(preamble)
                answer = await link.read_line(timeout + 3.0)
            except TimeoutError:
                link.abort()
                if early:
                    raise target.unanswered(address, f"no answer within {timeout:g}s") from None
                # No answer: the replica itself is stuck (the agent's own timeout would
                # have been answered); another replica may serve.
                raise DialFailed(
                    f"tunnel server {address} did not answer within {timeout:g}s",
                    pb.TIMEOUT,
                    retryable=True,
                ) from None
            except LinkClosed as exc:
                link.abort()
                if early:
                    # Early data went with the line: a replica that read it may have
                    # passed it on before the connection broke (even a pooled one).
                    raise target.unanswered(address, f"the connection ended: {exc}") from None
                if pooled is not None:
                    # A pooled connection the replica (or a middlebox) dropped while it
                    # waited: nothing was dialled on it; once more on a new one.
                    pooled = None
                    continue
                raise DialFailed(f"tunnel server {address}: {exc}", retryable=True) from None
            except BaseException:
                link.abort()
                raise
            break
        try:
            said = wire.parse_answer(answer, splice)
        except wire.Malformed as exc:
            link.abort()
            raise DialFailed(f"{exc} ({address})") from None
        if isinstance(said, wire.Accepted):
            if said.agent_sha256:
                # The agent agreed: both leave the replica's TLS, then ours with the agent.
                return DataStream(
                    await self._end_to_end(address, link, said.agent_sha256, timeout),
                    said.server_id,
                    said.connect_id,
                    end_to_end=True,
                )
            if target.early and not early:
                link.write(target.early)  # the stream's first bytes, after the answer
            return DataStream(link, said.server_id, said.connect_id)
        link.abort()
        if said.asks_older_form and splice:
            # A replica that takes no SPLICE line (from before it, or without TLS
            # links that can leave TLS): nothing was dialled; relayed from now on.
            if len(self._no_splice) >= 1024:
                self._no_splice.clear()
            self._no_splice.add(where)
            return await self._dial_raw(address, where, target, timeout)
        if said.asks_older_form and early:
            # A replica from before early data refused the line: nothing was dialled.
            # Again without it; remembered for this listener (at most 1,024 of them).
            if len(self._no_early) >= 1024:
                self._no_early.clear()
            self._no_early.add(where)
            return await self._dial_raw(address, where, target, timeout)
        raise DialFailed(
            said.message or said.name,
            said.reason,
            retryable=said.reason in mux.RETRYABLE_ELSEWHERE,
        )

    async def _end_to_end(self, address: str, link: Link, pin: str, timeout: float) -> Link:
        """Leave the replica's TLS on `link` and open a session with the agent through it,
        pinned to the certificate the replica authenticated (`pin`). Nothing was sent to
        the destination yet, so a failure here may be retried elsewhere."""
        inner = end_to_end_context(link.context, server_side=False)
        if inner is None:  # (the replica offered what this link cannot do)
            link.abort()
            raise DialFailed(f"tunnel server {address}: no certificate for TLS end to end")
        try:
            return await open_end_to_end(
                await link.step_out(timeout), inner, server_side=False, pin=pin, timeout=timeout
            )
        except (LinkClosed, TimeoutError, OSError) as exc:
            raise DialFailed(
                f"tunnel server {address}: TLS end to end with the agent failed: {exc}",
                retryable=True,
            ) from None

    async def _dial_one(
        self, address: str, target: _Target, metadata: Any, timeout: float
    ) -> TunnelStream | DataStream:
        if self.data_path:
            where = await self._data_address(address, timeout)
            if where is not None:
                return await self._dial_raw(address, where, target, timeout)
        first = target.frame()
        channel = self.channel(address)
        call = tunnel_pb2_grpc.TunnelStub(channel).Dial(metadata=metadata)
        self._stream_started(channel, call)
        try:
            async with asyncio.timeout(timeout + 2.0):
                await call.write(first)
                frame = await call.read()
        except TimeoutError:
            call.cancel()
            # No first frame: the replica itself is stuck (the agent's own connect timeout
            # would have been answered): another replica may serve. Each attempt has
            # its own budget.
            raise DialFailed(
                f"tunnel server {address} did not answer within {timeout:g}s",
                pb.TIMEOUT,
                retryable=True,
            ) from None
        except grpc.aio.AioRpcError as exc:
            call.cancel()
            # The replica never took the dial (down, draining, refused the TLS handshake).
            raise DialFailed(
                f"tunnel server {address}: {exc.code().name}: {exc.details()}", retryable=True
            ) from None
        except BaseException:
            call.cancel()
            raise
        if frame is grpc.aio.EOF:
            code = await call.code()
            details = await call.details()
            final = code in (grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.INVALID_ARGUMENT)
            raise DialFailed(
                f"tunnel server {address}: {code.name}: {details}",
                pb.NOT_ALLOWED if code == grpc.StatusCode.PERMISSION_DENIED else 0,
                retryable=not final,
            )
        which = frame.WhichOneof("frame")
        if which == "refused":
            refused = frame.refused
            call.cancel()
            raise DialFailed(
                refused.message or mux.reason_name(refused.reason),
                refused.reason,
                retryable=refused.reason in mux.RETRYABLE_ELSEWHERE,
            )
        if which != "accepted":
            call.cancel()
            raise DialFailed(f"tunnel server {address} answered a dial with {which}", pb.INVALID)
        stream = TunnelStream(call, frame.accepted.server_id, frame.accepted.connect_id)
        if target.early:
            # Tunnel.Dial carries no early data: the bytes are the stream's first, after
            # the answer (a refusal above sent none of them).
            try:
                await stream.write(target.early)
            except grpc.aio.AioRpcError as exc:
                call.cancel()
                raise target.unanswered(
                    address, f"{exc.code().name}: {exc.details()} as the early data went"
                ) from None
        return stream

    async def close(self) -> None:
        pools, self._pools = list(self._pools.values()), {}
        for pool in pools:
            pool.close()
        await asyncio.gather(*(pool.task for pool in pools if pool.task), return_exceptions=True)
        channels = [*self._channels.values(), *self._retired]
        self._channels, self._retired = {}, set()
        for channel in channels:
            await channel.close()
        await asyncio.gather(*self._closing, return_exceptions=True)


# ---------------------------------------------------------------- presence from the resolver


class ViewPresence:
    """node -> dialer addresses, read from a `waygate.resolver.client.ResolverWatch`'s view.

    The proxy passes the watch it already runs (its view carries tunnel
    presence); `waygate tunnel dial --resolver` runs one for tunnels only.
    Reading needs no I/O: the watch keeps the view current.
    """

    def __init__(self, watch: Any) -> None:
        self._watch = watch

    def servers_for(self, node: str) -> list[str]:
        view = self._watch.view
        if view is None:
            return []
        presence = view.tunnels.get(node)
        return [] if presence is None else [server.address for server in presence.servers]

    def addresses(self) -> set[str]:
        """Every replica address any node's presence names."""
        view = self._watch.view
        if view is None:
            return set()
        return {s.address for p in view.tunnels.values() for s in p.servers}


# ---------------------------------------------------------------- a socket for the proxy


class StreamTransport(asyncio.Transport):
    """A Tunnel.Dial stream (the gRPC fallback: a replica without a data listener) as a
    transport, so the proxy's protocols sit on it as they sit on a data connection.

    Two tasks per connection move the bytes (the stream API is awaitable only):
    `_send` writes what the protocol wrote, `_receive` hands the protocol what the
    stream read. Bounded both ways: writes queue up to `flow.HIGH_WATER` (then the
    protocol's `pause_writing`, `resume_writing` at `flow.LOW_WATER`); reading stops
    while the protocol paused it (the stream's own flow control then holds the agent
    back). `write_eof` half-closes after what is queued; `close` does that and ends
    the stream once the other side finished too (cancelled after `LINGER`, so the
    agent delivers what it still holds); `abort` and a broken stream end it at once.
    `connection_lost` is called once, from whichever comes first.
    """

    # After both directions ended: how long the agent may take to deliver what it still
    # holds for the destination before the stream is cancelled.
    LINGER = 30.0

    def __init__(self, stream: TunnelStream) -> None:
        super().__init__()
        self.stream = stream
        self.protocol: Any = None
        self._outgoing: collections.deque[bytes] = collections.deque()
        self._queued = 0
        self._high = flow.HIGH_WATER
        self._low = flow.LOW_WATER
        self._write_paused = False
        self._eof_out = False  # write_eof asked: no more writes
        self._closing = False
        self._lost = False
        self._reading = asyncio.Event()
        self._reading.set()
        self._wakeup: asyncio.Future[None] | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._linger: asyncio.Task[None] | None = None

    # ------------------------------------------------- lifecycle

    def attach(self, protocol: asyncio.BaseProtocol) -> None:
        """Hand the stream to `protocol` (connection_made) and start moving bytes."""
        self.set_protocol(protocol)
        protocol.connection_made(self)

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol
        if not self._tasks:
            self._tasks = [
                asyncio.ensure_future(self._send()),
                asyncio.ensure_future(self._receive()),
            ]
            for task in self._tasks:
                task.add_done_callback(self._task_done)

    def get_protocol(self) -> Any:
        return self.protocol

    def _task_done(self, task: asyncio.Task[None]) -> None:
        if self._lost:
            return
        if task.cancelled() or task.exception() is not None:
            error = None if task.cancelled() else task.exception()
            self._lose(error if isinstance(error, Exception) else None)
        elif all(t.done() for t in self._tasks) and self._linger is None:
            # Both directions ended cleanly, but our last bytes may still be on their
            # way to a destination that reads slowly: cancelling now would make the
            # agent drop them. Let the server end the call; cancel only after LINGER.
            self._linger = asyncio.ensure_future(self._finish())

    async def _finish(self) -> None:
        try:
            await asyncio.wait_for(self.stream.wait_closed(), self.LINGER)
        except (TimeoutError, grpc.RpcError):
            pass
        finally:
            self._lose(None)

    def _lose(self, exc: Exception | None) -> None:
        if self._lost:
            return
        self._lost = True
        self._closing = True
        for task in self._tasks:
            task.cancel()
        self.stream.close()
        self._reading.set()
        self._wake()
        if self.protocol is not None:
            self.protocol.connection_lost(exc)

    # ------------------------------------------------- the two directions

    def _wake(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _send(self) -> None:
        outgoing, stream = self._outgoing, self.stream
        while True:
            while not outgoing and not self._eof_out:
                self._wakeup = asyncio.get_running_loop().create_future()
                try:
                    await self._wakeup
                finally:
                    self._wakeup = None
            if outgoing:
                data = outgoing.popleft()
                if outgoing:
                    data = join_queued(data, outgoing)
                self._queued -= len(data)
                await stream.write(data)
                if self._write_paused and self._queued <= self._low:
                    self._write_paused = False
                    self.protocol.resume_writing()
                continue
            await stream.write_eof()
            return

    async def _receive(self) -> None:
        stream, reading = self.stream, self._reading
        while True:
            # Paused: no read (the stream's credit holds the agent back) and nothing
            # delivered; at most the one chunk read meanwhile waits here.
            if not reading.is_set():
                await reading.wait()
            data = await stream.read()
            if not reading.is_set():
                await reading.wait()
            if self._lost:
                return
            if not data:
                if not self.protocol.eof_received():
                    self.close()
                return
            if not self._closing:
                self.protocol.data_received(data)

    # ------------------------------------------------- Transport

    def write(self, data: bytes | bytearray | memoryview) -> None:
        if self._eof_out or self._lost or not data:
            return
        self._outgoing.append(bytes(data))
        self._queued += len(data)
        if not self._write_paused and self._queued > self._high:
            self._write_paused = True
            self.protocol.pause_writing()
        self._wake()

    def writelines(self, chunks: Any) -> None:
        for chunk in chunks:
            self.write(chunk)

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        if not self._eof_out:
            self._eof_out = True
            self._wake()

    def close(self) -> None:
        """No more reading; what was written goes, then the half-close."""
        if self._closing:
            return
        self._closing = True
        self.write_eof()

    def abort(self) -> None:
        self._lose(None)

    def is_closing(self) -> bool:
        return self._closing

    def pause_reading(self) -> None:
        self._reading.clear()

    def resume_reading(self) -> None:
        self._reading.set()

    def is_reading(self) -> bool:
        return self._reading.is_set()

    def set_write_buffer_limits(self, high: int | None = None, low: int | None = None) -> None:
        self._high = flow.HIGH_WATER if high is None else high
        self._low = min(self._high, self._high // 4 if low is None else low)

    def get_write_buffer_size(self) -> int:
        return self._queued

    def get_write_buffer_limits(self) -> tuple[int, int]:
        return self._low, self._high

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default


async def bridged_socket(stream: TunnelStream | DataStream) -> socket.socket:
    """One end of a socketpair whose other end is spliced (`relay.splice`) to `stream`'s
    data connection, or to its Tunnel.Dial stream as a `StreamTransport`, until both
    sides close: for callers that need a socket (tests, bench/tunnel's socket row). The
    proxy takes no socket (`transport_dialer`)."""
    other: Any = stream.link if isinstance(stream, DataStream) else StreamTransport(stream)
    ours, theirs = socket.socketpair()
    try:
        ours.setblocking(False)
        theirs.setblocking(False)
        transport, _ = await asyncio.get_running_loop().connect_accepted_socket(Pending, ours)
    except BaseException:
        ours.close()
        theirs.close()
        stream.close()
        raise
    splice(transport, other)
    return theirs


# ---------------------------------------------------------------- wiring for a process


class Dialled:
    """A tunnelled connection as the proxy's upstream step returns it
    (waygate.proxy.upstream.Attachable), not yet attached: its data connection itself
    (`relay.Link`), or on the gRPC fallback its Tunnel.Dial stream as a
    `StreamTransport`.

    `attach(protocol)` makes it that protocol's transport: bytes the destination
    sent first were held for it. `start_tls` runs a TLS client inside it (a second
    `Link` with it as its transport, inside the data connection's own mTLS): the
    destination's certificate is verified here, end to end, and the replica and the
    agent relay records they cannot read. Bounded as what it wraps is (HIGH_WATER per
    direction); a failed or cancelled handshake aborts the tunnelled connection.
    """

    __slots__ = ("transport",)

    def __init__(self, transport: Link | StreamTransport) -> None:
        self.transport = transport

    def attach(self, protocol: asyncio.BaseProtocol) -> None:
        self.transport.attach(protocol)

    def close(self) -> None:
        self.transport.abort()

    def abort(self) -> None:
        self.transport.abort()

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return self.transport.get_extra_info(name, default)

    async def start_tls(
        self, context: ssl.SSLContext, server_hostname: str, timeout: float
    ) -> Dialled:
        """The TLS connection inside this one, its handshake done within `timeout`;
        ssl.SSLError (the verification's own, with its code) when it failed."""
        inner = Link(context, server_side=False, server_hostname=server_hostname)
        self.transport.attach(inner)
        try:
            async with asyncio.timeout(timeout):
                await inner.established
        except LinkClosed as exc:
            inner.abort()
            if isinstance(exc.__cause__, ssl.SSLError):
                raise exc.__cause__ from None
            raise
        except BaseException:
            inner.abort()
            raise
        return Dialled(inner)


def transport_dialer(client: TunnelClient, error: Callable[..., Exception]) -> Callable[..., Any]:
    """The proxy's upstream-connect step for tunnel endpoints
    (waygate.proxy.upstream.Connect): the dialled connection as a `Dialled`, which
    every upstream protocol (HTTP/1.1, HTTP/2, reencrypt TLS, the passthrough relay,
    mirrors) attaches to directly: no socket, on either path.

    `error(reason, kind, retryable=...)` builds the proxy's ConnectError, so this
    module needs nothing from the proxy. The endpoint's address is the host the
    agent connects to, its node the node whose agent does it.
    """

    async def connect(target: Any, timeout: float, trace_context: str | None) -> Dialled:
        return await _dialled(client, error, target, timeout, trace_context)

    return connect


def early_transport_dialer(
    client: TunnelClient, error: Callable[..., Exception]
) -> Callable[..., Any]:
    """`transport_dialer` with early data (waygate.proxy.upstream.EarlyConnect): the
    request's first bytes go with the dial (`TunnelClient.dial(early=...)`), so they do
    not wait for its answer. Bytes over `EARLY_LIMIT` are not sent (False: the caller
    writes them once connected), nor any from a client that dials end to end (its
    bytes need the TLS session with the agent, which begins after the answer)."""

    async def connect(
        target: Any,
        timeout: float,
        trace_context: str | None,
        early: bytes,
        replay_safe: bool,
    ) -> tuple[Dialled, bool]:
        if len(early) > EARLY_LIMIT or client.end_to_end:
            early = b""
        dialled = await _dialled(client, error, target, timeout, trace_context, early, replay_safe)
        return dialled, bool(early)

    return connect


async def _dialled(
    client: TunnelClient,
    error: Callable[..., Exception],
    target: Any,
    timeout: float,
    trace_context: str | None,
    early: bytes = b"",
    replay_safe: bool = False,
) -> Dialled:
    try:
        stream = await client.dial(
            target.node,
            target.port,
            target.address,
            timeout=timeout,
            trace_context=trace_context,
            early=early,
            replay_safe=replay_safe,
        )
    except DialFailed as failed:
        raise error(str(failed), "tunnel", retryable=failed.retryable) from None
    if isinstance(stream, DataStream):
        return Dialled(stream.link)
    return Dialled(StreamTransport(stream))


async def process_client(
    process: Any,
    presence: Any,
    *,
    server_name: str | None = None,
    pool_size: int = 0,
    pool_idle: float = 30.0,
    end_to_end: bool = False,
) -> TunnelClient:
    """A TunnelClient with a ServiceProcess's TLS: its certificate from certs (channels
    renewed after each rotation), static tls_* files, or plaintext. Closed at stop.
    `end_to_end`: its dials' default (`TunnelClient.dial`)."""
    from waygate.core.grpcclient import ClientTLS

    settings = process.settings
    certificates = await process.certificates()
    # Raw dials (data connections) present the same certificate as the channels.
    context: Callable[[], ssl.SSLContext | None]
    if certificates is not None:
        from waygate.core.grpctls import client_credentials

        def credentials() -> grpc.ChannelCredentials | None:
            return client_credentials(certificates.rotator, certificates.trust)

        context = rotating_client_context(certificates.rotator, certificates.trust)

    elif settings.tls_cert_file is not None:
        static = ClientTLS(
            settings.tls_client_ca_file, settings.tls_cert_file, settings.tls_key_file
        ).credentials()
        static_context = client_context(
            settings.tls_client_ca_file.read_bytes() if settings.tls_client_ca_file else None,
            settings.tls_cert_file.read_bytes(),
            settings.tls_key_file.read_bytes() if settings.tls_key_file else None,
        )

        def credentials() -> grpc.ChannelCredentials | None:
            return static

        def context() -> ssl.SSLContext | None:
            return static_context

    else:

        def credentials() -> grpc.ChannelCredentials | None:
            return None

        def context() -> ssl.SSLContext | None:
            return None

    client = TunnelClient(
        presence,
        credentials=credentials,
        server_name=server_name,
        ssl_context=context,
        pool_size=pool_size,
        pool_idle=pool_idle,
        end_to_end=end_to_end,
    )
    if certificates is not None:
        for subscribe in (certificates.rotator.subscribe, certificates.trust.subscribe):
            process.on_stop(_async_call(subscribe(lambda _changed: client.renew_channels())))
    process.on_stop(client.close)
    return client


def _async_call(function: Callable[[], Any]) -> Callable[[], Any]:
    async def run() -> None:
        function()

    return run
