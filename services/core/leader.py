"""Leader election over a `coordination.k8s.io/v1` Lease, for any service's replicas.

Several replicas of a service run; one of them, the leader, does the writes
only one may do (certs: CA state, CSR signatures; the resolver: Route and
Gateway API status). This is client-go's leaderelection, with its rules:

- A candidate takes the Lease when it does not exist, when it holds it, or
  when the holder has not renewed it for `lease_duration` as observed on THIS
  replica's clock (the time it last saw the Lease record change), never by
  comparing the record's timestamps with its own clock, so clock skew between
  replicas does not matter; only clock rate does.
- Every take and renewal is a create, or a replace carrying the
  resourceVersion that was read: of two candidates, one wins and the other
  gets 409 and stays a follower.
- The leader renews every `retry_period`. `is_leader()` is true only until
  `renew_deadline` after the start of the last successful renewal; since
  `renew_deadline < lease_duration`, a leader that cannot renew (API down,
  partitioned) stops writing at least `lease_duration - renew_deadline`
  before any other replica can take the Lease.
- Leadership lost is never taken back silently: `leading` flips to False,
  `on_change` runs, and the elector tries to acquire again from scratch.
- Every Lease call runs on the elector's own thread, never on the event loop.

Each service names its own metrics (a leader gauge and a transitions counter
labelled `change`) and its component in log lines; this module registers none.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import logging
import math
import secrets
import socket
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter, Gauge

from waygate.core.kube import JSON, KubeAPI, KubeError

log = logging.getLogger(__name__)


def default_identity() -> str:
    """client-go's default: host name (the pod name) and a random suffix, unique per start."""
    return f"{socket.gethostname()}_{secrets.token_hex(4)}"


@dataclasses.dataclass(frozen=True)
class LeaseTiming:
    """client-go's defaults; renew_deadline < lease_duration, retry_period < renew_deadline."""

    lease_duration: float = 15.0
    renew_deadline: float = 10.0
    retry_period: float = 2.0

    def problem(self) -> str | None:
        if not 0 < self.retry_period < self.renew_deadline < self.lease_duration:
            return (
                "leader election needs 0 < retry_period < renew_deadline < lease_duration, "
                f"not {self.retry_period:g} / {self.renew_deadline:g} / {self.lease_duration:g}"
            )
        return None


