"""The CA rotation waits for the trust consumers: prepare -> activate -> retire.

A movable clock and consumer reports made by the test (as ReportTrust makes
them) drive the authority; the state machine is `waygate.certs.rotation`.
"""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from tests.unit.certs.helpers import RESOLVER_ID, Clock, make_csr, open_authority, sign
from waygate.certs.authority import Authority
from waygate.certs.consumers import ConsumerTable
from waygate.certs.rotation import Phase
from waygate.core.errors import FailedPrecondition, InvalidArgument

HOUR = dt.timedelta(hours=1)
CONFIG = {
    "ca_lifetime": 30 * 24 * HOUR,
    "default_lifetime": 4 * HOUR,
    "max_lifetime": 8 * HOUR,
    "propagation_delay": HOUR,
    "consumer_ttl": 12 * HOUR,
    "consumer_settle": dt.timedelta(minutes=2),
}
PROXY = "spiffe://waygate.local/ns/local/sa/proxy"
AGENT = "spiffe://waygate.local/ns/edge/sa/agent"


def fingerprints(authority: Authority) -> list[str]:
    return [a.fingerprint for a in authority.trust_bundle().authorities]


def report(authority: Authority, identity: str, instance: str = "pod-1") -> None:
    """The consumer applied the bundle published now."""
    bundle = authority.trust_bundle()
    authority.report_trust(
        identity=identity,
        instance=instance,
        version=bundle.version,
        fingerprints=[a.fingerprint for a in bundle.authorities],
    )


def held_by(authority: Authority) -> list[str]:
    return [c.name for c in authority.rotation_status().gate.waiting_for]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def authority(tmp_path: Path, clock: Clock) -> Authority:
    return open_authority(tmp_path / "ca", clock, **CONFIG)


def test_a_consumer_that_has_not_applied_the_new_ca_holds_activation(
    authority: Authority, clock: Clock
) -> None:
    report(authority, PROXY)
    report(authority, AGENT)
    old = authority.active_authority().fingerprint
    authority.rotate()
    assert authority.rotation_phase() is Phase.PREPARE
    report(authority, PROXY)  # the proxy applied the bundle with the new CA; the agent did not
    clock.advance(2 * HOUR)  # well past the propagation delay
    authority.advance()
    assert authority.rotation_phase() is Phase.PREPARE
    assert authority.active_authority().fingerprint == old
    assert held_by(authority) == [f"{AGENT} (pod-1)"]
    report(authority, AGENT)
    authority.advance()
    assert authority.rotation_phase() is Phase.ACTIVATE
    assert authority.active_authority().fingerprint != old


def test_the_propagation_delay_is_a_minimum_even_when_everyone_acknowledged(
    authority: Authority, clock: Clock
) -> None:
    report(authority, PROXY)
    authority.rotate()
    report(authority, PROXY)
    clock.advance(HOUR / 2)
    authority.advance()
    assert authority.rotation_phase() is Phase.PREPARE
    clock.advance(HOUR / 2)
    authority.advance()
    assert authority.rotation_phase() is Phase.ACTIVATE


def test_the_rotation_ends_only_once_consumers_dropped_the_old_ca(
    authority: Authority, clock: Clock
) -> None:
    report(authority, PROXY)
    csr, _ = make_csr()
    sign(authority, csr, identity=RESOLVER_ID, requested_by="test", lifetime=2 * HOUR)
    old = authority.active_authority().fingerprint
    authority.rotate(propagation_delay=dt.timedelta(0))
    report(authority, PROXY)
    authority.advance()
    assert authority.rotation_phase() is Phase.ACTIVATE
    clock.advance(HOUR)
    authority.advance()
    assert old in fingerprints(authority)  # its leaf is valid for another hour
    clock.advance(HOUR + dt.timedelta(seconds=2))
    authority.advance()
    assert old not in fingerprints(authority)
    assert authority.rotation_phase() is Phase.RETIRE
    assert held_by(authority) == [f"{PROXY} (pod-1)"]
    with pytest.raises(FailedPrecondition, match="still held by consumers"):
        authority.rotate()
    report(authority, PROXY)
    authority.advance()
    assert authority.rotation_phase() is Phase.IDLE
    authority.rotate()  # the next one may start


