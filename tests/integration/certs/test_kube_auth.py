"""TokenReviewAuthenticator against a STAND-IN Kubernetes API server (none can run here).

The stand-in (`tests.support.kubeapi`) answers POST tokenreviews over real
HTTP by calling the test's `token_reviewer(token, audiences)`; the reviewer
below plays the API server's token authenticator: it knows a few tokens, the
audience each was minted for, and refuses a token presented for another
audience, as the real one does.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client

from tests.support.kubeapi import KubeAPI as StandInAPI
from waygate.certs.auth import Caller
from waygate.certs.kube_api import KubeAPI
from waygate.certs.kube_auth import TOKEN_REVIEWS, TokenReviewAuthenticator
from waygate.core.errors import FailedPrecondition, Unavailable

AUDIENCE = "waygate-certs"

TOKENS: dict[str, tuple[str, dict[str, Any]]] = {
    "sa-token": (
        AUDIENCE,
        {
            "username": "system:serviceaccount:shop:web",
            "uid": "1111",
            "groups": ["system:serviceaccounts", "system:serviceaccounts:shop"],
        },
    ),
    "node-token": (
        AUDIENCE,
        {"username": "system:node:edge-1", "uid": "2222", "groups": ["system:nodes"]},
    ),
    "api-server-token": (
        "https://kubernetes.default.svc",
        {"username": "system:serviceaccount:shop:web", "uid": "1111", "groups": []},
    ),
}


class Reviewer:
    def __init__(self) -> None:
        self.calls: list[tuple[str, list[str]]] = []

    def __call__(self, token: str, audiences: list[str]) -> dict[str, Any] | None:
        self.calls.append((token, audiences))
        known = TOKENS.get(token)
        if known is None or known[0] not in audiences:
            return None
        return known[1]


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        yield api


@pytest.fixture
def reviewer(standin: StandInAPI) -> Reviewer:
    standin.token_reviewer = reviewer = Reviewer()
    return reviewer


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def authenticator(
    standin: StandInAPI,
    configuration: client.Configuration | None = None,
    clock: Clock | None = None,
) -> TokenReviewAuthenticator:
    api = KubeAPI(client.ApiClient(configuration or standin.configuration()), timeout=5.0)
    return TokenReviewAuthenticator(
        api, audiences=(AUDIENCE,), cache_ttl=60.0, clock=clock or Clock()
    )


async def test_service_account_token_authenticates_with_the_audience_passed(
    standin: StandInAPI, reviewer: Reviewer
) -> None:
    caller = await authenticator(standin).authenticate("sa-token")
    assert caller == Caller(
        name="system:serviceaccount:shop:web",
        namespace="shop",
        service_account="web",
        groups=("system:serviceaccounts", "system:serviceaccounts:shop"),
    )
    assert reviewer.calls == [("sa-token", [AUDIENCE])]


async def test_node_token_authenticates_as_the_node(
    standin: StandInAPI, reviewer: Reviewer
) -> None:
    caller = await authenticator(standin).authenticate("node-token")
    assert caller is not None
    assert caller.node == "edge-1"
    assert caller.namespace is None and caller.service_account is None


@pytest.mark.parametrize("token", ["unknown-token", "api-server-token"])
async def test_unauthenticated_or_wrong_audience_token_is_refused(
    standin: StandInAPI, reviewer: Reviewer, token: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="waygate.certs.kube_auth")
    assert await authenticator(standin).authenticate(token) is None
    assert reviewer.calls == [(token, [AUDIENCE])]
    assert "not authenticated" in caplog.text
    assert token not in caplog.text  # tokens are never logged


async def test_empty_token_is_refused_without_asking(
    standin: StandInAPI, reviewer: Reviewer
) -> None:
    assert await authenticator(standin).authenticate("  ") is None
    assert reviewer.calls == []


async def test_positive_results_are_cached_for_the_ttl_only(
    standin: StandInAPI, reviewer: Reviewer
) -> None:
    clock = Clock()
    auth = authenticator(standin, clock=clock)
    first = await auth.authenticate("sa-token")
    clock.now += 59
    assert await auth.authenticate("sa-token") == first
    assert len(reviewer.calls) == 1
    clock.now += 2
    assert await auth.authenticate("sa-token") == first
    assert len(reviewer.calls) == 2


async def test_refusals_are_cached_briefly(standin: StandInAPI, reviewer: Reviewer) -> None:
    """A caller retrying a bad token in a loop costs one review per 5 s, not one per call."""
    clock = Clock()
    auth = authenticator(standin, clock=clock)
    assert await auth.authenticate("unknown-token") is None
    clock.now += 4
    assert await auth.authenticate("unknown-token") is None
    assert len(reviewer.calls) == 1
    clock.now += 2
    assert await auth.authenticate("unknown-token") is None
    assert len(reviewer.calls) == 2


async def test_an_unreachable_api_server_is_unavailable(standin: StandInAPI) -> None:
    configuration = standin.configuration()
    standin.stop()
    with pytest.raises(Unavailable, match="TokenReview failed"):
        await authenticator(standin, configuration).authenticate("sa-token")


async def test_no_permission_to_review_is_a_failed_precondition(
    standin: StandInAPI, reviewer: Reviewer
) -> None:
    without_token = standin.configuration()
    standin.bearer_token = "only-this-one"
    with pytest.raises(FailedPrecondition, match="may not create TokenReviews"):
        await authenticator(standin, without_token).authenticate("sa-token")
    assert reviewer.calls == []
    assert any(r.path == TOKEN_REVIEWS for r in standin.requests)
