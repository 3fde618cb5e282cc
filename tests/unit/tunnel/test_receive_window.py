"""`mux.ReceiveWindow`: the receive-side credit bookkeeping both tunnel ends keep."""

from __future__ import annotations

from waygate.tunnel.mux import ReceiveWindow

WINDOW = 1024


def test_a_peer_within_its_window_is_granted_back_half_a_window_at_a_time() -> None:
    receive = ReceiveWindow(WINDOW)
    assert receive.received(WINDOW)  # exactly the window: allowed
    assert receive.consumed(WINDOW // 2 - 1) == 0  # under half a window: nothing yet
    assert receive.consumed(1) == WINDOW // 2  # half a window owed: all of it at once
    assert receive.unacked == WINDOW // 2 and receive.owed == 0
    assert receive.received(WINDOW // 2)  # the grant made room for exactly this much
    assert not receive.received(1)  # one byte past it: the peer broke the protocol


def test_held_credit_is_owed_until_it_may_go() -> None:
    receive = ReceiveWindow(WINDOW)
    assert receive.received(WINDOW)
    assert receive.consumed(WINDOW, hold=True) == 0  # the destination's buffer is full
    assert receive.owed == WINDOW
    assert receive.owed_now() == WINDOW  # it drained: everything owed goes, whatever its size
    assert receive.owed_now() == 0 and receive.unacked == 0
