"""The CA rotation state machine: prepare -> activate -> retire, each step gated.

Sans-IO: functions of the authority's state (`AuthorityState`: the CA
records and the rotation's own record), the consumers' reports as judged now
(`Judging`) and the settings; they change the state in place and say what
changed. `plan` checks a rotation can start and `staged_ca` makes its new CA
(CPU only). The authority holds the locks, writes the store, logs and tells
watchers (`waygate.certs.authority`).

    IDLE     one ACTIVE CA
      | rotate (RotateCA, or by itself when the CA nears its end)
    PREPARE  new CA STAGED: published, not signing
      | activate: at least the propagation delay passed AND every live consumer
      |           holds a bundle with the new CA (or --force)
    ACTIVATE new CA ACTIVE (signs), old CA RETIRING (still published)
      | retire: every leaf the old CA signed has expired (its retire_after)
    RETIRE   old CA out of the bundle; waiting until every live consumer holds
      |      a bundle without it (or --force); no new rotation meanwhile
    IDLE

Invariants:
- every CA that signed a leaf still valid is in the bundle: a CA is published
  before it signs and stays published until `retire_after`, the latest
  not_after of any leaf it signed;
- a consumer holds a step while its report says it lacks what the step needs;
  one that never reported (an older client) holds nothing; a consumer is live
  while it reported within `consumer_ttl`, or until it said it leaves;
- after a leader change (`settle_until`) no step is taken on acknowledgements
  until consumers have had time to report to the new leader: an empty table
  never lets a step through early;
- everything a resumed leader needs is in the CA records and the `rotation`
  mapping (persisted with them), so kill -9 in any phase resumes that phase.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from waygate.certs import leafbounds
from waygate.certs.bundle import TrustBundleView
from waygate.certs.castate import (
    AuthorityState,
    CARecord,
    CAState,
    CAView,
    Upstream,
    iso,
    make_ca,
    parse_iso,
    whole_seconds,
)
from waygate.core.errors import FailedPrecondition, InvalidArgument

if TYPE_CHECKING:
    # config reads defaults of modules that read this one: for the annotation only.
    from waygate.certs.config import AuthorityConfig


class Phase(enum.Enum):
    IDLE = "idle"
    PREPARE = "prepare"
    ACTIVATE = "activate"
    RETIRE = "retire"


@dataclasses.dataclass(frozen=True)
class ConsumerReport:
    """What one trust consumer (a process instance) last said it holds."""

    identity: str
    instance: str
    #: The bundle version it applied (as the replica it watches numbered it).
    version: int
    #: SHA-256 fingerprints of the CAs in the bundle it applied.
    fingerprints: frozenset[str]
    reported_at: datetime

    @property
    def name(self) -> str:
        return f"{self.identity} ({self.instance})"


@dataclasses.dataclass(frozen=True)
class Gate:
    """What the rotation's next step waits for."""

    phase: Phase
    #: The next step: "activate", "retire" or "finish"; "" when idle.
    step: str
    #: The clock part of the condition (None: none).
    not_before: datetime | None
    #: The fingerprint every live consumer must hold (activate) or have dropped (finish).
    must_hold: str | None
    must_drop: str | None
    #: Live consumers that do not meet it yet, by name.
    waiting_for: tuple[ConsumerReport, ...]
    #: Acknowledgements are not judged before this (a new leader's settling time).
    settle_until: datetime | None = None

    def open(self, now: datetime) -> bool:
        if not self.step:
            return False
        if self.not_before is not None and now < self.not_before:
            return False
        if self.waiting_for:
            return False
        return not (self.settle_until is not None and now < self.settle_until)


@dataclasses.dataclass(frozen=True)
class Step:
    """A step taken: its name, whether the bundle changed, and who was overridden."""

    name: str
    bundle_changed: bool
    forced_past: tuple[ConsumerReport, ...] = ()


@dataclasses.dataclass(frozen=True)
class RotationStatus:
    """Where the rotation stands and who holds it (status, cert status, check)."""

    phase: Phase
    gate: Gate
    #: Every consumer's last report, oldest first.
    consumers: tuple[ConsumerReport, ...]
    #: Consumers live now (reported within consumer_ttl).
    live: tuple[ConsumerReport, ...]
    #: Since when the next step's clock condition has been met (None: not yet, or
    #: idle); how long consumers have held it is now minus this.
    clock_ready_at: datetime | None = None


