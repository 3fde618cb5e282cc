"""What the certs leader does, and the certs replicas' leader election.

Several certs replicas serve Certify, GetTrustBundle and WatchTrustBundle; one
of them, the leader (elected over a Lease by `waygate.core.leader`), writes CA
state (rotation steps, the leaf-expiry bound, the CA Secret, the bundle
ConfigMap, CSR approvals and signatures). Followers read that state and keep
signing within the leaf-expiry bound the leader wrote.

Metrics: `waygate_certs_leader` (1 on the leader) and
`waygate_certs_leader_transitions_total`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import threading
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from typing import Any

from prometheus_client import Counter, Gauge

from waygate.core.errors import Unavailable, WaygateError
from waygate.core.kube import KubeAPI
from waygate.core.leader import LeaderElector, LeaseTiming

log = logging.getLogger(__name__)

LEADER = Gauge("waygate_certs_leader", "1 while this certs replica is the leader, else 0.")
TRANSITIONS = Counter(
    "waygate_certs_leader_transitions_total",
    "Times this certs replica started or stopped leading.",
    ["change"],
)


def certs_elector(
    api: KubeAPI,
    namespace: str,
    name: str,
    *,
    identity: str,
    timing: LeaseTiming | None = None,
) -> LeaderElector:
    """The certs replicas' elector: certs' metrics and log component."""
    return LeaderElector(
        api,
        namespace,
        name,
        identity=identity,
        timing=timing or LeaseTiming(),
        component="certs",
        leader_gauge=LEADER,
        transitions=TRANSITIONS,
    )


# ---------------------------------------------------------------- what the leader does

#: How far past the longest leaf a replica may sign now the leader keeps the
#: leaf-expiry bound: raised to twice this once it is less than this ahead, so
#: it is written about once per LEAF_BOUND_LEAD, and followers keep signing
#: for at least that long without a leader.
LEAF_BOUND_LEAD = timedelta(hours=1)
#: How often the leader checks the bound: often, because a rotation adds a CA
#: without one, and it must have one before it signs (the check is cheap when
#: every bound is ahead: no files are built).
LEAF_BOUND_CHECK = 1.0


async def while_leading(
    elector: LeaderElector, duties: list[Callable[[], Coroutine[Any, Any, None]]]
) -> None:
    """Run `duties` while this replica leads; cancel them the moment it stops.

    A duty that ends or fails while leadership lasts is started again after a
    pause, never in a tight loop.
    """
    while True:
        await elector.wait_for(True)
        tasks = [asyncio.ensure_future(duty()) for duty in duties]
        lost = asyncio.ensure_future(elector.wait_for(False))
        try:
            await asyncio.wait([lost, *tasks], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (lost, *tasks):
                task.cancel()
            results = await asyncio.gather(lost, *tasks, return_exceptions=True)
        for result in results:
            if isinstance(result, Exception):
                log.warning("a leader duty failed: %s", result, exc_info=result)
        if elector.leading:
            await asyncio.sleep(elector.timing.retry_period)


async def keep_leaf_bounds(authority: Any, store: Any, *, lead: timedelta | None = None) -> None:
    """The leader's duty: keep every CA's leaf-expiry bound at least `lead` past
    the longest leaf anyone could be signing now, so no Certify (on any replica)
    has to write it. The write happens off the authority's lock (Certify never
    waits for it) and only lands if nothing else was stored meanwhile. `lead`:
    the authority's `leaf_bound_step` (--leaf-bound-step), LEAF_BOUND_LEAD by default."""
    ahead: timedelta = lead or authority.config.leaf_bound_step or LEAF_BOUND_LEAD
    while True:
        now = datetime.now(UTC)
        longest = now + authority.config.max_lifetime
        low = await asyncio.to_thread(authority.with_leaf_bounds, longest + ahead)
        if low is not None:
            until = longest + 2 * ahead
            base = store.version
            files = await asyncio.to_thread(authority.with_leaf_bounds, until)
            written = None
            if files is not None:
                try:
                    written = await asyncio.to_thread(store.save_based_on, files, base)
                except WaygateError as exc:
                    log.warning("leaf-expiry bound not stored, retrying: %s", exc)
            if written is not None:
                await asyncio.to_thread(
                    authority.raise_leaf_bounds,
                    until,
                    stored=functools.partial(_still_at, store, written),
                )
                log.info("leaf-expiry bound raised", extra={"until": until.isoformat()})
                continue
        await asyncio.sleep(LEAF_BOUND_CHECK if low is None else 2.0)


