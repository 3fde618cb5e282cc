"""Steady load through the proxy, every answer checked, every outcome recorded.

Kinds of traffic (each a loop of its own, paced so two shared cores keep up):
- `direct-keepalive`, `tunnel-keepalive`: small GETs on one kept-alive connection;
- `direct-newconn`, `tunnel-newconn`: small GETs, a new connection each;
- `upload-1m`: 1 MiB POSTs to a direct backend, which answers the body's SHA-256;
- `download-1m`: 1 MiB GETs through the tunnel, recomputed here;
- `tls-newconn`: small GETs over HTTPS (a new handshake each), trusting the
  certs bundle file as it is now (re-read when it changes: CA rotation);
- `ws-direct`, `ws-tunnel`: WebSocket sessions of 10 echoed messages;
- `h2-tls`: small GETs over HTTP/2 (TLS, ALPN h2), many streams on one kept
  connection (a new one every `H2_STREAMS_PER_CONNECTION`);
- `grpc-unary`, `grpc-stream`: gRPC calls through the proxy's h2c port to a
  gRPC backend (a unary echo; a server stream of 20 messages, each checked).
Every request carries a unique `x-soak-id` (backends count ids seen twice).
A failure is recorded with its cause (HTTP status, reset, timeout, TLS,
corrupt body, ...), never retried.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import os
import ssl
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import grpc

from bench.soak.backend import blob
from bench.soak.stack import DIRECT_HOST, GRPC_HOST, TLS_HOST, TUNNEL_HOST
from tests.support.h2client import H2Client

MIB = 1024 * 1024
TIMEOUT = aiohttp.ClientTimeout(total=30)
H2_STREAMS_PER_CONNECTION = 200
GRPC_STREAM_MESSAGES = 20


@dataclass(frozen=True, slots=True)
class Outcome:
    start: float  # monotonic
    kind: str
    cause: str  # "" when it succeeded
    latency: float
    backend: str
    detail: str = ""  # the error's own words, for the report's failure list

    @property
    def ok(self) -> bool:
        return not self.cause


class Failed(Exception):
    """An answer that arrived but is wrong (status, body)."""


def cause_of(exc: BaseException) -> str:
    if isinstance(exc, Failed):
        return str(exc)
    if isinstance(exc, TimeoutError):
        return "timeout"
    if isinstance(exc, aiohttp.ClientConnectorCertificateError | ssl.SSLError):
        return "tls handshake"
    if isinstance(exc, aiohttp.ClientConnectorError):
        return "connect refused"
    if isinstance(exc, aiohttp.ServerDisconnectedError):
        return "closed without answer"
    if isinstance(exc, aiohttp.ClientPayloadError):
        return "body cut short"
    if isinstance(exc, aiohttp.WSServerHandshakeError):
        return f"ws handshake {exc.status}"
    if isinstance(exc, aiohttp.ClientOSError | ConnectionError):
        return "reset"
    if isinstance(exc, grpc.aio.AioRpcError):
        return f"grpc {exc.code().name}"
    return type(exc).__name__


class Load:
    def __init__(self, proxy_http: int, proxy_https: int, bundle: Path, scale: float = 1.0) -> None:
        self.http = f"http://127.0.0.1:{proxy_http}"
        self.https_port = proxy_https
        self.bundle = bundle
        self.scale = scale  # multiplies the pauses between requests
        self.outcomes: list[Outcome] = []
        self._ids = itertools.count(1)
        self._prefix = os.urandom(4).hex()
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._ssl: tuple[float, ssl.SSLContext] | None = None
        self._h2_ssl: tuple[float, ssl.SSLContext] | None = None
        self._h2: tuple[H2Client, list[int]] | None = None  # (connection, streams used)
        self._grpc: grpc.aio.Channel | None = None
        self._upload = os.urandom(MIB)

    def rid(self) -> str:
        return f"{self._prefix}-{next(self._ids)}"

    def start(self) -> None:
        plan: list[tuple[str, Callable[[aiohttp.ClientSession], Awaitable[str]], float, bool]] = [
            ("direct-keepalive", self._small(DIRECT_HOST), 0.02, False),
            ("direct-keepalive", self._small(DIRECT_HOST), 0.02, False),
            ("tunnel-keepalive", self._small(TUNNEL_HOST), 0.02, False),
            ("tunnel-keepalive", self._small(TUNNEL_HOST), 0.02, False),
            ("direct-newconn", self._small(DIRECT_HOST), 0.05, True),
            ("tunnel-newconn", self._small(TUNNEL_HOST), 0.05, True),
            ("upload-1m", self._upload_1m, 0.3, False),
            ("download-1m", self._download_1m, 0.3, False),
            ("tls-newconn", self._tls_small, 0.1, True),
            ("ws-direct", self._ws(DIRECT_HOST), 0.2, False),
            ("ws-tunnel", self._ws(TUNNEL_HOST), 0.2, False),
            ("h2-tls", self._h2_small, 0.05, False),
            ("grpc-unary", self._grpc_unary, 0.05, False),
            ("grpc-stream", self._grpc_stream, 0.2, False),
        ]
        for kind, call, pause, fresh in plan:
            self._tasks.append(
                asyncio.create_task(self._loop(kind, call, pause * self.scale, fresh))
            )

    async def stop(self) -> None:
        self._stop.set()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._h2 is not None:
            await self._h2[0].close()
            self._h2 = None
        if self._grpc is not None:
            await self._grpc.close()
            self._grpc = None

    async def _loop(
        self,
        kind: str,
        call: Callable[[aiohttp.ClientSession], Awaitable[str]],
        pause: float,
        fresh: bool,
    ) -> None:
        connector = aiohttp.TCPConnector(limit=1, force_close=fresh, enable_cleanup_closed=True)
        async with aiohttp.ClientSession(connector=connector, timeout=TIMEOUT) as session:
            while not self._stop.is_set():
                started = time.monotonic()
                backend, cause, detail = "", "", ""
                try:
                    backend = await call(session)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    cause, detail = cause_of(exc), f"{type(exc).__name__}: {exc}"[:200]
                self.outcomes.append(
                    Outcome(started, kind, cause, time.monotonic() - started, backend, detail)
                )
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stop.wait(), pause)

    # ------------------------------------------------------------ the calls

    def _small(self, host: str) -> Callable[[aiohttp.ClientSession], Awaitable[str]]:
        async def call(session: aiohttp.ClientSession) -> str:
            async with session.get(
                f"{self.http}/small", headers={"Host": host, "x-soak-id": self.rid()}
            ) as response:
                body = await response.read()
                return check_small(response, body)

        return call

    async def _upload_1m(self, session: aiohttp.ClientSession) -> str:
        rid = self.rid()
        # A different body each time (the id in front), known here.
        body = rid.encode().ljust(64, b".") + self._upload[64:]
        async with session.post(
            f"{self.http}/sum", data=body, headers={"Host": DIRECT_HOST, "x-soak-id": rid}
        ) as response:
            if response.status != 200:
                raise Failed(f"http {response.status}")
            answer = await response.json()
            if answer != {"sha256": hashlib.sha256(body).hexdigest(), "size": len(body)}:
                raise Failed("corrupt body")
            return response.headers.get("x-backend", "")

    async def _download_1m(self, session: aiohttp.ClientSession) -> str:
        rid = self.rid()
        async with session.get(
            f"{self.http}/blob",
            params={"size": str(MIB), "seed": rid},
            headers={"Host": TUNNEL_HOST, "x-soak-id": rid},
        ) as response:
            if response.status != 200:
                raise Failed(f"http {response.status}")
            if await response.read() != blob(MIB, rid):
                raise Failed("corrupt body")
            return response.headers.get("x-backend", "")

    def _trust(self) -> ssl.SSLContext:
        """The bundle as it is now: re-read when certs rewrites it (CA rotation)."""
        mtime = self.bundle.stat().st_mtime
        if self._ssl is None or self._ssl[0] != mtime:
            context = ssl.create_default_context(cafile=str(self.bundle))
            self._ssl = (mtime, context)
        return self._ssl[1]

    async def _tls_small(self, session: aiohttp.ClientSession) -> str:
        async with session.get(
            f"https://127.0.0.1:{self.https_port}/small",
            headers={"Host": TLS_HOST, "x-soak-id": self.rid()},
            ssl=self._trust(),
            server_hostname=TLS_HOST,
        ) as response:
            return check_small(response, await response.read())

    async def _h2_small(self, session: aiohttp.ClientSession) -> str:
        mtime = self.bundle.stat().st_mtime
        if self._h2_ssl is None or self._h2_ssl[0] != mtime:
            context = ssl.create_default_context(cafile=str(self.bundle))
            context.set_alpn_protocols(["h2"])
            self._h2_ssl = (mtime, context)
        if self._h2 is not None and (
            self._h2[0].closed.is_set()
            or self._h2[0].goaway is not None
            or self._h2[1][0] >= H2_STREAMS_PER_CONNECTION
        ):
            await self._h2[0].close()
            self._h2 = None
        if self._h2 is None:
            client = await H2Client.connect(
                self.https_port, tls=self._h2_ssl[1], server_hostname=TLS_HOST
            )
            self._h2 = (client, [0])
        client, used = self._h2
        used[0] += 1
        stream_id = client.start("GET", "/small", TLS_HOST, [("x-soak-id", self.rid())])
        try:
            response = await client.wait(stream_id, 30)
        finally:
            client.pending.pop(stream_id, None)  # the client keeps every stream otherwise
        if response.reset is not None:
            raise Failed(f"h2 stream reset ({response.reset})")
        if response.status != 200:
            raise Failed(f"http {response.status}")
        backend = (response.header(b"x-backend") or b"").decode()
        if response.body != f"ok {backend}\n".encode():
            raise Failed("corrupt body")
        return backend

    def _grpc_channel(self) -> grpc.aio.Channel:
        if self._grpc is None:
            self._grpc = grpc.aio.insecure_channel(
                self.http.removeprefix("http://"),
                options=[("grpc.default_authority", GRPC_HOST)],
            )
        return self._grpc

    async def _grpc_unary(self, session: aiohttp.ClientSession) -> str:
        rid = self.rid().encode()
        call = self._grpc_channel().unary_unary("/soak.Echo/Unary")
        reply: bytes = await call(rid, timeout=30, metadata=(("x-soak-id", rid.decode()),))
        echoed, _, backend = reply.partition(b"|")
        if echoed != rid:
            raise Failed("corrupt grpc reply")
        return backend.decode()

    async def _grpc_stream(self, session: aiohttp.ClientSession) -> str:
        rid = self.rid().encode()
        call = self._grpc_channel().unary_stream("/soak.Echo/ServerStream")
        request = rid + b":" + str(GRPC_STREAM_MESSAGES).encode()
        got = [m async for m in call(request, timeout=30)]
        if got != [rid + b":" + str(i).encode() for i in range(GRPC_STREAM_MESSAGES)]:
            raise Failed(f"grpc stream: {len(got)} of {GRPC_STREAM_MESSAGES} messages, or wrong")
        return "backend-a"

    def _ws(self, host: str) -> Callable[[aiohttp.ClientSession], Awaitable[str]]:
        async def call(session: aiohttp.ClientSession) -> str:
            async with session.ws_connect(
                f"{self.http}/ws",
                headers={"Host": host, "x-soak-id": self.rid()},
                heartbeat=None,
                timeout=aiohttp.ClientWSTimeout(ws_close=10),
            ) as socket:
                for index in range(10):
                    text = f"message {index} {os.urandom(8).hex()}"
                    await socket.send_str(text)
                    reply = await asyncio.wait_for(socket.receive(), 10)
                    if reply.type != aiohttp.WSMsgType.TEXT:
                        raise Failed(f"ws {reply.type.name.lower()} mid-session")
                    if reply.data != text:
                        raise Failed("corrupt ws message")
                return socket._response.headers.get("x-backend", "")

        return call


def check_small(response: aiohttp.ClientResponse, body: bytes) -> str:
    if response.status != 200:
        raise Failed(f"http {response.status}")
    backend = response.headers.get("x-backend", "")
    if body != f"ok {backend}\n".encode():
        raise Failed("corrupt body")
    return backend


async def probe(port: int, host: str) -> tuple[int, str]:
    """One GET /small through the proxy on a new connection: (status, backend); (0, cause)."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
            session.get(f"http://127.0.0.1:{port}/small", headers={"Host": host}) as response,
        ):
            await response.read()
            return response.status, response.headers.get("x-backend", "")
    except Exception as exc:
        return 0, cause_of(exc)
