"""Who trusts what: the trust bundle each consumer (process instance) reports it applied.

Every trust consumer (proxy, tunnel servers and agents, resolver, `waygate up`,
any tool using `waygate.certs.client`) calls ReportTrust after it applies a
bundle and every `REPORT_INTERVAL` while it runs; `ConsumerTable` keeps the
last report per (identity, instance). The rotation state machine
(`waygate.certs.rotation`) reads it to gate its steps; status, `waygate cert
status`, the status page and a metric show it.

Invariants:
- bounded: at most `max_consumers` entries (the oldest report goes first) and
  every field length-checked before it is stored (INVALID_ARGUMENT);
- thread-safe (its own lock): reports arrive on the event loop, rotation steps
  read it in worker threads;
- in memory only: after a restart or a leader change it fills again within one
  report interval, so a term of judging it (`start_term`) that finds a
  rotation under way waits that long (`settle_until`, see `rotation.gate`):
  an empty table is not "all acknowledged".
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Callable, Iterable
from datetime import datetime, timedelta

from waygate.certs.rotation import ConsumerReport, Judging
from waygate.core.errors import InvalidArgument, excerpt

#: How often a consumer reports while nothing changes (the client library's default).
REPORT_INTERVAL = 30.0
MAX_CONSUMERS = 10_000
MAX_IDENTITY_LENGTH = 2048
MAX_INSTANCE_LENGTH = 256
#: A bundle holds the old, the active and a staged CA at most; a few to spare.
MAX_FINGERPRINTS = 8
_FINGERPRINT_CHARS = frozenset("0123456789abcdef")


def check_report(
    identity: str, instance: str, fingerprints: Iterable[str]
) -> tuple[str, str, frozenset[str]]:
    """The report's fields, within bounds; INVALID_ARGUMENT naming the first that is not."""
    if not identity:
        raise InvalidArgument("identity is empty: say which identity this process holds")
    if len(identity) > MAX_IDENTITY_LENGTH:
        raise InvalidArgument(f"identity is longer than {MAX_IDENTITY_LENGTH} characters")
    if not instance:
        raise InvalidArgument("instance is empty: name this process (pod name, host/pid)")
    if len(instance) > MAX_INSTANCE_LENGTH:
        raise InvalidArgument(f"instance is longer than {MAX_INSTANCE_LENGTH} characters")
    prints = list(fingerprints)
    if len(prints) > MAX_FINGERPRINTS:
        raise InvalidArgument(
            f"the report names {len(prints)} CA fingerprints; at most {MAX_FINGERPRINTS}"
        )
    for value in prints:
        if len(value) != 64 or not set(value) <= _FINGERPRINT_CHARS:
            raise InvalidArgument(
                f"CA fingerprint {excerpt(value)} is not lower-case hex SHA-256 (64 characters)"
            )
    return identity, instance, frozenset(prints)


class ConsumerTable:
    """The last report of each (identity, instance), oldest report first."""

    def __init__(self, max_consumers: int = MAX_CONSUMERS) -> None:
        self.max_consumers = max_consumers
        self._lock = threading.Lock()
        self._reports: collections.OrderedDict[tuple[str, str], ConsumerReport] = (
            collections.OrderedDict()
        )
        #: Reports are not judged before this (the term's settling time; None: at once).
        self.settle_until: datetime | None = None
        self._judging = False

    def start_term(self, settle_until: Callable[[], datetime | None]) -> None:
        """This process just loaded the CA, or became the replica that takes rotation
        steps (leader): judge reports from now on, but not before `settle_until()`
        (a rotation under way gives consumers time to report here first). Once per
        term (a leader's duties may call it again); a rotation started later in the
        term is judged at once: its consumers have been reporting here all along,
        and it waits its propagation delay anyway."""
        if self._judging:
            return
        self._judging = True
        self.settle_until = settle_until()

    def end_term(self) -> None:
        """This replica no longer leads: the next term settles again."""
        self._judging = False
        self.settle_until = None

    def report(
        self,
        *,
        identity: str,
        instance: str,
        version: int,
        fingerprints: Iterable[str],
        now: datetime,
    ) -> ConsumerReport:
        identity, instance, prints = check_report(identity, instance, fingerprints)
        entry = ConsumerReport(identity, instance, version, prints, now)
        with self._lock:
            self._reports.pop((identity, instance), None)
            self._reports[(identity, instance)] = entry
            while len(self._reports) > self.max_consumers:
                self._reports.popitem(last=False)
        return entry

    def leave(self, identity: str, instance: str) -> bool:
        """The instance stopped (it said so): it holds nothing any more."""
        identity, instance, _ = check_report(identity, instance, ())
        with self._lock:
            return self._reports.pop((identity, instance), None) is not None

    def judging(self, now: datetime, ttl: timedelta) -> Judging:
        """What a rotation step is judged by now: every report, the term's settling time."""
        return Judging(self.snapshot(), now, ttl, self.settle_until)

    def snapshot(self) -> tuple[ConsumerReport, ...]:
        with self._lock:
            return tuple(self._reports.values())

    def __len__(self) -> int:
        return len(self._reports)
