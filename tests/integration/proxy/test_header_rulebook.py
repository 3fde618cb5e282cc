"""The one header rule book on the proxy's HTTP/1.1 path, one header at a time, over
real sockets: a header a client may not set never reaches the upstream, in any
spelling the rule book lists (waygate.core.httpheaders.CLIENT_FORBIDDEN_EXAMPLES).
The tunnel front's half is tests/integration/tunnel/test_front_header_rulebook.py."""

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
from waygate.core.httpheaders import CLIENT_FORBIDDEN_EXAMPLES


@pytest.fixture
async def proxy_port():
    upstream = await RecordingUpstream().start()
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    try:
        async with running_proxy(routes) as (_, port):
            yield port
    finally:
        await upstream.stop()


@pytest.mark.parametrize("name", CLIENT_FORBIDDEN_EXAMPLES, ids=lambda n: n.decode())
async def test_a_header_a_client_may_not_set_never_reaches_the_upstream(proxy_port, name):
    response = await exchange(
        proxy_port,
        b"GET / HTTP/1.1\r\nHost: echo.test\r\n%s: spoofed\r\nX-Kept: yes\r\n\r\n" % name,
    )
    seen = {n.lower(): v for n, v in body_json(response)["headers"]}  # type: ignore[union-attr]
    assert seen.get("x-kept") == "yes"
    assert name.decode().lower() not in seen
    assert "spoofed" not in seen.values()
