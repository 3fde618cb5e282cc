"""The trust bundle: what peers must trust now, and telling everyone when it changes.

`TrustBundleView` is one bundle (a version and its CAs); `Published` is what
the authority last published (the bundle and until when it holds);
`Publication` holds that for readers without the authority's lock, delivers
each new bundle to listeners (which rewrite ca.pem, the ConfigMap, ...) and
wakes `WatchTrustBundle` streams.

Invariants:
- a reader never waits for the authority's lock, and never pairs a bundle with
  another one's deadline (`Published` is replaced whole);
- on the event loop a bundle whose transition is due is still served (the
  rotation timer applies it within moments, and it holds every CA the next
  one does: a switch keeps both, a retirement only drops one); elsewhere the
  authority applies the transition first (`Publication.current`);
- listeners and waiters run on the event loop given to `deliver_on`,
  whichever thread made the change (a signing thread, a rotation);
- versions only move forward: a change delivered late (made in a thread) never
  overwrites a newer one already delivered; a failing listener is logged and
  does not stop the others.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Callable, Sequence
from datetime import datetime

from cryptography import x509

from waygate.certs.castate import CARecord, CAView

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class TrustBundleView:
    version: int
    authorities: tuple[CAView, ...]

    @property
    def pem(self) -> str:
        return "".join(a.pem for a in self.authorities)

    @property
    def certificates(self) -> tuple[x509.Certificate, ...]:
        return tuple(a.certificate for a in self.authorities)

    @classmethod
    def of(cls, version: int, cas: Sequence[CARecord]) -> TrustBundleView:
        """What peers must trust while `cas` are kept: what each publishes, once
        (intermediates under one upstream root publish that root once)."""
        views: dict[str, CAView] = {}
        for ca in cas:
            views.setdefault(ca.published_fingerprint, ca.view())
        return cls(version, tuple(views.values()))


@dataclasses.dataclass(frozen=True)
class Published:
    """What the authority published: read without its lock (a signing thread holds
    that across signing and store writes)."""

    bundle: TrustBundleView
    #: Until when `bundle` holds: the next bundle transition due by the clock.
    step_due: datetime | None
    #: The next transition of any kind (the rotation timer's).
    next_transition: datetime | None

    def stale(self, now: datetime) -> bool:
        """A transition is due: `bundle` no longer holds."""
        return self.step_due is not None and now >= self.step_due


class Publication:
    """The published bundle, and every new one delivered to listeners and waiters on
    one event loop."""

    def __init__(self, published: Published) -> None:
        #: Replaced whole by `publish` (under the authority's lock); read without it.
        self.published = published
        self._listeners: list[Callable[[TrustBundleView], None]] = []
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The newest bundle version listeners were told of: a change made in a thread
        # is delivered later than one made on the loop, and must not overwrite it.
        self._delivered_version = published.bundle.version

    def publish(self, published: Published) -> None:
        self.published = published

    def current(self, now: datetime) -> TrustBundleView | None:
        """The published bundle for a reader; None when a transition is due and the
        reader is not on the event loop (it applies the transition first)."""
        published = self.published
        if not published.stale(now):
            return published.bundle
        if self._loop is not None and running_on(self._loop):
            return published.bundle
        return None

    def add_listener(self, listener: Callable[[TrustBundleView], None]) -> None:
        self._listeners.append(listener)

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def wait_for_change(self, version: int) -> TrustBundleView:
        """The published bundle once its version is above `version` (at once if it is)."""
        while (bundle := self.published.bundle).version <= version:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
        return bundle

    def changed(self) -> None:
        """A new bundle was just published: deliver it (on the loop, from any thread)."""
        bundle = self.published.bundle
        loop = self._loop
        if loop is not None and not loop.is_closed() and not running_on(loop):
            loop.call_soon_threadsafe(self._deliver, bundle)
        else:
            self._deliver(bundle)

    def _deliver(self, bundle: TrustBundleView) -> None:
        if bundle.version <= self._delivered_version:
            return  # a newer bundle was delivered first (made on the loop meanwhile)
        self._delivered_version = bundle.version
        for listener in self._listeners:
            try:
                listener(bundle)
            except Exception:
                log.exception("trust bundle listener failed")
        if self._changed is not None:
            self._changed.set()
            self._changed = None


def running_on(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
