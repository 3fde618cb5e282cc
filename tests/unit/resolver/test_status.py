"""Route status: conditions computed by the store in the version of their cause."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

from waygate.resolver.model import (
    ADMITTED,
    CONFLICTED,
    FALSE,
    RESOLVED_REFS,
    TRUE,
    Endpoint,
    EndpointPort,
    Kind,
    Route,
    RouteBackend,
    Service,
    ServicePort,
)
from waygate.resolver.store import Batch, Store

FILE = "file:/tmp/routes.yaml"
KUBE = "kubernetes"


class Clock:
    def __init__(self) -> None:
        self.now = datetime(2026, 1, 1, tzinfo=UTC)

    def __call__(self) -> datetime:
        return self.now


def web(ns: str = "demo", name: str = "web") -> Service:
    return Service(ns, name, ports=(ServicePort("http", 80, "8080"),))


def ready(ns: str = "demo", service: str = "web", address: str = "10.0.0.1") -> Endpoint:
    return Endpoint(ns, service, address, (EndpointPort("http", 8080),))


def route(
    ns: str = "demo",
    name: str = "r",
    host: str = "echo.localtest.me",
    path: str = "/",
    to: str = "web",
    **kw: object,
) -> Route:
    return Route(ns, name, host, path, (RouteBackend(to, 100),), **kw)  # type: ignore[arg-type]


def condition(store: Store, ns: str, name: str, type: str) -> tuple[str, str, str]:
    found = store.get_route(ns, name)
    assert found is not None and found.status is not None
    c = found.status.condition(type)
    assert c is not None
    return (c.status, c.reason, c.message)


def healthy_store(**kw: object) -> Store:
    store = Store(initial_version=0, **kw)  # type: ignore[arg-type]
    store.upsert_service(web(), source=FILE)
    store.set_endpoints("demo", "web", [ready()], source=FILE)
    return store


def test_a_route_to_a_missing_service_says_which_service() -> None:
    store = healthy_store()
    store.upsert_route(route("mine", "ghost", to="doesnotexist"), source=FILE)
    assert condition(store, "mine", "ghost", RESOLVED_REFS) == (
        FALSE,
        "ServiceNotFound",
        "service mine/doesnotexist not found",
    )
    assert condition(store, "mine", "ghost", ADMITTED)[0] == TRUE
    ghost = store.get_route("mine", "ghost")
    assert ghost is not None and ghost.status is not None
    assert ghost.status.problem() == "service mine/doesnotexist not found"


def test_a_missing_port_and_no_ready_endpoints_are_named() -> None:
    store = healthy_store()
    store.upsert_route(route(name="p", target_port="grpc"), source=FILE)
    assert condition(store, "demo", "p", RESOLVED_REFS)[1:] == (
        "PortNotFound",
        "service demo/web has no port 'grpc'",
    )
    store.upsert_service(web(name="idle"), source=FILE)
    store.upsert_route(route(name="q", host="q.example", to="idle"), source=FILE)
    assert condition(store, "demo", "q", RESOLVED_REFS)[1:] == (
        "NoReadyEndpoints",
        "service demo/idle has no ready endpoints",
    )
    store.upsert_route(route(name="ok", host="ok.example", target_port="8080"), source=FILE)
    assert condition(store, "demo", "ok", RESOLVED_REFS)[:2] == (TRUE, "ResolvedRefs")


def test_an_endpoint_change_republishes_the_route_in_the_same_version() -> None:
    clock = Clock()
    store = Store(initial_version=0, clock=clock)
    store.upsert_service(web(), source=FILE)
    store.upsert_route(route(), source=FILE)
    assert condition(store, "demo", "r", RESOLVED_REFS)[0] == FALSE
    since = store.get_route("demo", "r").status.condition(RESOLVED_REFS).last_transition  # type: ignore[union-attr]
    with store.subscribe(resume_from=store.version, resume_epoch=None) as sub:
        clock.now += timedelta(minutes=5)
        store.set_endpoints("demo", "web", [ready()], source=FILE)
        batch = sub.take()
    assert isinstance(batch, Batch) and batch.version == batch.from_version + 1
    kinds = [c.kind for c in batch.changes]
    assert kinds == [Kind.ENDPOINTS, Kind.ROUTES], "the endpoint and the route it fixed"
    republished = batch.changes[1].value
    assert isinstance(republished, Route) and republished.status is not None
    fixed = republished.status.condition(RESOLVED_REFS)
    assert fixed is not None and fixed.status == TRUE
    assert fixed.last_transition == clock.now and fixed.last_transition != since
    # Admitted did not change status: its transition time stays.
    admitted = republished.status.condition(ADMITTED)
    assert admitted is not None and admitted.last_transition == since


def test_a_status_that_does_not_change_publishes_nothing() -> None:
    store = healthy_store()
    store.upsert_route(route(), source=FILE)
    with store.subscribe(resume_from=store.version, resume_epoch=None) as sub:
        store.set_endpoints("demo", "web", [ready(), ready(address="10.0.0.2")], source=FILE)
        batch = sub.take()
    assert isinstance(batch, Batch)
    assert [c.kind for c in batch.changes] == [Kind.ENDPOINTS]


def test_same_host_and_path_the_older_route_wins_and_the_younger_is_conflicted() -> None:
    store = healthy_store()
    store.replace_source(FILE, routes=[route(name="first"), route(name="second")])
    assert condition(store, "demo", "first", ADMITTED)[0] == TRUE
    assert condition(store, "demo", "second", CONFLICTED) == (
        TRUE,
        "HostAlreadyClaimed",
        "host echo.localtest.me path / is claimed by the older route demo/first",
    )
    assert condition(store, "demo", "second", ADMITTED)[:2] == (FALSE, "HostAlreadyClaimed")
    second = store.get_route("demo", "second")
    assert second is not None and second.status is not None and not second.status.admitted
    # Another path on the same host is no conflict.
    store.upsert_route(route(name="api", path="/api"), source=FILE)
    assert condition(store, "demo", "api", CONFLICTED)[:2] == (FALSE, "NoConflicts")
    # The older one goes: the younger takes the path over, in that same version.
    store.replace_source(FILE, routes=[route(name="second"), route(name="api", path="/api")])
    assert condition(store, "demo", "second", ADMITTED)[0] == TRUE


def test_file_order_decides_age_within_one_load_not_names() -> None:
    store = healthy_store()
    store.replace_source(FILE, routes=[route(name="zz"), route(name="aa")])
    assert condition(store, "demo", "zz", ADMITTED)[0] == TRUE
    assert condition(store, "demo", "aa", ADMITTED)[0] == FALSE


def test_a_host_belongs_to_the_namespace_of_its_oldest_route() -> None:
    store = healthy_store()
    store.upsert_route(route(name="echo"), source=FILE)
    # A route admin's route in another namespace for a path nobody claimed yet.
    store.upsert_service(web("evil"), source=FILE)
    store.upsert_route(route("evil", "api", path="/api"), source=FILE)
    assert condition(store, "evil", "api", CONFLICTED) == (
        TRUE,
        "HostAlreadyClaimed",
        "host echo.localtest.me belongs to namespace demo (its route demo/echo claimed it first)",
    )
    assert condition(store, "evil", "api", ADMITTED)[0] == FALSE
    # The owner's own new paths stay admitted.
    store.upsert_route(route(name="api", path="/api"), source=FILE)
    assert condition(store, "demo", "api", ADMITTED)[0] == TRUE


def test_host_sharing_lets_namespaces_share_but_not_a_path() -> None:
    store = healthy_store(share_hosts=True)
    store.upsert_service(web("other"), source=FILE)
    store.upsert_route(route(name="echo"), source=FILE)
    store.upsert_route(route("other", "api", path="/api"), source=FILE)
    store.upsert_route(route("other", "root"), source=FILE)
    assert condition(store, "other", "api", ADMITTED)[0] == TRUE
    assert condition(store, "other", "root", CONFLICTED)[0] == TRUE


def test_creation_time_from_the_source_beats_first_sight() -> None:
    store = healthy_store()
    old = datetime(2020, 1, 1, tzinfo=UTC)
    store.upsert_route(route(name="young", created=old + timedelta(days=1)), source=KUBE)
    store.upsert_route(route(name="old", created=old), source=KUBE)
    assert condition(store, "demo", "old", ADMITTED)[0] == TRUE
    assert condition(store, "demo", "young", CONFLICTED)[0] == TRUE


def test_a_status_passed_in_by_a_source_is_ignored() -> None:
    store = healthy_store()
    store.upsert_route(route(name="first"), source=FILE)
    forged = store.get_route("demo", "first")
    assert forged is not None
    store.upsert_route(route(name="second", status=forged.status), source=FILE)
    assert condition(store, "demo", "second", ADMITTED)[0] == FALSE


def test_source_health_keeps_the_first_failure_time_until_a_load() -> None:
    from waygate.resolver.status import SourceHealth

    now = [datetime(2026, 1, 1, tzinfo=UTC)]
    health = SourceHealth("manifests:/x", clock=lambda: now[0])
    assert not health.state().valid  # never loaded
    health.loaded(3)
    assert health.state().valid and health.state().loaded_version == 3
    now[0] += timedelta(seconds=5)
    assert health.failed("/x:4: bad") is True
    now[0] += timedelta(seconds=5)
    assert health.failed("/x:4: bad") is False  # the same error: not new
    assert health.failed("/x:9: worse") is True
    state = health.state()
    assert not state.valid and state.error == "/x:9: worse"
    assert state.error_since == datetime(2026, 1, 1, 0, 0, 5, tzinfo=UTC)
    assert state.loaded_version == 3  # the last good content is still served
    health.loaded(4)
    assert health.state().valid and health.state().error_since is None
