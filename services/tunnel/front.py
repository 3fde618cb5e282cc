"""The tunnel server's HTTPS front (yurttunnel parity): HTTP requests to edge nodes.

A cloud-side client (the kube-apiserver fetching logs from an edge kubelet,
`curl`, anything speaking HTTP/1.1 over TLS) connects to `front_port`
(10263, as yurttunnel's) either directly or because `waygate tunnel
iptables` rewrote its connection to NODE-IP:10250. The front:

1. terminates TLS and requires a client certificate from `front_client_ca_file`
   (default: the CA this process trusts for its own clients: certs' bundle
   or `tls_client_ca_file`);
2. reads the request head (at most `MAX_HEAD` bytes, within `front_head_timeout`)
   and takes the target from the absolute-form request target or the Host
   header, which must name HOST:PORT;
3. maps HOST to an edge node: an IP address through `front_node_addresses`
   (ADDR=NODE pairs: the node-address map, chosen over the resolver's
   endpoints because a node's own address, the kubelet's, is not an endpoint
   of any Service), or a DNS name naming the node itself (then the agent dials
   its default host, 127.0.0.1, as a Dial without a host does);
4. dials it through this replica's hub (`hub.selection.dial`, the one rule the
   gRPC and raw dials follow: with several agents for the node, the next one when
   one refuses for a reason another could answer or does not answer), with the
   request's W3C trace context;
5. writes the head (hop-by-hop headers, those the client's Connection names,
   and client-supplied identity headers removed; `Connection: close`, or
   `Connection: Upgrade` for an upgrade), then the request's body as httptools
   frames it (Content-Length or chunked, re-chunked) and nothing after it: a
   pipelined second request never reaches the node. The response relays back
   until the node closes. For an upgrade, the client's bytes after the head are
   held (bounded) until the node answers 101, then relayed both ways as they
   are (exec, attach, port-forward, WebSocket); any other answer drops them.

One request per client connection: the upstream is asked to close after the
response, so a connection never carries a request for another node to the
node of the first. On `front_upstream_tls_ports` (the kubelet's 10250) the
front speaks TLS to the node inside the tunnelled connection (memory BIOs),
presenting `front_upstream_cert_file` and verifying the node against
`front_upstream_ca_file` when given; other ports get plain HTTP.

Errors are an HTTP status with a one-line reason, then close: 400 malformed
request or unknown target, 408 head too slow, 431 head too large, 403 the
agent's allow-list refused, 502 unreachable or TLS with the node failed, 503
no agent / draining / too many connections, 504 dial timeout.

Invariants: every buffer is bounded (the head by MAX_HEAD; client-to-node
bytes by core.flow.HIGH_WATER, after which reading the client pauses until the
tunnel's credit lets them through; node-to-client bytes by the client
transport's write buffer, whose high-water mark delays the credit granted back
to the agent); each connection costs two tasks (one per direction), nothing
per chunk; a connection idle for `front_idle_timeout` is closed by one sweep
task; a closed client, a closed tunnel connection or a stop releases
everything the connection held.
"""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
import logging
import socket
import ssl
import time
from collections import deque
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httptools
from opentelemetry import trace

from waygate.core import errors, flow, httpheaders, tracing
from waygate.core.settings import parse_duration, port_number, positive, setting
from waygate.tunnel import mux
from waygate.tunnel import server as tunnel_server
from waygate.tunnel.mux import ConnectionClosed, Refused
from waygate.tunnel.v1 import tunnel_pb2 as pb

if TYPE_CHECKING:
    from waygate.core.runtime import ServiceProcess
    from waygate.tunnel.server import Hub, ServerConnection

log = logging.getLogger(__name__)

DEFAULT_FRONT_PORT = 10263
MAX_HEAD = 64 * 1024
DEFAULT_DIAL_HOST = "127.0.0.1"  # what a Dial without a host reaches on the agent

# Hop-by-hop headers (the one rule book, waygate.core.httpheaders) are never
# forwarded, except Transfer-Encoding: the front sends the body chunked again as
# httptools framed it. Headers a client may not set (identity, impersonation,
# client certificate) are dropped by httpheaders.client_forbidden.
_DROPPED = httpheaders.HOP_BY_HOP - {b"transfer-encoding"}


