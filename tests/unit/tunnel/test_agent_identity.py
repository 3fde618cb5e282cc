"""A tunnel agent in a cluster gets dns:NODE for its own node only: the TokenReview of
its pod-bound ServiceAccount token names the node, and certs' policy grants that
name only to the ServiceAccounts listed as node agents."""

from __future__ import annotations

from typing import Any

import pytest

from waygate.certs.kube_auth import NODE_NAME_EXTRA, TokenReviewAuthenticator
from waygate.certs.policy import Policy
from waygate.core.errors import PermissionDenied

AGENT = "system:serviceaccount:waygate:tunnel-agent"


class Answers:
    """Stands in for KubeAPI's `create`: the TokenReview answer a real API server gives."""

    def __init__(self, user: dict[str, Any]) -> None:
        self.user = user

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return {
            "kind": "TokenReview",
            "status": {"authenticated": True, "user": self.user, "audiences": ["waygate-certs"]},
        }


async def caller_of(user: dict[str, Any]) -> Any:
    auth = TokenReviewAuthenticator(Answers(user), audiences=("waygate-certs",))  # type: ignore[arg-type]
    return await auth.authenticate("a-token")


async def test_pod_bound_agent_token_gets_its_own_node_only() -> None:
    caller = await caller_of({"username": AGENT, "extra": {NODE_NAME_EXTRA: ["edge-7"]}})
    assert caller.pod_node == "edge-7"
    policy = Policy("cluster.local", node_agents=("waygate/tunnel-agent",))
    policy.authorize(caller, "edge-7", ["dns:edge-7"])
    with pytest.raises(PermissionDenied, match="edge-8"):
        policy.authorize(caller, "edge-8", ["dns:edge-8"])


async def test_other_service_accounts_on_the_node_get_no_node_name() -> None:
    caller = await caller_of(
        {"username": "system:serviceaccount:shop:web", "extra": {NODE_NAME_EXTRA: ["edge-7"]}}
    )
    policy = Policy("cluster.local", node_agents=("waygate/tunnel-agent",))
    with pytest.raises(PermissionDenied):
        policy.authorize(caller, "edge-7", ["dns:edge-7"])


async def test_a_token_not_bound_to_a_pod_names_no_node() -> None:
    caller = await caller_of({"username": AGENT})
    assert caller.pod_node is None
    with pytest.raises(PermissionDenied):
        Policy("cluster.local", node_agents=("waygate/tunnel-agent",)).authorize(
            caller, "edge-7", ["dns:edge-7"]
        )
