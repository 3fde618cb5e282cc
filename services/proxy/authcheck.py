"""The external authentication subrequest (`extauth`'s rules), sent by the drivers.

`start(ctx, plan, head, connect_timeout, answer_timeout, done, key)` runs one task:
a connection to the auth service through the proxy's own upstream machinery
(`ctx.dialer`, `upstream.start`, an `upstream_h1.UpstreamConnection`, counted
in the pool's per-endpoint bound like any upstream connection; over TLS for an
https:// service, `extauth.tls_context`, the handshake within the connect
timeout and a certificate that does not verify is no answer), the head sent,
the answer's head awaited within `answer_timeout`, then the connection closed
(the answer's body is never read: nginx discards it too) and `done(response)`
called with it (None: no answer); with a cache `key` (auth-cache-key) the answer
is kept in `extauth.CACHE` for its status's duration. The task is the request's: a driver that
goes away cancels it (`Exchange.abandon_upstream`, `H2Exchange._finish`), and
the connection is aborted with it. Every wait has a timeout; nothing is held
after the task ends.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import ssl
import time
from collections.abc import Callable
from typing import Any

from waygate.proxy import extauth
from waygate.proxy.extauth import AuthPlan
from waygate.proxy.http1 import ResponseHead
from waygate.proxy.upstream import ConnectError
from waygate.proxy.upstream import start as start_connection
from waygate.proxy.upstream_h1 import UpstreamConnection

log = logging.getLogger(__name__)
# A TLS failure to an auth service is logged once per LOG_EVERY seconds per service.
LOG_EVERY = 60.0
_logged: dict[str, float] = {}


class _Answer:
    """The H1User of a subrequest: it wants the answer's head, nothing else."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.head: asyncio.Future[ResponseHead | None] = loop.create_future()

    def _set(self, response: ResponseHead | None) -> None:
        if not self.head.done():
            self.head.set_result(response)

    def response_head(self, response: ResponseHead, rest: bytes, now: float) -> bytes | None:
        self._set(response)
        return None

    def informational(self, response: ResponseHead, size: int) -> str:
        return ""

    def switching(self, response: ResponseHead, rest: bytes) -> bool:
        return False

    def response_data(self, data: bytes, now: float) -> None:
        return None

    def relay_data(self, data: bytes) -> None:
        return None

    def relay_eof(self) -> bool:
        return False

    def upstream_closed(self, relay: bool, got_bytes: bool, reused: bool) -> None:
        self._set(None)

    def upstream_failed(self, status: int, reason: str, kind: str) -> None:
        self._set(None)

    def upstream_paused(self, paused: bool) -> None:
        return None


async def ask(
    ctx: Any, plan: AuthPlan, head: bytes, connect_timeout: float, answer_timeout: float
) -> ResponseHead | None:
    """The auth service's answer head (None: refused connect, closed, timed out)."""
    target = plan.target
    try:
        connection = await ctx.dialer.connect(target, connect_timeout, None)
        _, upstream = await start_connection(
            connection,
            functools.partial(UpstreamConnection, ctx, target),
            tls=extauth.tls_context() if plan.tls else None,
            server_hostname=plan.server_name if plan.tls else None,
            timeout=connect_timeout,
        )
    except (ConnectError, OSError, EOFError, TimeoutError) as exc:
        if plan.tls and isinstance(exc, ssl.SSLError):
            _log_tls_failure(plan, exc)
        return None
    user = _Answer(ctx.loop)
    try:
        upstream.begin(user, False, ctx.loop.time(), head)
        try:
            async with asyncio.timeout(answer_timeout):
                return await user.head
        except TimeoutError:
            return None
    finally:
        upstream.abort()


def _log_tls_failure(plan: AuthPlan, exc: ssl.SSLError) -> None:
    """Why an https:// auth service gave no answer (its clients only see a 500)."""
    name = f"{plan.server_name}:{plan.target.port}"
    now = time.monotonic()
    if now - _logged.get(name, -LOG_EVERY) < LOG_EVERY:
        return
    if len(_logged) > 1024:
        _logged.clear()
    _logged[name] = now
    reason = getattr(exc, "verify_message", "") or exc.reason or str(exc)
    log.warning(
        "the authentication service's TLS handshake failed: %s",
        reason,
        extra={"auth_service": name},
    )


def authorize(
    ctx: Any,
    forward: Any,
    req: Any,
    secure: bool,
    client_ip: bytes,
    done: Callable[[ResponseHead | None], None],
) -> ResponseHead | asyncio.Task[None]:
    """What a driver calls for a request marked "authorize first" (`Forward.auth`):
    the cached answer (auth-cache-key), or the subrequest's task (`start`), the
    route's connect and server timeouts bounding it."""
    plan = forward.auth
    options = forward.entry.options
    key = extauth.cache_key(plan, options.name, req, client_ip)
    if key is not None:
        cached = extauth.CACHE.get(key, ctx.loop.time())
        if cached is not None:
            return cached
    head = extauth.subrequest_head(plan, req, secure, client_ip)
    if forward.identity:  # ingress-nginx's ssl-client-* lines go to the auth service too
        head = head[:-2] + forward.identity + b"\r\n"
    return start(ctx, plan, head, options.connect_timeout, options.server_timeout, done, key)


def start(
    ctx: Any,
    plan: AuthPlan,
    head: bytes,
    connect_timeout: float,
    answer_timeout: float,
    done: Callable[[ResponseHead | None], None],
    key: bytes | None = None,
) -> asyncio.Task[None]:
    """The subrequest as the request's one task; `done` is called unless cancelled."""

    async def run() -> None:
        response = await ask(ctx, plan, head, connect_timeout, answer_timeout)
        if key is not None and response is not None:
            extauth.CACHE.put(plan, key, response, ctx.loop.time())
        done(response)

    return ctx.loop.create_task(run())  # type: ignore[no-any-return]