def _check_ports(ports: tuple[str, ...]) -> str | None:
    for port in ports:
        if not port.isdigit() or not 0 < int(port) < 65536:
            return f"ports must be numbers 1..65535, not {port!r}"
    return None


def _check_node_addresses(pairs: tuple[str, ...]) -> str | None:
    try:
        node_address_map(pairs)
    except ValueError as exc:
        return str(exc)
    return None


@dataclasses.dataclass(frozen=True, kw_only=True)
class FrontSettings:
    """The front's settings, mixed into the tunnel server's Settings."""

    front_port: int = setting(
        DEFAULT_FRONT_PORT,
        help="HTTPS front: requests to NODE-ADDRESS:PORT forwarded through the tunnel (mTLS)",
        check=port_number,
    )
    front_client_ca_file: Path | None = setting(
        None,
        help="PEM CA whose certificates the front accepts from clients (e.g. the cluster CA "
        "that signs the kube-apiserver's kubelet client certificate); unset: the CA this "
        "server trusts for its own clients",
    )
    front_node_addresses: tuple[str, ...] = setting(
        (),
        help="which node an address belongs to, comma-separated ADDR=NODE pairs "
        "(a Host naming the node itself needs no entry)",
        check=_check_node_addresses,
    )
    front_upstream_tls_ports: tuple[str, ...] = setting(
        ("10250",),
        help="destination ports spoken to in TLS through the tunnel (the kubelet's), "
        "comma-separated; other ports get plain HTTP",
        check=_check_ports,
    )
    front_upstream_ca_file: Path | None = setting(
        None,
        help="PEM CA that signs the nodes' serving certificates on TLS ports (checked for the "
        "address or node name); unset: not verified, as the kube-apiserver does without "
        "--kubelet-certificate-authority",
    )
    front_upstream_cert_file: Path | None = setting(
        None,
        help="PEM client certificate the front presents on TLS ports (the kubelet authorizes "
        "it, e.g. for nodes/proxy and nodes/log)",
    )
    front_upstream_key_file: Path | None = setting(None, help="PEM key of front_upstream_cert_file")
    front_max_connections: int = setting(
        1000, help="client connections the front holds at once (more get 503)", check=positive
    )
    front_head_timeout: float = setting(
        10.0,
        help="time a client has to send its request head",
        parse=parse_duration,
        check=positive,
    )
    front_idle_timeout: float = setting(
        3600.0,
        help="a relayed connection with no byte either way for this long is closed",
        parse=parse_duration,
        check=positive,
    )


def upstream_tls_context(settings: FrontSettings) -> ssl.SSLContext:
    """The client context for TLS ports: TLS 1.2+, the front's client certificate, and
    the nodes' CA when given (otherwise no verification, said once at start)."""
    if (settings.front_upstream_cert_file is None) != (settings.front_upstream_key_file is None):
        raise errors.FailedPrecondition(
            "give front_upstream_cert_file and front_upstream_key_file together, or neither"
        )
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if settings.front_upstream_ca_file is not None:
        context.load_verify_locations(settings.front_upstream_ca_file)
    else:
        if settings.front_upstream_tls_ports:
            log.warning(
                "tunnel front: nodes' certificates on TLS ports are not verified "
                "(set front_upstream_ca_file)"
            )
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
    if settings.front_upstream_cert_file is not None:
        context.load_cert_chain(settings.front_upstream_cert_file, settings.front_upstream_key_file)
    context.set_alpn_protocols(["http/1.1"])
    return context


# ---------------------------------------------------------------- sans-IO: requests


