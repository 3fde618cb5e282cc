"""Malformed HTTP/1.1 fed to a real proxy (issue 18 item 4), property-based.

Hypothesis builds requests from a grammar of what breaks parsers: request
lines with odd methods, targets and versions; header lines with bare LF,
obs-fold, NULs, missing colons, spaces before the colon, duplicate and
conflicting Content-Length / Transfer-Encoding; chunked bodies with bad sizes,
extensions and missing CRLFs; pipelined leftovers; raw bytes. Each example is
sent on its own connection to an in-process proxy (real sockets) in front of a
recording upstream, then half-closed. For every example:
- the proxy answers with well-formed status lines only, or says nothing, and
  closes the connection within the bound (no hang, no crash);
- another client is served at once (200) by the same proxy;
and after all of them no client connection is left open and the proxy's
tasks are back to their baseline. Example counts are bounded so `make test`
stays fast; `WAYGATE_FUZZ_EXAMPLES` raises them for a longer hunt.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.proxyharness import RecordingUpstream, endpoint, route, table
from waygate.proxy.metrics import ProxyMetrics
from waygate.proxy.routing import Defaults
from waygate.proxy.server import ProxyServer
from waygate.proxy.upstream import Dialer

EXAMPLES = int(os.environ.get("WAYGATE_FUZZ_EXAMPLES", "120"))
#: The proxy closes or answers within this (its own timeouts are shorter).
WITHIN = 10.0
HOST = b"fuzz.test"
STATUS_LINE = re.compile(rb"HTTP/1\.1 [1-5]\d\d [^\r\n]*\r\n")


@dataclass
class Proxy:
    loop: asyncio.AbstractEventLoop
    server: ProxyServer
    port: int
    upstream: RecordingUpstream

    def run(self, coroutine):  # type: ignore[no-untyped-def]
        return self.loop.run_until_complete(asyncio.wait_for(coroutine, WITHIN * 3))


@pytest.fixture(scope="module")
def proxy() -> Iterator[Proxy]:
    """One proxy for every example, on a loop of its own (hypothesis drives sync tests)."""
    loop = asyncio.new_event_loop()

    async def start() -> Proxy:
        upstream = await RecordingUpstream().start()
        server = ProxyServer(
            defaults=Defaults(client_timeout=2.0, http_request_timeout=2.0, server_timeout=2.0),
            dialer=Dialer(),
            metrics=ProxyMetrics(),
            cookie_key=b"k" * 32,
            max_connections=1000,
        )
        server.set_table(
            table([route(HOST.decode(), [("fuzz", 1)])], [endpoint("fuzz", upstream.port)])
        )
        port = await server.start("127.0.0.1", 0)
        return Proxy(loop, server, port, upstream)

    handle = loop.run_until_complete(start())
    gc.collect()
    tasks = len(asyncio.all_tasks(loop))
    try:
        yield handle

        # After every example: nothing left open, no task left behind but the
        # recording upstream's, one per connection the proxy keeps pooled.
        def ours(task: asyncio.Task[object]) -> bool:
            return "RecordingUpstream._serve" not in repr(task.get_coro())

        async def settled() -> tuple[int, list[str]]:
            current = asyncio.current_task()

            def left() -> list[str]:
                return [
                    repr(t.get_coro()) for t in asyncio.all_tasks() if t is not current and ours(t)
                ]

            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WITHIN):
                    while handle.server.metrics.client_connections or len(left()) > tasks:
                        await asyncio.sleep(0.05)
            return handle.server.metrics.client_connections, left()

        connections, left = loop.run_until_complete(settled())
        assert connections == 0 and len(left) <= tasks, (connections, left)
    finally:

        async def stop() -> None:
            await handle.server.drain(1.0)
            await handle.upstream.stop()

        loop.run_until_complete(stop())
        loop.close()


# ------------------------------------------------------------ the grammar

tokens = st.sampled_from(
    [b"GET", b"POST", b"PUT", b"HEAD", b"OPTIONS", b"TRACE", b"CONNECT", b"PRI", b"get",
     b"G\x00T", b"", b"GET GET", b"\xff\xfe", b"X" * 300]
)  # fmt: skip
targets = st.sampled_from(
    [b"/", b"/a?b=c", b"*", b"http://fuzz.test/x", b"//x", b"/%00", b"/\x7f", b"",
     b"/" + b"a" * 9000, b"fuzz.test:443", b"/a b", b"/\r"]
)  # fmt: skip
versions = st.sampled_from(
    [b"HTTP/1.1", b"HTTP/1.0", b"HTTP/0.9", b"HTTP/2.0", b"HTTP/1.1 ", b"http/1.1", b"HTTP/1.10",
     b"HTTP/", b""]
)  # fmt: skip
eols = st.sampled_from([b"\r\n", b"\n", b"\r", b"\r\r\n"])
header_names = st.sampled_from(
    [b"Host", b"Content-Length", b"Transfer-Encoding", b"Connection", b"Upgrade", b"Expect",
     b"X-A", b"Host ", b" Host", b"Content-Length ", b"X\x00Y", b"", b"Proxy",
     b"X-Remote-User", b"Forwarded"]
)  # fmt: skip
header_values = st.one_of(
    st.sampled_from(
        [b"fuzz.test", b"0", b"5", b"0005", b"-1", b"1, 2", b"99999999999999999999", b"chunked",
         b"gzip, chunked", b"chunked, identity", b"identity", b"close", b"keep-alive, Upgrade",
         b"websocket", b"100-continue", b"", b" ", b"\x00", b"a\rb", b"x" * 9000]
    ),
    st.binary(max_size=40),
)  # fmt: skip
chunk_sizes = st.sampled_from(
    [b"0", b"1", b"5", b"ff", b"FFFFFFFFFFFFFFFFFF", b"-1", b"", b"0x5", b"5;ext=1", b"5 ", b"zz",
     b"1;" + b"e" * 5000]
)  # fmt: skip


@st.composite
def header_line(draw: st.DrawFn) -> bytes:
    separator = draw(st.sampled_from([b": ", b":", b" : ", b"", b":\t"]))
    fold = draw(st.sampled_from([b"", b"\r\n continued", b"\n\tcontinued"]))
    return draw(header_names) + separator + draw(header_values) + fold + draw(eols)


@st.composite
def chunked_body(draw: st.DrawFn) -> bytes:
    out = b""
    for _ in range(draw(st.integers(0, 4))):
        size = draw(chunk_sizes)
        out += size + draw(eols) + draw(st.binary(max_size=12)) + draw(eols)
    if draw(st.booleans()):
        out += b"0\r\n" + draw(st.sampled_from([b"", b"Trailer: x\r\n", b"Bad trailer\r\n"]))
        out += b"\r\n"
    return out


@st.composite
def request(draw: st.DrawFn) -> bytes:
    line = draw(tokens) + b" " + draw(targets) + b" " + draw(versions) + draw(eols)
    headers = b""
    if draw(st.booleans()):
        headers += b"Host: fuzz.test\r\n"
    for _ in range(draw(st.integers(0, 5))):
        headers += draw(header_line())
    end = draw(eols)
    body = draw(st.one_of(st.just(b""), st.binary(max_size=64), chunked_body()))
    return line + headers + end + body


messages = st.one_of(
    request(),
    st.lists(request(), min_size=2, max_size=3).map(b"".join),  # pipelined
    st.binary(min_size=1, max_size=200),
)


# ------------------------------------------------------------ one example


async def send(port: int, data: bytes) -> bytes:
    """Send, half-close, read until the proxy closes; fails the example on a hang."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    out = bytearray()
    try:
        writer.write(data)
        with contextlib.suppress(ConnectionError):
            await writer.drain()
            writer.write_eof()
        async with asyncio.timeout(WITHIN):
            while True:
                try:
                    piece = await reader.read(65536)
                except ConnectionError:
                    break  # a reset is a close too
                if not piece:
                    break
                out += piece
    finally:
        writer.close()
    return bytes(out)


