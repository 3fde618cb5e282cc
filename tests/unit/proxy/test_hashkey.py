"""upstream-hash-by (waygate.proxy.hashkey) without sockets (through every pair of
protocols: tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

from tests.unit.proxy.test_decision import Facts, ep, req, rt, view
from waygate.proxy import decision
from waygate.proxy.decision import Forward, decide
from waygate.proxy.hashkey import HashKey
from waygate.resolver.model import BalancePolicy


def test_each_variable_is_read_from_the_request():
    head = req(
        "/p?A=1&b=two&b=3",
        host="Shop.Test",
        extra="X-User-Id: 42 \r\nCookie: s=abc; t=1\r\n",
    )
    assert HashKey("$request_uri").of(head) == b"/p?A=1&b=two&b=3"
    assert HashKey("$host").of(head) == b"shop.test"
    assert HashKey("$http_x_user_id").of(head) == b"42"
    assert HashKey("$http_x_absent").of(head) == b""
    assert HashKey("$cookie_t").of(head) == b"1"
    assert HashKey("$cookie_u").of(head) == b""
    assert HashKey("$arg_a").of(head) == b"1"  # names case-insensitive, as nginx's
    assert HashKey("$arg_b").of(head) == b"two"  # the first
    assert HashKey("$arg_c").of(req("/p")) == b""


def test_the_same_key_picks_the_same_endpoint():
    route = rt(balance=BalancePolicy.SOURCE, hash_by="$arg_user")
    built = view([route], [ep("10.0.0.1"), ep("10.0.0.2"), ep("10.0.0.3")])
    chosen: dict[str, set[str]] = {}
    for user in ("a", "b", "c", "d", "e", "f"):
        for _ in range(3):
            forward = decide(built, req(f"/x?user={user}"), Facts(), 0.0)
            assert isinstance(forward, Forward) and forward.hash_key == user.encode()
            chosen.setdefault(user, set()).add(forward.target.address)
            decision.release_pick(forward)
    assert all(len(addresses) == 1 for addresses in chosen.values())
    assert len({next(iter(a)) for a in chosen.values()}) > 1  # keys spread