def _micro_time(moment: float) -> str:
    return datetime.fromtimestamp(moment, UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """Acquires and renews one Lease until cancelled; `is_leader()` from any thread."""

    def __init__(
        self,
        api: KubeAPI,
        namespace: str,
        name: str,
        *,
        identity: str,
        timing: LeaseTiming = LeaseTiming(),
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        component: str,
        leader_gauge: Gauge,
        transitions: Counter,
    ) -> None:
        self._component = component
        self._gauge = leader_gauge
        self._transitions = transitions
        problem = timing.problem()
        if problem:
            raise ValueError(problem)
        self._api = api
        self.namespace, self.name = namespace, name
        self.identity = identity
        self.timing = timing
        self._clock = clock
        self._wall_clock = wall_clock
        self._collection = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases"
        self._path = f"{self._collection}/{name}"
        self._lock = threading.Lock()
        # Start (local clock) of the last successful take or renewal; None: not leading.
        self._renewed_at: float | None = None
        # The Lease as last seen, and when (local clock) its record last changed.
        self._observed: JSON | None = None
        self._observed_at = 0.0
        #: The holder as last seen ("" when none); this replica's identity when leading.
        self.holder = ""
        self._leading = False
        # Set when run() ends: a renewal still in flight then counts for nothing,
        # since the Lease is being released.
        self._stopping = False
        self._changed: asyncio.Event | None = None
        self._callbacks: list[Callable[[bool], None]] = []

    # ------------------------------------------------------------ queries

    def is_leader(self) -> bool:
        """True while this replica may write: within renew_deadline of its last renewal."""
        with self._lock:
            return (
                not self._stopping
                and self._renewed_at is not None
                and self._clock() < self._renewed_at + self.timing.renew_deadline
            )

    @property
    def leading(self) -> bool:
        """What the election loop last concluded (`is_leader()` is the safe check)."""
        return self._leading

    def leader_description(self) -> str:
        holder = self.holder
        return holder if holder else "none elected yet"

    def on_change(self, callback: Callable[[bool], None]) -> None:
        """Call `callback(leading)` on the event loop whenever leadership starts or stops."""
        self._callbacks.append(callback)

    async def wait_for(self, leading: bool) -> None:
        """Return once `leading` has the given value."""
        while self._leading != leading:
            if self._changed is None:
                self._changed = asyncio.Event()
            await self._changed.wait()

    # ------------------------------------------------------------ the loop

    async def run(self) -> None:
        executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="leader-election"
        )
        loop = asyncio.get_running_loop()
        try:
            while True:
                started = self._clock()
                try:
                    await loop.run_in_executor(executor, self._try_acquire_or_renew)
                except Exception:
                    log.warning("leader election step failed unexpectedly", exc_info=True)
                self._set_leading(self.is_leader())
                elapsed = self._clock() - started
                await asyncio.sleep(max(0.0, self.timing.retry_period - elapsed))
        finally:
            with self._lock:
                self._stopping = True
            self._set_leading(False)
            executor.shutdown(wait=False, cancel_futures=True)
            await asyncio.to_thread(self._release)

    def _set_leading(self, leading: bool) -> None:
        if leading == self._leading:
            return
        self._leading = leading
        self._gauge.set(1 if leading else 0)
        self._transitions.labels("started" if leading else "stopped").inc()
        if leading:
            log.info(
                "this %s replica leads",
                self._component,
                extra={"lease": self._path, "id": self.identity},
            )
        else:
            with self._lock:
                self._renewed_at = None
            log.warning(
                "this %s replica stopped leading",
                self._component,
                extra={"lease": self._path, "id": self.identity},
            )
        if self._changed is not None:
            self._changed.set()
            self._changed = None
        for callback in self._callbacks:
            try:
                callback(leading)
            except Exception:
                log.exception("leadership callback failed")

    # ------------------------------------------------------------ one step (a thread)

    def _try_acquire_or_renew(self) -> None:
        attempt_started = self._clock()
        now = self._wall_clock()
        try:
            current: JSON | None = self._api.get(self._path)
        except KubeError as exc:
            if not exc.not_found:
                self._failed("read", exc)
                return
            current = None
        if current is None:
            record = self._record(None, now)
            try:
                self._api.create(self._collection, record)
            except KubeError as exc:
                self._failed("create", exc)
                return
            self._succeeded(record, attempt_started)
            return
        self._observe(current)
        spec = current.get("spec") or {}
        holder = str(spec.get("holderIdentity") or "")
        duration = float(spec.get("leaseDurationSeconds") or self.timing.lease_duration)
        if holder and holder != self.identity and self._observed_at + duration > self._clock():
            return  # someone else holds an unexpired lease: stay a follower
        record = self._record(current, now)
        try:
            written = self._api.replace(self._path, record)
        except KubeError as exc:
            self._failed("renew" if holder == self.identity else "take", exc)
            return
        self._succeeded(written, attempt_started)

    def _record(self, current: JSON | None, now: float) -> JSON:
        spec = dict((current or {}).get("spec") or {})
        metadata: JSON = {"name": self.name, "namespace": self.namespace}
        if current is not None:
            metadata["resourceVersion"] = (current.get("metadata") or {}).get("resourceVersion", "")
            for field in ("labels", "annotations"):
                if (current.get("metadata") or {}).get(field):
                    metadata[field] = current["metadata"][field]
        stamp = _micro_time(now)
        if spec.get("holderIdentity") != self.identity:
            spec["acquireTime"] = stamp
            if current is not None:
                spec["leaseTransitions"] = int(spec.get("leaseTransitions") or 0) + 1
            else:
                spec["leaseTransitions"] = 0
        spec.update(
            holderIdentity=self.identity,
            leaseDurationSeconds=math.ceil(self.timing.lease_duration),
            renewTime=stamp,
        )
        return {
            "apiVersion": "coordination.k8s.io/v1",
            "kind": "Lease",
            "metadata": metadata,
            "spec": spec,
        }

    def _observe(self, lease: JSON) -> None:
        """Note when the Lease record last changed, on this replica's clock."""
        if self._observed is None or (lease.get("spec") or {}) != (
            self._observed.get("spec") or {}
        ):
            self._observed_at = self._clock()
        self._observed = lease
        self.holder = str((lease.get("spec") or {}).get("holderIdentity") or "")

    def _succeeded(self, lease: JSON, attempt_started: float) -> None:
        self._observed = lease
        self._observed_at = self._clock()
        self.holder = self.identity
        with self._lock:
            if self._stopping:
                return
            # Counted from before the request was sent: the lease can only run
            # out later than that on anyone's clock.
            self._renewed_at = attempt_started

    def _failed(self, what: str, exc: KubeError) -> None:
        if exc.conflict:
            log.info("leader lease %s lost a race (409); retrying", what)
            return
        log.warning(
            "cannot %s the leader lease %s/%s: %s",
            what,
            self.namespace,
            self.name,
            exc.message,
            extra={"status": exc.status},
        )

    def _release(self) -> None:
        """On a clean stop, give the Lease up so the next leader need not wait it out."""
        lease = self._observed
        if lease is None or (lease.get("spec") or {}).get("holderIdentity") != self.identity:
            return
        released: Any = {
            **lease,
            "spec": {**(lease.get("spec") or {}), "holderIdentity": "", "leaseDurationSeconds": 1},
        }
        try:
            self._api.replace(self._path, released)
        except KubeError as exc:
            log.info("could not release the leader lease: %s", exc.message)
