"""The ceiling under Waygate's HTTP/2 path: a minimal h2 -> HTTP/1.1 relay on the same
library (h2) and loop (uvloop).

    python -m bench.h2.minimal [--tuned] LISTEN_PORT UPSTREAM_PORT [TLS_PORT CERT KEY]

Each HTTP/2 stream becomes one HTTP/1.1 request on an idle keep-alive upstream
connection (opened when none is idle, kept afterwards); httptools finds where
each response ends; the answer goes back as HEADERS and DATA. Flow control is
h2's (data beyond the client's window is held, nothing else). No routing, no
header rules, no limits, no timeouts: the least a Python h2 proxy on these
libraries does per request, so Waygate / minimal shows what its rules and
exchange machinery cost. Serves until stdin closes.

`--tuned`: the same relay on the h2 connection Waygate itself builds
(`waygate.proxy.http2.h2_connection`: the HPACK block memory of
`waygate.proxy.hpackcache`, h2's and hpack's logging silenced, the frame-buffer
bounds and settings), keeping h2's own inbound header checks, which Waygate
replaces with its one-pass rules. h2 as shipped pays for things Waygate's set-up
of the library avoids; against this relay, Waygate / minimal is the cost of the
rules and the exchange alone, not of the library adjustments.
"""

from __future__ import annotations

import asyncio
import ssl
import sys

import h2.config
import h2.connection
import h2.events
import h2.settings
import httptools
import uvloop

from waygate.proxy.http2 import H2Limits, h2_connection


class Upstream(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection to the upstream, one request at a time."""

    def __init__(self, relay: Relay) -> None:
        self.relay = relay
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.stream: tuple[Client, int] | None = None
        self.headers: list[tuple[bytes, bytes]] = []
        self.body: list[bytes] = []
        self.ready = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.ready.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_header(self, name: bytes, value: bytes) -> None:
        lname = name.lower()
        if lname not in (b"connection", b"keep-alive", b"transfer-encoding"):
            self.headers.append((lname, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        stream = self.stream
        self.stream = None
        headers, self.headers = self.headers, []
        body, self.body = b"".join(self.body), []
        if stream is not None:
            client, stream_id = stream
            client.respond(stream_id, self.parser.get_status_code(), headers, body)
        self.relay.idle.append(self)

    def connection_lost(self, exc: Exception | None) -> None:
        if self in self.relay.idle:
            self.relay.idle.remove(self)


class Relay:
    def __init__(self, upstream_port: int) -> None:
        self.upstream_port = upstream_port
        self.idle: list[Upstream] = []
        self.tasks: set[asyncio.Task[None]] = set()

    async def send(self, client: Client, stream_id: int, head: bytes) -> None:
        if self.idle:
            upstream = self.idle.pop()
        else:
            loop = asyncio.get_running_loop()
            _, upstream = await loop.create_connection(
                lambda: Upstream(self), "127.0.0.1", self.upstream_port
            )
        upstream.stream = (client, stream_id)
        upstream.transport.write(head)  # type: ignore[union-attr]


class Client(asyncio.Protocol):
    def __init__(self, relay: Relay, tuned: bool = False) -> None:
        self.relay = relay
        if tuned:
            self.h2 = h2_connection(H2Limits(), client_side=False)
            # Waygate turns h2's inbound header checks off because its own
            # one-pass rules replace them; this relay has no rules of its own,
            # so it keeps h2's (the least RFC 9113 asks of a proxy).
            self.h2.config.validate_inbound_headers = True
            self.h2.config.normalize_inbound_headers = True
        else:
            config = h2.config.H2Configuration(client_side=False, header_encoding=None)
            self.h2 = h2.connection.H2Connection(config=config)
        self.transport: asyncio.Transport | None = None
        self.held: dict[int, bytes] = {}

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]
        self.h2.initiate_connection()
        self.transport.write(self.h2.data_to_send())  # type: ignore[union-attr]

    def data_received(self, data: bytes) -> None:
        for event in self.h2.receive_data(data):
            if isinstance(event, h2.events.RequestReceived):
                fields = dict(event.headers)
                head = b"%s %s HTTP/1.1\r\nHost: %s\r\n\r\n" % (
                    fields[b":method"],
                    fields[b":path"],
                    fields.get(b":authority", b"x"),
                )
                loop = asyncio.get_running_loop()
                if self.relay.idle:
                    upstream = self.relay.idle.pop()
                    upstream.stream = (self, event.stream_id)
                    upstream.transport.write(head)  # type: ignore[union-attr]
                else:
                    task = loop.create_task(self.relay.send(self, event.stream_id, head))
                    self.relay.tasks.add(task)
                    task.add_done_callback(self.relay.tasks.discard)
            elif isinstance(event, h2.events.DataReceived):
                self.h2.acknowledge_received_data(event.flow_controlled_length, event.stream_id)
            elif isinstance(event, h2.events.WindowUpdated):
                for stream_id in list(self.held):
                    self._send(stream_id, self.held.pop(stream_id))
        out = self.h2.data_to_send()
        if out:
            self.transport.write(out)  # type: ignore[union-attr]

    def respond(
        self, stream_id: int, status: int, headers: list[tuple[bytes, bytes]], body: bytes
    ) -> None:
        self.h2.send_headers(
            stream_id, [(b":status", b"%d" % status), *headers], end_stream=not body
        )
        if body:
            self._send(stream_id, body)
        out = self.h2.data_to_send()
        if out:
            self.transport.write(out)  # type: ignore[union-attr]

    def _send(self, stream_id: int, body: bytes) -> None:
        h2conn = self.h2
        while body:
            window = min(
                h2conn.local_flow_control_window(stream_id), h2conn.max_outbound_frame_size
            )
            if window <= 0:
                self.held[stream_id] = body
                return
            # The end goes with the last bytes (no empty DATA frame to end).
            h2conn.send_data(stream_id, body[:window], end_stream=len(body) <= window)
            body = body[window:]


async def main(argv: list[str]) -> None:
    loop = asyncio.get_running_loop()
    tuned = argv[:1] == ["--tuned"]
    argv = argv[tuned:]
    relay = Relay(int(argv[1]))
    servers = [await loop.create_server(lambda: Client(relay, tuned), "127.0.0.1", int(argv[0]))]
    if len(argv) >= 5:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(argv[3], argv[4])
        context.set_alpn_protocols(["h2"])
        servers.append(
            await loop.create_server(
                lambda: Client(relay, tuned), "127.0.0.1", int(argv[2]), ssl=context
            )
        )
    await loop.run_in_executor(None, sys.stdin.read)
    for server in servers:
        server.close()


if __name__ == "__main__":
    uvloop.run(main(sys.argv[1:]))