@dataclasses.dataclass(frozen=True)
class Rotation:
    """A rotation just started (RotateCA's reply)."""

    new_authority: CAView
    signing_switch_at: datetime  # at the earliest: it also waits for the consumers
    old_retire_after: datetime  # at the latest: the old CA may sign until the switch
    bundle: TrustBundleView


@dataclasses.dataclass(frozen=True)
class Judging:
    """What a step's gate judges by: the consumers' last reports, as of `now`."""

    consumers: tuple[ConsumerReport, ...]
    now: datetime
    #: A consumer that has not reported for this long holds nothing.
    consumer_ttl: timedelta
    #: Acknowledgements are not judged before this (a new leader's settling time).
    settle_until: datetime | None = None

    def live(self) -> tuple[ConsumerReport, ...]:
        return tuple(c for c in self.consumers if self.now - c.reported_at <= self.consumer_ttl)


@dataclasses.dataclass(frozen=True)
class Plan:
    """A rotation checked to start (`plan`): when its new CA may sign at the earliest,
    that CA's lifetime and generation."""

    switch_at: datetime
    lifetime: timedelta
    generation: int


def find(cas: Sequence[CARecord], state: CAState) -> CARecord | None:
    return next((c for c in cas if c.state is state), None)


def active(cas: Sequence[CARecord]) -> CARecord:
    found = find(cas, CAState.ACTIVE)
    if found is None:  # decode_state and advance keep exactly one
        raise FailedPrecondition("the CA has no active signing key")
    return found


def phase_of(state: AuthorityState) -> Phase:
    if find(state.cas, CAState.STAGED) is not None:
        return Phase.PREPARE
    if find(state.cas, CAState.RETIRING) is not None:
        return Phase.ACTIVATE
    if state.rotation.get("retired"):
        return Phase.RETIRE
    return Phase.IDLE


def gate(state: AuthorityState, judging: Judging) -> Gate:
    """What the next step of the rotation in `state` waits for, now."""
    cas, live, settle_until = state.cas, judging.live(), judging.settle_until
    phase = phase_of(state)
    if phase is Phase.PREPARE:
        staged = find(cas, CAState.STAGED)
        assert staged is not None
        must_hold = staged.published_fingerprint
        waiting = tuple(c for c in live if must_hold not in c.fingerprints)
        return Gate(phase, "activate", staged.activate_at, must_hold, None, waiting, settle_until)
    if phase is Phase.ACTIVATE:
        retiring = find(cas, CAState.RETIRING)
        assert retiring is not None
        # Strictly after it: a leaf valid until retire_after still needs the old CA.
        after = (
            None
            if retiring.retire_after is None
            else retiring.retire_after + timedelta(microseconds=1)
        )
        # Retiring needs no acknowledgement: a consumer that still trusts the old CA
        # is harmed by nothing; only the rotation's end waits for them.
        return Gate(phase, "retire", after, None, None, ())
    if phase is Phase.RETIRE:
        retired = str(state.rotation["retired"])
        # An intermediate retired under the root its successor uses: nothing to drop.
        still_published = {c.published_fingerprint for c in cas}
        waiting = (
            ()
            if retired in still_published
            else tuple(c for c in live if retired in c.fingerprints)
        )
        return Gate(phase, "finish", None, None, retired, waiting, settle_until)
    return Gate(phase, "", None, None, None, ())


def status(state: AuthorityState, judging: Judging) -> RotationStatus:
    """Where the rotation in `state` stands now, and which consumers hold its next step."""
    current = gate(state, judging)
    now = judging.now
    ready: datetime | None = None
    if current.step == "finish":
        ready = parse_iso(state.rotation.get("retired_at"))
    elif current.step and current.not_before is not None and current.not_before <= now:
        ready = current.not_before
    return RotationStatus(current.phase, current, judging.consumers, judging.live(), ready)


