"""Leader election over a Lease, and the leader-only CA store, against the STAND-IN API server.

No Kubernetes API server can run here; `tests.support.kubeapi` stores Leases
like any object, with resourceVersion conflicts, and can cut one client off
(`partition(token)`), so each elector here talks with its own bearer token.
Timings are short (lease 2 s, renew deadline 1 s, retry 0.2 s) so failover
happens within a test; the rules are the same at client-go's 15/10/2 s.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta

import pytest
from kubernetes import client

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.support.poll import until
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.issuing import leaf_request
from waygate.certs.kube_store import WRITTEN_BY, SecretCAStore
from waygate.certs.leader import certs_elector, keep_leaf_bounds
from waygate.core.errors import Unavailable
from waygate.core.kube import KubeAPI
from waygate.core.leader import LeaderElector, LeaseTiming

FAST = LeaseTiming(lease_duration=2.0, renew_deadline=1.0, retry_period=0.2)


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        yield api


def client_as(standin: StandInAPI, token: str) -> KubeAPI:
    configuration = client.Configuration()
    configuration.host = standin.url
    configuration.api_key = {"authorization": token}
    configuration.api_key_prefix = {"authorization": "Bearer"}
    return KubeAPI(client.ApiClient(configuration), timeout=2.0)


def secret_version(standin: StandInAPI) -> str:
    """The CA Secret's resourceVersion (the global one also moves with Lease renewals)."""
    return str(standin.get("v1", "Secret", "ca", "waygate")["metadata"]["resourceVersion"])


def elector(standin: StandInAPI, name: str) -> LeaderElector:
    return certs_elector(client_as(standin, name), "waygate", "certs", identity=name, timing=FAST)


class Electors:
    """Several electors running, with a 10 ms record of who believed it led when."""

    def __init__(self, standin: StandInAPI, names: list[str]) -> None:
        self.by_name = {name: elector(standin, name) for name in names}
        self.tasks: list[asyncio.Task[None]] = []
        self.timeline: list[tuple[float, frozenset[str]]] = []
        self._stop = threading.Event()
        self._sampler = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._stop.is_set():
            started = time.monotonic()
            leaders = frozenset(n for n, e in self.by_name.items() if e.is_leader())
            # A sample whose checks were far apart (this thread descheduled on a
            # loaded machine) says nothing about "at once": keep only tight ones.
            if time.monotonic() - started < 0.02:
                self.timeline.append((time.monotonic(), leaders))
            time.sleep(0.01)

    def leaders(self) -> set[str]:
        return {n for n, e in self.by_name.items() if e.is_leader()}

    async def __aenter__(self) -> Electors:
        self.tasks = [asyncio.create_task(e.run()) for e in self.by_name.values()]
        self._sampler.start()
        await until(lambda: len(self.leaders()) == 1, "a leader")
        await until(
            lambda: all(e.holder in self.leaders() for e in self.by_name.values()),
            "every replica to know the leader",
        )
        return self

    async def stop(self, name: str) -> None:
        task = self.tasks[list(self.by_name).index(name)]
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

    async def __aexit__(self, *exc: object) -> None:
        for task in self.tasks:
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        self._stop.set()
        self._sampler.join(2)
        # Never two replicas that both believed they could write, at any sample.
        assert all(len(leaders) <= 1 for _, leaders in self.timeline)


@pytest.mark.parametrize("replicas", [2, 3])
async def test_exactly_one_of_several_replicas_leads_and_the_lease_names_it(
    standin: StandInAPI, replicas: int
) -> None:
    async with Electors(standin, [f"certs-{i}" for i in range(replicas)]) as running:
        (leader,) = running.leaders()
        lease = standin.get("coordination.k8s.io/v1", "Lease", "certs", "waygate")
        assert lease["spec"]["holderIdentity"] == leader
        assert lease["spec"]["leaseDurationSeconds"] == 2
        await asyncio.sleep(1.0)  # several renewals later: still the same one
        assert running.leaders() == {leader}
        assert all(e.holder == leader for e in running.by_name.values())


async def test_a_partitioned_leader_stops_writing_before_another_takes_over(
    standin: StandInAPI,
) -> None:
    async with Electors(standin, ["a", "b", "c"]) as running:
        (old,) = running.leaders()
        standin.partition(old)
        cut = time.monotonic()
        await until(lambda: running.leaders() - {old}, "a new leader", timeout=10)
        (new,) = running.leaders()
        await asyncio.sleep(0.2)  # the sampler has recorded the new leader too
        stopped = next(t for t, leaders in running.timeline if t > cut and old not in leaders)
        started = next(t for t, leaders in running.timeline if new in leaders)
        # The old leader gave up within its renew deadline; the new one waited
        # out the whole lease duration after it last saw a renewal.
        assert stopped - cut <= FAST.renew_deadline + 0.5
        assert started - stopped >= FAST.lease_duration - FAST.renew_deadline - 0.3
        lease = standin.get("coordination.k8s.io/v1", "Lease", "certs", "waygate")
        assert lease["spec"]["holderIdentity"] == new
        assert lease["spec"]["leaseTransitions"] >= 1
        standin.heal(old)
        await asyncio.sleep(1.0)
        assert running.leaders() == {new}  # healed, it follows: the lease is held


