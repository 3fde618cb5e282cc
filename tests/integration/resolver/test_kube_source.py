"""The Kubernetes source against a STAND-IN API server (tests/support/kubeapi.py: real HTTP,
real resourceVersion and 410 semantics; no real API server can run on these machines),
through the official `kubernetes` client. Every wait on a watch has a timeout."""

from __future__ import annotations

import asyncio
import logging
import random
from datetime import UTC, datetime

import pytest

from tests.support.kubeapi import KubeAPI
from tests.support.poll import until
from waygate.core.settings import SettingsError
from waygate.resolver.kube import (
    SOURCE,
    KubernetesSource,
    Timeouts,
    kube_configuration,
    parse_node_list,
)
from waygate.resolver.store import Store

WAIT = 10.0


def service(name, namespace="default", **spec) -> dict:
    spec.setdefault("ports", [{"name": "http", "port": 80, "targetPort": 8080}])
    spec.setdefault("clusterIP", "10.96.0.10")
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace},
        "spec": spec,
    }


def endpoint(address, *, ready=True, serving=None, terminating=False, node="") -> dict:
    conditions = {"ready": ready, "terminating": terminating}
    if serving is not None:
        conditions["serving"] = serving
    entry = {"addresses": [address], "conditions": conditions}
    if node:
        entry["nodeName"] = node
    return entry


def endpoint_slice(name, service_name, endpoints, namespace="default", labels=None) -> dict:
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": service_name, **(labels or {})},
        },
        "addressType": "IPv4",
        "ports": [{"name": "http", "port": 8080, "protocol": "TCP"}],
        "endpoints": endpoints,
    }


def route(name, host, namespace="default", **spec) -> dict:
    spec.setdefault("backends", [{"service": "web", "weight": 100}])
    return {
        "apiVersion": "waygate.io/v1",
        "kind": "Route",
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"host": host, **spec},
    }


def addresses(store: Store, service_name: str, namespace: str = "default") -> set[str]:
    return {ep.address for ep in store.endpoints_of(namespace, service_name)}


@pytest.fixture
def kubeapi():
    with KubeAPI(history=200, default_watch_timeout=60) as api:
        api.register("waygate.io/v1", "Route", "routes", namespaced=True)
        yield api


class Running:
    def __init__(
        self, api: KubeAPI, *, timeouts: Timeouts | None = None, watches: int = 3, **options
    ) -> None:
        self.api = api
        self.watches = watches
        self.store = Store()
        self.source = KubernetesSource(
            self.store,
            api.configuration(),
            timeouts=timeouts or Timeouts(watch=60, connect=2, request=5),
            backoff_initial=0.02,
            backoff_maximum=0.1,
            rng=random.Random(4),
            **options,
        )
        self.task: asyncio.Task | None = None

    async def __aenter__(self) -> Running:
        self.task = asyncio.create_task(self.source.run())
        async with asyncio.timeout(WAIT):
            await self.source.wait_synced()
            # Every kind's watch is open, so later writes arrive as live events.
            await self.api.wait_watchers(self.watches)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.task is not None
        self.task.cancel()
        await asyncio.gather(self.task, return_exceptions=True)

    def lists(self, resource: str) -> int:
        return sum(
            1
            for r in self.api.requests
            if r.method == "GET" and not r.watch and r.path.endswith(resource)
        )


async def test_services_of_each_type_are_listed_and_watched(kubeapi):
    kubeapi.create(service("plain"))
    kubeapi.create(service("nodeport", type="NodePort", ports=[{"port": 80, "nodePort": 30080}]))
    kubeapi.create(
        service(
            "lb",
            type="LoadBalancer",
            ports=[{"port": 443, "targetPort": "https", "nodePort": 30443}],
        )
    )
    kubeapi.create(service("headless", clusterIP="None"))
    kubeapi.create(
        service(
            "external", type="ExternalName", externalName="db.example.com", clusterIP=None, ports=[]
        )
    )
    async with Running(kubeapi) as run:
        store = run.store
        plain = store.get_service("default", "plain")
        assert (plain.type, plain.cluster_ips, plain.headless) == (
            "ClusterIP",
            ("10.96.0.10",),
            False,
        )
        assert plain.ports[0].target_port == "8080"
        nodeport = store.get_service("default", "nodeport")
        assert (nodeport.type, nodeport.ports[0].node_port, nodeport.ports[0].target_port) == (
            "NodePort",
            30080,
            "80",
        )
        lb = store.get_service("default", "lb")
        assert (lb.type, lb.ports[0].target_port) == ("LoadBalancer", "https")
        headless = store.get_service("default", "headless")
        assert headless.headless and headless.cluster_ips == ()
        external = store.get_service("default", "external")
        assert (external.type, external.external_name, external.cluster_ips) == (
            "ExternalName",
            "db.example.com",
            (),
        )
        kubeapi.delete("v1", "Service", "plain", "default")
        kubeapi.create(service("later", namespace="other"))
        await until(
            lambda: (
                store.get_service("default", "plain") is None
                and store.get_service("other", "later") is not None
            ),
            "the watched delete and create",
        )
        assert store.last_sync()[0] == SOURCE and store.last_sync()[1] is not None


