"""upstream-hash-by (waygate.proxy.hashkey) without sockets (through every pair of
protocols: tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

from typing import Any

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


def subsets_view() -> Any:
    route = rt(balance=BalancePolicy.SOURCE, hash_by="$request_uri", hash_subset_size=3)
    return view([route], [ep(f"10.0.0.{i}") for i in range(6)])


def addresses(built: Any, path: str, n: int = 60) -> set[str]:
    seen = set()
    for _ in range(n):
        forward = decide(built, req(path), Facts(), 0.0)
        assert isinstance(forward, Forward)
        seen.add(forward.target.address)
        decision.release_pick(forward)
    return seen


def test_subsets_a_key_reaches_its_subset_and_an_ejected_subset_its_next():
    # upstream-hash-by-subset: the key's subset of three, one of them at random.
    built = subsets_view()
    subset = addresses(built, "/a")
    assert len(subset) == 3
    # Endpoints that failed to connect (passive health) are passed over within the
    # subset; when the whole subset failed, the key goes to the next subset.
    failed = sorted(subset)
    built.health.failed(next(t for t in built.table.targets if t.address == failed[0]))
    assert addresses(built, "/a") == set(failed[1:])
    for target in built.table.targets:
        if target.address in subset:
            built.health.failed(target)
    spilled = addresses(built, "/a")
    assert len(spilled) == 3 and not spilled & subset


def test_a_redispatch_keeps_the_hash_key():
    # After a connect failure the request is picked again by its upstream-hash-by
    # value (not the client address): it stays within the key's subset.
    built = subsets_view()
    subset = addresses(built, "/a")
    forward = decide(built, req("/a"), Facts(), 0.0)
    assert isinstance(forward, Forward)
    failed = forward.target
    assert decision.repick(built, forward, Facts(), failed)
    assert forward.target != failed and forward.target.address in subset
    decision.release_pick(forward)
