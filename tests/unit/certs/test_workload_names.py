"""Per-workload names (issue 12 item 5): a ServiceAccount gets NAME.NS.svc only for its Service.

The rule is the policy's (`Policy.check_service_names`), fed by a
`ServiceDirectory`: here an in-memory one, and `KubeServiceDirectory` over an
object with KubeAPI's `get` (answers, 404, 403, a hang). The CSR controller
and the Kubernetes read path are covered against the stand-in API server in
tests/integration/certs.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest

from waygate.certs.auth import Caller
from waygate.certs.kube_api import KubeError
from waygate.certs.kube_auth import KubeServiceDirectory
from waygate.certs.policy import (
    MAX_SERVICES_PER_CSR,
    SERVING_ACCOUNT_ANNOTATION,
    Policy,
    ServiceInfo,
)
from waygate.core.errors import FailedPrecondition, InvalidArgument, PermissionDenied, Unavailable

WEB = Caller(name="system:serviceaccount:shop:web", namespace="shop", service_account="web")
SPIFFE = "uri:spiffe://cluster.test/ns/shop/sa/web"


class Directory:
    """Services by (namespace, name) -> annotation value (None: no annotation)."""

    def __init__(self, services: dict[tuple[str, str], str | None]) -> None:
        self.services = services
        self.asked: list[tuple[str, str]] = []

    async def service(self, namespace: str, name: str) -> ServiceInfo | None:
        self.asked.append((namespace, name))
        if (namespace, name) not in self.services:
            return None
        return ServiceInfo(namespace, name, self.services[(namespace, name)])


def policy(services: dict[tuple[str, str], str | None]) -> tuple[Policy, Directory]:
    directory = Directory(services)
    return Policy("cluster.test", services=directory), directory


async def test_service_annotated_for_the_service_account_is_allowed() -> None:
    rules, _ = policy({("shop", "api"): "web"})
    await rules.check_service_names(WEB, [SPIFFE, "dns:api.shop.svc"])
    await rules.check_service_names(WEB, ["dns:API.shop.svc.cluster.local."])


async def test_service_named_like_the_service_account_is_allowed() -> None:
    rules, _ = policy({("shop", "web"): None})
    await rules.check_service_names(WEB, ["dns:web.shop.svc", "dns:web.shop.svc.cluster.local"])


async def test_an_annotation_naming_another_account_wins_over_the_name() -> None:
    rules, _ = policy({("shop", "web"): "frontend"})
    with pytest.raises(PermissionDenied) as refused:
        await rules.check_service_names(WEB, ["dns:web.shop.svc"])
    message = str(refused.value)
    assert SERVING_ACCOUNT_ANNOTATION in message
    assert "names ServiceAccount 'frontend'" in message


async def test_another_workloads_service_is_refused_naming_the_rule() -> None:
    rules, _ = policy({("shop", "db"): None})
    with pytest.raises(PermissionDenied) as refused:
        await rules.check_service_names(WEB, [SPIFFE, "dns:db.shop.svc"])
    message = str(refused.value)
    assert "'dns:db.shop.svc'" in message
    assert "only for a Service NAME in its own namespace" in message
    assert "has no waygate.io/serving-service-account annotation and is not named web" in message


async def test_a_missing_service_is_refused() -> None:
    rules, _ = policy({})
    with pytest.raises(PermissionDenied, match="Service shop/ghost does not exist"):
        await rules.check_service_names(WEB, ["dns:ghost.shop.svc"])


async def test_names_that_are_not_service_names_are_not_looked_up() -> None:
    rules, directory = policy({})
    await rules.check_service_names(WEB, [SPIFFE, "dns:web.other.svc", "ip:10.0.0.1"])
    assert directory.asked == []  # another namespace's name is refused by `authorize`
    # ... where a static caller's names are its own patterns, never Services.
    static = Caller(name="resolver", allowed=("dns:web.shop.svc",))
    await rules.check_service_names(static, ["dns:web.shop.svc"])
    assert directory.asked == []


async def test_a_label_that_cannot_be_a_service_is_refused_without_a_lookup() -> None:
    rules, directory = policy({})
    with pytest.raises(PermissionDenied, match="is not a Service name"):
        await rules.check_service_names(WEB, ["dns:a_b.shop.svc"])
    assert directory.asked == []


async def test_at_most_so_many_services_per_request() -> None:
    names = [f"dns:s{i}.shop.svc" for i in range(MAX_SERVICES_PER_CSR + 1)]
    rules, directory = policy({("shop", f"s{i}"): "web" for i in range(100)})
    with pytest.raises(InvalidArgument, match=f"at most {MAX_SERVICES_PER_CSR}"):
        await rules.check_service_names(WEB, names)
    assert directory.asked == []


async def test_without_a_directory_service_names_are_refused() -> None:
    with pytest.raises(PermissionDenied, match="reads no Services"):
        await Policy("cluster.test").check_service_names(WEB, ["dns:web.shop.svc"])


def test_the_shape_check_still_refuses_other_namespaces() -> None:
    rules, _ = policy({})
    assert rules.is_allowed(WEB, "dns:web.shop.svc")
    assert not rules.is_allowed(WEB, "dns:web.bank.svc")


# ---------------------------------------------------------------- KubeServiceDirectory


class FakeAPI:
    """KubeAPI's `get`, answering from a dict of path -> object or error."""

    def __init__(self, answers: dict[str, Any], delay: float = 0.0) -> None:
        self.answers = answers
        self.delay = delay
        self.calls: list[str] = []
        self.threads: set[int] = set()

    def get(self, path: str) -> dict[str, Any]:
        self.calls.append(path)
        self.threads.add(threading.get_ident())
        time.sleep(self.delay)
        answer = self.answers.get(path, KubeError(404, "404 not found"))
        if isinstance(answer, Exception):
            raise answer
        return answer