class BadRequest(ValueError):
    """The request cannot be forwarded; `status` and the message go back to the client."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def node_address_map(pairs: tuple[str, ...] | list[str]) -> dict[str, str]:
    """'10.0.0.5=edge-1' pairs -> {canonical address: node}; ValueError names a bad pair."""
    mapping: dict[str, str] = {}
    for pair in pairs:
        address, sep, node = pair.partition("=")
        try:
            canonical = str(ipaddress.ip_address(address.strip()))
        except ValueError:
            raise ValueError(f"{pair!r} is not ADDR=NODE with an IP address") from None
        node = node.strip().lower().rstrip(".")
        if not sep or not node:
            raise ValueError(f"{pair!r} is not ADDR=NODE: the node is missing")
        mapping[canonical] = node
    return mapping


@dataclasses.dataclass(frozen=True)
class RequestHead:
    method: bytes
    target: bytes  # origin-form (/path?query), or '*'
    version: str
    headers: tuple[tuple[bytes, bytes], ...]
    upgrade: bool
    host: str  # lower case, no brackets
    port: int


class _RequestReader:
    """httptools callbacks for the one request a front connection carries.

    Only the first message counts: its URL and headers until its head ends, its
    body (re-framed in chunks when it came chunked) until it ends; everything after
    that (a pipelined second request) is never forwarded.
    """

    __slots__ = (
        "body",
        "body_bytes",
        "chunked",
        "complete",
        "headers",
        "message_complete",
        "method",
        "parser",
        "upgrade",
        "url",
        "version",
    )

    def __init__(self, body: deque[bytes] | None = None) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.complete = False  # the first head ended
        self.message_complete = False  # the first request ended
        self.chunked = False
        self.body = body  # where body bytes go (None: dropped, as parse_head does)
        self.body_bytes = 0  # appended to `body` since the owner last looked
        self.parser = httptools.HttpRequestParser(self)
        # Read from the parser when the first head ends: later it describes later input.
        self.method = b""
        self.version = ""
        self.upgrade = False

    def on_url(self, url: bytes) -> None:
        if not self.complete:
            self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.complete:
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if not self.complete:
            self.complete = True
            self.chunked = any(n.lower() == b"transfer-encoding" for n, _ in self.headers)
            parser = self.parser
            self.method = parser.get_method()
            self.version = parser.get_http_version()
            self.upgrade = parser.should_upgrade()

    def on_body(self, body: bytes) -> None:
        if self.message_complete or self.body is None:
            return
        piece = bytes(body)
        if self.chunked:  # httptools hands over the chunks' data: frame it again
            piece = b"%x\r\n" % len(piece) + piece + b"\r\n"
        self.body.append(piece)
        self.body_bytes += len(piece)

    def on_message_complete(self) -> None:
        if self.message_complete:
            return
        self.message_complete = True
        if self.chunked and self.body is not None:
            self.body.append(_LAST_CHUNK)
            self.body_bytes += len(_LAST_CHUNK)


_LAST_CHUNK = b"0\r\n\r\n"


def split_authority(authority: bytes) -> tuple[str, int]:
    """b'10.0.0.5:10250' / b'[fd00::5]:10250' / b'edge-1:10250' -> (host, port)."""
    text = authority.decode("ascii", "replace").strip()
    if text.startswith("["):
        host, _, rest = text[1:].partition("]")
        port_text = rest[1:] if rest.startswith(":") else ""
    else:
        host, _, port_text = text.rpartition(":")
        if not _:
            host, port_text = text, ""
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise BadRequest(
            400, f"the request must name its target as HOST:PORT, not {errors.excerpt(text)}"
        )
    return host.lower().rstrip("."), int(port_text)


def parse_head(head: bytes) -> RequestHead:
    """Parse one request head (up to and including the blank line; what follows is ignored)."""
    callbacks = _RequestReader()
    try:
        callbacks.parser.feed_data(head)
    except httptools.HttpParserUpgrade:
        pass
    except httptools.HttpParserError as exc:
        if not callbacks.complete:
            raise BadRequest(400, f"malformed request: {exc}") from None
    if not callbacks.complete:
        raise BadRequest(400, "malformed request: incomplete head")
    return request_head(callbacks)


def request_head(callbacks: _RequestReader) -> RequestHead:
    """The first request's head as `callbacks` collected it."""
    url = callbacks.url
    target = url
    authority = b""
    if not url.startswith(b"/") and url != b"*":
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            raise BadRequest(400, "malformed request target") from None
        if parsed.host is None:
            raise BadRequest(400, "malformed request target")
        url_host: bytes = parsed.host
        authority = b"[" + url_host + b"]" if b":" in url_host else url_host
        if parsed.port:
            authority += b":" + str(parsed.port).encode()
        target = (parsed.path or b"/") + (b"?" + parsed.query if parsed.query else b"")
    hosts = [v for n, v in callbacks.headers if n.lower() == b"host"]
    if len(hosts) > 1:
        raise BadRequest(400, "more than one Host header")
    if not authority:
        if not hosts:
            raise BadRequest(400, "the request names no target: no Host header")
        authority = hosts[0]
    host, port = split_authority(authority)
    return RequestHead(
        method=callbacks.method,
        target=target,
        version=callbacks.version,
        headers=tuple(callbacks.headers),
        upgrade=callbacks.upgrade,
        host=host,
        port=port,
    )


