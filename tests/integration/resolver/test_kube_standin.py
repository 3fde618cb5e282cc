"""The stand-in Kubernetes API server (tests/support/kubeapi.py) behaves like the real one
for what the official client and Waygate's sources rely on. It is a STAND-IN: no real API
server can run on these machines."""

from __future__ import annotations

import pytest
from kubernetes import client

from tests.support.kubeapi import KubeAPI, iter_lines


@pytest.fixture
def api():
    with KubeAPI(history=50, default_watch_timeout=10) as server:
        yield server


@pytest.fixture
def core(api):
    with client.ApiClient(api.configuration()) as api_client:
        yield client.CoreV1Api(api_client)


def service(name: str, namespace: str = "default", labels: dict | None = None) -> dict:
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": name, "namespace": namespace, "labels": labels or {}},
        "spec": {"ports": [{"port": 80}]},
    }


def watch_events(core, *, stop_after: int, **kwargs) -> list[dict]:
    resp = core.list_namespaced_service(
        "default", watch=True, _preload_content=False, _request_timeout=5, **kwargs
    )
    events = []
    try:
        for event in iter_lines(resp.stream(decode_content=False)):
            events.append(event)
            if len(events) >= stop_after:
                break
    finally:
        resp.release_conn()
    return events


def test_crud_through_the_official_client(api, core):
    created = core.create_namespaced_service("default", service("a"))
    assert created.metadata.resource_version and created.metadata.uid
    with pytest.raises(client.ApiException) as exc:
        core.create_namespaced_service("default", service("a"))
    assert exc.value.status == 409
    patched = core.patch_namespaced_service("a", "default", {"metadata": {"labels": {"x": "1"}}})
    assert patched.metadata.labels == {"x": "1"}
    assert int(patched.metadata.resource_version) > int(created.metadata.resource_version)
    stale = service("a")
    stale["metadata"]["resourceVersion"] = created.metadata.resource_version
    with pytest.raises(client.ApiException) as exc:
        core.replace_namespaced_service("a", "default", stale)
    assert exc.value.status == 409
    listed = core.list_namespaced_service("default", label_selector="x=1")
    assert [s.metadata.name for s in listed.items] == ["a"]
    assert core.list_namespaced_service("default", label_selector="x=2").items == []
    assert [
        s.metadata.name
        for s in core.list_service_for_all_namespaces(field_selector="metadata.name=a").items
    ] == ["a"]
    core.delete_namespaced_service("a", "default")
    with pytest.raises(client.ApiException) as exc:
        core.read_namespaced_service("a", "default")
    assert exc.value.status == 404


def test_watch_replays_from_a_resource_version_and_answers_410_when_too_old(api, core):
    api.create(service("a"))
    since = api.resource_version
    api.create(service("b"))
    api.delete("v1", "Service", "a", "default")
    events = watch_events(core, stop_after=2, resource_version=str(since), timeout_seconds=5)
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in events] == [
        ("ADDED", "b"),
        ("DELETED", "a"),
    ]
    api.expire_history()
    events = watch_events(core, stop_after=1, resource_version=str(since), timeout_seconds=5)
    assert events[0]["type"] == "ERROR" and events[0]["object"]["code"] == 410


def test_watch_from_zero_lists_then_follows_and_honours_selectors(api, core):
    api.create(service("a", labels={"app": "x"}))
    api.create(service("b", labels={"app": "y"}))
    resp = core.list_namespaced_service(
        "default",
        watch=True,
        label_selector="app=x",
        timeout_seconds=5,
        _preload_content=False,
        _request_timeout=5,
    )
    events = iter_lines(resp.stream(decode_content=False))
    try:
        first = next(events)
        assert (first["type"], first["object"]["metadata"]["name"]) == ("ADDED", "a")
        relabelled = service("a", labels={"app": "z"})
        api.replace(relabelled)  # leaves the selector: the watcher sees DELETED
        second = next(events)
        assert (second["type"], second["object"]["metadata"]["name"]) == ("DELETED", "a")
    finally:
        resp.release_conn()


def test_subresources_and_token_review(api):
    api.token_reviewer = lambda token, audiences: (
        {"username": "system:serviceaccount:ns:sa", "uid": "1", "groups": ["g"]}
        if token == "good"
        else None
    )
    with client.ApiClient(api.configuration()) as api_client:
        certificates = client.CertificatesV1Api(api_client)
        csr = certificates.create_certificate_signing_request(
            {
                "apiVersion": "certificates.k8s.io/v1",
                "kind": "CertificateSigningRequest",
                "metadata": {"name": "c"},
                "spec": {
                    "request": "cmVx",
                    "signerName": "waygate.io/x",
                    "usages": ["digital signature"],
                },
            }
        )
        body = client.V1CertificateSigningRequest(
            metadata=csr.metadata,
            spec=csr.spec,
            status=client.V1CertificateSigningRequestStatus(
                conditions=[
                    client.V1CertificateSigningRequestCondition(
                        type="Approved", status="True", reason="r"
                    )
                ]
            ),
        )
        body.spec.signer_name = "changed/by-approval"  # must be ignored: only conditions change
        approved = certificates.replace_certificate_signing_request_approval("c", body)
        assert approved.status.conditions[0].type == "Approved"
        assert approved.spec.signer_name == "waygate.io/x"
        listed = certificates.list_certificate_signing_request(
            field_selector="spec.signerName=waygate.io/x"
        )
        assert len(listed.items) == 1
        auth = client.AuthenticationV1Api(api_client)
        good = auth.create_token_review({"spec": {"token": "good", "audiences": ["waygate"]}})
        assert (
            good.status.authenticated and good.status.user.username == "system:serviceaccount:ns:sa"
        )
        bad = auth.create_token_review({"spec": {"token": "bad"}})
        assert not bad.status.authenticated


def test_drop_watches_cuts_the_stream(api, core):
    api.create(service("a"))
    resp = core.list_namespaced_service(
        "default", watch=True, timeout_seconds=30, _preload_content=False, _request_timeout=5
    )
    events = iter_lines(resp.stream(decode_content=False))
    assert next(events)["type"] == "ADDED"
    assert api.watchers("Service") == 1
    api.drop_watches()
    with pytest.raises(Exception):  # noqa: B017 - urllib3 reports a cut stream in several ways
        for _ in events:
            pass
    resp.release_conn()
    assert api.watchers("Service") == 0
    assert api.requests[-1].watch