SERVICE_PATH = "/api/v1/namespaces/shop/services/api"


async def test_directory_reads_the_annotation_in_a_worker_thread() -> None:
    api = FakeAPI(
        {
            SERVICE_PATH: {
                "metadata": {"name": "api", "annotations": {SERVING_ACCOUNT_ANNOTATION: "web"}}
            }
        }
    )
    directory = KubeServiceDirectory(api)  # type: ignore[arg-type]
    assert await directory.service("shop", "api") == ServiceInfo("shop", "api", "web")
    assert await directory.service("shop", "none") is None
    assert threading.get_ident() not in api.threads


async def test_directory_caches_briefly_and_boundedly() -> None:
    now = [0.0]
    api = FakeAPI({SERVICE_PATH: {"metadata": {"name": "api"}}})
    directory = KubeServiceDirectory(api, cache_ttl=5.0, cache_size=2, clock=lambda: now[0])  # type: ignore[arg-type]
    for _ in range(3):
        await directory.service("shop", "api")
    assert len(api.calls) == 1
    now[0] = 6.0
    await directory.service("shop", "api")
    assert len(api.calls) == 2
    for name in ("a", "b", "c"):
        await directory.service("shop", name)
    assert len(directory._cache) == 2


async def test_directory_gives_up_after_its_timeout() -> None:
    directory = KubeServiceDirectory(FakeAPI({}, delay=2.0), timeout=0.2)  # type: ignore[arg-type]
    started = time.monotonic()
    with pytest.raises(Unavailable, match="did not answer within 0.2s"):
        await directory.service("shop", "api")
    assert time.monotonic() - started < 1.5


@pytest.mark.parametrize(
    ("error", "raised", "match"),
    [
        (KubeError(403, "403 forbidden"), FailedPrecondition, "may not read Services"),
        (KubeError(500, "500 boom"), Unavailable, "cannot read a Service"),
    ],
)
async def test_directory_failures_are_domain_errors(
    error: KubeError, raised: type[Exception], match: str
) -> None:
    directory = KubeServiceDirectory(FakeAPI({SERVICE_PATH: error}))  # type: ignore[arg-type]
    with pytest.raises(raised, match=match):
        await directory.service("shop", "api")