def upstream_head(head: RequestHead) -> bytes:
    """The head sent through the tunnel: origin-form, only end-to-end headers, one request."""
    lines = [head.method + b" " + head.target + b" HTTP/" + head.version.encode()]
    upgrade_to = b""
    # Headers the client's Connection names are hop-by-hop too (RFC 9110 7.6.1); Host
    # stays whatever Connection says (it names the target).
    named = httpheaders.connection_named(
        [value for name, value in head.headers if name.lower() == b"connection"]
    )
    named.discard(b"host")
    for name, value in head.headers:
        lowered = name.lower()
        if lowered == b"upgrade":
            upgrade_to = value
        if lowered in _DROPPED or lowered in named or httpheaders.client_forbidden(lowered):
            continue
        lines.append(name + b": " + value)
    if head.upgrade and upgrade_to:
        lines += [b"Connection: Upgrade", b"Upgrade: " + upgrade_to]
    else:
        lines.append(b"Connection: close")
    return b"\r\n".join(lines) + b"\r\n\r\n"


@dataclasses.dataclass(frozen=True)
class Destination:
    node: str
    address: str  # host:port as the agent dials it
    server_name: str  # the name a TLS upstream's certificate must carry
    port: int


def destination(head: RequestHead, addresses: dict[str, str]) -> Destination:
    """Which node and address a request goes to, or BadRequest."""
    try:
        ip = ipaddress.ip_address(head.host)
    except ValueError:
        ip = None
    if ip is not None:
        node = addresses.get(str(ip))
        if node is None:
            raise BadRequest(
                400, f"no edge node is known for address {ip} (the front's node-address map)"
            )
        host = f"[{ip}]" if ip.version == 6 else str(ip)
        return Destination(node, f"{host}:{head.port}", str(ip), head.port)
    return Destination(head.host, f"{DEFAULT_DIAL_HOST}:{head.port}", head.host, head.port)


_REASONS = {
    400: "Bad Request",
    403: "Forbidden",
    408: "Request Timeout",
    431: "Request Header Fields Too Large",
    502: "Bad Gateway",
    503: "Service Unavailable",
    504: "Gateway Timeout",
}

REFUSAL_HTTP = {
    pb.NOT_ALLOWED: 403,
    pb.UNREACHABLE: 502,
    pb.NO_AGENT: 503,
    pb.TIMEOUT: 504,
    pb.DRAINING: 503,
    pb.INVALID: 400,
}


def error_response(status: int, message: str) -> bytes:
    body = (message.replace("\r", " ").replace("\n", " ") + "\n").encode("utf-8", "replace")
    return (
        f"HTTP/1.1 {status} {_REASONS.get(status, 'Error')}\r\n"
        f"Content-Type: text/plain; charset=utf-8\r\nContent-Length: {len(body)}\r\n"
        "Connection: close\r\n\r\n"
    ).encode() + body


# ---------------------------------------------------------------- the tunnel side


class _Upstream:
    """A tunnelled connection from this replica's hub, as the front uses it.

    The one place the front touches the server's connection internals (the
    frame markers of `waygate.tunnel.server`): read() gives bytes, b"" at the
    node's half-close, and raises ConnectionClosed once the connection ended.
    """

    __slots__ = ("connection",)

    def __init__(self, connection: ServerConnection) -> None:
        self.connection = connection

    async def read(self) -> bytes:
        item = await self.connection.next_for_dialer()
        if type(item) is bytes:
            return item
        if item is tunnel_server.EOF:
            return b""
        raise ConnectionClosed

    def delivered(self, size: int) -> None:
        self.connection.delivered(size)

    async def write(self, data: bytes) -> None:
        await self.connection.send(data)

    def write_eof(self) -> None:
        self.connection.send_eof()

    def close(self, reason: str) -> None:
        connection = self.connection
        if not connection.finished:
            connection.session.send(mux.close_request(connection.connect_id, reason))
            connection.finish(tunnel_server.CLOSED)


