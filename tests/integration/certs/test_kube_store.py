"""SecretCAStore against a STAND-IN Kubernetes API server (none can run here).

`tests.support.kubeapi` serves real HTTP with resourceVersion preconditions
(409 on a stale replace, 409 AlreadyExists on create); the store talks to it
through the official `kubernetes` client.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator

import pytest
from kubernetes import client

from tests.support.kubeapi import KubeAPI as StandInAPI
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.kube_api import KubeAPI
from waygate.certs.kube_store import SecretCAStore, parse_secret_reference
from waygate.core.errors import FailedPrecondition, Unavailable

FILES = {
    "ca-1.key.pem": b"-----BEGIN PRIVATE KEY-----\nkey\n-----END PRIVATE KEY-----\n",
    "ca-1.cert.pem": b"-----BEGIN CERTIFICATE-----\ncert\n-----END CERTIFICATE-----\n",
    "state.json": b'{"format": 1}\n',
}


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        yield api


def store(standin: StandInAPI, configuration: client.Configuration | None = None) -> SecretCAStore:
    api = KubeAPI(client.ApiClient(configuration or standin.configuration()), timeout=5.0)
    return SecretCAStore(api, "waygate", "certs-ca")


def stored_secret(standin: StandInAPI) -> dict:
    return standin.get("v1", "Secret", "certs-ca", namespace="waygate")


def test_nothing_stored_yet_loads_as_none(standin: StandInAPI) -> None:
    assert store(standin).load() is None


def test_save_creates_an_opaque_secret_that_loads_back_byte_for_byte(
    standin: StandInAPI,
) -> None:
    first = store(standin)
    assert first.load() is None
    first.save(FILES)

    secret = stored_secret(standin)
    assert secret["type"] == "Opaque"
    assert secret["metadata"]["labels"]["app.kubernetes.io/component"] == "certs"
    assert {k: base64.b64decode(v) for k, v in secret["data"].items()} == FILES
    assert store(standin).load() == FILES
    assert first.description == "secret waygate/certs-ca"


def test_save_replaces_the_whole_set(standin: StandInAPI) -> None:
    ca = store(standin)
    ca.load()
    ca.save(FILES)
    ca.save({"state.json": b"{}"})  # the same process saves again: no conflict
    assert store(standin).load() == {"state.json": b"{}"}


def test_a_concurrent_replace_is_a_conflict_and_overwrites_nothing(
    standin: StandInAPI,
) -> None:
    store(standin).save(FILES)
    replica_a, replica_b = store(standin), store(standin)
    assert replica_a.load() == FILES
    assert replica_b.load() == FILES
    replica_a.save({**FILES, "state.json": b'{"by": "a"}'})

    with pytest.raises(FailedPrecondition, match="changed by another writer"):
        replica_b.save({**FILES, "state.json": b'{"by": "b"}'})
    assert store(standin).load() == {**FILES, "state.json": b'{"by": "a"}'}


def test_a_concurrent_first_save_is_a_conflict_and_overwrites_nothing(
    standin: StandInAPI,
) -> None:
    replica_a, replica_b = store(standin), store(standin)
    assert replica_a.load() is None
    assert replica_b.load() is None
    replica_a.save(FILES)
    with pytest.raises(FailedPrecondition, match="created by another writer"):
        replica_b.save({"state.json": b"{}"})
    assert store(standin).load() == FILES


def test_an_empty_secret_made_ahead_of_time_is_filled_and_keeps_its_metadata(
    standin: StandInAPI,
) -> None:
    standin.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": {
                "name": "certs-ca",
                "namespace": "waygate",
                "labels": {"team": "platform"},
                "annotations": {"note": "made by kustomize"},
            },
        }
    )
    ca = store(standin)
    assert ca.load() is None
    ca.save(FILES)
    metadata = stored_secret(standin)["metadata"]
    assert metadata["labels"]["team"] == "platform"
    assert metadata["annotations"] == {"note": "made by kustomize"}
    assert store(standin).load() == FILES


def test_a_secret_of_another_type_is_refused(standin: StandInAPI) -> None:
    standin.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {"name": "certs-ca", "namespace": "waygate"},
            "data": {"tls.crt": "", "tls.key": ""},
        }
    )
    with pytest.raises(FailedPrecondition, match="not Opaque"):
        store(standin).load()


def test_forbidden_access_names_the_missing_permission(standin: StandInAPI) -> None:
    without_token = standin.configuration()
    standin.bearer_token = "only-this-one"
    with pytest.raises(FailedPrecondition, match="secrets get/create/update"):
        store(standin, without_token).load()


def test_an_unreachable_api_server_is_unavailable_not_absent(standin: StandInAPI) -> None:
    configuration = standin.configuration()
    standin.stop()
    with pytest.raises(Unavailable, match="cannot read CA secret waygate/certs-ca"):
        store(standin, configuration).load()


def test_authority_creates_its_ca_in_the_secret_and_finds_it_again(
    standin: StandInAPI,
) -> None:
    config = AuthorityConfig(trust_domain="cluster.test")
    created = Authority.open(store(standin), config)
    reopened = Authority.open(store(standin), config)
    assert reopened.active_authority().fingerprint == created.active_authority().fingerprint
    keys = [k for k in stored_secret(standin)["data"] if "key" in k]
    assert keys, "the CA key lives in the Secret"


@pytest.mark.parametrize(
    ("text", "expected"),
    [("waygate/certs-ca", ("waygate", "certs-ca")), (" a/b ", ("a", "b"))],
)
def test_secret_reference_parses(text: str, expected: tuple[str, str]) -> None:
    assert parse_secret_reference(text) == expected


@pytest.mark.parametrize("text", ["certs-ca", "/x", "x/", "a/b/c", ""])
def test_bad_secret_reference_is_refused(text: str) -> None:
    with pytest.raises(ValueError, match="NAMESPACE/NAME"):
        parse_secret_reference(text)


class Leading:
    identity = "replica-a"

    def is_leader(self) -> bool:
        return True

    def leader_description(self) -> str:
        return "replica-a"


def _state(*bounds: tuple[str, str], version: int) -> dict[str, bytes]:
    import json

    entries = [{"name": name, "leaf_bound": bound} for name, bound in bounds]
    files = {f"{name}.cert.pem": b"cert" for name, _ in bounds}
    files["state.json"] = json.dumps({"version": version, "authorities": entries}).encode()
    return files


def test_a_transition_written_behind_never_lands_after_a_newer_save(
    standin: StandInAPI,
) -> None:
    """A transition waits to be written behind; a new CA is saved meanwhile: the
    Secret ends with the new CA, never with the older transition on top of it."""
    import threading

    api = KubeAPI(client.ApiClient(standin.configuration()), timeout=5.0)
    ca = SecretCAStore(api, "waygate", "certs-ca", writer=Leading())
    ca.load()
    first = _state(("ca-1", "2026-03-02T12:00:00+00:00"), version=1)
    ca.save(first)  # nothing stored: a new CA, written at once
    transition = _state(("ca-1", "2026-03-02T12:00:00+00:00"), version=2)
    new_ca = _state(
        ("ca-1", "2026-03-02T12:00:00+00:00"), ("ca-2", "2026-03-02T12:00:00+00:00"), version=3
    )
    with ca._write_lock:  # the write-behind thread waits for it: its write is pending
        ca.save(transition)
        behind = [t for t in threading.enumerate() if t.name == "ca-write-behind"]
        ca.save(new_ca)
    for thread in behind:
        thread.join(5)
    assert {k: base64.b64decode(v) for k, v in stored_secret(standin)["data"].items()} == new_ca