def _still_at(store: Any, version: str) -> bool:
    return bool(store.version == version)


async def take_over(authority: Any, store: Any) -> None:
    """The leader's first duty: start from what is stored (a follower may have
    applied transitions in memory only), then store the transitions now due —
    so a rotation a previous leader started is carried on by this one."""
    files = await asyncio.to_thread(store.load)
    if files is not None:
        await asyncio.to_thread(authority.adopt, files)
    # A rotation under way waits for the consumers to report to this leader first.
    authority.start_judging()
    await asyncio.to_thread(authority.rotate_if_expiring)


async def wait_for_leaf_bound(authority: Any, elector: Any) -> None:
    """Before a replica reports ready: wait until the leaf-expiry bound covers the
    longest leaf it may sign now (the leader's keeper raises it, off the
    authority's lock), so no Certify waits on a store write: a follower may not
    make it, and the leader would hold every signer up while it does."""
    while True:
        longest = datetime.now(UTC) + authority.config.max_lifetime
        if await asyncio.to_thread(authority.with_leaf_bounds, longest) is None:
            return
        await asyncio.sleep(0.2)


# ---------------------------------------------------------------- one writer, several processes


class ParentWrites:
    """The writer rule of a `--workers` worker: the parent process writes, never this one."""

    def __init__(self, parent_pid: int, index: int) -> None:
        self.identity = f"worker {index} of certs process {parent_pid}"
        self._parent = parent_pid

    def is_leader(self) -> bool:
        return False

    def leader_description(self) -> str:
        return f"the parent certs process {self._parent}, which writes CA state for its workers"


class FollowingStore:
    """A worker's view of a CA directory: loads it, never writes it.

    Like a follower's Secret store: a due state transition stays in memory
    (the parent stores the same one); a new CA or a raised bound is the
    writer's, so a save of one raises Unavailable naming it.
    """

    def __init__(self, inner: Any, writer: Any) -> None:
        self._inner = inner
        self._writer = writer
        self.description = inner.description
        self._stored: dict[str, bytes] | None = None

    def load(self) -> dict[str, bytes] | None:
        files = self._inner.load()
        self._stored = files
        return files

    def save(self, files: dict[str, bytes]) -> None:
        from waygate.certs.kube_store import save_kind

        kind = save_kind(self._stored, files)
        if kind == "transition":
            return
        raise Unavailable(self.refusal("a new CA" if kind == "new-ca" else "the leaf-expiry bound"))

    def refusal(self, what: str) -> str:
        """Why this worker does not write `what`: its parent does."""
        return (
            f"this {self._writer.identity} does not write {what}; "
            f"{self._writer.leader_description()} does (retry on a new connection)"
        )

    async def follow(self, adopt: Callable[[dict[str, bytes]], object], every: float = 0.5) -> None:
        """Poll the directory's state file; `adopt(files)` (a worker thread) on every change."""
        path = getattr(self._inner, "path", None)
        seen: tuple[float, int] | None = None
        while True:
            await asyncio.sleep(every)
            try:
                stat = await asyncio.to_thread((path / "state.json").stat) if path else None
            except OSError:
                continue
            mark = (stat.st_mtime, stat.st_size) if stat else None
            if mark == seen:
                continue
            seen = mark
            try:
                files = await asyncio.to_thread(self.load)
                if files is not None:
                    await asyncio.to_thread(adopt, files)
            except WaygateError as exc:
                log.warning("cannot take the CA state from %s: %s", self.description, exc)


class VersionedStore:
    """The parent's CA directory store with a version, for `keep_leaf_bounds`.

    The version counts this process's saves (it is the only writer of the
    directory); `save_based_on` writes only if no other save came between.
    """

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.description = inner.description
        self._lock = threading.RLock()
        self._saves = 0

    @property
    def version(self) -> str:
        return str(self._saves)

    def load(self) -> dict[str, bytes] | None:
        return self._inner.load()  # type: ignore[no-any-return]

    def save(self, files: dict[str, bytes]) -> None:
        with self._lock:
            self._inner.save(files)
            self._saves += 1

    def save_based_on(self, files: dict[str, bytes], version: str) -> str | None:
        with self._lock:
            if self.version != version:
                return None
            self.save(files)
            return self.version
