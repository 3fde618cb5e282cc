"""CA rotation under a controllable clock: no valid leaf ever fails against the bundle.

Time is walked in 30-minute steps through every phase (one CA; old ACTIVE +
new STAGED; old RETIRING + new ACTIVE; new alone), issuing leaves of several
lifetimes all along, restarting the authority from its store in the middle
of each phase, and at every step every still-valid leaf is verified against
the bundle published at that moment.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import json
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.x509 import verification

from tests.unit.certs.helpers import RESOLVER_ID, Clock, make_csr, open_authority, sign
from waygate.certs.authority import Authority, AuthorityConfig, CAState
from waygate.certs.store import DirectoryCAStore
from waygate.core.errors import FailedPrecondition, InvalidArgument, Unavailable

HOUR = dt.timedelta(hours=1)
STEP = dt.timedelta(minutes=30)
CONFIG = {
    "ca_lifetime": 30 * 24 * HOUR,
    "default_lifetime": 24 * HOUR,
    "max_lifetime": 48 * HOUR,
    "propagation_delay": 6 * HOUR,
}


def verifies(leaf: x509.Certificate, bundle: tuple[x509.Certificate, ...], at: dt.datetime) -> bool:
    builder = verification.PolicyBuilder().store(verification.Store(list(bundle))).time(at)
    try:
        builder.build_server_verifier(x509.DNSName("resolver.waygate.local")).verify(leaf, [])
    except verification.VerificationError:
        return False
    return True


def states(authority: Authority) -> list[str]:
    return [a.state.value for a in authority.trust_bundle().authorities]


def test_rotation_walk(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, **CONFIG)
    old_fingerprint = authority.active_authority().fingerprint
    leaves: list[x509.Certificate] = []
    versions = [authority.version]
    phases_seen: set[tuple[str, ...]] = set()
    rotation = None
    restarted_in: set[tuple[str, ...]] = set()
    lifetimes = [HOUR, 24 * HOUR, 48 * HOUR]

    for step in range(int(5 * 24 * HOUR / STEP)):
        if step == int(12 * HOUR / STEP):
            rotation = authority.rotate()
            assert rotation.signing_switch_at == clock() + 6 * HOUR
            # The old CA may sign until the switch, with the longest lifetime at most.
            assert rotation.old_retire_after == clock() + 6 * HOUR + 48 * HOUR
            assert [a.state for a in rotation.bundle.authorities] == [
                CAState.ACTIVE,
                CAState.STAGED,
            ]
            with pytest.raises(FailedPrecondition, match="rotation is still in progress"):
                authority.rotate()
        # A leaf every hour, cycling through short, default and maximum lifetimes.
        if step % 2 == 0:
            csr, _ = make_csr()
            lifetime = lifetimes[(step // 2) % len(lifetimes)]
            leaves.append(
                sign(authority, csr, identity=RESOLVER_ID, requested_by="r", lifetime=lifetime).leaf
            )
        phase = tuple(states(authority))
        phases_seen.add(phase)
        if phase not in restarted_in:
            # A restart in every phase: the state, and the leaves' verification, survive it.
            authority = open_authority(tmp_path / "ca", clock, **CONFIG)
            assert tuple(states(authority)) == phase
            restarted_in.add(phase)
        bundle = authority.trust_bundle()
        versions.append(bundle.version)
        now = clock()
        for leaf in leaves:
            if leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
                assert verifies(leaf, bundle.certificates, now), (
                    f"valid leaf {leaf.serial_number:x} fails at {now} with bundle {phase}"
                )
        clock.advance(STEP)

    assert phases_seen == {
        ("ACTIVE",),
        ("ACTIVE", "STAGED"),
        ("RETIRING", "ACTIVE"),
    }
    assert versions == sorted(versions) and versions[-1] == versions[0] + 3
    (final,) = authority.trust_bundle().authorities
    assert final.state is CAState.ACTIVE and final.fingerprint != old_fingerprint
    assert rotation is not None and final.fingerprint == rotation.new_authority.fingerprint

    old_leaves = [c for c in leaves if c.issuer != final.certificate.subject]
    new_leaves = [c for c in leaves if c.issuer == final.certificate.subject]
    assert old_leaves and new_leaves
    # Nothing was signed by the new CA before the switch, nor by the old one after it.
    assert rotation is not None
    switch = rotation.signing_switch_at
    backdate = dt.timedelta(minutes=5)
    assert all(c.not_valid_before_utc + backdate < switch for c in old_leaves)
    assert all(c.not_valid_before_utc + backdate >= switch for c in new_leaves)


def test_old_ca_leaves_the_bundle_only_after_its_last_leaf(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, leaf_bound_step=dt.timedelta(0), **CONFIG)
    csr, _ = make_csr()
    last_old = sign(authority, csr, identity=RESOLVER_ID, requested_by="r", lifetime=48 * HOUR)
    authority.rotate(propagation_delay=HOUR)
    clock.advance(HOUR)
    assert states(authority) == ["RETIRING", "ACTIVE"]
    clock.time = last_old.valid_until
    assert states(authority) == ["RETIRING", "ACTIVE"]  # the leaf is valid through not_after
    clock.advance(dt.timedelta(seconds=1))
    assert states(authority) == ["ACTIVE"]
    assert open_authority(tmp_path / "ca", clock, **CONFIG).version == authority.version


def test_rotation_with_no_delay_switches_at_once(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, **CONFIG)
    rotation = authority.rotate(propagation_delay=dt.timedelta(0))
    # No leaf was ever signed by the old CA, so it is not needed any more either.
    clock.advance(dt.timedelta(seconds=1))
    assert states(authority) == ["ACTIVE"]
    assert authority.active_authority().fingerprint == rotation.new_authority.fingerprint


def test_next_transition_tells_the_timer_when_to_wake(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, **CONFIG)
    # With one CA, the next moment is when it must start rotating itself.
    not_after = authority.active_authority().not_after
    assert authority.next_transition() == not_after - authority.config.auto_rotate_before
    authority.rotate(propagation_delay=2 * HOUR)
    assert authority.next_transition() == clock() + 2 * HOUR


def test_the_ca_rotates_itself_and_no_leaf_is_ever_shortened_or_refused(tmp_path: Path) -> None:
    """Three CA lifetimes on a controllable clock, the timer's call every 6 hours,
    a maximum-lifetime leaf every step: every leaf gets its full lifetime, and every
    valid leaf verifies against the bundle at every step."""
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, **CONFIG)
    fingerprints = {authority.active_authority().fingerprint}
    leaves: list[x509.Certificate] = []
    step = 6 * HOUR
    for _ in range(int(3 * CONFIG["ca_lifetime"] / step)):
        authority.rotate_if_expiring()
        csr, _ = make_csr()
        issued = sign(authority, csr, identity=RESOLVER_ID, requested_by="r", lifetime=48 * HOUR)
        assert issued.valid_until == clock().replace(microsecond=0) + 48 * HOUR
        leaves.append(issued.leaf)
        fingerprints.add(authority.active_authority().fingerprint)
        bundle = authority.trust_bundle().certificates
        now = clock()
        for leaf in leaves[-10:]:
            if leaf.not_valid_before_utc <= now <= leaf.not_valid_after_utc:
                assert verifies(leaf, bundle, now)
        clock.advance(step)
    assert len(fingerprints) >= 3  # it rotated at least twice, with nobody asking


def test_a_propagation_delay_past_the_cas_expiry_is_refused(tmp_path: Path) -> None:
    authority = open_authority(tmp_path / "ca", Clock(), **CONFIG)
    with pytest.raises(InvalidArgument, match="ends after the active CA expires"):
        authority.rotate(propagation_delay=CONFIG["ca_lifetime"])
    assert states(authority) == ["ACTIVE"]


def test_rotation_arguments_are_checked(tmp_path: Path) -> None:
    authority = open_authority(tmp_path / "ca", Clock(), **CONFIG)
    with pytest.raises(InvalidArgument, match="must exceed the maximum leaf lifetime"):
        authority.rotate(ca_lifetime=24 * HOUR)
    with pytest.raises(InvalidArgument, match="must not be negative"):
        authority.rotate(propagation_delay=-HOUR)
    assert states(authority) == ["ACTIVE"]


async def test_watchers_wake_on_every_change(tmp_path: Path) -> None:
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, **CONFIG)
    heard: list[int] = []
    authority.add_listener(lambda bundle: heard.append(bundle.version))
    start = authority.version
    already = await authority.wait_for_change(start - 1)
    assert already.version == start
    waiter = asyncio.ensure_future(authority.wait_for_change(start))
    await asyncio.sleep(0)
    assert not waiter.done()
    authority.rotate(propagation_delay=HOUR)
    bundle = await asyncio.wait_for(waiter, 5)
    assert bundle.version == start + 1 and len(bundle.authorities) == 2
    clock.advance(HOUR)
    authority.advance()
    assert heard == [start + 1, start + 2]


class FlakyStore:
    """A real directory store that refuses saves while `down` is set."""

    def __init__(self, directory: Path) -> None:
        self.inner = DirectoryCAStore(directory)
        self.description = self.inner.description
        self.down = False

    def load(self) -> dict[str, bytes] | None:
        return self.inner.load()

    def save(self, files: dict[str, bytes]) -> None:
        if self.down:
            raise FailedPrecondition("store is down")
        self.inner.save(files)


def test_a_transition_the_store_refuses_is_retried(tmp_path: Path) -> None:
    clock = Clock()
    store = FlakyStore(tmp_path / "ca")
    authority = Authority.open(store, AuthorityConfig(**CONFIG), now=clock)  # type: ignore[arg-type]
    authority.rotate(propagation_delay=HOUR)
    version = authority.version
    clock.advance(HOUR)
    store.down = True
    with pytest.raises(FailedPrecondition, match="store is down"):
        authority.advance()
    assert authority.version == version
    assert [a.state.value for a in authority._bundle().authorities] == ["ACTIVE", "STAGED"]
    store.down = False
    assert authority.advance() is True
    assert states(authority) == ["RETIRING", "ACTIVE"]
    assert open_authority(tmp_path / "ca", clock, **CONFIG).version == version + 1


def test_a_leaf_whose_bound_the_store_refuses_is_not_handed_out(tmp_path: Path) -> None:
    """The leaf bound is stored before the leaf leaves: a refused write refuses the leaf,
    records nothing and puts the bound back, so the next leaf writes it again."""
    clock = Clock()
    store = FlakyStore(tmp_path / "ca")
    authority = Authority.open(store, AuthorityConfig(**CONFIG), now=clock)  # type: ignore[arg-type]
    stored = (tmp_path / "ca" / "state.json").read_bytes()
    store.down = True
    with pytest.raises(FailedPrecondition, match="store is down"):
        sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r")
    assert authority.list_issued() == []
    assert (tmp_path / "ca" / "state.json").read_bytes() == stored
    store.down = False
    leaf = sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="r").leaf
    assert (tmp_path / "ca" / "state.json").read_bytes() != stored
    # What a restart goes by covers the leaf handed out.
    (bound,) = [
        dt.datetime.fromisoformat(entry["leaf_bound"])
        for entry in json.loads((tmp_path / "ca" / "state.json").read_bytes())["authorities"]
    ]
    assert bound >= leaf.not_valid_after_utc


class FollowerStore(FlakyStore):
    """A directory store whose replica is not the writer (as a Secret store's follower)."""

    def refusal(self, what: str) -> str:
        return f"this replica is not the leader, and only the leader writes {what}"


def test_rotate_on_a_replica_that_does_not_write_names_the_writer_first(tmp_path: Path) -> None:
    """A follower's state can lag the leader's (a rotation it has not yet seen finish):
    RotateCA there answers UNAVAILABLE naming the writer, never FAILED_PRECONDITION from
    its stale view (the soak's RotateCA loop retries UNAVAILABLE on the next replica)."""
    clock = Clock()
    writer = Authority.open(FlakyStore(tmp_path / "ca"), AuthorityConfig(**CONFIG), now=clock)  # type: ignore[arg-type]
    writer.rotate(propagation_delay=HOUR)  # a rotation under way in the follower's view
    store = FollowerStore(tmp_path / "ca")
    follower = Authority.open(store, AuthorityConfig(**CONFIG), now=clock)  # type: ignore[arg-type]
    stored = (tmp_path / "ca" / "state.json").read_bytes()
    with pytest.raises(Unavailable, match="only the leader writes a new CA"):
        follower.rotate(propagation_delay=HOUR)
    assert (tmp_path / "ca" / "state.json").read_bytes() == stored
    with pytest.raises(FailedPrecondition, match="still in progress"):
        writer.rotate(propagation_delay=HOUR)  # the writer judges its own state
