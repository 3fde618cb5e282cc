"""The demo backend: a small HTTP/1.1 server that answers every request with what it received.

`waygate up` runs it (`python -m waygate.demo`) on 127.0.0.1:8090 (plus the
port offset) as the endpoint of the example route `demo/echo`, so
`curl -H 'Host: echo.localtest.me' http://127.0.0.1:8080/` shows what the
proxy forwarded. The answer is one JSON object: method, path, query, HTTP
version, every header in the order and spelling received, and the body's
size (the body is read and counted, never kept or echoed).

It is a demo, not a service: no TLS, no gRPC, no admin port. It still keeps
the rules of every Waygate listener:
- a request head must arrive whole within `head_timeout` and fit in
  `max_head_bytes` (else 408 / 431, then close); a malformed request is a 400
  and a close;
- a body larger than `max_body_bytes` is refused with 413 before it is read;
  a body that stalls for `idle_timeout` closes the connection, and so does a
  keep-alive connection idle that long;
- at most `max_connections` connections are open; more are closed at once;
- reading pauses while the client does not read its answers (pipelining).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import json
import logging
import signal
import sys
from collections.abc import Sequence
from typing import ClassVar

import httptools

from waygate.core.logs import configure_logging
from waygate.core.settings import (
    LOG_FORMATS,
    LOG_LEVELS,
    SettingsError,
    add_settings_arguments,
    parse_duration,
    port_number,
    positive,
    setting,
    settings_from_args,
)

log = logging.getLogger(__name__)

NAME = "demo-backend"
DEFAULT_PORT = 8090


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings:
    CONFIG_ENV: ClassVar[str] = "WAYGATE_DEMO_CONFIG"

    host: str = setting("127.0.0.1", help="address to listen on", env="WAYGATE_DEMO_HOST")
    http_port: int = setting(
        DEFAULT_PORT, help="HTTP port (0: any free port)", check=port_number,
        env="WAYGATE_DEMO_HTTP_PORT",
    )  # fmt: skip
    max_connections: int = setting(
        256, help="connections open at once", check=positive, env="WAYGATE_DEMO_MAX_CONNECTIONS"
    )
    max_head_bytes: int = setting(
        32 * 1024, help="request line and headers", check=positive,
        env="WAYGATE_DEMO_MAX_HEAD_BYTES",
    )  # fmt: skip
    max_body_bytes: int = setting(
        1 << 30, help="largest request body accepted (read and counted, not kept)",
        check=positive, env="WAYGATE_DEMO_MAX_BODY_BYTES",
    )  # fmt: skip
    head_timeout: float = setting(
        10.0, help="time for a request head to arrive whole", parse=parse_duration,
        check=positive, env="WAYGATE_DEMO_HEAD_TIMEOUT",
    )  # fmt: skip
    idle_timeout: float = setting(
        60.0, help="an idle keep-alive connection or a stalled body closes after this",
        parse=parse_duration, check=positive, env="WAYGATE_DEMO_IDLE_TIMEOUT",
    )  # fmt: skip
    log_level: str = setting("info", help="log level", choices=LOG_LEVELS)
    log_format: str = setting(
        "auto", help="log line format: json, text, or auto (text on a terminal)",
        choices=LOG_FORMATS,
    )  # fmt: skip


def _status_line(status: int, reason: str) -> bytes:
    return f"HTTP/1.1 {status} {reason}\r\n".encode()


def _plain(status: int, reason: str, text: str) -> bytes:
    body = (text + "\n").encode()
    return (
        _status_line(status, reason)
        + b"Content-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
        + b"Content-Length: "
        + str(len(body)).encode()
        + b"\r\n\r\n"
        + body
    )


class _Server:
    """What every connection shares: the settings and the set of open connections."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.connections: set[EchoProtocol] = set()
        self.refused = 0


