"""The shared Kubernetes layer (`waygate.core.kube`) against the STAND-IN API server.

No real API server can run here; `tests.support.kubeapi` serves real HTTP to
the official `kubernetes` client. These cover what every user of the layer
relies on: paged lists, selectors, resume, 410 in both forms, metrics, and a
watch cancelled while it is still opening.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kubernetes import client
from prometheus_client import REGISTRY

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.support.poll import until
from waygate.core.backoff import Backoff
from waygate.core.kube import JSON, KubeAPI, Reflector

CONFIGMAPS = "/api/v1/namespaces/default/configmaps"


def configmap(name: str, **labels: str) -> JSON:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {"name": name, "namespace": "default", "labels": labels},
        "data": {"k": name},
    }


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI(history=100, default_watch_timeout=60) as api:
        yield api


def client_for(standin: StandInAPI) -> KubeAPI:
    return KubeAPI(client.ApiClient(standin.configuration()), timeout=5.0)


class Mirror:
    """What a reflector's callbacks built: name -> object."""

    def __init__(self) -> None:
        self.objects: dict[str, JSON] = {}
        self.lists = 0

    def relisted(self, items: list[JSON]) -> None:
        self.lists += 1
        self.objects = {i["metadata"]["name"]: i for i in items}

    def changed(self, kind: str, obj: JSON) -> None:
        if kind == "DELETED":
            self.objects.pop(obj["metadata"]["name"], None)
        else:
            self.objects[obj["metadata"]["name"]] = obj


def metric(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def running(reflector: Reflector) -> asyncio.Task[None]:
    task = asyncio.create_task(reflector.run())
    async with asyncio.timeout(10):
        await reflector.synced.wait()
    return task


async def stop(task: asyncio.Task[None]) -> None:
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_list_pages_follow_continue_tokens_with_selectors(standin: StandInAPI) -> None:
    for i in range(7):
        standin.create(configmap(f"cm-{i}", tier="a" if i % 2 else "b"))
    api = client_for(standin)
    items, version = api.list(CONFIGMAPS, limit=2, selectors=[("labelSelector", "tier=a")])
    assert sorted(i["metadata"]["name"] for i in items) == ["cm-1", "cm-3", "cm-5"]
    assert version == str(standin.resource_version)
    pages = [r for r in standin.requests if r.method == "GET" and not r.watch]
    assert len(pages) == 2  # three items in pages of two
    assert pages[1].query["continue"] and pages[1].query["labelSelector"] == "tier=a"


async def test_reflector_lists_watches_and_resumes_without_relisting(standin) -> None:
    standin.create(configmap("a"))
    mirror = Mirror()
    reflector = Reflector(
        client_for(standin),
        CONFIGMAPS,
        name="test-resume",
        on_list=mirror.relisted,
        on_event=mirror.changed,
        page_size=1,
        backoff=lambda: Backoff(0.02, 0.1),
    )
    task = await running(reflector)
    try:
        await standin.wait_watchers(1)
        standin.create(configmap("b"))
        await until(lambda: "b" in mirror.objects, "the watched create")
        standin.drop_watches()  # connection cut: resume from the last version
        standin.delete("v1", "ConfigMap", "a", "default")
        await until(lambda: "a" not in mirror.objects, "the delete after the resume")
        assert mirror.lists == 1
        restarts = metric(
            "waygate_kube_watch_restarts_total", resource="test-resume", reason="error"
        )
        assert restarts >= 1
    finally:
        await stop(task)


@pytest.mark.parametrize("as_http", [False, True], ids=["error-event", "http-410"])
async def test_reflector_relists_on_410_in_both_forms(standin, as_http: bool) -> None:
    standin.gone_as_http = as_http
    standin.create(configmap("kept"))
    standin.create(configmap("deleted-while-away"))
    mirror = Mirror()
    name = f"test-gone-{as_http}"
    reflector = Reflector(
        client_for(standin),
        CONFIGMAPS,
        name=name,
        on_list=mirror.relisted,
        on_event=mirror.changed,
        label_selector="",
        backoff=lambda: Backoff(0.02, 0.1),
    )
    task = await running(reflector)
    try:
        await standin.wait_watchers(1)
        before = metric("waygate_kube_relists_total", resource=name)
        # Away long enough for the history to be gone: the delete can only be
        # learnt by listing again.
        standin.unavailable = True
        standin.drop_watches()
        standin.delete("v1", "ConfigMap", "deleted-while-away", "default")
        standin.expire_history()
        standin.unavailable = False
        await until(lambda: "deleted-while-away" not in mirror.objects, "the relist")
        assert metric("waygate_kube_relists_total", resource=name) > before
        assert "kept" in mirror.objects
        assert metric("waygate_kube_watch_restarts_total", resource=name, reason="gone") >= 1
    finally:
        await stop(task)


async def test_a_watch_cancelled_while_opening_closes_its_stream_once_open(standin) -> None:
    """STAND-IN for the watch request: a `watch` that blocks in the reflector's
    thread (as the client does while connecting) until released, then returns a
    stream that records being closed. The stand-in API server cannot hold a
    watch's response headers, which is the moment this is about."""
    entered, release = threading.Event(), threading.Event()

    class Stream:
        closed = False

        def close(self) -> None:
            self.closed = True

    stream = Stream()

    class Opening(KubeAPI):
        def watch(self, *args: Any, **kwargs: Any) -> Any:
            entered.set()
            release.wait(10)
            return stream

    reflector = Reflector(
        Opening(client.ApiClient(standin.configuration())),
        CONFIGMAPS,
        name="test-opening",
        on_list=lambda items: None,
        on_event=lambda kind, obj: None,
    )
    task = asyncio.create_task(reflector.run())
    try:
        await until(entered.is_set, "the watch request to start opening")
        await stop(task)
        assert task.cancelled()
        release.set()  # the request completes after its caller is gone
        await until(lambda: stream.closed, "the stream to be closed")
    finally:
        release.set()


async def test_callbacks_run_on_the_loop_thread(standin) -> None:
    standin.create(configmap("a"))
    threads: set[int] = set()

    def record(*_: object) -> None:
        threads.add(threading.get_ident())

    reflector = Reflector(
        client_for(standin), CONFIGMAPS, name="test-thread", on_list=record, on_event=record
    )
    task = await running(reflector)
    try:
        await standin.wait_watchers(1)
        standin.create(configmap("b"))
        await until(lambda: len(threads) >= 1, "a callback")
        await asyncio.sleep(0.2)
        assert threads == {threading.get_ident()}
    finally:
        await stop(task)