async def test_an_invalid_service_is_skipped_and_the_watch_goes_on(kubeapi, caplog):
    kubeapi.create(service("broken", type="ExternalName", clusterIP=None))  # no externalName
    async with Running(kubeapi) as run:
        assert run.store.get_service("default", "broken") is None
        assert "externalName" in caplog.text or "external_name" in caplog.text
        kubeapi.create(service("fine"))
        await until(lambda: run.store.get_service("default", "fine") is not None, "a valid service")


async def test_an_endpoint_removed_while_the_watch_is_open_disappears(kubeapi):
    kubeapi.create(service("web"))
    kubeapi.create(endpoint_slice("web-1", "web", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]))
    async with Running(kubeapi) as run:
        assert addresses(run.store, "web") == {"10.0.0.1", "10.0.0.2"}
        kubeapi.replace(endpoint_slice("web-1", "web", [endpoint("10.0.0.2")]))
        await until(lambda: addresses(run.store, "web") == {"10.0.0.2"}, "the endpoint to go")
        kubeapi.delete("discovery.k8s.io/v1", "EndpointSlice", "web-1", "default")
        await until(lambda: addresses(run.store, "web") == set(), "the slice to go")


async def test_terminating_endpoints_are_never_ready(kubeapi):
    kubeapi.create(service("web"))
    kubeapi.create(
        endpoint_slice(
            "web-1",
            "web",
            [
                endpoint("10.0.0.1"),
                # Kubernetes may report ready=true with terminating=true (publishNotReadyAddresses).
                endpoint("10.0.0.2", ready=True, serving=True, terminating=True),
                endpoint("10.0.0.3", ready=False, serving=False),
            ],
        )
    )
    async with Running(kubeapi) as run:
        by_address = {ep.address: ep for ep in run.store.endpoints_of("default", "web")}
        assert by_address["10.0.0.1"].usable
        terminating = by_address["10.0.0.2"]
        assert terminating.terminating and terminating.serving
        assert not terminating.ready and not terminating.usable
        assert not by_address["10.0.0.3"].usable
        kubeapi.replace(endpoint_slice("web-1", "web", [endpoint("10.0.0.1", terminating=True)]))
        await until(
            lambda: [ep.usable for ep in run.store.endpoints_of("default", "web")] == [False],
            "the endpoint to start terminating",
        )


async def test_slices_of_one_service_are_merged(kubeapi):
    kubeapi.create(service("web"))
    kubeapi.create(endpoint_slice("web-a", "web", [endpoint("10.0.0.1")]))
    kubeapi.create(endpoint_slice("web-b", "web", [endpoint("10.0.0.2"), endpoint("10.0.0.1")]))
    async with Running(kubeapi) as run:
        assert addresses(run.store, "web") == {"10.0.0.1", "10.0.0.2"}
        kubeapi.delete("discovery.k8s.io/v1", "EndpointSlice", "web-b", "default")
        # 10.0.0.1 is still listed by web-a: it stays; 10.0.0.2 goes.
        await until(lambda: addresses(run.store, "web") == {"10.0.0.1"}, "web-b's endpoints to go")
        relabelled = endpoint_slice("web-a", "web", [endpoint("10.0.0.1")])
        relabelled["metadata"]["labels"]["kubernetes.io/service-name"] = "api"
        kubeapi.replace(relabelled)
        await until(
            lambda: (
                addresses(run.store, "web") == set() and addresses(run.store, "api") == {"10.0.0.1"}
            ),
            "the slice to move to another service",
        )


