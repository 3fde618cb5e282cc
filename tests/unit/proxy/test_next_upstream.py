"""proxy-next-upstream in decision.may_redispatch, without sockets (through every pair of
protocols: tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

from tests.unit.proxy.test_decision import rt
from waygate.proxy.decision import may_redispatch


def test_may_redispatch_follows_proxy_next_upstream():
    default = rt()
    assert may_redispatch(True, "refused", 2, default)
    assert not may_redispatch(True, "refused", 3, default)
    assert not may_redispatch(False, "error", 1, default)  # not retryable: never
    errors = rt(next_upstream="error", next_upstream_tries=5)
    assert may_redispatch(True, "refused", 4, errors)
    assert not may_redispatch(True, "refused", 5, errors)
    assert not may_redispatch(True, "timeout", 1, errors)  # nginx's `timeout`, not listed
    assert may_redispatch(True, "tls_verify", 1, errors)
    assert may_redispatch(True, "timeout", 1, rt(next_upstream="timeout"))
    assert not may_redispatch(True, "refused", 1, rt(next_upstream="off"))
    assert not may_redispatch(True, "refused", 1, rt(next_upstream_tries=1))
