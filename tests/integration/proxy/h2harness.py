"""The proxy with its HTTP/2 side on real sockets: h2c and HTTP/1.1 on one plain port.

`running_h2_proxy` starts a `ProxyServer` (the harness's `running_proxy`)
and serves its port through `waygate.proxy.http2.ClientProtocol`, the
factory both listeners use, so a test reaches HTTP/1.1 and h2c on one port.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

from tests.integration.proxy.harness import running_proxy
from waygate.proxy.http2 import ClientProtocol, H2Limits
from waygate.proxy.server import ProxyServer


@contextlib.asynccontextmanager
async def running_h2_proxy(
    routes_table: Any = None, *, limits: H2Limits | None = None, **kw: Any
) -> AsyncIterator[tuple[ProxyServer, int]]:
    async with running_proxy(routes_table, **kw) as (server, _h1_port):
        server.h2_limits = limits or H2Limits()  # type: ignore[attr-defined]
        loop = asyncio.get_running_loop()
        listener = await loop.create_server(lambda: ClientProtocol(server), "127.0.0.1", 0)
        server._servers.append(listener)
        yield server, listener.sockets[0].getsockname()[1]