@pytest.mark.parametrize("gone_as_http", [False, True], ids=["error-event", "http-410"])
async def test_a_410_relist_drops_endpoints_deleted_while_disconnected(kubeapi, gone_as_http):
    kubeapi.gone_as_http = gone_as_http
    kubeapi.create(service("web"))
    kubeapi.create(endpoint_slice("web-1", "web", [endpoint("10.0.0.1"), endpoint("10.0.0.2")]))
    kubeapi.create(endpoint_slice("gone", "old", [endpoint("10.0.9.9")]))
    async with Running(kubeapi) as run:
        assert addresses(run.store, "web") == {"10.0.0.1", "10.0.0.2"}
        assert addresses(run.store, "old") == {"10.0.9.9"}
        slice_lists = run.lists("/endpointslices")
        # The API server goes away; while the source is disconnected an endpoint and a
        # whole slice are deleted and the history that would replay it is compacted.
        kubeapi.unavailable = True
        kubeapi.drop_watches()
        kubeapi.replace(endpoint_slice("web-1", "web", [endpoint("10.0.0.2")]))
        kubeapi.delete("discovery.k8s.io/v1", "EndpointSlice", "gone", "default")
        kubeapi.expire_history()
        assert addresses(run.store, "web") == {"10.0.0.1", "10.0.0.2"}  # nothing seen yet
        kubeapi.unavailable = False
        await until(
            lambda: (
                addresses(run.store, "web") == {"10.0.0.2"} and addresses(run.store, "old") == set()
            ),
            "the relist to drop what was deleted while disconnected",
        )
        assert run.lists("/endpointslices") > slice_lists
        # And the source keeps watching after the relist.
        await kubeapi.wait_watchers(3, timeout=WAIT)
        kubeapi.create(endpoint_slice("web-2", "web", [endpoint("10.0.0.3")]))
        await until(lambda: "10.0.0.3" in addresses(run.store, "web"), "a change after the relist")


async def test_a_dropped_watch_resumes_from_its_resource_version_without_a_relist(kubeapi):
    kubeapi.create(service("web"))
    kubeapi.create(endpoint_slice("web-1", "web", [endpoint("10.0.0.1")]))
    async with Running(kubeapi) as run:
        lists_before = run.lists("/endpointslices")
        last_seen = kubeapi.resource_version
        kubeapi.unavailable = True
        kubeapi.drop_watches()
        kubeapi.replace(endpoint_slice("web-1", "web", [endpoint("10.0.0.2")]))
        kubeapi.unavailable = False
        await until(lambda: addresses(run.store, "web") == {"10.0.0.2"}, "the missed change")
        assert run.lists("/endpointslices") == lists_before
        resumed = [
            r
            for r in kubeapi.requests
            if r.watch and r.path.endswith("/endpointslices") and r.query.get("resourceVersion")
        ]
        # It resumed exactly where it had been before the connection dropped.
        assert resumed[-1].query["resourceVersion"] == str(last_seen)


async def test_bookmarks_advance_the_last_sync_time(kubeapi):
    async with Running(kubeapi) as run:
        _, first = run.store.last_sync()
        assert first is not None
        kubeapi.create(service("unrelated", namespace="elsewhere"))
        await until(lambda: run.store.get_service("elsewhere", "unrelated"), "an event")
        kubeapi.bookmark()
        await until(lambda: run.store.last_sync()[1] > first, "the bookmark to refresh last_sync")


async def test_route_custom_resources_are_validated(kubeapi, caplog):
    kubeapi.create(
        route(
            "web",
            "Web.Example.COM",
            path="/app",
            targetPort=8080,
            balance="leastconn",
            timeouts={"connect": "2s", "tunnel": "1h"},
        )
    )
    kubeapi.create(route("bad-host", "not_a_host!"))
    kubeapi.create(
        route("bad-weight", "ok.example.com", backends=[{"service": "web", "weight": 300}])
    )
    with caplog.at_level(logging.WARNING, logger="waygate.resolver.kube"):
        async with Running(kubeapi) as run:
            web = run.store.get_route("default", "web")
            assert (web.host, web.path, web.target_port, web.balance.value) == (
                "web.example.com",
                "/app",
                "8080",
                "leastconn",
            )
            assert (web.timeouts.connect, web.timeouts.tunnel) == (2.0, 3600.0)
            assert run.store.get_route("default", "bad-host") is None
            assert run.store.get_route("default", "bad-weight") is None
            assert "bad-host" in caplog.text and "bad-weight" in caplog.text
            # A valid route edited into an invalid one leaves the store (no stale route).
            kubeapi.replace(route("web", "web.example.com", path="no-slash"))
            await until(lambda: run.store.get_route("default", "web") is None, "the invalid edit")
            kubeapi.replace(route("web", "web.example.com", path="/v2"))
            await until(
                lambda: (
                    (r := run.store.get_route("default", "web")) is not None and r.path == "/v2"
                ),
                "the fixed route",
            )


