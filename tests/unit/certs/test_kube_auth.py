"""Kubernetes users -> Callers, and how TokenReview answers are read (no sockets).

The review answers here are what a real API server may send but the
stand-in cannot (it echoes the audiences asked for), fed through an object
with KubeAPI's `create` method.
"""

from __future__ import annotations

from typing import Any

import pytest

from waygate.certs.auth import Caller
from waygate.certs.kube_auth import TokenReviewAuthenticator, caller_for_user


@pytest.mark.parametrize(
    ("username", "groups", "expected"),
    [
        (
            "system:serviceaccount:shop:web",
            (),
            Caller(name="system:serviceaccount:shop:web", namespace="shop", service_account="web"),
        ),
        (
            "system:node:edge-1",
            ("system:nodes",),
            Caller(name="system:node:edge-1", node="edge-1", groups=("system:nodes",)),
        ),
        # No system:nodes group: only a name, nothing allowed by policy.
        ("system:node:edge-1", (), Caller(name="system:node:edge-1")),
        ("system:serviceaccount:shop", (), Caller(name="system:serviceaccount:shop")),
        ("system:serviceaccount:shop:web:x", (), Caller(name="system:serviceaccount:shop:web:x")),
        ("system:node:", ("system:nodes",), Caller(name="system:node:", groups=("system:nodes",))),
        ("alice", ("dev",), Caller(name="alice", groups=("dev",))),
    ],
)
def test_caller_for_user(username: str, groups: tuple[str, ...], expected: Caller) -> None:
    assert caller_for_user(username, groups) == expected


class Answers:
    """Stands in for KubeAPI: answers each create with the next canned review."""

    def __init__(self, *statuses: dict[str, Any]) -> None:
        self.statuses = list(statuses)
        self.bodies: list[dict[str, Any]] = []

    def create(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        self.bodies.append(body)
        return {"kind": "TokenReview", "status": self.statuses.pop(0)}


USER = {"username": "system:serviceaccount:shop:web", "groups": ["system:authenticated"]}


async def test_token_valid_only_for_other_audiences_is_refused() -> None:
    api = Answers({"authenticated": True, "user": USER, "audiences": ["https://kubernetes"]})
    auth = TokenReviewAuthenticator(api, audiences=("waygate-certs",))  # type: ignore[arg-type]
    assert await auth.authenticate("t") is None
    assert api.bodies[0]["spec"] == {"token": "t", "audiences": ["waygate-certs"]}


async def test_review_that_reports_no_audience_is_refused_when_one_was_asked() -> None:
    api = Answers({"authenticated": True, "user": USER})
    auth = TokenReviewAuthenticator(api, audiences=("waygate-certs",))  # type: ignore[arg-type]
    assert await auth.authenticate("t") is None


async def test_one_matching_audience_is_enough() -> None:
    api = Answers({"authenticated": True, "user": USER, "audiences": ["waygate-certs", "other"]})
    auth = TokenReviewAuthenticator(api, audiences=("waygate-certs", "x"))  # type: ignore[arg-type]
    caller = await auth.authenticate("t")
    assert caller is not None and caller.service_account == "web"


async def test_authenticated_review_without_a_user_name_is_refused() -> None:
    api = Answers({"authenticated": True, "user": {}, "audiences": ["a"]})
    auth = TokenReviewAuthenticator(api, audiences=("a",))  # type: ignore[arg-type]
    assert await auth.authenticate("t") is None


async def test_without_configured_audiences_the_api_servers_default_applies() -> None:
    api = Answers({"authenticated": True, "user": USER})
    auth = TokenReviewAuthenticator(api, audiences=())  # type: ignore[arg-type]
    assert await auth.authenticate("t") is not None
    assert "audiences" not in api.bodies[0]["spec"]


async def test_the_cache_stays_bounded() -> None:
    api = Answers(*[{"authenticated": True, "user": USER, "audiences": ["a"]}] * 5)
    auth = TokenReviewAuthenticator(api, audiences=("a",), cache_size=2)  # type: ignore[arg-type]
    for token in ("t1", "t2", "t3"):
        await auth.authenticate(token)
    await auth.authenticate("t3")  # cached
    await auth.authenticate("t1")  # evicted: asked again
    assert len(api.bodies) == 4