def test_force_takes_the_step_and_names_who_will_break(authority: Authority, clock: Clock) -> None:
    report(authority, PROXY)
    report(authority, AGENT, "edge-7")
    authority.rotate()
    with pytest.raises(FailedPrecondition, match="propagation delay"):
        authority.force_step()  # never before the minimum delay
    clock.advance(HOUR)
    step, broken = authority.force_step()
    assert step == "activate"
    assert sorted(c.name for c in broken) == [f"{AGENT} (edge-7)", f"{PROXY} (pod-1)"]
    assert authority.rotation_phase() is Phase.ACTIVATE


def test_a_silent_or_leaving_consumer_holds_nothing(authority: Authority, clock: Clock) -> None:
    report(authority, PROXY)
    report(authority, AGENT)
    authority.rotate()
    authority.report_trust(
        identity=AGENT, instance="pod-1", version=0, fingerprints=[], leaving=True
    )
    clock.advance(13 * HOUR)  # the proxy's last report is older than consumer_ttl
    authority.advance()
    assert authority.rotation_phase() is Phase.ACTIVATE


def test_a_resumed_rotation_waits_for_consumers_to_report_again(
    tmp_path: Path, clock: Clock
) -> None:
    """kill -9 of the leader in prepare: the next process resumes prepare, and does not
    take an empty consumer table for "everyone acknowledged"."""
    first = open_authority(tmp_path / "ca", clock, **CONFIG)
    report(first, PROXY)
    first.rotate()
    clock.advance(2 * HOUR)
    del first  # no shutdown: what a kill leaves is the store
    resumed = open_authority(tmp_path / "ca", clock, **CONFIG)
    assert resumed.rotation_phase() is Phase.PREPARE
    report(resumed, PROXY)  # the proxy reports again, to the new process
    resumed.advance()
    assert resumed.rotation_phase() is Phase.PREPARE  # still settling
    clock.advance(dt.timedelta(minutes=3))
    resumed.advance()
    assert resumed.rotation_phase() is Phase.ACTIVATE


def test_a_resumed_retire_phase_is_remembered(tmp_path: Path, clock: Clock) -> None:
    first = open_authority(tmp_path / "ca", clock, **CONFIG)
    report(first, PROXY)
    first.rotate(propagation_delay=dt.timedelta(0))
    report(first, PROXY)
    first.advance()
    clock.advance(9 * HOUR)
    first.advance()
    assert first.rotation_phase() is Phase.RETIRE
    resumed = open_authority(tmp_path / "ca", clock, **CONFIG)
    assert resumed.rotation_phase() is Phase.RETIRE
    clock.advance(dt.timedelta(minutes=3))
    resumed.advance()  # nobody reported to this process: the rotation may end
    assert resumed.rotation_phase() is Phase.IDLE


@pytest.mark.parametrize(
    ("identity", "instance", "prints", "message"),
    [
        ("", "x", [], "identity is empty"),
        (PROXY, "", [], "instance is empty"),
        (PROXY, "x" * 257, [], "instance is longer"),
        (PROXY, "x", ["AB" * 32], "not lower-case hex"),
        (PROXY, "x", ["ab" * 32] * 9, "at most 8"),
    ],
)
def test_reports_out_of_bounds_are_invalid_argument(
    identity: str, instance: str, prints: list[str], message: str
) -> None:
    with pytest.raises(InvalidArgument, match=message):
        ConsumerTable().report(
            identity=identity,
            instance=instance,
            version=1,
            fingerprints=prints,
            now=dt.datetime.now(dt.UTC),
        )


def test_the_consumer_table_is_bounded() -> None:
    table = ConsumerTable(max_consumers=3)
    now = dt.datetime.now(dt.UTC)
    for index in range(5):
        table.report(identity=PROXY, instance=f"p{index}", version=1, fingerprints=[], now=now)
    assert [c.instance for c in table.snapshot()] == ["p2", "p3", "p4"]


def test_a_rotation_started_during_a_leaders_term_does_not_wait_to_settle(
    authority: Authority, clock: Clock
) -> None:
    """The leader's duties call start_judging again and again: only the term's first
    call may settle, and only for a rotation that was under way then."""
    authority.start_judging()
    report(authority, PROXY)
    authority.rotate()
    authority.start_judging()  # a duty restarted: not a new term
    report(authority, PROXY)
    clock.advance(HOUR)
    authority.advance()
    assert authority.rotation_phase() is Phase.ACTIVATE
    # A new term (leadership lost and taken again) in the middle of a rotation settles.
    authority.stop_judging()
    authority.start_judging()
    assert authority.consumers.settle_until == clock() + CONFIG["consumer_settle"]