async def test_route_objects_past_the_budget_are_not_served_and_say_why(kubeapi):
    """--max-routes-per-source: the oldest Route objects are served; a younger one
    past the budget is left out with its reason, and the oldest waiting takes a
    place another route leaves."""
    for index in range(3):
        obj = route(f"r{index}", f"r{index}.example.com")
        obj["metadata"]["creationTimestamp"] = f"2026-01-0{index + 1}T00:00:00Z"
        kubeapi.create(obj)
    # An unknown key is refused as the routes file refuses it, not ignored.
    kubeapi.create(route("typo", "typo.example.com", balanse="roundrobin"))
    async with Running(kubeapi, max_routes=2) as run:
        assert {r.name for r in run.store.routes()} == {"r0", "r1"}
        invalid = run.source.invalid_routes()
        assert "budget of 2 routes per source" in invalid[("default", "r2")]
        assert "spec: unknown key 'balanse'" in invalid[("default", "typo")]
        # A live ADDED past the budget is refused too.
        kubeapi.create(route("r3", "r3.example.com"))
        await until(
            lambda: ("default", "r3") in run.source.invalid_routes(), "r3 refused for budget"
        )
        assert run.store.get_route("default", "r3") is None
        # A deletion frees a place: the oldest route waiting for one takes it.
        kubeapi.delete("waygate.io/v1", "Route", "r0", "default")
        await until(lambda: run.store.get_route("default", "r2") is not None, "r2 served")
        assert run.store.get_route("default", "r0") is None
        assert ("default", "r2") not in run.source.invalid_routes()
        assert run.store.get_route("default", "r3") is None
        assert "budget" in run.source.invalid_routes()[("default", "r3")]


async def test_tunnel_endpoints_by_label_or_edge_node(kubeapi):
    kubeapi.create(service("edge-app"))
    kubeapi.create(
        endpoint_slice(
            "edge-app-1",
            "edge-app",
            [endpoint("10.1.0.1", node="edge-1")],
            labels={"waygate.io/tunnel": "true"},
        )
    )
    kubeapi.create(service("mixed"))
    kubeapi.create(
        endpoint_slice(
            "mixed-1",
            "mixed",
            [endpoint("10.2.0.1", node="edge-2"), endpoint("10.2.0.2", node="cloud-1")],
        )
    )
    async with Running(kubeapi, edge_nodes=["edge-2"]) as run:
        assert [ep.tunnel for ep in run.store.endpoints_of("default", "edge-app")] == [True]
        tunnel = {ep.address: ep.tunnel for ep in run.store.endpoints_of("default", "mixed")}
        assert tunnel == {"10.2.0.1": True, "10.2.0.2": False}


async def test_namespace_scoped_source_sees_only_its_namespace(kubeapi):
    kubeapi.create(service("web", namespace="team-a"))
    kubeapi.create(service("web", namespace="team-b"))
    async with Running(kubeapi, namespace="team-a") as run:
        assert run.store.get_service("team-a", "web") is not None
        assert run.store.get_service("team-b", "web") is None
        assert all("/namespaces/team-a/" in r.path for r in kubeapi.requests)


async def test_cancelling_the_source_closes_its_watches(kubeapi):
    run = Running(kubeapi)
    async with run:
        assert kubeapi.watchers() == 3
    await until(lambda: kubeapi.watchers() == 0, "the watches to close")
    assert run.task.done()


async def test_a_silent_dead_connection_is_noticed_by_the_read_timeout(kubeapi):
    kubeapi.create(service("web"))
    kubeapi.create(endpoint_slice("web-1", "web", [endpoint("10.0.0.1")]))
    # Watches of 1 s and a read timeout of 1 s more: a stalled stream is given up
    # after about 2 s, while a healthy one ends cleanly every second.
    timeouts = Timeouts(watch=1, connect=1, request=1)
    async with Running(kubeapi, timeouts=timeouts) as run:
        kubeapi.stall_watches()  # connections stay open, nothing more arrives on them
        kubeapi.replace(endpoint_slice("web-1", "web", [endpoint("10.0.0.2")]))
        await until(
            lambda: addresses(run.store, "web") == {"10.0.0.2"}, "the change after a reconnect"
        )
        assert run.lists("/endpointslices") == 1  # resumed, not relisted


