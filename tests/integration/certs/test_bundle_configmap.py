"""The trust bundle published to a ConfigMap, against a STAND-IN Kubernetes API server.

No Kubernetes API server can run here: `tests.support.kubeapi` serves real
HTTP on 127.0.0.1 to the official client. The publisher creates the
ConfigMap, follows a CA rotation, keeps what others put there, and retries
while the API refuses.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
from collections.abc import Iterator
from pathlib import Path

import pytest
from kubernetes import client

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.unit.certs.helpers import open_authority
from waygate.certs.bundle_configmap import ConfigMapBundlePublisher
from waygate.certs.kube_api import KubeAPI
from waygate.core.backoff import Backoff

NAMESPACE, NAME = "waygate", "waygate-trust-bundle"


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        yield api


def published(standin: StandInAPI) -> dict:
    return standin.get("v1", "ConfigMap", NAME, namespace=NAMESPACE)


async def until(condition, timeout: float = 10.0) -> None:  # type: ignore[no-untyped-def]
    async with asyncio.timeout(timeout):
        while not condition():
            await asyncio.sleep(0.02)


def exists(standin: StandInAPI) -> bool:
    try:
        published(standin)
    except Exception:
        return False
    return True


@contextlib.asynccontextmanager
async def running(publisher: ConfigMapBundlePublisher):  # type: ignore[no-untyped-def]
    task = asyncio.ensure_future(publisher.run())
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_publishes_and_follows_rotation_keeping_foreign_keys(
    standin: StandInAPI, tmp_path: Path
) -> None:
    authority = open_authority(tmp_path / "ca")
    api = KubeAPI(client.ApiClient(standin.configuration()), timeout=5.0)
    publisher = ConfigMapBundlePublisher(api, NAMESPACE, NAME)
    authority.add_listener(publisher.changed)
    publisher.changed(authority.trust_bundle())
    async with running(publisher):
        await until(lambda: exists(standin))
        first = published(standin)
        assert first["data"]["ca.pem"] == authority.trust_bundle().pem
        assert first["metadata"]["labels"]["app.kubernetes.io/component"] == "certs"

        # Someone else annotates the ConfigMap and adds a key: both survive.
        first["metadata"].setdefault("annotations", {})["team"] = "platform"
        first["data"]["extra.pem"] = "not ours"
        standin.replace({"apiVersion": "v1", "kind": "ConfigMap", **first})

        authority.rotate(propagation_delay=dt.timedelta(hours=1))
        await until(lambda: published(standin)["data"]["ca.pem"].count("BEGIN CERTIFICATE") == 2)
        after = published(standin)
        assert after["data"]["ca.pem"] == authority.trust_bundle().pem
        assert after["data"]["extra.pem"] == "not ours"
        assert after["metadata"]["annotations"]["team"] == "platform"


async def test_retries_while_the_api_refuses(standin: StandInAPI, tmp_path: Path) -> None:
    authority = open_authority(tmp_path / "ca")
    standin.bearer_token = "the-right-token"
    wrong = standin.configuration()
    wrong.api_key = {"authorization": "wrong-token"}
    api = KubeAPI(client.ApiClient(wrong), timeout=5.0)
    publisher = ConfigMapBundlePublisher(
        api, NAMESPACE, NAME, backoff=Backoff(initial=0.05, maximum=0.05)
    )
    publisher.changed(authority.trust_bundle())
    async with running(publisher):
        await asyncio.sleep(0.3)  # several refused attempts
        assert not exists(standin) and publisher.published is None
        wrong.api_key = {"authorization": "the-right-token"}
        await until(lambda: exists(standin))
    assert published(standin)["data"]["ca.pem"] == authority.trust_bundle().pem
