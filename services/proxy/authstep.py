"""The external-auth step of an HTTP/1.1 exchange (ingress-nginx auth-url), before dispatch.

`AuthStep` is a mixin of `exchange.Exchange` (its state lives in the
Exchange's slots, as `relay_h1.UpgradeRelay`'s does). When the decided
request carries an auth plan (`Forward.auth`, made by `extauth`), dispatch
asks the auth service first (`_authorize`: the subrequest is `authcheck`'s
task, held as the exchange's `connect_task` so that `abandon_upstream`
cancels it however the exchange ends; a cached answer is used at once), then
`_authorized` applies the answer (`extauth.outcome`): the request goes on,
with the answer's headers copied into the upstream head when the plan asks
(and its Set-Cookie kept for the backend's answer, on the forward's response
modifier), or the client is answered (401/403, or a redirect to
auth-signin; `extauth.refusal_page`, with the answer's WWW-Authenticate and
Set-Cookie as nginx passes them on).

Invariants: the plan is consumed once (`Forward.auth` cleared before the
request goes on, so the redispatch does not ask again); an answer that comes
after the exchange ended or moved on is dropped; no answer, or an auth
service that cannot be reached, refuses the request (fail closed, by
`extauth.outcome`). Nothing here runs for a route without auth-url.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

from waygate.proxy import authcheck, extauth
from waygate.proxy.context import ExchangeContext
from waygate.proxy.decision import Forward
from waygate.proxy.http1 import ForwardedContext, RequestHead, ResponseHead


class AuthDownstream(Protocol):
    """What the auth step needs of the exchange's driver (`exchange.Downstream`)."""

    secure: Any

    @property
    def context(self) -> ForwardedContext | None: ...


class _Authorizing(Protocol):
    """What the auth step uses of its exchange (`exchange.Exchange`)."""

    ctx: ExchangeContext
    req: RequestHead | None
    forward: Forward | None
    upstream_head: bytes
    connect_task: asyncio.Task[None] | None

    @property
    def down(self) -> AuthDownstream: ...
    def dispatch(self) -> None: ...
    def fail(self, status: int, reason: str, kind: str, response: bytes = b"") -> None: ...
    def _authorized(self, response: ResponseHead | None) -> None: ...


class AuthStep:
    """The external-auth subrequest step of an exchange, before its dispatch."""

    __slots__ = ()
    # (Slots of the Exchange, declared for the type checker.)
    connect_task: asyncio.Task[None] | None

    def _authorize(self: _Authorizing, forward: Forward) -> None:
        """ingress-nginx auth-url: the auth service is asked first (`authcheck`, the
        request's one task while it runs); its answer lets the request go on, with
        the answer's headers, or answers the client."""
        context = self.down.context
        assert context is not None
        found = authcheck.authorize(
            self.ctx, forward, self.req, bool(self.down.secure), context.client_ip, self._authorized
        )
        if isinstance(found, asyncio.Task):
            self.connect_task = found
        else:
            self._authorized(found)  # a cached answer

    def _authorized(self: _Authorizing, response: ResponseHead | None) -> None:
        self.connect_task = None
        forward = self.forward
        req = self.req
        if forward is None or req is None or forward.auth is None:
            return
        plan = forward.auth
        forward.auth = None
        result = extauth.outcome(plan, response, req, bool(self.down.secure), forward)
        if isinstance(result, bytes):
            if plan.copied:
                head = extauth.with_auth_headers(self.upstream_head, plan, result)
                self.upstream_head = forward.upstream_head = head
            self.dispatch()
            return
        page = extauth.refusal_page(result, close=True, head_only=req.method == b"HEAD")
        self.fail(result.status, result.reason, "external_auth", page)