async def test_a_missing_route_crd_counts_as_no_routes_until_it_is_installed(caplog):
    with KubeAPI(auto_register=False) as api:
        api.create(service("web"))
        with caplog.at_level(logging.WARNING, logger="waygate.resolver.kube"):
            async with Running(api, watches=2) as run:
                assert run.store.get_service("default", "web") is not None
                assert run.store.routes() == []
                assert "CRD" in caplog.text
                api.register("waygate.io/v1", "Route", "routes", namespaced=True)
                api.create(route("web", "web.example.com"))
                await until(lambda: run.store.get_route("default", "web") is not None, "the route")


async def test_a_kubeconfig_file_with_a_token_reaches_the_server(tmp_path):
    with KubeAPI() as api:
        api.bearer_token = "s3cret-token"
        api.create(service("web"))
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            f"""
apiVersion: v1
kind: Config
clusters: [{{name: stand-in, cluster: {{server: "{api.url}"}}}}]
users: [{{name: tester, user: {{token: s3cret-token}}}}]
contexts: [{{name: test, context: {{cluster: stand-in, user: tester}}}}]
current-context: test
"""
        )
        store = Store()
        source = KubernetesSource(store, kube_configuration(str(kubeconfig)), namespace="default")
        task = asyncio.create_task(source.run())
        try:
            async with asyncio.timeout(WAIT):
                await source.wait_synced()
            assert store.get_service("default", "web") is not None
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)


def test_an_unreadable_kubeconfig_is_a_one_line_settings_error(tmp_path):
    with pytest.raises(SettingsError, match=r"kubernetes: cannot load kubeconfig .*missing") as exc:
        kube_configuration(str(tmp_path / "missing"))
    assert "\n" not in str(exc.value)
    assert parse_node_list("edge-1, edge-2 edge-3,,") == {"edge-1", "edge-2", "edge-3"}


async def test_freshness_is_that_of_the_stalest_kind(kubeapi):
    """Fresh news about Services and Routes must not make stale endpoints look current."""
    async with Running(kubeapi) as running:
        assert running.store.last_sync()[1] is not None
        await asyncio.sleep(0.05)
        before = datetime.now(UTC)
        kubeapi.create(service("moved"))
        kubeapi.create(route("r1", "a.example.com"))
        await until(lambda: running.store.get_service("default", "moved"), "the service")
        await until(lambda: running.store.get_route("default", "r1"), "the route")
        # EndpointSlices were last confirmed before `before`: so is the whole source.
        assert running.store.last_sync()[1] < before
        kubeapi.create(endpoint_slice("s1", "moved", [endpoint("10.0.0.1")]))
        await until(lambda: running.store.last_sync()[1] >= before, "every kind confirmed")


async def test_a_failing_api_server_is_published_as_the_source_state(kubeapi):
    """Issue 29 finding 1: the Kubernetes source's own state (valid with its version, or
    the failing list/watch and since when) is in the store for ListRoutes, Watch, check,
    the status page and the metric, not only in a log line."""

    def state():
        (found,) = [s for s in running.store.source_states() if s.source == SOURCE]
        return found

    async with Running(kubeapi) as running:
        await until(lambda: state().valid, "the source published as valid")
        assert state().loaded_version > 0 and state().loaded_at is not None
        assert state().error_since is None
        before = datetime.now(UTC)
        kubeapi.unavailable = True
        kubeapi.drop_watches()
        await until(lambda: not state().valid, "the source published as failing")
        # The dropped watches fail first ("Response ended prematurely"); the relists
        # that follow meet the 503, and the published error follows the latest failure.
        await until(
            lambda: "currently unable to handle the request" in state().error,
            "the API server's answer published as the error",
        )
        assert not state().valid
        assert state().error_since is not None and state().error_since >= before
        first_since = state().error_since
        await asyncio.sleep(0.3)  # more failed retries keep the first failure's time
        assert state().error_since == first_since
        kubeapi.unavailable = False
        await kubeapi.wait_watchers(3)
        kubeapi.bookmark()
        await until(lambda: state().valid, "the source valid again")
        assert state().error == "" and state().error_since is None
