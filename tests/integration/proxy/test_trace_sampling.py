"""The proxy starts traces for untraced requests at its configured ratio, follows
the parent's decision otherwise, and its access-log line names the request's span."""

from __future__ import annotations

import pytest

from tests.support.proxyharness import (
    RecordingUpstream,
    body_json,
    endpoint,
    exchange,
    route,
    running_proxy,
    table,
)
from waygate.core.tracing import configure_tracing

H = b"Host: echo.test\r\n"


@pytest.fixture
async def upstream():
    server = await RecordingUpstream().start()
    yield server
    await server.stop()


def traceparents(response: bytes) -> list[str]:
    headers = body_json(response)["headers"]
    return [value for name, value in headers if name.lower() == "traceparent"]  # type: ignore[union-attr]


async def test_untraced_requests_start_a_trace_only_at_the_ratio(upstream, caplog):
    configure_tracing("proxy-test", None)  # the process's real provider, no exporter
    caplog.set_level("INFO", logger="waygate.proxy.access")
    routes = table([route("echo.test", [("echo", 1)])], [endpoint("echo", upstream.port)])
    async with running_proxy(routes) as (server, port):
        # The default: no trace of our own, nothing added.
        response = await exchange(port, b"GET /none HTTP/1.1\r\n" + H + b"\r\n")
        assert traceparents(response) == []
        server.trace_ratio = 1.0
        response = await exchange(port, b"GET /all HTTP/1.1\r\n" + H + b"\r\n")
        (sent,) = traceparents(response)
        version, trace_id, span_id, flags = sent.split("-")
        assert (version, flags) == ("00", "01") and len(trace_id) == 32
        # An unsampled parent is followed (parent-based), whatever the ratio.
        parent = b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
        response = await exchange(
            port, b"GET /unsampled HTTP/1.1\r\n" + H + b"traceparent: " + parent + b"\r\n\r\n"
        )
        assert traceparents(response) == [parent.decode()]
    lines = {r.path: r for r in caplog.records if r.name == "waygate.proxy.access"}
    # The access-log line of the traced request names its trace and the proxy's span
    # (the one the upstream got as its parent); the others name none.
    assert (lines["/all"].trace_id, lines["/all"].span_id) == (trace_id, span_id)
    assert not hasattr(lines["/none"], "trace_id")
    assert not hasattr(lines["/unsampled"], "trace_id")