class EchoProtocol(asyncio.Protocol):
    """One client connection; httptools parses, this answers each complete request."""

    def __init__(self, server: _Server) -> None:
        self.server = server
        self.settings = server.settings
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None
        # Between requests and while a head arrives; head_bytes counts what was
        # received meanwhile, head_size the parsed line and headers.
        self.in_head = True
        self.head_bytes = 0
        self.refusal: tuple[int, str, str] | None = None
        self.answered = 0
        self._reset()

    def _reset(self) -> None:
        self.url = b""
        self.headers: list[tuple[str, str]] = []
        self.head_size = 0
        self.body_bytes = 0

    # ---------------------------------------------------------------- transport events

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        if len(self.server.connections) >= self.settings.max_connections:
            self.server.refused += 1
            transport.abort()
            return
        self.server.connections.add(self)
        self._arm(self.settings.head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self.server.connections.discard(self)
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None

    def data_received(self, data: bytes) -> None:
        if self.in_head:
            self.head_bytes += len(data)
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            # An upgrade request was answered like any other; there is nothing to upgrade to.
            self._close()
            return
        except httptools.HttpParserError as exc:
            self._refuse(400, "Bad Request", f"malformed request: {exc}")
            return
        if self.refusal is not None:
            self._refuse(*self.refusal)
        elif self.in_head and self.head_bytes > self.settings.max_head_bytes:
            self._refuse(431, "Request Header Fields Too Large", "request head too large")

    def pause_writing(self) -> None:
        # The client is not reading its answers: stop reading its requests.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None:
            self.transport.resume_reading()

    # ---------------------------------------------------------------- parser callbacks

    def on_message_begin(self) -> None:
        self._reset()
        self._arm(self.settings.head_timeout)

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name.decode("latin-1"), value.decode("latin-1")))
        self._count_head(len(name) + len(value) + 4)

    def _count_head(self, size: int) -> None:
        self.head_size += size
        if self.head_size > self.settings.max_head_bytes and self.refusal is None:
            self.refusal = (431, "Request Header Fields Too Large", "request head too large")

    def on_headers_complete(self) -> None:
        self.in_head = False
        self.head_bytes = 0
        if self.refusal is not None:
            return
        length = next((v for k, v in self.headers if k.lower() == "content-length"), None)
        if length is not None and length.isdigit() and int(length) > self.settings.max_body_bytes:
            self.refusal = (413, "Content Too Large", "request body too large")
            return
        self._arm(self.settings.idle_timeout)

    def on_body(self, body: bytes) -> None:
        self.body_bytes += len(body)
        if self.body_bytes > self.settings.max_body_bytes and self.refusal is None:
            self.refusal = (413, "Content Too Large", "request body too large")
        self._arm(self.settings.idle_timeout)

    def on_message_complete(self) -> None:
        self.in_head = True
        if self.refusal is not None or self.transport is None or self.transport.is_closing():
            return
        parsed = httptools.parse_url(self.url) if self.url else None
        answer = {
            "method": self.parser.get_method().decode(),
            "path": parsed.path.decode("latin-1") if parsed and parsed.path else "",
            "query": parsed.query.decode("latin-1") if parsed and parsed.query else "",
            "version": self.parser.get_http_version(),
            "headers": [f"{name}: {value}" for name, value in self.headers],
            "body_bytes": self.body_bytes,
        }
        keep_alive = self.parser.should_keep_alive()
        body = (json.dumps(answer, indent=2) + "\n").encode()
        head = (
            _status_line(200, "OK")
            + b"Content-Type: application/json\r\nContent-Length: "
            + str(len(body)).encode()
            + (b"\r\n\r\n" if keep_alive else b"\r\nConnection: close\r\n\r\n")
        )
        self.transport.write(head + body)
        self.answered += 1
        if keep_alive:
            self._arm(self.settings.idle_timeout)
        else:
            self._close()

    # ---------------------------------------------------------------- endings

    def _arm(self, seconds: float) -> None:
        if self.timer is not None:
            self.timer.cancel()
        self.timer = asyncio.get_running_loop().call_later(seconds, self._timed_out)

    def _timed_out(self) -> None:
        self.timer = None
        if self.in_head and self.head_bytes:
            self._refuse(408, "Request Timeout", "request head did not arrive in time")
        else:
            self._close()

    def _refuse(self, status: int, reason: str, text: str) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.write(_plain(status, reason, text))
        self._close()

    def _close(self) -> None:
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        if self.transport is not None:
            self.transport.close()


async def serve(settings: Settings, started: asyncio.Future[int] | None = None) -> None:
    """Listen until SIGTERM or SIGINT (or cancellation), then close every connection."""
    loop = asyncio.get_running_loop()
    state = _Server(settings)
    server = await loop.create_server(
        lambda: EchoProtocol(state), settings.host, settings.http_port, reuse_address=True
    )
    port = server.sockets[0].getsockname()[1]
    log.info("listening", extra={"http_port": port, "host": settings.host})
    if started is not None:
        started.set_result(port)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        server.close()
        for connection in list(state.connections):
            connection._close()
        await server.wait_closed()
        log.info("stopped", extra={"connections_refused": state.refused})


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m waygate.demo",
        description="Waygate's demo HTTP backend: answers every request with what it received.",
    )
    add_settings_arguments(parser, Settings)
    args = parser.parse_args(argv)
    try:
        settings = settings_from_args(Settings, args)
    except SettingsError as exc:
        print(f"waygate demo: {exc}", file=sys.stderr)
        return 2
    configure_logging(NAME, settings.log_level, settings.log_format)
    try:
        asyncio.run(serve(settings))
    except OSError as exc:
        print(
            f"waygate demo: cannot listen on {settings.host}:{settings.http_port}: "
            f"{exc.strerror or exc}",
            file=sys.stderr,
        )
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
