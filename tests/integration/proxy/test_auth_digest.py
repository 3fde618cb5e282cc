"""ingress-nginx `auth-type: digest` through the proxy's request core, real sockets:
HTTP/1.1 and HTTP/2 clients, HTTP/1.1 and HTTP/2 backends decide alike
(waygate.proxy.access with waygate.core.digest). The rules one by one:
tests/unit/proxy/test_access_digest.py, tests/unit/core/test_digest.py."""

from __future__ import annotations

import pytest

from tests.integration.proxy.test_request_core import (
    PAIRS,
    ask,
    built,
    core_route,
)
from tests.integration.proxy.test_request_core import (
    backends as backends,  # the fixture: the two real backends
)
from tests.support.proxyharness import running_proxy
from tests.unit.proxy.test_access_digest import REALM, RULES, answer
from waygate.resolver.model import Cors, RouteAccess

pytestmark = pytest.mark.asyncio


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_digest_challenge_then_the_answer_passes(backends, client, backend):
    table = built([core_route(backend, access=RULES)], [backends.endpoint()])
    async with running_proxy(table) as (server, port):
        first = await ask(client, port, "/in?a=1")
        assert first.status == 401 and backends.requests(backend) == 0
        challenge = first.headers["www-authenticate"]
        assert challenge.startswith(f'Digest algorithm="MD5", qop="auth", realm="{REALM}"')
        assert b"401 Authorization Required" in first.body
        line = answer(challenge, uri="/in?a=1").partition(": ")[2]
        passed = await ask(client, port, "/in?a=1", [("authorization", line)])
        replayed = await ask(client, port, "/in?a=1", [("authorization", line)])
        wrong = answer(challenge, uri="/in?a=1", nc=2, password="x").partition(": ")[2]
        refused = await ask(client, port, "/in?a=1", [("authorization", wrong)])
        assert server.metrics.refused.get("unauthorized") == 3
    assert passed.status == 200 and backends.requests(backend) == 1
    info = passed.headers["authentication-info"]
    assert info.startswith('qop="auth", rspauth="') and info.endswith(", nc=00000001")
    for again in (replayed, refused):
        assert again.status == 401
        assert again.headers["www-authenticate"] != challenge  # a new nonce each time


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_cors_routes_401_carries_the_cors_headers(backends, client, backend):
    # kubernetes/ingress-nginx test/e2e/annotations/auth.go: It("should return status
    # code 401 and cors headers when authentication and cors is configured but
    # Authorization header is not configured"): Access-Control-Allow-Origin "*".
    basic = RouteAccess(auth_type="basic", auth_realm="test auth", credentials=("a:{PLAIN}b",))
    route = core_route(backend, access=basic, cors=Cors())
    async with running_proxy(built([route], [backends.endpoint()])) as (_, port):
        answer = await ask(client, port, "/")
    assert answer.status == 401
    assert answer.headers["www-authenticate"] == 'Basic realm="test auth"'
    assert answer.headers["access-control-allow-origin"] == "*"
    assert backends.requests(backend) == 0
