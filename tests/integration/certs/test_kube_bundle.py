"""The trust-bundle ConfigMap publisher against the stand-in Kubernetes API server
(tests/support/kubeapi.py; there is no real API server on these machines)."""

from __future__ import annotations

import asyncio

import pytest
from kubernetes import client

from tests.support.kubeapi import ApiError
from tests.support.kubeapi import KubeAPI as StandIn
from tests.support.poll import until
from waygate.certs.kube_api import KubeAPI
from waygate.certs.kube_bundle import BUNDLE_KEY, BundlePublisher
from waygate.core.backoff import Backoff


@pytest.fixture
def standin():
    with StandIn() as api:
        yield api


@pytest.fixture
async def publisher(standin):
    api = KubeAPI(client.ApiClient(standin.configuration()))
    pub = BundlePublisher(
        api, "waygate", "waygate-trust-bundle", backoff=Backoff(initial=0.05, maximum=0.1)
    )
    task = asyncio.create_task(pub.run())
    yield pub
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def stored(standin):
    try:
        obj = standin.get("v1", "ConfigMap", "waygate-trust-bundle", namespace="waygate")
    except ApiError:
        return None
    return obj["data"][BUNDLE_KEY]


async def test_creates_then_replaces_with_the_newest_bundle(standin, publisher):
    publisher.publish("OLD\n")
    await until(lambda: stored(standin) == "OLD\n")
    publisher.publish("OLD\nNEW\n")
    await until(lambda: stored(standin) == "OLD\nNEW\n")
    obj = standin.get("v1", "ConfigMap", "waygate-trust-bundle", namespace="waygate")
    assert obj["metadata"]["labels"]["app.kubernetes.io/part-of"] == "waygate"


async def test_an_unchanged_bundle_is_not_rewritten(standin, publisher):
    publisher.publish("SAME\n")
    await until(lambda: publisher.published == "SAME\n")
    version = standin.resource_version
    publisher.published = (
        None  # as after a restart: it reads, sees the same content, writes nothing
    )
    publisher.publish("SAME\n")
    await until(lambda: publisher.published == "SAME\n")
    assert standin.resource_version == version


async def test_a_hand_edit_is_corrected_by_the_next_change(standin, publisher):
    publisher.publish("ONE\n")
    await until(lambda: stored(standin) == "ONE\n")
    obj = standin.get("v1", "ConfigMap", "waygate-trust-bundle", namespace="waygate")
    obj["data"][BUNDLE_KEY] = "tampered"
    obj["data"]["extra.pem"] = "someone else's"
    obj["metadata"]["labels"]["team"] = "platform"
    standin.replace(obj)
    publisher.publish("TWO\n")
    await until(lambda: stored(standin) == "TWO\n")
    obj = standin.get("v1", "ConfigMap", "waygate-trust-bundle", namespace="waygate")
    assert obj["data"]["extra.pem"] == "someone else's"
    assert obj["metadata"]["labels"]["team"] == "platform"


async def test_an_unavailable_api_is_retried_until_it_works(standin, publisher):
    standin.unavailable = True
    publisher.publish("LATER\n")

    def attempts() -> int:
        return sum("/configmaps" in r.path for r in standin.requests)

    await until(lambda: attempts() >= 3)  # refused, and tried again with backoff
    assert stored(standin) is None and publisher.published is None
    standin.unavailable = False
    await until(lambda: stored(standin) == "LATER\n")
