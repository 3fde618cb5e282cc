"""ratelimit without sockets: nginx limit_req (burst, nodelay) and limit_conn as
ingress-nginx configures them for limit-rps/-rpm/-connections, with the clock
passed in; and the gate in decision.decide (the protocol pairs are
tests/integration/proxy/test_request_core.py's)."""

from __future__ import annotations

from typing import Any

from tests.unit.proxy.test_decision import Facts, ep, req, rt, view
from waygate.proxy import decision, ratelimit
from waygate.proxy.decision import Answer, Forward, decide, release_pick
from waygate.proxy.ratelimit import Held, Limiter, RequestRate
from waygate.resolver.model import RateLimit, Route


def test_a_fresh_client_gets_the_burst_plus_one_then_the_rate():
    # nginx limit_req: excess = max(0, excess - rate*elapsed + 1), refused past burst.
    rate = RequestRate(10.0, 5)
    assert [rate.admit(b"a", 0.0) for _ in range(7)] == [True] * 6 + [False]
    assert not rate.admit(b"a", 0.05)  # half a request drained: still past the burst
    assert rate.admit(b"a", 0.1)  # one drained: one more
    assert not rate.admit(b"a", 0.1)
    assert rate.admit(b"b", 0.1)  # keyed by the client
    # A second later the burst is whole again.
    assert [rate.admit(b"a", 1.1) for _ in range(7)] == [True] * 6 + [False]


def test_a_refused_request_does_not_add_to_the_excess():
    rate = RequestRate(1.0, 0)
    assert rate.admit(b"a", 0.0)
    for _ in range(100):
        assert not rate.admit(b"a", 0.5)
    assert rate.admit(b"a", 1.0)


def test_the_rate_is_kept_over_time():
    rate = RequestRate(100.0, 0)
    admitted = sum(rate.admit(b"a", i / 1000.0) for i in range(10_000))  # 1,000/s for 10 s
    assert 995 <= admitted <= 1_001


def test_memory_per_route_is_bounded(monkeypatch):
    monkeypatch.setattr(ratelimit, "MAX_CLIENTS", 100)
    rate = RequestRate(1.0, 0)
    for i in range(1_000):
        rate.admit(b"10.0.%d.%d" % (i // 256, i % 256), 0.0)
    assert len(rate.buckets) == 100
    # The least recently used are forgotten: the newest is still limited.
    assert not rate.admit(b"10.0.3.231", 0.0)


def test_connections_are_counted_per_client_and_released_once():
    limiter = Limiter(RateLimit(connections=2, connection_status=429))
    first, second = limiter.admit(b"a", 0.0), limiter.admit(b"a", 0.0)
    assert isinstance(first, Held) and isinstance(second, Held)
    assert limiter.admit(b"a", 0.0) == (429, "connection limit exceeded")
    assert isinstance(limiter.admit(b"b", 0.0), Held)
    first.release()
    first.release()  # once only
    assert limiter.in_flight[b"a"] == 1
    third = limiter.admit(b"a", 0.0)
    assert isinstance(third, Held)
    second.release()
    third.release()
    assert b"a" not in limiter.in_flight


def test_both_rates_apply_and_the_allow_list_is_not_limited():
    limiter = Limiter(
        RateLimit(rps=100, rpm=2, burst_multiplier=1, allow=("10.0.0.0/8", "2001:db8::1"))
    )
    results = [limiter.admit(b"192.0.2.1", 0.0) for _ in range(4)]
    assert results == [None, None, None, (503, "request rate limit exceeded")]  # rpm's burst 2
    for client in (b"10.1.2.3", b"2001:db8::1"):
        assert all(limiter.admit(client, 0.0) is None for _ in range(50))
    # Not an address: never on the list, limited as any client.
    assert [limiter.admit(b"not-an-address", 0.0) is None for _ in range(4)] == [
        True,
        True,
        True,
        False,
    ]


def _limited(name: str, **limits: Any) -> Route:
    return Route("demo", name, "a.test", backends=rt().backends, rate_limit=RateLimit(**limits))


def test_the_gate_answers_with_the_configured_status_and_keeps_buckets_across_tables():
    route = _limited("gate-rps", rps=1, burst_multiplier=2, request_status=429)
    statuses = []
    for _ in range(4):
        # A new table each time (as endpoint changes make): the buckets stay.
        decided = decide(view([route], [ep()]), req(), Facts(), 0.0)
        statuses.append(decided.status if isinstance(decided, Answer) else 200)
    assert statuses == [200, 200, 200, 429]
    answer = decide(view([route], [ep()]), req(), Facts(), 0.0)
    assert isinstance(answer, Answer) and answer.kind == "rate_limited"
    assert answer.route == "demo/gate-rps"


def test_the_gate_holds_a_connection_slot_until_the_driver_releases_it():
    route = _limited("gate-conn", connections=1)
    built = view([route], [ep()])
    forward = decide(built, req(), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.held is not None
    refused = decide(built, req(), Facts(), 0.0)
    assert isinstance(refused, Answer) and refused.status == 503
    release_pick(forward)
    again = decide(built, req(), Facts(), 0.0)
    assert isinstance(again, Forward)
    release_pick(again)
    # No endpoint: the answer gives the slot back at once.
    empty = view([route], [])
    assert isinstance(decide(empty, req(), Facts(), 0.0), Answer)
    assert ratelimit.limiter_for(route).in_flight == {}


def test_a_route_without_limits_has_no_gate():
    plain = next(iter(view([rt()], [ep()]).table.entries()))
    assert decision.rules_of(plain) is False