async def test_a_leader_stopped_cleanly_releases_the_lease_at_once(standin: StandInAPI) -> None:
    async with Electors(standin, ["a", "b"]) as running:
        (old,) = running.leaders()
        await running.stop(old)
        stopped = time.monotonic()
        await until(lambda: running.leaders() - {old}, "the other to lead")
        # Released: no need to wait out the lease duration.
        assert time.monotonic() - stopped < FAST.lease_duration + FAST.retry_period + 1.0


async def test_only_the_leader_writes_the_ca_and_a_follower_names_it(standin: StandInAPI) -> None:
    async with Electors(standin, ["a", "b"]) as running:
        (leader,) = running.leaders()
        (follower,) = set(running.by_name) - {leader}
        config = AuthorityConfig(propagation_delay=timedelta(0))
        leading_store = SecretCAStore(
            client_as(standin, leader), "waygate", "ca", writer=running.by_name[leader]
        )
        authority = await asyncio.to_thread(Authority.open, leading_store, config)
        secret = standin.get("v1", "Secret", "ca", "waygate")
        assert secret["metadata"]["annotations"][WRITTEN_BY] == leader

        following_store = SecretCAStore(
            client_as(standin, follower), "waygate", "ca", writer=running.by_name[follower]
        )
        replica = await asyncio.to_thread(Authority.open, following_store, config)
        assert replica.active_authority().fingerprint == authority.active_authority().fingerprint
        version = secret_version(standin)
        with pytest.raises(Unavailable, match=f"not the leader.*the leader is {leader}"):
            await asyncio.to_thread(replica.rotate)
        assert secret_version(standin) == version  # nothing written
        assert len(replica.trust_bundle().authorities) == 1  # nothing kept either

        # The follower follows the Secret: a rotation by the leader reaches it.
        adopted = asyncio.Event()
        loop = asyncio.get_running_loop()

        def adopt(files: dict[str, bytes]) -> None:
            replica.adopt(files)
            loop.call_soon_threadsafe(adopted.set)

        following = asyncio.create_task(following_store.follow(adopt))
        try:
            await asyncio.sleep(0.3)
            rotation = await asyncio.to_thread(authority.rotate)
            async with asyncio.timeout(5):
                await adopted.wait()
            # Staged, then (delay 0) switched: the switch is stored by a background
            # thread and arrives as a second version.
            new = rotation.new_authority.fingerprint
            await until(
                lambda: replica.active_authority().fingerprint == new, "the switch to reach it"
            )
        finally:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)


async def test_the_leader_keeps_the_leaf_bound_ahead_so_a_follower_never_writes(
    standin: StandInAPI,
) -> None:
    async with Electors(standin, ["a", "b"]) as running:
        (leader,) = running.leaders()
        (follower,) = set(running.by_name) - {leader}
        config = AuthorityConfig(max_lifetime=timedelta(days=2))
        store = SecretCAStore(
            client_as(standin, leader), "waygate", "ca", writer=running.by_name[leader]
        )
        authority = await asyncio.to_thread(Authority.open, store, config)
        keeper = asyncio.create_task(keep_leaf_bounds(authority, store))
        try:
            horizon = datetime.now(UTC) + timedelta(days=2, hours=1)
            await until(
                lambda: authority.with_leaf_bounds(horizon) is None, "the bound raised ahead"
            )
        finally:
            keeper.cancel()
            await asyncio.gather(keeper, return_exceptions=True)
        following_store = SecretCAStore(
            client_as(standin, follower), "waygate", "ca", writer=running.by_name[follower]
        )
        replica = await asyncio.to_thread(Authority.open, following_store, config)
        version = secret_version(standin)
        from cryptography import x509

        from tests.support.kubeapi_certs import make_csr

        csr = x509.load_pem_x509_csr(make_csr("dns:web.example"))
        # The longest leaf a follower can sign needs no write.
        request = leaf_request(
            csr,
            replica.config,
            identity="web.example",
            requested_by="t",
            lifetime=timedelta(days=2),
        )
        issued = await asyncio.to_thread(replica.issue, request)
        assert issued.valid_until > datetime.now(UTC) + timedelta(days=1)
        assert secret_version(standin) == version