def check_forcible(current: Gate, now: datetime) -> None:
    """FailedPrecondition unless `current`'s step may be forced now: a step is forced
    past consumers only, never past its clock condition (a leaf is never left without
    its CA, a new CA never signs before its minimum propagation delay)."""
    if not current.step:
        raise FailedPrecondition("no CA rotation is under way: nothing to force")
    if current.not_before is not None and now < current.not_before:
        raise FailedPrecondition(
            f"the {current.step} step cannot be forced before "
            f"{iso(current.not_before)}: leaves the old CA signed are still valid"
            if current.step == "retire"
            else f"the {current.step} step cannot be forced before its "
            f"minimum propagation delay ends ({iso(current.not_before)})"
        )


def advance(state: AuthorityState, judging: Judging, *, force: bool = False) -> list[Step]:
    """Take every step that is due by now, in order; changes `state` in place (the
    bundle version moves on when the bundle changed).

    `force` takes the next step even though consumers hold it (its clock
    condition still applies: a leaf is never left without its CA); the step
    records who it overrode.
    """
    now = judging.now
    steps: list[Step] = []
    while True:
        current = gate(state, judging)
        if not current.step:
            break
        clock_ok = current.not_before is None or now >= current.not_before
        if not clock_ok:
            break
        forced = force and not steps and not current.open(now)
        if not current.open(now) and not forced:
            break
        steps.append(_take(state, current, now, forced))
    if any(step.bundle_changed for step in steps):
        state.version += 1
    return steps


def _take(state: AuthorityState, current: Gate, now: datetime, forced: bool) -> Step:
    cas, rotation = state.cas, state.rotation
    overridden = current.waiting_for if forced else ()
    if current.step == "activate":
        staged = find(cas, CAState.STAGED)
        old = find(cas, CAState.ACTIVE)
        assert staged is not None
        if old is not None:
            old.state = CAState.RETIRING
            # Nothing signed by the old CA outlives its latest leaf; no leaf: retire now.
            old.retire_after = old.leaf_max or whole_seconds(now)
        staged.state, staged.activate_at = CAState.ACTIVE, None
        rotation["activated_at"] = iso(now)
        return Step("activate", True, overridden)
    if current.step == "retire":
        retiring = find(cas, CAState.RETIRING)
        assert retiring is not None
        cas.remove(retiring)
        rotation["retired"] = retiring.published_fingerprint
        rotation["retired_at"] = iso(now)
        return Step("retire", True, overridden)
    rotation.clear()
    return Step("finish", False, overridden)


def step_due(state: AuthorityState, judging: Judging) -> datetime | None:
    """When the next step can be taken, if no report changes: None when it waits for
    consumers (a report, or a consumer's report ageing out, opens it) or when there
    is no step."""
    current = gate(state, judging)
    if not current.step or current.waiting_for:
        return None
    moments = [m for m in (current.not_before, current.settle_until) if m is not None]
    return max(moments, default=datetime.min.replace(tzinfo=UTC))


def next_transition(
    state: AuthorityState, auto_rotate_before: timedelta, due: datetime | None
) -> datetime | None:
    """When the timer should next look: the next step's `step_due`, or the automatic
    rotation's moment."""
    moments = [due]
    if state.cas and phase_of(state) is Phase.IDLE:
        moments.append(state.cas[0].not_after - auto_rotate_before)
    return min((m for m in moments if m is not None), default=None)


def settle_until(state: AuthorityState, now: datetime, settle: timedelta) -> datetime | None:
    """Until when a term of judging that starts now waits for reports: `settle` from
    now while a rotation is under way, else not at all."""
    return None if phase_of(state) is Phase.IDLE else now + settle


def expiring(
    state: AuthorityState, now: datetime, auto_rotate_before: timedelta
) -> CARecord | None:
    """The active CA when no rotation is under way and it has no more than
    `auto_rotate_before` left; else None."""
    if phase_of(state) is not Phase.IDLE:
        return None
    current = active(state.cas)
    return current if current.not_after - now <= auto_rotate_before else None


