"""Resolve over real gRPC: every service type, every error case, port mapping and picks."""

from __future__ import annotations

import grpc
import pytest

from tests.integration.resolver.conftest import Resolver
from waygate.resolver.model import Endpoint, EndpointPort
from waygate.resolver.v1 import resolver_pb2 as pb


async def resolve(
    resolver: Resolver, name: str, port: str = "", **kw: object
) -> pb.ResolveResponse:
    return await resolver.stub.Resolve(
        pb.ResolveRequest(namespace="shop", name=name, port=port, **kw), timeout=5
    )


async def status_of(
    resolver: Resolver, name: str, port: str = "", **kw: object
) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await resolve(resolver, name, port, **kw)
    return info.value.code(), info.value.details() or ""


async def test_cluster_ip_resolves_ready_endpoints_only(resolver: Resolver) -> None:
    response = await resolve(resolver, "web", "http")
    targets = [(t.address, t.port, t.node_name, t.tunnel) for t in response.targets]
    # 10.1.0.3 is not ready and 10.1.0.4 is terminating: neither is served.
    assert targets == [("10.1.0.1", 8080, "node-a", False), ("10.1.0.2", 8080, "edge-1", True)]
    assert response.service.type == pb.SERVICE_TYPE_CLUSTER_IP
    assert response.version == resolver.store.version
    assert response.HasField("last_sync")
    assert not response.HasField("picked")


async def test_port_by_number_and_mapping_by_target_port_name(resolver: Resolver) -> None:
    by_number = await resolve(resolver, "web", "80")
    assert {t.port for t in by_number.targets} == {8080}
    admin = await resolve(resolver, "web", "admin")
    assert {t.port for t in admin.targets} == {9100}, "targetPort 'metrics' names the endpoint port"


@pytest.mark.parametrize(("name", "port"), [("nodeport", 8080), ("lb", 8443)])
async def test_node_port_and_load_balancer_services_resolve(
    resolver: Resolver, name: str, port: int
) -> None:
    response = await resolve(resolver, name)
    assert [(t.address, t.port) for t in response.targets] == [
        (f"10.{2 if name == 'nodeport' else 3}.0.1", port)
    ]


async def test_external_name_is_failed_precondition(resolver: Resolver) -> None:
    code, message = await status_of(resolver, "external")
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "ExternalName" in message


async def test_headless_is_failed_precondition(resolver: Resolver) -> None:
    code, message = await status_of(resolver, "headless")
    assert code == grpc.StatusCode.FAILED_PRECONDITION
    assert "headless" in message


async def test_unknown_service_is_not_found(resolver: Resolver) -> None:
    code, message = await status_of(resolver, "nope")
    assert (code, message) == (grpc.StatusCode.NOT_FOUND, "service shop/nope not found")


async def test_unknown_port_is_not_found(resolver: Resolver) -> None:
    code, message = await status_of(resolver, "web", "https")
    assert code == grpc.StatusCode.NOT_FOUND
    assert "no port 'https'" in message


async def test_ambiguous_empty_port_is_invalid_argument(resolver: Resolver) -> None:
    code, message = await status_of(resolver, "web")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "several ports" in message


@pytest.mark.parametrize("name", ["draining", "empty"])
async def test_no_ready_endpoint_is_unavailable_with_the_aggregator_message(
    resolver: Resolver, name: str
) -> None:
    code, message = await status_of(resolver, name)
    assert (code, message) == (
        grpc.StatusCode.UNAVAILABLE,
        f"no endpoints available for service shop/{name}",
    )


async def test_removed_endpoint_is_never_served_again(resolver: Resolver) -> None:
    store = resolver.store
    store.set_endpoints(
        "shop",
        "empty",
        [Endpoint("shop", "empty", "10.9.0.1", (EndpointPort("", 8080),))],
        source="test",
    )
    assert [t.address for t in (await resolve(resolver, "empty")).targets] == ["10.9.0.1"]
    store.set_endpoints("shop", "empty", [], source="test")
    code, _ = await status_of(resolver, "empty")
    assert code == grpc.StatusCode.UNAVAILABLE


async def test_missing_name_and_hash_without_key_are_invalid(resolver: Resolver) -> None:
    code, _ = await status_of(resolver, "")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    code, message = await status_of(resolver, "web", "http", pick=pb.PICK_POLICY_HASH)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "hash_key" in message


async def test_round_robin_pick_cycles_through_every_target(resolver: Resolver) -> None:
    picked = [
        (await resolve(resolver, "web", "http", pick=pb.PICK_POLICY_ROUND_ROBIN)).picked.address
        for _ in range(4)
    ]
    assert picked[0] != picked[1] and picked[:2] == picked[2:]
    assert set(picked) == {"10.1.0.1", "10.1.0.2"}


async def test_hash_pick_is_stable_per_key_and_random_pick_is_a_target(resolver: Resolver) -> None:
    first = await resolve(resolver, "web", "http", pick=pb.PICK_POLICY_HASH, hash_key="192.0.2.7")
    for _ in range(5):
        again = await resolve(
            resolver, "web", "http", pick=pb.PICK_POLICY_HASH, hash_key="192.0.2.7"
        )
        assert again.picked == first.picked
    keys = {
        (
            await resolve(resolver, "web", "http", pick=pb.PICK_POLICY_HASH, hash_key=f"10.0.0.{i}")
        ).picked.address
        for i in range(40)
    }
    assert keys == {"10.1.0.1", "10.1.0.2"}, "different keys spread over the targets"
    random_pick = await resolve(resolver, "web", "http", pick=pb.PICK_POLICY_RANDOM)
    assert random_pick.picked in list(random_pick.targets)


async def test_a_removed_endpoint_is_never_resolved_again(resolver: Resolver) -> None:
    """Answers are cached per service port; a change to the endpoints must show at once."""
    first = await resolve(resolver, "web", "http")
    assert [t.address for t in first.targets] == ["10.1.0.1", "10.1.0.2"]
    again = await resolve(resolver, "web", "http")
    assert again == first
    source = resolver.file.source  # type: ignore[union-attr]
    kept = [e for e in resolver.store.endpoints_of("shop", "web") if e.address != "10.1.0.1"]
    resolver.store.set_endpoints("shop", "web", kept, source=source)
    after = await resolve(resolver, "web", "http")
    assert [t.address for t in after.targets] == ["10.1.0.2"]
    assert after.version == resolver.store.version > first.version
    resolver.store.set_endpoints(
        "shop",
        "web",
        [*kept, Endpoint("shop", "web", "10.1.0.9", (EndpointPort("http", 8080),))],
        source=source,
    )
    latest = await resolve(resolver, "web", "http")
    assert [t.address for t in latest.targets] == ["10.1.0.2", "10.1.0.9"]