def well_formed(answer: bytes) -> bool:
    """Only status lines with headers and bodies the proxy framed (checked loosely:
    every answer starts with a status line)."""
    return not answer or STATUS_LINE.match(answer) is not None


async def one(proxy: Proxy, data: bytes) -> None:
    answer = await send(proxy.port, data)
    assert well_formed(answer), answer[:200]
    ok = await send(proxy.port, b"GET /ok HTTP/1.1\r\nHost: fuzz.test\r\nConnection: close\r\n\r\n")
    assert ok.startswith(b"HTTP/1.1 200 "), ok[:200]


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(data=messages)
def test_malformed_http1_is_answered_or_closed_and_others_are_served(
    proxy: Proxy, data: bytes
) -> None:
    proxy.run(one(proxy, data))


def test_the_fuzzer_reaches_the_upstream_sometimes(proxy: Proxy) -> None:
    """The grammar is not so broken that nothing is ever forwarded (a fuzzer that only
    tests the 400 path would prove little): a valid request from it gets through."""
    before = len(proxy.upstream.requests)
    proxy.run(
        one(proxy, b"POST /p HTTP/1.1\r\nHost: fuzz.test\r\nContent-Length: 0005\r\n\r\nhello")
    )
    assert len(proxy.upstream.requests) > before
