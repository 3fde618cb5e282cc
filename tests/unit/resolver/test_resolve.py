"""Resolve rules as plain functions over a store: port mapping, readiness, picks."""

from __future__ import annotations

import random

import pytest

from waygate.core.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable
from waygate.resolver.model import Endpoint, EndpointPort, Service, ServicePort
from waygate.resolver.resolve import Pick, Resolver, endpoint_port
from waygate.resolver.store import Store

SRC = "test"


def service(*ports: ServicePort, **kw: object) -> Service:
    return Service("ns", "svc", ports=ports or (ServicePort("http", 80, "8080"),), **kw)  # type: ignore[arg-type]


def endpoint(address: str, *ports: EndpointPort, **kw: object) -> Endpoint:
    return Endpoint("ns", "svc", address, ports, **kw)  # type: ignore[arg-type]


def store_with(svc: Service, endpoints: list[Endpoint]) -> Store:
    store = Store(initial_version=0)
    store.upsert_service(svc, source=SRC)
    store.set_endpoints("ns", "svc", endpoints, source=SRC)
    return store


def test_endpoint_port_by_name_then_target_number_then_target_name() -> None:
    by_name = ServicePort("http", 80, "8080")
    assert endpoint_port(endpoint("a", EndpointPort("http", 9999)), by_name) == 9999
    assert endpoint_port(endpoint("a", EndpointPort("other", 8080)), by_name) == 8080
    assert endpoint_port(endpoint("a", EndpointPort("other", 1234)), by_name) is None
    assert endpoint_port(endpoint("a"), by_name) == 8080, "no ports listed: the target number"
    by_target_name = ServicePort("web", 80, "http-alt")
    assert endpoint_port(endpoint("a", EndpointPort("http-alt", 8081)), by_target_name) == 8081
    assert endpoint_port(endpoint("a"), by_target_name) is None


def test_terminating_endpoints_are_never_ready_even_when_serving() -> None:
    store = store_with(
        service(),
        [
            endpoint("10.0.0.1", ready=True),
            endpoint("10.0.0.2", ready=True, serving=True, terminating=True),
            endpoint("10.0.0.3", ready=False, serving=True),
        ],
    )
    result = Resolver(store).resolve("ns", "svc")
    assert [t.address for t in result.targets] == ["10.0.0.1"]
    store.set_endpoints("ns", "svc", [endpoint("10.0.0.2", terminating=True)], source=SRC)
    with pytest.raises(Unavailable, match="^no endpoints available for service ns/svc$"):
        Resolver(store).resolve("ns", "svc")


@pytest.mark.parametrize(
    ("svc", "error", "text"),
    [
        (
            Service("ns", "svc", "ExternalName", external_name="db.example.com"),
            FailedPrecondition,
            "ExternalName",
        ),
        (service(headless=True), FailedPrecondition, "headless"),
        (Service("ns", "svc"), NotFound, "has no ports"),
    ],
)
def test_service_level_errors(svc: Service, error: type[Exception], text: str) -> None:
    store = store_with(svc, [endpoint("10.0.0.1")])
    with pytest.raises(error, match=text):
        Resolver(store).resolve("ns", "svc")


def test_port_selection_errors() -> None:
    two = service(ServicePort("http", 80, "8080"), ServicePort("https", 443, "8443"))
    store = store_with(
        two, [endpoint("10.0.0.1", EndpointPort("http", 8080), EndpointPort("https", 8443))]
    )
    resolver = Resolver(store)
    with pytest.raises(InvalidArgument, match="several ports"):
        resolver.resolve("ns", "svc")
    with pytest.raises(NotFound, match="no port 'grpc'"):
        resolver.resolve("ns", "svc", "grpc")
    assert [t.port for t in resolver.resolve("ns", "svc", "443").targets] == [8443]
    with pytest.raises(NotFound, match="service ns/other not found"):
        resolver.resolve("ns", "other")


def test_round_robin_keeps_its_rotation_when_an_endpoint_is_added() -> None:
    store = store_with(service(), [endpoint(f"10.0.0.{i}") for i in (1, 2, 3)])
    resolver = Resolver(store, random.Random(7))
    first = [resolver.resolve("ns", "svc", pick=Pick.ROUND_ROBIN).picked for _ in range(3)]
    assert len({t.address for t in first if t}) == 3
    store.set_endpoints("ns", "svc", [endpoint(f"10.0.0.{i}") for i in (1, 2, 3, 4)], source=SRC)
    after = [resolver.resolve("ns", "svc", pick=Pick.ROUND_ROBIN).picked for _ in range(8)]
    counts = {
        a: sum(1 for t in after if t and t.address == a) for a in {t.address for t in after if t}
    }
    assert counts == {f"10.0.0.{i}": 2 for i in (1, 2, 3, 4)}