class _TlsUpstream:
    """TLS to the node, spoken inside a tunnelled connection (memory BIOs, no socket).

    Raw bytes from the agent are granted back (credit) as they are fed to
    OpenSSL, which happens only when the plaintext is used up: at most one
    chunk waits in the BIO. One lock serialises writes to the tunnel (the
    reading side may owe the node a TLS record too).
    """

    __slots__ = ("_incoming", "_lock", "_outgoing", "inner", "tls")

    def __init__(self, inner: _Upstream, context: ssl.SSLContext, server_name: str) -> None:
        self.inner = inner
        self._incoming = ssl.MemoryBIO()
        self._outgoing = ssl.MemoryBIO()
        self.tls = context.wrap_bio(
            self._incoming, self._outgoing, server_side=False, server_hostname=server_name
        )
        self._lock = asyncio.Lock()

    async def _flush(self) -> None:
        async with self._lock:
            data = self._outgoing.read()
            if data:
                await self.inner.write(data)

    async def _fill(self) -> bool:
        """Feed the next raw chunk to OpenSSL; False at the node's end of stream."""
        raw = await self.inner.read()
        if not raw:
            self._incoming.write_eof()
            return False
        self._incoming.write(raw)
        self.inner.delivered(len(raw))
        return True

    async def handshake(self, timeout: float) -> None:
        async with asyncio.timeout(timeout):
            while True:
                try:
                    self.tls.do_handshake()
                    break
                except ssl.SSLWantReadError:
                    await self._flush()
                    if not await self._fill():
                        raise ConnectionClosed from None
            await self._flush()

    async def read(self) -> bytes:
        while True:
            try:
                data = self.tls.read(mux.MAX_CHUNK)
            except ssl.SSLWantReadError:
                await self._flush_if_idle()
                if not await self._fill():
                    return b""
                continue
            except (ssl.SSLZeroReturnError, ssl.SSLEOFError):
                return b""
            except ssl.SSLError:
                raise ConnectionClosed from None
            await self._flush_if_idle()
            return data

    async def _flush_if_idle(self) -> None:
        """Records reading produced (rare after the handshake), unless the writer is
        mid-send: waiting for its credit here could stall the node's response behind
        the request body, and the writer's next flush takes them anyway."""
        if self._outgoing.pending and not self._lock.locked():
            await self._flush()

    def delivered(self, size: int) -> None:
        """Credit went back when the raw bytes were fed to OpenSSL."""

    async def write(self, data: bytes) -> None:
        try:
            self.tls.write(data)
        except ssl.SSLError:
            raise ConnectionClosed from None
        await self._flush()

    def write_eof(self) -> None:
        """TLS has no half-close short of close_notify, which ends the session: nothing."""

    def close(self, reason: str) -> None:
        self.inner.close(reason)


# ---------------------------------------------------------------- the listener


class Front:
    """The listener's shared state: settings, hub, open connections."""

    def __init__(self, hub: Hub, settings: FrontSettings, dial_timeout: float) -> None:
        self.hub = hub
        self.addresses = node_address_map(settings.front_node_addresses)
        self.max_connections = settings.front_max_connections
        self.head_timeout = settings.front_head_timeout
        self.idle_timeout = settings.front_idle_timeout
        self.dial_timeout = dial_timeout
        self.tls_ports = frozenset(int(p) for p in settings.front_upstream_tls_ports)
        self.upstream_context = upstream_tls_context(settings)
        self.connections: set[FrontConnection] = set()
        self.tasks: set[asyncio.Task[None]] = set()
        self.server: asyncio.Server | None = None
        self._sweeper: asyncio.Task[None] | None = None

    async def start(self, host: str, port: int, context: ssl.SSLContext) -> int:
        loop = asyncio.get_running_loop()
        self.server = await loop.create_server(
            lambda: FrontConnection(self),
            host,
            port,
            ssl=context,
            ssl_handshake_timeout=self.head_timeout,
            backlog=1024,
        )
        self._sweeper = loop.create_task(self._sweep(), name="tunnel-front-sweep")
        return int(self.server.sockets[0].getsockname()[1])

    async def _sweep(self) -> None:
        """Close connections idle past the timeout (one task for all of them)."""
        period = min(self.head_timeout, self.idle_timeout) / 2
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            for connection in list(self.connections):
                connection.check_timeouts(now)

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
        for connection in list(self.connections):
            connection.abort("the tunnel server is stopping")
        tasks = [*self.tasks, *([self._sweeper] if self._sweeper is not None else [])]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.server is not None:
            await self.server.wait_closed()