def check_idle(state: AuthorityState) -> None:
    """FailedPrecondition, saying what it waits for, while a rotation is under way."""
    busy = next((c for c in state.cas if c.state is not CAState.ACTIVE), None)
    if busy is not None:
        when = busy.activate_at if busy.state is CAState.STAGED else busy.retire_after
        raise FailedPrecondition(
            f"a CA rotation is still in progress: {busy.name} is {busy.state.value} "
            f"until {iso(when)}"
        )
    if state.rotation.get("retired"):
        raise FailedPrecondition(
            "a CA rotation is still in progress: the retired CA "
            f"{str(state.rotation['retired'])[:16]} is still held by consumers "
            "(rotate-ca --force moves on)"
        )


def check_can_make(state: AuthorityState, provided: Upstream | None) -> None:
    """FailedPrecondition when a rotation needs a CA certs cannot make: it signs with
    an upstream authority's intermediate and none is `provided`."""
    if provided is None and active(state.cas).anchor is not None:
        raise FailedPrecondition(
            "certs signs with an upstream authority's intermediate CA and cannot "
            "make one: rotate by starting certs with the new intermediate "
            "(--ca-cert/--ca-key, and --trust-anchor for a new root)"
        )


def check_unchanged(state: AuthorityState, planned: Plan) -> None:
    """The state a rotation was planned on is still the one in memory."""
    check_idle(state)
    if state.generation != planned.generation - 1:
        raise FailedPrecondition(
            "the CA state changed while the new CA was made (another replica's "
            "rotation?); retry RotateCA"
        )


def check_new_upstream(state: AuthorityState, upstream: Upstream) -> bool:
    """Whether certs must rotate to the upstream intermediate it was started with:
    False when it is stored already; FailedPrecondition while another rotation is
    under way (one at a time)."""
    if any(ca.fingerprint == upstream.fingerprint for ca in state.cas):
        return False
    if phase_of(state) is not Phase.IDLE:
        raise FailedPrecondition(
            f"{upstream.source}: a new intermediate CA was given while a CA rotation "
            "is still in progress; start certs with the current one until it has "
            "finished (`waygate cert status`)"
        )
    return True


def plan(
    state: AuthorityState,
    now: datetime,
    config: AuthorityConfig,
    *,
    delay: timedelta | None,
    lifetime: timedelta | None,
) -> Plan:
    """Check a rotation can start now (`delay` and `lifetime` None: `config`'s)."""
    delay = config.propagation_delay if delay is None else delay
    lifetime = config.ca_lifetime if lifetime is None else lifetime
    if delay < timedelta(0):
        raise InvalidArgument(f"propagation delay must not be negative, not {delay}")
    if lifetime <= config.max_lifetime:
        raise InvalidArgument(
            f"CA lifetime {human(lifetime)} must exceed the maximum leaf lifetime "
            f"{human(config.max_lifetime)}"
        )
    check_idle(state)
    old = active(state.cas)
    switch_at = whole_seconds(now) + delay
    if switch_at >= old.not_after:
        raise InvalidArgument(
            f"propagation delay {human(delay)} ends after the active CA expires "
            f"({iso(old.not_after)}): signing would stop"
        )
    return Plan(switch_at, lifetime, state.generation + 1)


def staged_ca(
    planned: Plan, config: AuthorityConfig, now: datetime, provided: Upstream | None
) -> CARecord:
    """The new CA of `planned`, STAGED: made here (a new key: seconds for RSA, so no
    lock is held), or the upstream intermediate `provided`. Its first leaf bound
    covers its first leaves (`leafbounds.staged_bound`)."""
    if provided is None:
        new = make_ca(
            config,
            generation=planned.generation,
            lifetime=planned.lifetime,
            state=CAState.STAGED,
            now=now,
        )
    else:
        new = provided.record(planned.generation, CAState.STAGED)
    new.activate_at = planned.switch_at
    new.leaf_bound = leafbounds.staged_bound(
        planned.switch_at, config.max_lifetime, config.leaf_bound_step
    )
    return new


def old_retire_after(old: CARecord, switch_at: datetime, max_lifetime: timedelta) -> datetime:
    """When the old CA leaves the bundle at the latest, if it stops signing at `switch_at`."""
    latest_old_leaf = min(switch_at + max_lifetime, old.not_after)
    return max(latest_old_leaf, old.leaf_max or latest_old_leaf)


def human(delta: timedelta) -> str:
    seconds = int(delta.total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size and seconds % size == 0:
            return f"{seconds // size}{unit}"
    return f"{seconds}s"
