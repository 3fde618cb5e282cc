"""The soak's schedule of faults, its monitor, and what it checks and reports.

One cycle of phases (each held `hold` seconds of steady load unless said):
  steady          nothing happens;
  resolver-replica-killed
                  kill -9 the resolver replica the proxy watches (its
                  waygate_resolver_watchers); while it is down the routes file
                  gains a route (late.soak.test), which must answer through the
                  proxy (its Watch moved to the other) while the killed one is
                  still down; restart it;
  resolver-down   kill -9 both resolver replicas; while they are down the late
                  route is removed again; restart both; the removal must take
                  effect within seconds of the return;
  certs-leader-killed
                  kill -9 the certs replica holding the Lease; the other must
                  take the Lease, and Certify through the load balancer must
                  succeed throughout (a probe every half second); restart the
                  killed one;
  certs-down      kill -9 both certs replicas for longer than a renewal retry
                  (renewals fail meanwhile), restart both; renewals must
                  resume, and no process's certificate may ever expire
                  (sampled every second);
  leaf-rotation   held until every process has renewed its leaf again;
  ca-rotation     RotateCA (propagation delay `hold`, a minimum: activation also
                  waits for every trust consumer's acknowledgement; the notes say
                  how long past the delay it waited and for whom), held until every process
                  has renewed after the switch to the new CA (first cycle only:
                  the old CA stays published about an hour, and certs refuses
                  another rotation until it retires);
  ts-killed       kill -9 tunnel-server replica ts-a, restart it after `hold`;
  agent-killed    kill -9 agent-1 (agent-2 serves the same node), restart it;
  changes         the direct service loses endpoint backend-b and gains
                  backend-c (and the reverse the next cycle).
What must hold (issue 18, item 2) is checked per phase: zero failed requests,
except tunnelled connections in flight when a replica (ts-a) or an agent
(agent-1) was killed, and only with a cut (reset, closed mid-body or
mid-session, or the proxy's 502): their bytes went through the process that
died. Which replica or agent carried a connection is not visible from the
client, so "in flight at that kill, tunnelled, cut" is the rule, counted and
reported apart; a request started after the grace must succeed; no request reaches a removed endpoint after
the proxy was seen to stop using it; every 2xx body intact; no request
answered twice; memory, fds and threads back near the baseline at the end.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import statistics
import time
from collections import Counter, defaultdict
from collections.abc import Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import grpc
from cryptography.hazmat.primitives import serialization
from google.protobuf import duration_pb2

from bench.soak.load import Load, Outcome, probe
from bench.soak.stack import (
    ADDED_ADDRESS,
    CERTS_REPLICAS,
    DIRECT_ADDRESSES,
    DIRECT_HOST,
    LATE_HOST,
    RESOLVER_REPLICAS,
    Stack,
    spiffe,
)
from tests.support.pki import make_csr
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

CERT_HOLDERS = (*RESOLVER_REPLICAS, "ts-a", "ts-b", "agent-1", "agent-2", "proxy")
TUNNEL_KINDS = ("tunnel-keepalive", "tunnel-newconn", "download-1m", "ws-tunnel")
#: After a replica dies, requests started this long after it may still have
#: been on their way to it (the kill itself is not instantaneous).
IN_FLIGHT_GRACE = 1.0
#: How a connection cut by its replica's death may end, each a clear error to the
#: client: the connection reset or closed under it (mid-body, mid-session), or
#: the proxy's 502 when the upstream died before the answer.
CUT_CAUSES = frozenset({"reset", "closed without answer", "body cut short", "http 502"})


def is_cut(cause: str) -> bool:
    # "ws close mid-session", "ws closed mid-session", "ws error mid-session"...
    return cause in CUT_CAUSES or (cause.startswith("ws ") and cause.endswith(" mid-session"))


_WATCHERS = re.compile(r"^waygate_resolver_watchers ([0-9.e+-]+)$", re.M)
_METRIC = re.compile(r"^(waygate_certificate_\w+)\{([^}]*)\} ([0-9.e+-]+)$", re.M)


@dataclass
class Phase:
    name: str
    start: float
    end: float = 0.0
    notes: list[str] = field(default_factory=list)


@dataclass
class Check:
    name: str
    ok: bool
    detail: str


class Soak:
    def __init__(
        self,
        stack: Stack,
        *,
        hold: float,
        cycles: int,
        scale: float = 1.0,
        leaf_phase: bool = True,
        minimum: float = 0.0,
    ) -> None:
        self.stack = stack
        self.hold = hold
        self.cycles = cycles
        # The run lasts at least this long from its start: steady load fills what the
        # cycles leave (a cycle's length depends on how fast every process renews).
        self.minimum = minimum
        # False: the wait for renewals after certs-down is the leaf rotation
        # (every process renews under load there too); the short soak skips
        # the separate phase.
        self.leaf_phase = leaf_phase
        self.load = Load(stack.ports["proxy-http"], stack.ports["proxy-https"], stack.bundle, scale)
        self.phases: list[Phase] = []
        self.checks: list[Check] = []
        self.kills: list[tuple[str, float]] = []  # (process, when)
        self.removed_seen: list[tuple[str, float]] = []  # (backend, proxy stopped using it)
        self.changed_at: list[float] = []  # when each endpoint change was written
        self.min_margin: dict[str, float] = {}  # process -> least life left seen (s)
        self.renewals: dict[str, float] = {}  # process -> ok renewals (latest sample)
        self.usage_before: dict[str, dict[str, int]] = {}
        self.usage_after: dict[str, dict[str, int]] = {}
        self.sockets_after: dict[str, str] = {}
        self.started = 0.0
        # Restarts that failed: (process, why); each was started again once.
        self.failed_starts: list[tuple[str, str]] = []

    # ------------------------------------------------------------ running

    async def run(self) -> None:
        self.started = time.monotonic()
        await self.stack.start_all()
        monitor = asyncio.create_task(self._monitor())
        try:
            await self._wait_serving()
            self.load.start()
            await self._phase("steady", self._sleep())
            self.usage_before = self.stack.usage()
            for cycle in range(self.cycles):
                # The late route comes (one replica down) and goes (both down).
                await self._phase("resolver-replica-killed", self._resolver_replica_killed())
                await self._phase("resolver-down", self._resolver_down())
                await self._phase("steady", self._sleep())
                await self._phase("certs-leader-killed", self._certs_leader_killed())
                await self._phase("certs-down", self._certs_down())
                if self.leaf_phase:
                    await self._phase("leaf-rotation", self._leaf_rotation())
                if cycle == 0:
                    # Once: certs refuses another rotation while the old CA is still
                    # published for the leaves it signed (it retires about an hour on).
                    await self._phase("ca-rotation", self._ca_rotation())
                await self._phase("ts-killed", self._kill_restart("ts-a"))
                await self._phase("agent-killed", self._kill_restart("agent-1"))
                await self._phase("changes", self._changes(cycle))
                await self._phase("steady", self._sleep())
            left = self.started + self.minimum - time.monotonic()
            if left > 0:
                await self._phase("steady", asyncio.sleep(left))
            await self.load.stop()
            await asyncio.sleep(min(self.hold, 5.0))  # connections close, buffers go
            self.usage_after = self.stack.usage()
            # Described now, while the processes still run (the checks come later).
            self.sockets_after = {name: self.stack.sockets(name) for name in self.usage_after}
            await self._backend_checks()
        finally:
            monitor.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await monitor
            await self.load.stop()
        self._outcome_checks()

    async def _phase(self, name: str, action: Coroutine[Any, Any, None]) -> None:
        phase = Phase(name, time.monotonic())
        self.phases.append(phase)
        await action
        phase.end = time.monotonic()

    def note(self, text: str) -> None:
        self.phases[-1].notes.append(text)

    async def _sleep(self) -> None:
        await asyncio.sleep(self.hold)

    async def _wait_serving(self) -> None:
        """Until both routes answer (the proxy has its view and the agents are in)."""
        port = self.stack.ports["proxy-http"]
        async with asyncio.timeout(60):
            for host in (DIRECT_HOST, "tunnel.soak.test"):
                while (await probe(port, host))[0] != 200:
                    await asyncio.sleep(0.2)

    async def _restart(self, name: str) -> None:
        """Start a killed process again; one that dies while starting (a crash, not
        the fault injected) is recorded as a failed check and started once more, so
        the soak goes on measuring."""
        try:
            await self.stack.start(name)
        except RuntimeError as exc:
            why = str(exc).splitlines()[0]
            self.failed_starts.append((name, why))
            self.note(f"{name} failed to restart: {why}")
            await self.stack.start(name)

    async def _late_route_arrives(self, late: bool, since: float) -> float | None:
        """Seconds from `since` until the proxy serves the late route as `late` says
        (answers when added, no longer answers when removed); None: not in 30 s."""
        port = self.stack.ports["proxy-http"]
        while time.monotonic() < since + 30:
            status, _ = await probe(port, LATE_HOST)
            if (status == 200) == late:
                return time.monotonic() - since
            await asyncio.sleep(0.1)
        return None

    async def _resolver_replica_killed(self) -> None:
        killed = await self._watched_resolver()
        (survivor,) = [r for r in RESOLVER_REPLICAS if r != killed]
        self.stack.kill(killed)
        self.kills.append((killed, time.monotonic()))
        await asyncio.sleep(self.hold / 2)
        self._late = True
        self.stack.write_routes(direct=self._direct, late=True)
        written = time.monotonic()
        arrived = await self._late_route_arrives(True, written)
        self.checks.append(
            Check(
                "resolver-replica-killed: a route added while the watched replica was down "
                "took effect through the other",
                arrived is not None and self.stack.procs[survivor].alive,
                f"{killed} killed; "
                + ("never (30 s)" if arrived is None else f"{arrived:.1f} s after the write"),
            )
        )
        self.note(
            f"{killed} killed, late route added: {'-' if arrived is None else f'{arrived:.1f} s'}"
        )
        await asyncio.sleep(max(0.0, written + self.hold / 2 - time.monotonic()))
        await self._restart(killed)
        await asyncio.sleep(self.hold / 2)

    async def _watched_resolver(self) -> str:
        """The resolver replica the proxy's Watch is on (the proxy is its only watcher);
        the first replica when neither says (the metric is read within 10 s)."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            for _ in range(20):
                for name in RESOLVER_REPLICAS:
                    port = self.stack.procs[name].admin_port
                    try:
                        async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
                            text = await response.text()
                    except (aiohttp.ClientError, TimeoutError):
                        continue
                    found = _WATCHERS.search(text)
                    if found and float(found.group(1)) >= 1:
                        return name
                await asyncio.sleep(0.5)
        return RESOLVER_REPLICAS[0]

    async def _resolver_down(self) -> None:
        for name in RESOLVER_REPLICAS:
            self.stack.kill(name)
            self.kills.append((name, time.monotonic()))
        await asyncio.sleep(self.hold / 2)
        self._late = False
        self.stack.write_routes(direct=self._direct, late=False)
        await asyncio.sleep(self.hold / 2)
        await asyncio.gather(*(self._restart(name) for name in RESOLVER_REPLICAS))
        # The change made while both were down reaches the proxy after their return.
        arrived = await self._late_route_arrives(False, time.monotonic())
        self.checks.append(
            Check(
                "resolver-down: a route removed while every replica was down took effect "
                "after their return",
                arrived is not None,
                "never (30 s)" if arrived is None else f"{arrived:.1f} s after the return",
            )
        )
        self.note(f"late route removed: {'-' if arrived is None else f'{arrived:.1f} s'}")

    _direct: tuple[str, ...] = DIRECT_ADDRESSES
    _late = False

    async def _certs_leader_killed(self) -> None:
        """kill -9 the Lease holder: the other replica takes the Lease (6 s lease) and
        Certify goes on through the load balancer meanwhile (every replica signs;
        only the leader writes CA state). A Certify every half second shows it
        (renewals come too seldom to rely on one landing in the outage)."""
        async with asyncio.timeout(30):
            while not (leader := await self.stack.certs_leader()):
                await asyncio.sleep(0.5)
        (other,) = [r for r in CERTS_REPLICAS if r != leader]
        self.stack.kill(leader)
        killed = time.monotonic()
        self.kills.append((leader, killed))
        took, issued, refused = None, 0, []
        deadline = killed + max(self.hold, 30.0)
        while time.monotonic() < deadline and (
            took is None or time.monotonic() < killed + self.hold
        ):
            error = await self._certify()
            if error is None:
                issued += 1
            else:
                refused.append(error)
            if took is None and await self.stack.certs_leader() == other:
                took = time.monotonic() - killed
            await asyncio.sleep(0.5)
        self.checks.append(
            Check(
                "certs-leader-killed: the other replica took the Lease and issued meanwhile",
                took is not None and issued > 0 and not refused,
                f"{leader} killed; {other} leading after "
                + ("-" if took is None else f"{took:.1f} s")
                + f"; Certify through the load balancer: {issued} issued, {len(refused)} failed"
                + (f" ({refused[0]})" if refused else ""),
            )
        )
        self.note(
            f"{leader} killed, {other} leading after {'-' if took is None else f'{took:.1f} s'}"
        )
        await self._restart(leader)

    async def _certify(self) -> str | None:
        """One Certify through the certs load balancer as the soak's user; its error or None."""
        csr, _ = make_csr((f"uri:{spiffe('user')}",), critical=False)
        credentials = grpc.ssl_channel_credentials(self.stack.bundle.read_bytes())
        address = f"127.0.0.1:{self.stack.ports['certs-lb']}"
        async with grpc.aio.secure_channel(address, credentials) as channel:
            try:
                await certs_pb2_grpc.CertsStub(channel).Certify(
                    certs_pb2.CertifyRequest(
                        identity=spiffe("user"),
                        token=self.stack.tokens["user"],
                        certificate_signing_request=csr.public_bytes(serialization.Encoding.DER),
                    ),
                    timeout=10,
                )
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name}: {(exc.details() or '')[:200]}"
        return None

    async def _certs_down(self) -> None:
        # Unavailable (kill to the first replica ready again) for about a tenth
        # of the lifetime: longer than a renewal retry (a fiftieth of it), well
        # shorter than what a leaf due for renewal has left (25-35% of it). The
        # restart's own time counts (several seconds with the Kubernetes client
        # on a busy machine): it is taken from the last start.
        retry = self.stack.leaf_lifetime / 50
        startup = max(self.stack.start_seconds.get(n, 0.0) for n in CERTS_REPLICAS)
        before = dict(self.renewals)
        killed = time.monotonic()
        for name in CERTS_REPLICAS:
            self.stack.kill(name)
            self.kills.append((name, time.monotonic()))
        await asyncio.sleep(max(2 * retry, self.stack.leaf_lifetime * 0.1 - startup))
        await asyncio.gather(*(self._restart(name) for name in CERTS_REPLICAS))
        back = min(self.stack.ready_at[n] for n in CERTS_REPLICAS) - killed
        self.note(f"both certs replicas down, unavailable {back:.1f} s")
        resumed = await self._renewed_since(before, self.stack.leaf_lifetime)
        self.checks.append(
            Check(
                "certs-down: renewals resumed in every process",
                not resumed,
                "all renewed" if not resumed else f"not renewed: {', '.join(resumed)}",
            )
        )

    async def _renewed_since(self, before: dict[str, float], timeout: float) -> list[str]:
        """Wait until every certificate holder renewed since `before`; those that did not."""
        deadline = time.monotonic() + timeout
        while True:
            behind = [n for n in CERT_HOLDERS if self.renewals.get(n, 0) <= before.get(n, 0)]
            if not behind or time.monotonic() > deadline:
                return behind
            await asyncio.sleep(0.5)

    async def _leaf_rotation(self) -> None:
        behind = await self._renewed_since(dict(self.renewals), self.stack.leaf_lifetime * 1.2)
        self.checks.append(
            Check(
                "leaf-rotation: every process renewed its leaf under load",
                not behind,
                "all renewed" if not behind else f"not renewed: {', '.join(behind)}",
            )
        )

    async def _ca_rotation(self) -> None:
        rotation, address = await self._rotate_ca()
        self.note("new CA " + rotation.new_authority.fingerprint_sha256[:12])
        # The acknowledged path: the new CA signs once the delay passed and every trust
        # consumer reported it; record how long the step waited, and for whom.
        switch = rotation.signing_switch_at.ToDatetime().timestamp()
        activated, held = await self._until_activated(address, timeout=self.hold * 4 + 120)
        waited = max(0.0, (activated or time.time()) - switch)
        self.note(
            f"prepare -> activate: {waited:.1f}s past the propagation delay, waiting for "
            + (", ".join(sorted(held)) or "nobody")
        )
        self.checks.append(
            Check(
                "ca-rotation: every trust consumer acknowledged the new CA before it signed",
                activated is not None,
                "activated" if activated is not None else f"still held by {', '.join(held)}",
            )
        )
        behind = await self._renewed_since(dict(self.renewals), self.stack.leaf_lifetime * 1.2)
        self.checks.append(
            Check(
                "ca-rotation: every process took a leaf from the new CA",
                not behind,
                "all renewed" if not behind else f"not renewed: {', '.join(behind)}",
            )
        )

    async def _until_activated(self, address: str, timeout: float) -> tuple[float | None, set[str]]:
        """Poll GetRotationStatus on the certs leader until the rotation leaves prepare:
        (when it did, or None on timeout; every consumer seen holding it)."""
        token = self.stack.tokens["admin"]
        held: set[str] = set()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            credentials = grpc.ssl_channel_credentials(self.stack.bundle.read_bytes())
            try:
                async with grpc.aio.secure_channel(address, credentials) as channel:
                    status = await certs_pb2_grpc.CertsStub(channel).GetRotationStatus(
                        certs_pb2.GetRotationStatusRequest(),
                        metadata=(("authorization", f"Bearer {token}"),),
                        timeout=10,
                    )
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
                continue
            held |= {f"{c.identity} ({c.instance})" for c in status.waiting_for}
            if status.phase != certs_pb2.ROTATION_PHASE_PREPARE:
                return time.time(), held
            await asyncio.sleep(0.5)
        return None, held

    async def _rotate_ca(self) -> tuple[certs_pb2.RotateCAResponse, str]:
        """RotateCA on the certs leader (a follower refuses, UNAVAILABLE naming it):
        asked of each replica directly, not through the load balancer; the reply and
        the leader's address."""
        token = self.stack.tokens["admin"]
        credentials = grpc.ssl_channel_credentials(self.stack.bundle.read_bytes())
        async with asyncio.timeout(60):
            while True:
                for replica in CERTS_REPLICAS:
                    address = f"127.0.0.1:{self.stack.ports[replica]}"
                    async with grpc.aio.secure_channel(address, credentials) as channel:
                        try:
                            reply = await certs_pb2_grpc.CertsStub(channel).RotateCA(
                                certs_pb2.RotateCARequest(
                                    propagation_delay=duration_pb2.Duration(seconds=int(self.hold))
                                ),
                                metadata=(("authorization", f"Bearer {token}"),),
                                timeout=30,
                            )
                            return reply, address
                        except grpc.aio.AioRpcError as exc:
                            if exc.code() != grpc.StatusCode.UNAVAILABLE:
                                raise
                await asyncio.sleep(0.5)

    async def _kill_restart(self, name: str) -> None:
        self.stack.kill(name)
        self.kills.append((name, time.monotonic()))
        await asyncio.sleep(self.hold)
        await self._restart(name)
        await asyncio.sleep(self.hold / 2)

    async def _changes(self, cycle: int) -> None:
        # Alternate: drop backend-b and add backend-c, then back.
        if cycle % 2 == 0:
            new, removed = (DIRECT_ADDRESSES[0], ADDED_ADDRESS), "backend-b"
        else:
            new, removed = DIRECT_ADDRESSES, "backend-c"
        self._direct = new
        changed = time.monotonic()
        self.changed_at.append(changed)
        self.stack.write_routes(direct=new, late=self._late)
        # The proxy has stopped using the removed endpoint once 20 requests in a
        # row went elsewhere (round robin over two: 2^-20 by chance).
        port, streak, seen = self.stack.ports["proxy-http"], 0, None
        while time.monotonic() < changed + 30:
            status, backend = await probe(port, DIRECT_HOST)
            streak = streak + 1 if status == 200 and backend != removed else 0
            if streak >= 20:
                seen = time.monotonic()
                break
        if seen is None:
            self.checks.append(
                Check(f"changes: proxy stopped using {removed}", False, "not in 30 s")
            )
        else:
            self.removed_seen.append((removed, seen))
            self.note(f"{removed} removed, unused after {seen - changed:.1f} s")
        await asyncio.sleep(self.hold)

    async def _monitor(self) -> None:
        """Every second: each process's certificate life left and renewal count."""
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=2)) as session:
            while True:
                now = time.time()
                for name in CERT_HOLDERS:
                    proc = self.stack.procs[name]
                    if not proc.alive:
                        continue
                    try:
                        async with session.get(
                            f"http://127.0.0.1:{proc.admin_port}/metrics"
                        ) as response:
                            text = await response.text()
                    except (aiohttp.ClientError, TimeoutError):
                        continue
                    expiry, renewed = None, 0.0
                    for metric, labels, value in _METRIC.findall(text):
                        if metric == "waygate_certificate_expiry_timestamp_seconds":
                            expiry = float(value) if expiry is None else min(expiry, float(value))
                        elif (
                            metric == "waygate_certificate_renewals_total"
                            and 'result="ok"' in labels
                        ):
                            renewed += float(value)
                    if expiry is not None:
                        margin = expiry - now
                        self.min_margin[name] = min(self.min_margin.get(name, margin), margin)
                    # A restarted process counts from zero: keep counting up.
                    key = f"{name}@{proc.pid}"
                    previous = self.renewals.get(key, 0.0)
                    self.renewals[name] = self.renewals.get(name, 0.0) + max(
                        0.0, renewed - previous
                    )
                    self.renewals[key] = renewed
                await asyncio.sleep(1.0)

    async def _backend_checks(self) -> None:
        duplicates: dict[str, int] = {}
        retried: dict[str, int] = {}
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            for name in ("backend-a", "backend-b", "backend-c", "backend-t"):
                proc = self.stack.procs[name]
                assert proc.ready_address is not None
                host, port = proc.ready_address
                async with session.get(f"http://{host}:{port}/__stats") as response:
                    stats = json.loads(await response.text())
                    seen_twice = stats["duplicate_ids"]
                    # A GET (or a WebSocket upgrade, a GET too) seen twice is the
                    # proxy retrying an idempotent request whose first try died with
                    # its upstream connection: the client still got one answer.
                    duplicates[name] = sum(1 for d in seen_twice if " GET " not in d)
                    retried[name] = len(seen_twice) - duplicates[name]
                    if seen_twice:
                        self.note(f"{name} saw twice: {', '.join(seen_twice[:5])}")
        self.checks.append(
            Check(
                "nothing lost: no request answered twice (non-idempotent ids seen twice)",
                not any(duplicates.values()),
                ", ".join(f"{k} {v}" for k, v in duplicates.items())
                + f"; idempotent GETs retried after a lost upstream: {sum(retried.values())}",
            )
        )

    # ------------------------------------------------------------ judging

    def phase_of(self, outcome: Outcome) -> Phase | None:
        for phase in self.phases:
            if phase.start <= outcome.start < (phase.end or float("inf")):
                return phase
        return None

    def _outcome_checks(self) -> None:
        outcomes = self.load.outcomes
        corrupt = [o for o in outcomes if "corrupt" in o.cause]
        self.checks.append(
            Check("nothing lost: every 2xx delivered its body intact", not corrupt,
                  f"{len(corrupt)} corrupt of {len(outcomes)}")
        )  # fmt: skip
        by_phase: dict[str, list[Outcome]] = defaultdict(list)
        for outcome in outcomes:
            phase = self.phase_of(outcome)
            if phase is not None:
                by_phase[phase.name].append(outcome)
        # Allowed by rule, whatever phase it started in: a tunnelled connection in
        # flight when a tunnel-server replica or an agent died (started before the
        # kill, or within the grace after it, and still open at it) that ended
        # with a cut. Its bytes went through the process that died. Everything
        # else - a new request after the grace, a direct one, another kind of
        # error - is not: new dials go through the other replica or agent at once.
        kills = [(n, t) for n, t in self.kills if n in ("ts-a", "agent-1")]

        def cut_by(o: Outcome) -> str | None:
            if o.kind not in TUNNEL_KINDS or not is_cut(o.cause):
                return None
            for killed, t in kills:
                if o.start <= t + IN_FLIGHT_GRACE and o.start + o.latency >= t:
                    return killed
            return None

        for name, got in by_phase.items():
            failed = [o for o in got if not o.ok]
            allowed = [o for o in failed if cut_by(o) is not None]
            bad = [o for o in failed if o not in allowed]
            through = ", ".join(sorted({f"{cut_by(o)}" for o in allowed}))
            detail = (
                f"{len(bad)} of {len(got)} failed ({summary(bad)})"
                + (f"; allowed: {len(allowed)} in flight through killed {through} "
                   f"({summary(allowed)})" if allowed else "")
            )  # fmt: skip
            if name == "ts-killed":
                self.checks.append(
                    Check("ts-killed: only requests in flight through the killed replica failed",
                          not bad, detail)
                )  # fmt: skip
            else:
                self.checks.append(Check(f"{name}: zero failed requests", not bad, detail))
        for removed, seen in self.removed_seen:
            # Up to the next change, which may add that backend back.
            until = min((t for t in self.changed_at if t > seen), default=float("inf"))
            late_uses = [o for o in outcomes if o.backend == removed and seen < o.start < until]
            self.checks.append(
                Check(f"changes: {removed} not used after the proxy stopped using it",
                      not late_uses, f"{len(late_uses)} requests reached it later")
            )  # fmt: skip
        self.checks.append(
            Check(
                "restarts: every killed process came back on its first start",
                not self.failed_starts,
                "; ".join(f"{n}: {why}" for n, why in self.failed_starts)
                or f"{len(self.kills)} restarts",
            )
        )
        expired = {n: m for n, m in self.min_margin.items() if m <= 0}
        self.checks.append(
            Check(
                "certs: no certificate anywhere expired (least life left, sampled each second)",
                not expired and set(self.min_margin) >= set(CERT_HOLDERS),
                ", ".join(f"{n} {m:.0f}s" for n, m in sorted(self.min_margin.items())),
            )
        )
        for name, before in self.usage_before.items():
            after = self.usage_after.get(name)
            if after is None or name in ("haproxy", "kubeapi"):  # stand-ins: not ours
                continue
            self.checks.append(
                Check(
                    f"resources: {name} memory and threads back near the baseline",
                    after["threads"] <= before["threads"] + 4
                    and after["rss"] <= before["rss"] * 1.5 + 32 * 2**20,
                    f"rss {before['rss'] >> 20} -> {after['rss'] >> 20} MiB, "
                    f"threads {before['threads']} -> {after['threads']}",
                )
            )
            ok = after["fds"] <= before["fds"] + 8
            self.checks.append(
                Check(
                    f"resources: {name} file descriptors back near the baseline",
                    ok,
                    f"fds {before['fds']} -> {after['fds']}"
                    + ("" if ok else f"; its TCP sockets: {self.sockets_after.get(name, '-')}"),
                )
            )

    # ------------------------------------------------------------ reporting

    def table(self) -> str:
        by_phase: dict[str, list[Outcome]] = defaultdict(list)
        for outcome in self.load.outcomes:
            phase = self.phase_of(outcome)
            if phase is not None:
                by_phase[phase.name].append(outcome)
        lines = [
            "| phase | time in phase | sent | succeeded | failed | failures by cause | p50 | p99 |",
            "|---|---|---|---|---|---|---|---|",
        ]
        names = list(dict.fromkeys(p.name for p in self.phases))
        total: list[Outcome] = []
        for name in [*names, "all"]:
            got = total if name == "all" else by_phase.get(name, [])
            if name != "all":
                total.extend(got)
            seconds = sum(p.end - p.start for p in self.phases if name == "all" or p.name == name)
            failed = [o for o in got if not o.ok]
            small = sorted(
                o.latency for o in got if o.ok and o.kind.endswith(("keepalive", "newconn"))
            )
            lines.append(
                f"| {name} | {seconds:.0f} s | {len(got)} | {len(got) - len(failed)} | "
                f"{len(failed)} | {summary(failed) or '-'} | {ms(small, 0.5)} | {ms(small, 0.99)} |"
            )
        return "\n".join(lines)

    def report(self) -> str:
        checks = "\n".join(
            f"- {'PASS' if c.ok else 'FAIL'} {c.name}: {c.detail}" for c in self.checks
        )
        notes = "\n".join(
            f"- {p.name} at {p.start - self.started:.0f} s: {'; '.join(p.notes)}"
            for p in self.phases
            if p.notes
        )
        kinds: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for o in self.load.outcomes:
            kinds[o.kind][0] += 1
            kinds[o.kind][1] += not o.ok
        by_kind = ", ".join(f"{k} {n} ({f} failed)" for k, (n, f) in sorted(kinds.items()))
        failures = "\n".join(
            f"- {o.start - self.started:.1f} s ({p.name if (p := self.phase_of(o)) else '-'}), "
            f"{o.kind}, after {o.latency:.2f} s: {o.cause} ({o.detail})"
            for o in [o for o in self.load.outcomes if not o.ok][:40]
        )
        return (
            f"{self.table()}\n\np50/p99: small GETs (keep-alive and new connections, direct "
            f"and tunnelled, HTTP and HTTPS) that succeeded.\n\nBy kind: {by_kind}.\n\n"
            f"{checks}\n\n{notes}\n"
            + (f"\nFailures (the first 40):\n{failures}\n" if failures else "")
        )

    @property
    def passed(self) -> bool:
        return all(c.ok for c in self.checks)

    def plot(self, path: Path, title: str) -> None:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        t0 = self.started
        ok: Counter[int] = Counter()
        bad: Counter[int] = Counter()
        for o in self.load.outcomes:
            (ok if o.ok else bad)[int(o.start - t0)] += 1
        end = int(max((p.end for p in self.phases), default=t0) - t0) + 1
        xs = list(range(end))
        figure, axis = plt.subplots(figsize=(14, 5))
        axis.plot(xs, [ok[x] for x in xs], color="tab:green", linewidth=0.8, label="succeeded/s")
        axis.bar(xs, [bad[x] for x in xs], color="tab:red", width=1.0, label="failed/s")
        colours = {
            "steady": None, "resolver-down": "tab:blue", "certs-down": "tab:orange",
            "resolver-replica-killed": "tab:gray", "certs-leader-killed": "tab:brown",
            "leaf-rotation": "tab:olive", "ca-rotation": "tab:purple",
            "ts-killed": "tab:red", "agent-killed": "tab:pink", "changes": "tab:cyan",
        }  # fmt: skip
        labelled: set[str] = set()
        for phase in self.phases:
            colour = colours.get(phase.name)
            if colour is None:
                continue
            axis.axvspan(
                phase.start - t0, phase.end - t0, color=colour, alpha=0.15,
                label=None if phase.name in labelled else phase.name,
            )  # fmt: skip
            labelled.add(phase.name)
        axis.set_xlabel("seconds since the stack started")
        axis.set_ylabel("requests per second")
        axis.set_title(title)
        axis.legend(loc="upper left", fontsize=8, ncol=5)
        figure.tight_layout()
        figure.savefig(path, dpi=100)
        plt.close(figure)


def summary(outcomes: list[Outcome]) -> str:
    counts = Counter(f"{o.kind}: {o.cause}" for o in outcomes)
    return ", ".join(f"{cause} x{n}" for cause, n in counts.most_common())


def ms(sorted_values: list[float], q: float) -> str:
    if not sorted_values:
        return "-"
    if q == 0.5:
        return f"{statistics.median(sorted_values) * 1000:.1f} ms"
    index = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return f"{sorted_values[index] * 1000:.1f} ms"
