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


async def test_limit_rate_is_refused_alone(suite: Conformance) -> None:
    # limit-rate throttles response bytes (limitrate.go checks nginx's limit_rate):
    # not honoured yet, and it bears on access: that Ingress is not served, others are.
    throttled = single_ingress("limit-rate", "/", "limit-rate", {P + "limit-rate": "1"})
    other = single_ingress("limit-rate-other", "/", "limit-rate-other")
    await suite.apply(extra=yaml.safe_dump_all([LIMITS_CONTROLLER, throttled, other]))
    assert (await suite.request("/", host="limit-rate-other")).status == 200
    assert (await suite.request("/", host="limit-rate")).status != 200