def test_hash_pick_mostly_stays_when_another_endpoint_goes() -> None:
    store = store_with(service(), [endpoint(f"10.0.0.{i}") for i in range(1, 9)])
    resolver = Resolver(store, random.Random(7))
    keys = [f"192.0.2.{i}" for i in range(200)]
    before = {k: resolver.resolve("ns", "svc", pick=Pick.HASH, hash_key=k).picked for k in keys}
    store.set_endpoints("ns", "svc", [endpoint(f"10.0.0.{i}") for i in range(1, 8)], source=SRC)
    after = {k: resolver.resolve("ns", "svc", pick=Pick.HASH, hash_key=k).picked for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(before[k] is not None and before[k].address == "10.0.0.8" for k in moved), (
        "only the keys of the removed endpoint move"
    )
    assert moved, "the removed endpoint had keys"


def test_random_pick_is_one_of_the_targets_and_seeded() -> None:
    store = store_with(service(), [endpoint(f"10.0.0.{i}") for i in range(1, 5)])
    picks_a = [
        Resolver(store, random.Random(1)).resolve("ns", "svc", pick=Pick.RANDOM).picked
        for _ in range(5)
    ]
    picks_b = [
        Resolver(store, random.Random(1)).resolve("ns", "svc", pick=Pick.RANDOM).picked
        for _ in range(5)
    ]
    assert picks_a == picks_b
    result = Resolver(store).resolve("ns", "svc", pick=Pick.RANDOM)
    assert result.picked in result.targets


# ---------------------------------------------------------------- the per-port cache


def addresses(resolver: Resolver, port: str = "http") -> list[str]:
    return [t.address for t in resolver.resolve("ns", "svc", port).targets]


def test_an_unchanged_service_port_is_answered_from_the_cache() -> None:
    store = store_with(service(), [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    resolver = Resolver(store)
    first = resolver.resolve("ns", "svc", "http")
    # Unrelated changes leave this service's entry alone.
    store.set_endpoints("ns", "other", [Endpoint("ns", "other", "10.9.0.1")], source=SRC)
    again = resolver.resolve("ns", "svc", "http")
    assert again.targets is first.targets, "the sorted targets are built once"
    assert again.version == store.version


def test_cache_follows_every_change_to_the_service_and_its_endpoints() -> None:
    store = store_with(service(), [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    resolver = Resolver(store)
    assert addresses(resolver) == ["10.0.0.1", "10.0.0.2"]
    # A removed endpoint is never returned again.
    store.set_endpoints("ns", "svc", [endpoint("10.0.0.2")], source=SRC)
    assert addresses(resolver) == ["10.0.0.2"]
    # An endpoint that stops being ready goes; a new one comes.
    store.set_endpoints(
        "ns", "svc", [endpoint("10.0.0.2", ready=False), endpoint("10.0.0.3")], source=SRC
    )
    assert addresses(resolver) == ["10.0.0.3"]
    # The service's port mapping changes: the cached port numbers must not stay.
    store.upsert_service(service(ServicePort("http", 80, "9090")), source=SRC)
    assert [t.port for t in resolver.resolve("ns", "svc", "http").targets] == [9090]
    # A whole-source replace drops the last endpoint: Unavailable, not a stale target.
    store.replace_source(SRC, endpoints=[])
    with pytest.raises(Unavailable):
        resolver.resolve("ns", "svc", "http")
    # Deleted, then made again with other endpoints: nothing of the old one remains.
    store.delete_service("ns", "svc", source=SRC)
    with pytest.raises(NotFound):
        resolver.resolve("ns", "svc", "http")
    store.upsert_service(service(), source=SRC)
    store.set_endpoints("ns", "svc", [endpoint("10.0.0.7")], source=SRC)
    assert addresses(resolver) == ["10.0.0.7"]


def test_picks_follow_the_cached_targets() -> None:
    store = store_with(service(), [endpoint("10.0.0.1"), endpoint("10.0.0.2")])
    resolver = Resolver(store, rng=random.Random(1))
    picks = {resolver.resolve("ns", "svc", pick=Pick.ROUND_ROBIN).picked for _ in range(4)}
    assert {p.address for p in picks if p} == {"10.0.0.1", "10.0.0.2"}
    store.set_endpoints("ns", "svc", [endpoint("10.0.0.2")], source=SRC)
    picks = {resolver.resolve("ns", "svc", pick=Pick.ROUND_ROBIN).picked for _ in range(4)}
    assert {p.address for p in picks if p} == {"10.0.0.2"}