_HEAD, _DIALING, _RELAY, _DONE = range(4)
# Linux TCP states (tcp_states.h) of a socket whose peer has closed or reset it.
_TCP_CLOSE, _TCP_CLOSE_WAIT = 7, 8


class FrontConnection(asyncio.Protocol):
    """One client connection: read a head, dial, relay."""

    def __init__(self, front: Front) -> None:
        self.front = front
        self.transport: asyncio.Transport | None = None
        self.state = _HEAD
        # Client -> node bytes waiting for tunnel credit: the request's body (only its
        # first request's), or after a 101 everything the client sends.
        self.pending: deque[bytes] = deque()
        self.request = _RequestReader(self.pending)
        self.head_bytes = 0  # fed to the parser before the head ended
        self.raw = False  # after the node's 101: client bytes pass as they are
        self.held: bytearray | None = None  # an upgrade's bytes, until the node answers
        self.started = self.last_activity = time.monotonic()
        # Reading the client pauses while more than flow.HIGH_WATER of its bytes wait
        # (held for an upgrade's 101 or for tunnel credit), resumes at flow.LOW_WATER.
        self.flow: flow.FlowControl | None = None
        self.client_eof = False
        self._pending_ready: asyncio.Future[None] | None = None
        self.upstream: _Upstream | _TlsUpstream | None = None

    # ------------------------------------------------- asyncio.Protocol

    @property
    def pending_bytes(self) -> int:
        """Client bytes held for the node (an upgrade's, or waiting for credit)."""
        return self.flow.buffered if self.flow is not None else 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.flow = flow.FlowControl(transport)  # type: ignore[arg-type]
        if len(self.front.connections) >= self.front.max_connections:
            self.reply(503, "the tunnel front is at its connection limit; retry later")
            return
        self.front.connections.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_activity = time.monotonic()
        if self.raw:
            self._queue(data)
            return
        if self.state == _DONE:
            return
        held = self.held
        if held is not None:  # an upgrade waiting for the node's 101
            held += data
            self.flow.queued(len(data))  # type: ignore[union-attr]
            return
        request = self.request
        if request.message_complete:
            return  # one request per connection: a pipelined one is never forwarded
        heading = not request.complete
        try:
            request.parser.feed_data(data)
        except httptools.HttpParserUpgrade as upgrade:
            if heading and request.upgrade:  # (never a pipelined request's upgrade)
                self.held = bytearray(data[upgrade.args[0] :] if upgrade.args else b"")
        except httptools.HttpParserError as exc:
            if heading and not request.complete:
                self.reply(400, f"malformed request: {exc}")
                return
            # Bad framing after the head: forward what was sound, take no more.
            request.message_complete = True
        added, request.body_bytes = request.body_bytes, 0
        if added:
            self.flow.queued(added)  # type: ignore[union-attr]
            self._wake_sender()
        if not heading:
            return
        if not request.complete:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:
                self.reply(431, f"the request head is larger than {MAX_HEAD} bytes")
            return
        try:
            head = request_head(request)
            target = destination(head, self.front.addresses)
        except BadRequest as exc:
            self.reply(exc.status, str(exc))
            return
        self.state = _DIALING
        task = asyncio.get_running_loop().create_task(self._forward(head, target))
        self.front.tasks.add(task)
        task.add_done_callback(self.front.tasks.discard)

    def _queue(self, data: bytes) -> None:
        self.pending.append(data)
        self.flow.queued(len(data))  # type: ignore[union-attr]
        self._wake_sender()

    def _upgrade_answered(self, response: bytes) -> None:
        """The node's first bytes after an upgrade request: a 101 lets the held bytes go."""
        held, self.held = self.held, None
        if response.startswith((b"HTTP/1.1 101", b"HTTP/1.0 101")):
            self.raw = True
            if held:  # already counted as held: they wait for credit now
                self.pending.append(bytes(held))
                self._wake_sender()
        else:
            self.request.message_complete = True  # refused: nothing more goes up
            if held:
                self.flow.drained(len(held))  # type: ignore[union-attr]

    def eof_received(self) -> bool:
        self.client_eof = True
        self._wake_sender()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.front.connections.discard(self)
        self.client_eof = True
        self._finish("the front's client went away")
        self._wake_sender()
        if self.flow is not None:
            self.flow.closed()

    def pause_writing(self) -> None:
        self.flow.pause_writing()  # type: ignore[union-attr]

    def resume_writing(self) -> None:
        self.flow.resume_writing()  # type: ignore[union-attr]

    # ------------------------------------------------- helpers

    def reply(self, status: int, message: str) -> None:
        """An error response, then close (only before the relay started)."""
        self.state = _DONE
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(error_response(status, message))
            transport.close()

    def abort(self, reason: str) -> None:
        self._finish(reason)
        if self.transport is not None:
            self.transport.abort()

    def check_timeouts(self, now: float) -> None:
        if self.state == _HEAD and now - self.started > self.front.head_timeout:
            self.reply(408, f"no complete request head within {self.front.head_timeout:g}s")
        elif self.state == _RELAY and now - self.last_activity > self.front.idle_timeout:
            self.abort("idle")
        elif self.flow is not None and self.flow.reading_paused and self._peer_gone():
            # While reading is paused (its bytes wait for tunnel credit) the loop
            # cannot see the client's FIN or RST: ask the kernel.
            self.abort("the front's client went away")

    def _peer_gone(self) -> bool:
        raw = self.transport.get_extra_info("socket") if self.transport is not None else None
        if raw is None:
            return False
        try:
            state = raw.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0]
        except OSError:
            return True
        return state in (_TCP_CLOSE, _TCP_CLOSE_WAIT)

    def _finish(self, reason: str) -> None:
        self.state = _DONE
        upstream, self.upstream = self.upstream, None
        if upstream is not None:
            upstream.close(reason)

    def _wake_sender(self) -> None:
        ready = self._pending_ready
        if ready is not None and not ready.done():
            ready.set_result(None)

    # ------------------------------------------------- the forwarding task

    async def _forward(self, request: RequestHead, target: Destination) -> None:
        front = self.front
        carrier = {
            k.decode("latin-1").lower(): v.decode("latin-1")
            for k, v in request.headers
            if k.lower() in (b"traceparent", b"tracestate")
        }
        span_name = "tunnel front " + request.method.decode("ascii", "replace")
        with tracing.tracer().start_as_current_span(
            span_name,
            context=tracing.extract_context(carrier.items()),
            kind=trace.SpanKind.SERVER,
            attributes={
                "waygate.tunnel.node": target.node,
                "waygate.tunnel.address": target.address,
                "waygate.tunnel.replica": front.hub.server_id,
            },
        ) as span:
            try:
                # The hub's one rule for several agents of a node (the gRPC and raw
                # dials use it too): the next agent when one refuses for a reason
                # another could answer. It carries this span's trace context.
                connection = await front.hub.selection.dial(
                    target.node, target.address, front.dial_timeout
                )
            except Refused as refused:
                span.set_attribute("waygate.tunnel.refusal", mux.reason_name(refused.reason))
                self.reply(REFUSAL_HTTP.get(refused.reason, 502), str(refused))
                return
            span.set_attribute("waygate.tunnel.connection_id", connection.connect_id)
            plain = _Upstream(connection)
            upstream: _Upstream | _TlsUpstream = plain
            if self.state != _DIALING:  # the client went away while dialing
                plain.close("the front's client went away")
                return
            if target.port in front.tls_ports:
                tls = _TlsUpstream(plain, front.upstream_context, target.server_name)
                self.upstream = tls
                try:
                    await tls.handshake(front.dial_timeout)
                except (ssl.SSLError, ConnectionClosed, TimeoutError) as exc:
                    span.set_attribute("waygate.tunnel.refusal", "TLS")
                    reason = getattr(exc, "reason", None) or type(exc).__name__
                    self.reply(
                        502, f"TLS with node {target.node} at {target.address} failed: {reason}"
                    )
                    tls.close("TLS handshake failed")
                    return
                if self.state != _DIALING:
                    tls.close("the front's client went away")
                    return
                upstream = tls
            self.upstream = upstream
            self.state = _RELAY
            sender = asyncio.get_running_loop().create_task(
                self._client_to_node(upstream, upstream_head(request))
            )
            try:
                await self._node_to_client(upstream)
            finally:
                sender.cancel()
                await asyncio.gather(sender, return_exceptions=True)
                self._finish("done")
                if self.transport is not None:
                    self.transport.close()

    async def _client_to_node(self, upstream: _Upstream | _TlsUpstream, head: bytes) -> None:
        try:
            await upstream.write(head)
            while True:
                while self.pending:
                    data = self.pending.popleft()
                    await upstream.write(data)
                    self.flow.drained(len(data))  # type: ignore[union-attr]
                if self.client_eof:
                    upstream.write_eof()
                    return
                self._pending_ready = asyncio.get_running_loop().create_future()
                try:
                    await self._pending_ready
                finally:
                    self._pending_ready = None
        except ConnectionClosed:
            return

    async def _node_to_client(self, upstream: _Upstream | _TlsUpstream) -> None:
        transport = self.transport
        assert transport is not None
        while True:
            try:
                data = await upstream.read()
            except ConnectionClosed:
                return
            if not data:  # the node half-closed: a TLS client cannot be half-closed
                return
            if transport.is_closing():
                return
            if self.held is not None:
                self._upgrade_answered(data)
            self.last_activity = time.monotonic()
            transport.write(data)
            flow_control = self.flow
            if flow_control is not None and flow_control.write_paused:
                await flow_control.drain()
                if transport.is_closing():
                    return
            upstream.delivered(len(data))


