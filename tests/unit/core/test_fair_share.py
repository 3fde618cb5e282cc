"""The unauthenticated streams' fair share (waygate.core.grpcserver._Admission), no sockets.

Issue 18: 20 addresses holding 50 watches each filled certs' cap of 1,000
unauthenticated streams, and no other address could watch the trust bundle.
Now a newcomer below its fair share takes the place of the oldest stream of
the address holding the most.
"""

from __future__ import annotations

from waygate.core.grpcserver import CallLimits, _Admission

LIMITS = CallLimits(
    max_streams=4000,
    max_unauthenticated_streams=1000,
    max_streams_per_peer=512,
    max_streams_per_unauthenticated_peer=64,
)


class Held:
    """One admitted stream and what its eviction said."""

    def __init__(self, admission: _Admission, peer: str) -> None:
        self.peer = peer
        self.evicted: str | None = None
        self.refusal = admission.admit_stream(peer, False, self, self.evict)

    def evict(self, message: str) -> None:
        self.evicted = message


def test_twenty_addresses_at_the_total_leave_room_for_a_twenty_first() -> None:
    admission = _Admission(LIMITS)
    held = [Held(admission, f"10.0.0.{a}") for a in range(20) for _ in range(50)]
    assert all(h.refusal is None for h in held)
    assert admission.unauthenticated_streams == 1000

    newcomer = Held(admission, "10.0.1.1")
    assert newcomer.refusal is None
    evicted = [h for h in held if h.evicted is not None]
    assert len(evicted) == 1
    assert "fair share of 47" in (evicted[0].evicted or "")  # 1000 // 21
    # The oldest stream of one of the largest holders, whose place was released at once.
    assert evicted[0] is held[0]
    assert admission.unauthenticated_streams == 1000
    assert admission.streams_by_peer["10.0.0.0"] == 49
    # Its own release later (its generator ending) changes nothing more.
    admission.release_stream("10.0.0.0", False, evicted[0])
    assert admission.streams_by_peer["10.0.0.0"] == 49
    assert admission.unauthenticated_streams == 1000


def test_the_newcomer_gets_its_share_and_no_more() -> None:
    admission = _Admission(LIMITS)
    for a in range(20):
        for _ in range(50):
            Held(admission, f"10.0.0.{a}")
    mine = [Held(admission, "10.0.1.1") for _ in range(48)]
    share = 1000 // 21
    assert [h.refusal is None for h in mine] == [True] * share + [False] * (48 - share)
    refusal = mine[-1].refusal or ""
    assert "--max-unauthenticated-streams" in refusal
    assert admission.streams_by_peer["10.0.1.1"] == share
    # Nobody holds more than one over the share now (no one was evicted below it).
    assert max(admission.streams_by_peer.values()) <= 50
    assert min(admission.streams_by_peer[f"10.0.0.{a}"] for a in range(20)) >= share


def test_an_address_at_its_share_is_never_evicted_and_newcomers_are_then_refused() -> None:
    limits = CallLimits(
        max_streams=10, max_unauthenticated_streams=4, max_streams_per_peer=4,
        max_streams_per_unauthenticated_peer=4,
    )  # fmt: skip
    admission = _Admission(limits)
    a = [Held(admission, "a") for _ in range(2)]
    b = [Held(admission, "b") for _ in range(2)]
    c = Held(admission, "c")  # share 4 // 3 = 1; a and b hold 2 > 1: the oldest of one goes
    assert c.refusal is None
    assert sum(h.evicted is not None for h in a + b) == 1
    d = Held(admission, "d")  # share 1; the one still holding 2 gives one up
    assert d.refusal is None
    assert sorted(admission.streams_by_peer.values()) == [1, 1, 1, 1]
    e = Held(admission, "e")  # share 4 // 5 = 0 -> 1; nobody holds more: refused
    assert e.refusal is not None and "--max-unauthenticated-streams" in e.refusal
    assert sum(h.evicted is not None for h in a + b) == 2


def test_streams_without_an_eviction_handle_are_counted_as_before() -> None:
    """Authenticated peers, and calls admitted without a ticket, are never evicted."""
    admission = _Admission(LIMITS)
    assert admission.admit_stream("spiffe://x/ns/a/sa/b", True) is None
    assert admission.admit_stream("10.0.0.1", False) is None
    admission.release_stream("spiffe://x/ns/a/sa/b", True)
    admission.release_stream("10.0.0.1", False)
    assert admission.streams == 0 and admission.unauthenticated_streams == 0
    assert admission.streams_by_peer == {}
