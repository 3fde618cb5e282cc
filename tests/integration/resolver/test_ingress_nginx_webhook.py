"""The ingress-nginx ValidatingAdmissionWebhook: AdmissionReview in, the same verdicts out.

A real HTTPS listener (WebhookServer, a self-signed certificate) and a real client
(http.client over ssl). CVE-2025-1974 (IngressNightmare) was an AdmissionReview
sent straight to ingress-nginx's webhook whose Ingress injected `ssl_engine` with
a path under /proc; the webhook rendered and tested it. Here the same review is
denied with the reason, and nothing is rendered or loaded.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import ssl
import tempfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio

from tests.support.pki import self_signed
from waygate.resolver.ingress_nginx.config import IngressNginx
from waygate.resolver.ingress_nginx.webhook import ReviewError, WebhookServer, review

P = "nginx.ingress.kubernetes.io/"

# The payloads published with CVE-2025-1974's proofs of concept: an AdmissionReview
# whose Ingress injects a directive loading a shared object from /proc/PID/fd/FD.
CVE_2025_1974_AUTH_URL = "http://example.com/#;}}}\n\nssl_engine /proc/25/fd/14;\n\n"
CVE_2025_1974_MATCH_CN = "CN=abc #(\n){}\n }}\nssl_engine ../../../../../../proc/22/fd/45;\n#"


def admission_review(
    annotations: dict[str, str], *, kind: str = "Ingress", cls: str = "nginx"
) -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "3babc164-2b11-4c9c-976a-52f477c63e35",
            "kind": {"group": "networking.k8s.io", "version": "v1", "kind": kind},
            "resource": {"group": "networking.k8s.io", "version": "v1", "resource": "ingresses"},
            "operation": "CREATE",
            "namespace": "default",
            "object": {
                "apiVersion": "networking.k8s.io/v1",
                "kind": kind,
                "metadata": {"name": "poc", "annotations": annotations},
                "spec": {
                    "ingressClassName": cls,
                    "rules": [
                        {
                            "host": "poc.example.com",
                            "http": {
                                "paths": [
                                    {
                                        "path": "/",
                                        "pathType": "Prefix",
                                        "backend": {
                                            "service": {"name": "web", "port": {"number": 80}}
                                        },
                                    }
                                ]
                            },
                        }
                    ],
                },
            },
        },
    }


def no_objects(kind: str) -> dict:
    return {}


def answer(body: dict[str, Any]) -> dict[str, Any]:
    return review(json.dumps(body).encode(), IngressNginx(), no_objects)["response"]


@pytest.mark.parametrize(
    "annotations",
    [
        {P + "auth-url": CVE_2025_1974_AUTH_URL},
        {P + "auth-tls-match-cn": CVE_2025_1974_MATCH_CN, P + "auth-tls-secret": "kube-system/x"},
    ],
    ids=["auth-url", "auth-tls-match-cn"],
)
def test_cve_2025_1974_reviews_are_denied_with_the_reason(annotations):
    response = answer(admission_review(annotations))
    assert response["allowed"] is False
    assert response["uid"] == "3babc164-2b11-4c9c-976a-52f477c63e35"
    assert response["status"]["code"] == 403
    assert "InvalidAnnotation" in response["status"]["message"]
    assert "Ingress default/poc" in response["status"]["message"]


def test_access_annotation_denied_differences_warned_others_admitted():
    response = answer(admission_review({P + "enable-modsecurity": "true"}))
    assert response["allowed"] is False and "UnsupportedAnnotation" in response["status"]["message"]
    response = answer(admission_review({P + "fastcgi-index": "index.php"}))
    assert response["allowed"] is True
    assert any(w.startswith("fastcgi-index: not-honoured") for w in response["warnings"])
    response = answer(admission_review({P + "custom-http-errors": "404,503"}))
    assert response["allowed"] is True
    assert any(
        w.startswith("custom-http-errors: honoured-with-difference") for w in response["warnings"]
    )
    response = answer(admission_review({P + "upstream-vhost": "internal"}))
    assert response == {"uid": "3babc164-2b11-4c9c-976a-52f477c63e35", "allowed": True}
    # Not ours: another class, another kind.
    assert answer(admission_review({P + "auth-url": "x\n"}, cls="other"))["allowed"] is True
    assert answer(admission_review({}, kind="ConfigMap"))["allowed"] is True


def test_what_is_not_an_admission_review_is_a_review_error():
    for body in (b"not json", b"[]", b'{"kind": "AdmissionReview", "apiVersion": "v1beta1"}'):
        with pytest.raises(ReviewError):
            review(body, IngressNginx(), no_objects)


@pytest_asyncio.fixture
async def webhook() -> AsyncIterator[tuple[int, ssl.SSLContext]]:
    cert, key = self_signed("webhook.example.test")
    with tempfile.TemporaryDirectory() as temp:
        (Path(temp) / "c.pem").write_text(cert)
        (Path(temp) / "k.pem").write_text(key)
        server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
        server_context.load_cert_chain(Path(temp) / "c.pem", Path(temp) / "k.pem")
        client_context = ssl.create_default_context(cafile=str(Path(temp) / "c.pem"))
    server = WebhookServer(IngressNginx(), no_objects, server_context, head_timeout=1.0)
    port = await server.start("127.0.0.1", 0)
    try:
        yield port, client_context
    finally:
        await server.stop()


def post(port: int, context: ssl.SSLContext, path: str, body: bytes, method: str = "POST"):
    connection = http.client.HTTPSConnection("127.0.0.1", port, context=_named(context), timeout=5)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, response.read()
    finally:
        connection.close()


def _named(context: ssl.SSLContext) -> ssl.SSLContext:
    context.check_hostname = False  # the certificate names webhook.example.test
    return context


async def test_the_https_listener_answers_reviews_and_refuses_the_rest(webhook) -> None:
    port, context = webhook
    body = json.dumps(admission_review({P + "auth-url": CVE_2025_1974_AUTH_URL})).encode()
    status, data = await asyncio.to_thread(post, port, context, "/validate", body)
    assert status == 200
    document = json.loads(data)
    assert document["kind"] == "AdmissionReview" and document["response"]["allowed"] is False
    status, _ = await asyncio.to_thread(post, port, context, "/elsewhere", body)
    assert status == 404
    status, _ = await asyncio.to_thread(post, port, context, "/validate", b"{}", "PUT")
    assert status == 405
    status, data = await asyncio.to_thread(post, port, context, "/validate", b"nope")
    assert status == 400 and b"not JSON" in data


async def test_a_slow_head_is_cut_off(webhook) -> None:
    port, context = webhook
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=_named(context), server_hostname="webhook.example.test"
    )
    writer.write(b"POST /validate HTTP/1.1\r\n")
    data = await asyncio.wait_for(reader.read(), 5)
    assert data.startswith(b"HTTP/1.1 400")
    writer.close()


@pytest.mark.parametrize(
    "mangle",
    [
        lambda obj: obj.update(metadata=[]),
        lambda obj: obj["metadata"].update(annotations=["x"]),
        lambda obj: obj.update(spec=[]),
        lambda obj: obj["spec"].update(rules="x"),
        lambda obj: obj["spec"]["rules"][0].update(http=[]),
        lambda obj: obj["spec"]["rules"][0]["http"].update(paths=[None, 3]),
        lambda obj: obj["spec"].update(ingressClassName=7),
        lambda obj: obj["spec"]["rules"][0].update(host="bad host\n"),
        lambda obj: obj["metadata"].update(annotations={P + "use-regex": None}),
    ],
)
def test_a_malformed_object_is_an_answer_or_a_review_error_never_a_crash(mangle):
    body = admission_review({})
    mangle(body["request"]["object"])
    try:
        response = review(json.dumps(body).encode(), IngressNginx(), no_objects)["response"]
    except ReviewError:
        return
    assert response["uid"] and isinstance(response["allowed"], bool)
