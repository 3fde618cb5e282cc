"""The certificate authority: one coordinator over the CA's lifecycle steps.

Each step lives in its own module, with no lock of the authority's and, but
for the store's writer, no I/O:
- `config`: the authority's settings (`AuthorityConfig`);
- `castate`: CA records, making a CA (or taking an upstream's), the state
  the authority keeps (`AuthorityState`) and its stored form;
- `persistence`: writing that state to the store, one write at a time, and
  putting memory back when a write fails (`StateWriter`);
- `csr` and `issuing`: checking a CSR and what is asked for it
  (`leaf_request`), the leaf profile, signing (`Issuer`), the ListIssued
  records;
- `leafbounds`: the stored bound on each CA's leaves' not_after;
- `rotation`: the rotation state machine (prepare -> activate -> retire),
  gated on the consumers' reports (`consumers`), its status, and planning a
  rotation and making its new CA;
- `bundle`: the published trust bundle, read without the lock (`Publication`),
  and delivering its changes.

`Authority` is their coordinator: it holds the state and the locks, orders
the steps, and delegates every rule to them.
No grpc and no sockets here; the clock is injected (`now`), so rotation is
tested by moving time rather than sleeping.

Invariants:
- every CA that signed a leaf still valid is in the published bundle, and a
  leaf never outlives its CA (see `rotation` and `issuing`);
- a leaf is handed out only once the store's leaf bound covers it (`leafbounds`);
- errors raise domain errors before anything is signed, recorded or written;
- the bundle version increases with every change and survives restarts;
- the authority is thread-safe: signing runs on the event loop when that is
  quick and waits for nothing (`issue_at_once`), else in worker threads (the
  service's executor), while the event loop serves bundles; every public
  method holds one lock, except that a rotation makes its key and writes the
  store without it (it holds the lock only to check and to swap the new CA
  in); every store write is serialised by the writer's lock, taken inside the
  first, and a rotation never writes files older than the last write; bundle
  listeners and watchers are called on the event loop given to
  `deliver_changes_on`, whichever thread made the change.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Sequence
from datetime import datetime, timedelta
from typing import Any, Concatenate, ParamSpec, TypeVar

from waygate.certs import castate, issuing, leafbounds, rotation
from waygate.certs.bundle import Publication, Published, TrustBundleView
from waygate.certs.castate import (
    KEY_ALGORITHMS,
    STATE_FILE,
    AuthorityState,
    CARecord,
    CAState,
    CAView,
    Upstream,
    generate_key,
    iso,
    utc_now,
)
from waygate.certs.config import AuthorityConfig
from waygate.certs.consumers import ConsumerTable
from waygate.certs.csr import MAX_SANS, check_csr, load_csr
from waygate.certs.issuing import (
    LIST_LIMIT,
    Issued,
    IssuedPage,
    IssuedRecord,
    LeafRequest,
    leaf_request,
)
from waygate.certs.persistence import StateWriter
from waygate.certs.rotation import ConsumerReport, Phase, Rotation, RotationStatus, Step
from waygate.certs.store import CAStore, write_refusal
from waygate.core.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

__all__ = [
    "KEY_ALGORITHMS",
    "MAX_SANS",
    "STATE_FILE",
    "Authority",
    "AuthorityConfig",
    "CAState",
    "CAView",
    "Issued",
    "IssuedRecord",
    "LeafRequest",
    "Rotation",
    "RotationStatus",
    "TrustBundleView",
    "Upstream",
    "check_csr",
    "generate_key",
    "leaf_request",
    "load_csr",
    "utc_now",
]

_P = ParamSpec("_P")
_R = TypeVar("_R")


def _locked(
    method: Callable[Concatenate[Authority, _P], _R],
) -> Callable[Concatenate[Authority, _P], _R]:
    """Run an Authority method under its lock, then republish what `trust_bundle` reads
    without it."""

    @functools.wraps(method)
    def locked(self: Authority, *args: _P.args, **kwargs: _P.kwargs) -> _R:
        with self._lock:
            try:
                return method(self, *args, **kwargs)
            finally:
                self._publish()

    return locked


class Authority:
    """Signs leaves with the active CA and keeps the trust bundle, persisted in a CAStore."""

    def __init__(
        self,
        store: CAStore,
        config: AuthorityConfig,
        state: AuthorityState,
        *,
        now: Callable[[], datetime],
    ) -> None:
        self.store = store
        self.config = config
        self._now = now
        self._state = state
        self._writer = StateWriter(store)
        self._issuer = issuing.Issuer(config)
        #: What each trust consumer reported it holds.
        self.consumers = ConsumerTable()
        #: Whether this process takes rotation steps: a follower replica (cluster mode)
        #: or a worker does not (its consumer table is not the leader's); it adopts
        #: the steps the leader stores.
        self.steps_allowed: Callable[[], bool] = lambda: True
        # Every public method holds it: signing runs in worker threads. The writer's
        # lock is taken inside it, never the other way round.
        self._lock = threading.RLock()
        # One rotation at a time; taken before `_lock`, never while holding it.
        self._rotating = threading.Lock()
        # What the event loop reads without the lock.
        self._publication = Publication(self._snapshot())

    # ------------------------------------------------------------ opening

    @classmethod
    def open(
        cls,
        store: CAStore,
        config: AuthorityConfig | None = None,
        *,
        now: Callable[[], datetime] = utc_now,
        upstream: Upstream | None = None,
    ) -> Authority:
        """Load the CA from `store`, or create and save one on first start.

        With `upstream`, certs signs with that intermediate and publishes its root;
        an intermediate other than the stored one starts a rotation to it (the same
        phases). Raises FailedPrecondition when what is stored or given cannot be
        used (unsafe or unreadable key, key and certificate that do not match, bad
        state, an intermediate too close to its end to rotate safely).
        """
        config = config or AuthorityConfig()
        if upstream is not None:
            upstream.check(now=now(), needed_life=config.auto_rotate_before)
        files = store.load()
        if files is None:
            authority = cls(store, config, castate.first_state(config, now(), upstream), now=now)
            authority._writer.write(authority._state.files())
            log.info(
                "created CA",
                extra={"store": store.description, "fingerprint": authority._active().fingerprint},
            )
            return authority
        authority = cls(store, config, castate.decode_state(files, store.description), now=now)
        authority.start_judging()
        authority.advance()
        if upstream is not None:
            authority._take_upstream(upstream)
        log.info(
            "loaded CA",
            extra={
                "store": store.description,
                "authorities": [
                    (c.name, c.state.value, c.fingerprint) for c in authority._state.cas
                ],
                "rotation": authority.rotation_phase().value,
            },
        )
        return authority

    # ------------------------------------------------------------ rotation steps

    @_locked
    def advance(self, *, force: bool = False) -> bool:
        """Take the rotation steps due by now; True when the bundle changed.

        Persists and notifies on change. Called by every public operation and
        by the server's timer, so watchers see a change when it is due. If the
        store refuses the new state, memory is put back as it was and the error
        raised: the step is tried again on the next call. `force`: take the next
        step although consumers hold it (see `force_step`).
        """
        return any(step.bundle_changed for step in self._advance(force=force))

    def _advance(self, *, force: bool = False) -> list[Step]:
        if not self.steps_allowed():
            return []
        before = self._state.checkpoint()
        steps = rotation.advance(self._state, self._judging(), force=force)
        if not steps:
            return steps
        self._writer.save_or_restore(self._state, before)
        for step in steps:
            extra: dict[str, Any] = {"step": step.name, "fingerprint": self._active().fingerprint}
            if step.forced_past:
                extra["forced_past"] = [c.name for c in step.forced_past]
                log.warning("CA rotation: step forced past consumers", extra=extra)
            else:
                log.info("CA rotation: step taken", extra=extra)
        if any(step.bundle_changed for step in steps):
            self._notify()
        return steps

    def _judging(self) -> rotation.Judging:
        return self.consumers.judging(self._now(), self.config.consumer_ttl)

    @_locked
    def force_step(self) -> tuple[str, tuple[ConsumerReport, ...]]:
        """Take the rotation's next step now although consumers hold it (rotate-ca
        --force): (the step, the consumers it overrode: who will break). Its clock
        condition still holds: FailedPrecondition when that is not met, or no
        rotation is under way."""
        current = rotation.gate(self._state, self._judging())
        rotation.check_forcible(current, self._now())
        steps = self._advance(force=True)
        if not steps:
            raise FailedPrecondition(f"the {current.step} step could not be taken")
        return steps[0].name, steps[0].forced_past

    @_locked
    def rotation_status(self) -> RotationStatus:
        return rotation.status(self._state, self._judging())

    @_locked
    def rotation_phase(self) -> Phase:
        return rotation.phase_of(self._state)

    def report_trust(
        self,
        *,
        identity: str,
        instance: str,
        version: int,
        fingerprints: Sequence[str],
        leaving: bool = False,
    ) -> bool:
        """A consumer applied a bundle (or still holds it, or is leaving): remember it.
        Needs no lock (the table has its own); True when a rotation is under way, so
        the caller wakes the timer to take a step the report may have opened."""
        if leaving:
            self.consumers.leave(identity, instance)
        else:
            self.consumers.report(
                identity=identity,
                instance=instance,
                version=version,
                fingerprints=fingerprints,
                now=self._now(),
            )
        # Read without the lock: a stale answer only wakes the timer once too often.
        return rotation.phase_of(self._state) is not Phase.IDLE

    def rotate(
        self,
        *,
        propagation_delay: timedelta | None = None,
        ca_lifetime: timedelta | None = None,
        provided: Upstream | None = None,
    ) -> Rotation:
        """Stage a new CA (made here, or the upstream intermediate `provided`);
        FailedPrecondition while an earlier rotation has not finished, and when certs
        signs with an upstream intermediate and none is provided (it cannot make one).

        The slow parts hold no lock that signing needs: the new key (seconds for
        RSA) is made and the store written (a round trip for a Secret) off the lock,
        held only to check the rotation (again before the write) and to swap it in.
        """
        # A replica that does not write says so first: its state may lag the
        # writer's (a rotation it has not yet seen finish), and only the writer's counts.
        refusal = write_refusal(self._writer.store, "a new CA")
        if refusal is not None:
            raise Unavailable(refusal)
        with self._rotating:
            planned = self._plan_rotation(propagation_delay, ca_lifetime, provided)
            new = rotation.staged_ca(planned, self.config, self._now(), provided)
            written = self._writer.write_latest(lambda: self._rotation_files(new, planned))
            return self._swap_in(new, planned, written)

    @_locked
    def _plan_rotation(
        self, delay: timedelta | None, lifetime: timedelta | None, provided: Upstream | None
    ) -> rotation.Plan:
        rotation.check_can_make(self._state, provided)
        self.advance()
        return rotation.plan(self._state, self._now(), self.config, delay=delay, lifetime=lifetime)

    @_locked
    def _rotation_files(self, new: CARecord, planned: rotation.Plan) -> dict[str, bytes]:
        """The files of the state in memory plus `new`."""
        rotation.check_unchanged(self._state, planned)
        return self._state.files(adding=new)

    @_locked
    def _swap_in(self, new: CARecord, planned: rotation.Plan, written: int) -> Rotation:
        """Serve with `new` (stored as write number `written`) from now on."""
        adopted = next((ca for ca in self._state.cas if ca.name == new.name), None)
        if adopted is not None:
            new = adopted  # the store's watch brought our own write back first (`adopt`)
        else:
            rotation.check_unchanged(self._state, planned)
            before = self._state.checkpoint()
            self._state.add(new)
            if self._writer.saves != written:
                # A write came between ours and this swap, made without the new CA.
                self._writer.save_or_restore(self._state, before)
            self._notify()
        switch_at = planned.switch_at
        retire_after = rotation.old_retire_after(
            self._active(), switch_at, self.config.max_lifetime
        )
        log.info(
            "CA rotation: new CA staged",
            extra={"fingerprint": new.fingerprint, "signing_switch_at": iso(switch_at)},
        )
        # An immediate switch (delay 0, no consumer holding it) happens here, so the
        # reply shows it.
        self.advance()
        return Rotation(new.view(), switch_at, retire_after, self._bundle())

    def _take_upstream(self, upstream: Upstream) -> None:
        """Sign with `upstream` from now on: already stored, or staged by a rotation."""
        with self._lock:
            if not rotation.check_new_upstream(self._state, upstream):
                return
        log.warning(
            "new upstream intermediate CA: rotating to it",
            extra={"source": upstream.source, "fingerprint": upstream.fingerprint},
        )
        self.rotate(provided=upstream)

    def rotate_if_expiring(self) -> Rotation | None:
        """Start a rotation when the active CA nears its end and none is in progress.

        The CA rotates itself: nobody has to remember a yearly RotateCA, and an
        expiring CA never shortens leaves or stops signing.
        """
        if not self._expiring():
            return None
        try:
            return self.rotate()
        except FailedPrecondition:
            if self.rotation_phase() is not Phase.IDLE:
                return None  # a RotateCA came first
            raise

    @_locked
    def _expiring(self) -> bool:
        self.advance()
        ca = rotation.expiring(self._state, self._now(), self.config.auto_rotate_before)
        if ca is None:
            return False
        extra = {"fingerprint": ca.fingerprint, "not_after": iso(ca.not_after)}
        if ca.anchor is not None:
            # certs cannot make an organisation's intermediate: it says so, loudly.
            log.warning(
                "the upstream intermediate CA expires soon: give certs a new one "
                "(--ca-cert/--ca-key) and restart it",
                extra=extra,
            )
            return False
        log.warning("CA expires soon; rotating it", extra=extra)
        return True

    def start_judging(self) -> None:
        """A term of taking rotation steps begins: see `ConsumerTable.start_term`."""
        self.consumers.start_term(
            lambda: rotation.settle_until(self._state, self._now(), self.config.consumer_settle)
        )

    def stop_judging(self) -> None:
        """This replica no longer leads: see `ConsumerTable.end_term`."""
        self.consumers.end_term()

    def next_transition(self) -> datetime | None:
        """When `advance` (or `rotate_if_expiring`) will next change something; read
        without the lock (the timer asks on the event loop)."""
        return self._publication.published.next_transition

    def _active(self) -> CARecord:
        return rotation.active(self._state.cas)

    # ------------------------------------------------------------ signing

    @_locked
    def issue(self, request: LeafRequest) -> Issued:
        """Sign `request` (see `issuing.leaf_request`) with the active CA. Policy
        checks are the caller's (see policy.py)."""
        self.advance()
        issued = self._sign(request, at_once=False)
        assert issued is not None  # only the at-once path declines
        return issued

    def issue_at_once(self, request: LeafRequest) -> Issued | None:
        """`issue`, when it can be done at once on the calling thread (the event loop):
        the lock is free, the active CA signs quickly (ECDSA or Ed25519; an RSA
        signature takes 0.5 to 2 ms), no CA transition is due and the leaf stays
        within the stored leaf bound (no store write). Otherwise None, with nothing
        done: the caller runs `issue` in a signing thread, which may wait and write.
        """
        if not self._lock.acquire(blocking=False):
            return None
        try:
            # Nothing published changes when nothing is due (checked first): no _publish.
            if self._publication.published.stale(self._now()):
                return None
            if not issuing.signs_quickly(self._active()):
                return None
            return self._sign(request, at_once=True)
        finally:
            self._lock.release()

    def _sign(self, request: LeafRequest, *, at_once: bool) -> Issued | None:
        """Under the lock: the leaf the active CA signs for `request`; with `at_once`
        None when it would write the store."""
        return self._issuer.sign(
            self._active(), request, self._now(), at_once=at_once, store_bound=self._store_bound
        )

    def _store_bound(self, ca: CARecord, not_after: datetime) -> None:
        """Under the lock: raise `ca`'s leaf bound past `not_after` and store it."""
        before = self._state.checkpoint()
        leafbounds.raise_past(ca, not_after, self.config.leaf_bound_step)
        self._writer.save_or_restore(self._state, before)

    @_locked
    def list_issued(
        self, *, identity: str = "", include_expired: bool = False, limit: int = LIST_LIMIT
    ) -> list[IssuedRecord]:
        """Matching records, oldest first; at most the newest `limit` of them."""
        return self._issuer.records.newest(
            identity=identity, include_expired=include_expired, limit=limit, now=self._now()
        )

    @_locked
    def issued_page(
        self, *, identity: str, include_expired: bool, after: int, size: int, max_bytes: int
    ) -> IssuedPage:
        """One page of ListIssued: see `IssuedRecords.page`."""
        return self._issuer.records.page(
            identity=identity,
            include_expired=include_expired,
            after=after,
            size=size,
            max_bytes=max_bytes,
            now=self._now(),
        )

    # ------------------------------------------------------------ the bundle

    def trust_bundle(self) -> TrustBundleView:
        """The bundle now, read without the lock so a signing or a store write in
        progress never holds up a bundle reader; off the event loop a transition
        due is applied first (see `Publication.current`)."""
        bundle = self._publication.current(self._now())
        return self._advanced_bundle() if bundle is None else bundle

    @_locked
    def _advanced_bundle(self) -> TrustBundleView:
        self.advance()
        return self._bundle()

    def _publish(self) -> None:
        # Under the lock, after every locked call and before every notification.
        self._publication.publish(self._snapshot())

    def _snapshot(self) -> Published:
        # A follower takes no step (it adopts the leader's): none is due by its clock.
        due = rotation.step_due(self._state, self._judging()) if self.steps_allowed() else None
        return Published(
            self._bundle(),
            due,
            rotation.next_transition(self._state, self.config.auto_rotate_before, due),
        )

    def _bundle(self) -> TrustBundleView:
        return TrustBundleView.of(self._state.version, self._state.cas)

    @property
    def version(self) -> int:
        return self._state.version

    @_locked
    def active_authority(self) -> CAView:
        return self._active().view()

    # ------------------------------------------------------------ replicas (cluster mode)

    @_locked
    def adopt(self, files: dict[str, bytes]) -> bool:
        """Take the CA state another replica stored (the leader's, seen through the
        store's watch); True when the bundle changed, and then listeners hear of it.

        Issued records and the latest leaf not_after this replica knows are kept;
        FailedPrecondition (and nothing changed) when the files cannot be used.
        """
        other = castate.decode_state(files, self.store.description)
        leafbounds.keep_known_leaves(other.cas, self._state.cas)
        if not self._state.adopt(other):
            return False
        self._notify()
        return True

    @_locked
    def with_leaf_bounds(self, until: datetime) -> dict[str, bytes] | None:
        """The files to store for every CA's leaf bound raised to at least `until`;
        None when every bound already is. Memory is not changed: the leader saves
        these files itself (off this lock, so Certify never waits on the write),
        then calls `raise_leaf_bounds`."""
        return leafbounds.encoded_with_bounds(self._state.cas, until, self._state.files)

    @_locked
    def raise_leaf_bounds(self, until: datetime, *, stored: Callable[[], bool]) -> bool:
        """Raise in-memory leaf bounds to `until` if `stored()` (checked under the
        lock) says the files of `with_leaf_bounds(until)` are still what the store
        holds; True when raised. A leaf up to the bound then needs no save."""
        if not stored():
            return False
        leafbounds.raise_all(self._state.cas, until)
        return True

    # ------------------------------------------------------------ change notification

    @_locked
    def add_listener(self, listener: Callable[[TrustBundleView], None]) -> None:
        """Call `listener(bundle)` after every bundle change (e.g. to rewrite ca.pem)."""
        self._publication.add_listener(listener)

    def deliver_changes_on(self, loop: asyncio.AbstractEventLoop) -> None:
        """Call listeners and wake watchers on `loop`, also for changes made in threads."""
        self._publication.deliver_on(loop)

    async def wait_for_change(self, version: int) -> TrustBundleView:
        """Return the bundle once its version is above `version` (at once if it already
        is); the published one, so the event loop never waits for the lock."""
        return await self._publication.wait_for_change(version)

    def _notify(self) -> None:
        # Under the lock: published first, so whoever is woken reads this bundle.
        self._publish()
        self._publication.changed()
