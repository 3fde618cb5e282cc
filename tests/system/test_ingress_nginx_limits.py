"""ingress-nginx's limit-* annotations through a real resolver (--manifests
--ingress-nginx) and proxy: per replica, keyed by the client address.

Ported from kubernetes/ingress-nginx (controller v1.15.1):
test/e2e/annotations/limitconnections.go (It "should limit-connections"), and the
documented behaviour of limit-rpm/limit-burst-multiplier/limit-allowlist and the
ConfigMap's limit-req-status-code (docs/user-guide/nginx-configuration/
annotations.md "Rate Limiting", configmap.md), which ingress-nginx's e2e suite
checks only through the rendered nginx.conf (limit_req ... burst=N nodelay).
"""

from __future__ import annotations

import asyncio
import collections

import pytest
import yaml

from tests.support.gatewayapi import Conformance
from tests.system.test_ingress_nginx import CONTROLLER, P, single_ingress
from tests.system.test_ingress_nginx import suite as suite  # the same real processes, per module

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

LIMITS_CONTROLLER = {
    **CONTROLLER,
    "data": {**CONTROLLER["data"], "limit-req-status-code": "429"},
}


async def statuses(suite: Conformance, count: int, path: str, host: str) -> collections.Counter:
    answers = await asyncio.gather(*(suite.request(path, host=host) for _ in range(count)))
    return collections.Counter(answer.status for answer in answers)


async def test_limit_connections(suite: Conformance) -> None:
    # limitconnections.go: It("should limit-connections"): 20 concurrent slow
    # requests under limit-connections 8: 8 answered 200, 12 answered 503, no other.
    host = "limit-connections"
    ingress = single_ingress(host, "/", host, {P + "limit-connections": "8"})
    await suite.apply(extra=yaml.safe_dump_all([LIMITS_CONTROLLER, ingress]))
    found = await statuses(suite, 20, "/slow?s=2", host)
    assert found == {200: 8, 503: 12}
    # Every slot came back: the next 8 are served again.
    assert await statuses(suite, 8, "/slow?s=0.2", host) == {200: 8}


async def test_limit_rpm_with_burst_multiplier_answers_the_configmaps_status(
    suite: Conformance,
) -> None:
    # annotations.md "Rate Limiting": burst = limit-rpm x limit-burst-multiplier,
    # nodelay (ingress-nginx's limit_req); configmap.md limit-req-status-code. A
    # fresh client gets burst + 1 at once; the rate (2 a minute) gives no more here.
    host = "limit-rpm"
    limited = single_ingress(
        host, "/", host, {P + "limit-rpm": "2", P + "limit-burst-multiplier": "1"}
    )
    allowed_host = "limit-rpm-allowlist"
    allowed = single_ingress(
        allowed_host,
        "/",
        allowed_host,
        {
            P + "limit-rpm": "2",
            P + "limit-burst-multiplier": "1",
            P + "limit-allowlist": "10.0.0.0/8, 127.0.0.1/32",
        },
    )
    await suite.apply(extra=yaml.safe_dump_all([LIMITS_CONTROLLER, limited, allowed]))
    assert await statuses(suite, 10, "/", host) == {200: 3, 429: 7}
    refused = await suite.request("/", host=host)
    assert refused.status == 429
    assert refused.header("X-Waygate-Error") == "request rate limit exceeded"
    # limit-allowlist: the client's address is on it, nothing is limited.
    assert await statuses(suite, 10, "/", allowed_host) == {200: 10}


async def test_limit_rate(suite: Conformance) -> None:
    # limitrate.go: It("Check limit-rate annotation"): limit-rate 1, then updated to 90
    # (ingress-nginx checks the rendered `limit_rate 1k;`, then `90k`). Here the
    # body's pace itself: at most 1 KB plus 1 KB a second (nginx's first second at
    # once), so 2.5 KB take at least 1.5 s less the first second -- a lower bound on
    # the time, which load cannot break; the update applies live.
    host = "limit-rate"
    throttled = single_ingress(host, "/", host, {P + "limit-rate": "1"})
    await suite.apply(extra=yaml.safe_dump_all([LIMITS_CONTROLLER, throttled]))
    loop = asyncio.get_running_loop()
    began = loop.time()
    response = await suite.eventually("/big?n=1536", host=host)
    assert len(response.body) == 1536
    assert loop.time() - began >= 0.4
    faster = single_ingress(host, "/", host, {P + "limit-rate": "90"})
    await suite.apply(extra=yaml.safe_dump_all([LIMITS_CONTROLLER, faster]))
    # 90 KB a second: 64 KB go within the first second's allowance (no wait at all).
    response = await suite.eventually("/big?n=65536", host=host)
    assert len(response.body) == 65536