# ---------------------------------------------------------------- wiring


async def start_front(process: ServiceProcess, settings: Any, hub: Hub) -> int | None:
    """Start the front on `settings.front_port` when the server has TLS; its port, or None."""
    if not settings.tls_enabled:
        log.warning("tunnel front off: it serves HTTPS with client certificates only, and "
                    "this server has no TLS settings")  # fmt: skip
        return None
    context = await _front_ssl_context(process, settings)
    front = Front(hub, settings, settings.dial_timeout)
    port = await front.start(settings.host, settings.front_port, context)
    process.on_stop(front.stop)
    log.info("tunnel front listening", extra={"front_port": port})
    return port


async def _front_ssl_context(process: ServiceProcess, settings: Any) -> ssl.SSLContext:
    # Trust consumers (ReportTrust): without front_client_ca_file the front verifies
    # clients with the process's trust bundle, which the process already acknowledges;
    # front_client_ca_file is a CA of its own (the API server's client CA), not certs'
    # bundle, so there is nothing of certs' to acknowledge for it.
    client_ca: Path | None = settings.front_client_ca_file
    if client_ca is None:
        if settings.certs_address is None and settings.tls_client_ca_file is None:
            raise errors.FailedPrecondition(
                "the tunnel front requires client certificates: set front_client_ca_file "
                "(or tls_client_ca_file)"
            )
        context = await process.server_ssl_context(client_auth=True, alpn_protocols=("http/1.1",))
        assert context is not None
        return context
    if not client_ca.is_file():
        raise errors.FailedPrecondition(f"front_client_ca_file {client_ca} is not a readable file")
    certificates = await process.certificates()
    if certificates is not None:
        from waygate.core.rotation import TrustBundle, TrustStore
        from waygate.core.tls import ServerSSLContexts

        contexts = ServerSSLContexts(
            certificates.rotator,
            TrustStore(TrustBundle.from_pem(client_ca.read_bytes())),
            client_auth=True,
            alpn_protocols=("http/1.1",),
        )

        async def close() -> None:
            contexts.close()

        process.on_stop(close)
        return contexts.context
    context = await process.server_ssl_context(alpn_protocols=("http/1.1",))
    assert context is not None
    context.load_verify_locations(client_ca)
    context.verify_mode = ssl.CERT_REQUIRED
    return context
