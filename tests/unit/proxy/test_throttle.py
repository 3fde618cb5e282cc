"""nginx's limit_rate arithmetic (ngx_http_write_filter: `limit = rate x (now - start
+ 1) - (sent - limit_rate_after)`), sans-IO: waygate.proxy.throttle."""

from __future__ import annotations

from waygate.proxy.throttle import ResponseThrottle


def test_the_first_seconds_worth_and_the_after_bytes_go_at_once():
    throttle = ResponseThrottle(rate=1000, after=500)
    now_part, rest = throttle.split(b"x" * 4000, 10.0)
    assert (len(now_part), len(rest)) == (1500, 2500)
    # Nothing more is due at the same instant; half a second later, 500 bytes.
    assert throttle.split(b"y", 10.0) == (b"", b"y")
    assert throttle.allowance(10.5) == 500


def test_held_pieces_are_handed_on_as_they_fall_due_with_their_credit():
    throttle = ResponseThrottle(rate=100, after=0)
    assert throttle.split(b"a" * 100, 0.0) == (b"a" * 100, b"")
    throttle.held, throttle.flows = [b"b" * 50, b"c" * 80], [50, 80]
    assert throttle.wait(0.0) > 0  # nothing due before time passes
    due = throttle.take_due(0.7)  # 70 bytes due: the first piece, part of the second
    assert due == [(b"b" * 50, 50), (b"c" * 20, 0)]
    assert throttle.held == [b"c" * 60] and throttle.flows == [80]
    assert throttle.take_due(1.5) == [(b"c" * 60, 80)]
    assert throttle.held == [] and throttle.flows == []


def test_the_wait_is_a_share_of_a_second_not_a_spin():
    throttle = ResponseThrottle(rate=8000, after=0)
    throttle.split(b"x" * 8000, 0.0)
    throttle.held = [b"x" * 100000]
    assert 0.1 <= throttle.wait(0.0) <= 0.2  # an eighth of a second's worth
    throttle.held = [b"x"]
    assert throttle.wait(0.0) >= 0.001
