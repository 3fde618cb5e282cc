"""Kubernetes API calls made for a Certify are bounded (issue 8: unary calls never starved).

TokenReviews and Service reads run in pools of their own, at most N at once: a
Certify finding them all busy gets RESOURCE_EXHAUSTED at once instead of
waiting behind a slow API server; one CSR's Services are read concurrently.
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import pytest

from waygate.certs.auth import Caller
from waygate.certs.kube_auth import KubeCalls, KubeServiceDirectory, TokenReviewAuthenticator
from waygate.certs.policy import SERVING_ACCOUNT_ANNOTATION, Policy
from waygate.core.errors import ResourceExhausted


class SlowAPI:
    """Stand-in for the KubeAPI client: every call blocks until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.most_at_once = 0

    def _call(self) -> None:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            assert self.release.wait(10)
        finally:
            with self.lock:
                self.running -= 1

    def create(self, path: str, body: Any) -> Any:
        self._call()
        return {"status": {"authenticated": False, "error": "unknown"}}

    def get(self, path: str) -> Any:
        self._call()
        name = path.rsplit("/", 1)[-1]
        return {"metadata": {"name": name, "annotations": {SERVING_ACCOUNT_ANNOTATION: "web"}}}


async def test_token_reviews_over_the_bound_are_refused_at_once() -> None:
    api = SlowAPI()
    auth = TokenReviewAuthenticator(api, audiences=("a",), max_in_flight=2)  # type: ignore[arg-type]
    held = [asyncio.ensure_future(auth.authenticate(f"token-{i}")) for i in range(2)]
    try:
        await asyncio.sleep(0.1)
        with pytest.raises(ResourceExhausted, match="too many TokenReviews in flight"):
            await asyncio.wait_for(auth.authenticate("token-3"), 5)
    finally:
        api.release.set()
        assert await asyncio.wait_for(asyncio.gather(*held), 10) == [None, None]
    assert api.most_at_once == 2


async def test_a_place_is_held_until_the_thread_is_done_not_until_the_caller_gives_up() -> None:
    calls = KubeCalls(1, "reads")
    release = threading.Event()
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(calls.run(release.wait, 10), 0.1)
    assert calls.in_flight == 1  # the thread still runs
    with pytest.raises(ResourceExhausted):
        await calls.run(release.wait, 10)
    release.set()
    for _ in range(100):
        if calls.in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert calls.in_flight == 0
    assert await calls.run(lambda: "ok") == "ok"


async def test_one_csrs_services_are_read_concurrently() -> None:
    api = SlowAPI()
    policy = Policy("waygate.local", services=KubeServiceDirectory(api))  # type: ignore[arg-type]
    caller = Caller(name="system:serviceaccount:shop:web", namespace="shop", service_account="web")
    names = [f"dns:svc{i}.shop.svc" for i in range(4)]
    check = asyncio.ensure_future(policy.check_service_names(caller, names))
    try:
        for _ in range(100):
            if api.running == 4:
                break
            await asyncio.sleep(0.02)
        assert api.running == 4  # all four reads at once, not one after another
    finally:
        api.release.set()
    await asyncio.wait_for(check, 10)
