"""The one header rule book on the tunnel's HTTPS front, one header at a time, over
real mTLS sockets through a real hub and agent: a header a client may not set
never reaches the node (waygate.core.httpheaders.CLIENT_FORBIDDEN_EXAMPLES).
The proxy's half is tests/integration/proxy/test_header_rulebook.py."""

from __future__ import annotations

import asyncio

import pytest

from tests.integration.tunnel.harness import http_backend
from tests.integration.tunnel.test_front import front  # noqa: F401  (the fixture)
from waygate.core.httpheaders import CLIENT_FORBIDDEN_EXAMPLES


@pytest.mark.parametrize("name", CLIENT_FORBIDDEN_EXAMPLES, ids=lambda n: n.decode())
async def test_a_header_a_client_may_not_set_never_reaches_the_node(front, name) -> None:  # noqa: F811
    _, _, port, context = front
    backend, backend_port, heads = await http_backend()
    async with backend:
        reader, writer = await asyncio.open_connection("127.0.0.1", port, ssl=context)
        writer.write(
            b"GET / HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n%s: spoofed\r\nX-Kept: yes\r\n\r\n"
            % (backend_port, name)
        )
        answer = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200 OK")
    (head,) = heads
    lowered = head.lower()
    assert b"\r\nx-kept: yes\r\n" in lowered
    assert b"\r\n" + name.lower() + b":" not in lowered
    assert b"spoofed" not in head
