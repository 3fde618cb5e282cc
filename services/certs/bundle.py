"""The trust bundle: what peers must trust now, and telling everyone when it changes.

`TrustBundleView` is one published bundle (a version and its CAs);
`BundleChanges` delivers each new one to listeners (which rewrite ca.pem, the
ConfigMap, ...) and wakes `WatchTrustBundle` streams.

Invariants:
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


class BundleChanges:
    """Deliver every new bundle to listeners and waiters, on one event loop."""

    def __init__(self, current: Callable[[], TrustBundleView], version: int) -> None:
        #: The published bundle (read without any lock).
        self._current = current
        self._listeners: list[Callable[[TrustBundleView], None]] = []
        self._changed: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # The newest bundle version listeners were told of: a change made in a thread
        # is delivered later than one made on the loop, and must not overwrite it.
        self._delivered_version = version

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop

    def add_listener(self, listener: Callable[[TrustBundleView], None]) -> None:
        self._listeners.append(listener)

    def deliver_on(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    async def wait_for_change(self, version: int) -> TrustBundleView:
        """The published bundle once its version is above `version` (at once if it is)."""
        while (bundle := self._current()).version <= version:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()
        return bundle

    def changed(self, bundle: TrustBundleView) -> None:
        """`bundle` was just published: deliver it (on the loop, from any thread)."""
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
