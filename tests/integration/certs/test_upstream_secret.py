"""An upstream authority in the --ca-secret Secret, against a STAND-IN Kubernetes API
server (none can run here): the Secret carries the intermediate, its key and the
organisation's root under cert-manager's CA Secret keys (tls.crt, tls.key, ca.crt),
as --ca-cert/--ca-key/--trust-anchor give them; certs signs with the intermediate,
publishes the root, and every store write keeps the three it did not write. Some of
the three only, or one that does not parse, is refused at start with the reason."""

from __future__ import annotations

import base64
import datetime as dt
from collections.abc import Iterator

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import serialization
from kubernetes import client

from tests.integration.certs.test_upstream_authority import DAY, OrgCA
from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.unit.certs.helpers import RESOLVER_ID, make_csr, sign
from waygate.certs.app import Settings, open_authority
from waygate.certs.kube_api import KubeAPI
from waygate.certs.kube_store import SecretCAStore
from waygate.core.errors import FailedPrecondition
from waygate.core.settings import load_settings

NOW = dt.datetime.now(dt.UTC)


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        yield api


def pem(cert: x509.Certificate) -> bytes:
    return cert.public_bytes(serialization.Encoding.PEM)


def put_secret(standin: StandInAPI, data: dict[str, bytes]) -> None:
    standin.create(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": {"name": "certs-ca", "namespace": "waygate"},
            "type": "Opaque",
            "data": {k: base64.b64encode(v).decode() for k, v in data.items()},
        }
    )


def secret_store(standin: StandInAPI) -> SecretCAStore:
    api = KubeAPI(client.ApiClient(standin.configuration()), timeout=5.0)
    return SecretCAStore(api, "waygate", "certs-ca")


def settings() -> Settings:
    return load_settings(
        Settings, flags={"ca_secret": "waygate/certs-ca", "max_leaf_lifetime": 86400.0}, env={}
    )


async def test_the_secrets_intermediate_signs_and_the_root_is_the_anchor(
    standin: StandInAPI,
) -> None:
    root = OrgCA("Example Root", NOW, 3650 * DAY)
    intermediate = OrgCA("Example Intermediate", NOW, 365 * DAY, issuer=root)
    key = intermediate.key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    given = {"tls.crt": pem(intermediate.cert), "tls.key": key, "ca.crt": pem(root.cert)}
    put_secret(standin, given)

    authority = await open_authority(settings(), secret_store(standin), None)
    csr, _ = make_csr()
    issued = sign(authority, csr, identity=RESOLVER_ID, requested_by="test")
    assert issued.leaf.issuer == intermediate.cert.subject
    assert intermediate.cert in issued.chain  # served with every leaf
    assert authority.trust_bundle().certificates == (root.cert,)  # the root is the anchor

    # certs' own state went into the Secret beside the three, which it kept as given.
    data = standin.get("v1", "Secret", "certs-ca", namespace="waygate")["data"]
    assert {k: base64.b64decode(data[k]) for k in given} == given
    assert "state.json" in data
    # A second start finds its state and the same intermediate: nothing to rotate.
    again = await open_authority(settings(), secret_store(standin), None)
    assert again.trust_bundle().certificates == (root.cert,)
    assert again.rotation_status().phase.value == "idle"


@pytest.mark.parametrize(
    ("data", "words"),
    [
        ({"tls.crt": b"x", "ca.crt": b"y"}, "without tls.key"),
        ({"tls.crt": b"not pem", "tls.key": b"k", "ca.crt": b"c"}, "not a PEM certificate"),
    ],
)
async def test_an_incomplete_or_unreadable_upstream_in_the_secret_is_refused(
    standin: StandInAPI, data: dict[str, bytes], words: str
) -> None:
    put_secret(standin, data)
    with pytest.raises(FailedPrecondition, match=words) as refused:
        await open_authority(settings(), secret_store(standin), None)
    assert "--ca-secret waygate/certs-ca" in str(refused.value)
