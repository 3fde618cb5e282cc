"""ingress-nginx's proxy-ssl-secret (and proxy-ssl-verify, -name, -server-name) and
backend-protocol AUTO_HTTP -> the route's reencrypt RouteTLS and
upstream_scheme_from_client (waygate.resolver.ingress_nginx.proxyssl, .annotations).

ingress-nginx's rules (internal/ingress/annotations/proxyssl/main.go, the store's
getPemCertificate in internal/ingress/controller/store/backend_ssl.go, controller
v1.15.1): the Secret is `namespace/name` of the Ingress's namespace, with tls.crt and
tls.key (the client certificate) and/or ca.crt (the CAs the backend is verified
against); a Secret it cannot read denies the location (503): here the Ingress is
refused, naming why. The proxy's side: tests/integration/proxy/test_backend_client_tls.py.
"""

from __future__ import annotations

import base64
from typing import Any

import pytest

from tests.support.pki import LocalCA
from tests.unit.resolver.test_ingress_nginx import P, by_ingress, ingress, refusal
from tests.unit.resolver.test_ingress_nginx_access import routes, secret
from waygate.resolver import convert
from waygate.resolver.model import Route, TLSTermination

BACKEND_CA = LocalCA(name="Backend CA")
CLIENTS = LocalCA(name="Ingress client CA")
CLIENT_CERT, CLIENT_KEY = CLIENTS.issue(common_name="ingress", client_only=True)
OTHER_CERT, OTHER_KEY = CLIENTS.issue(common_name="other", client_only=True)


def ssl_secret(name: str = "backend-mtls", namespace: str = "default", **data: str) -> Any:
    return secret(name, data, namespace)


def full_secret(name: str = "backend-mtls") -> Any:
    return ssl_secret(
        name,
        **{
            "tls.crt": CLIENT_CERT.decode(),
            "tls.key": CLIENT_KEY.decode(),
            "ca.crt": BACKEND_CA.pem.decode(),
        },
    )


def https(**extra: str) -> dict[str, str]:
    return {P + "backend-protocol": "HTTPS", **{P + k: v for k, v in extra.items()}}


def verdicts(route: Route) -> dict[str, str]:
    return {line.split(":")[0]: line for line in route.ingress_verdicts}


def only(found: list[Route], name: str, port: int = 80) -> Route:
    [route] = [r for r in by_ingress(found, name) if r.listener_port == port]
    assert route.ingress_refusal is None, route.ingress_refusal
    return route


def test_the_secret_gives_the_backend_tls_its_client_certificate_and_ca():
    annotations = https(
        **{
            "proxy-ssl-secret": "default/backend-mtls",
            "proxy-ssl-verify": "on",
            "proxy-ssl-name": "api.internal",
            "proxy-ssl-server-name": "on",
        }
    )
    found = routes(full_secret(), ingress("mtls", annotations))
    route = only(found, "mtls")
    tls = route.tls
    assert tls is not None and tls.termination is TLSTermination.REENCRYPT
    assert tls.backend_client_certificate == CLIENT_CERT.decode()
    assert tls.backend_client_key == CLIENT_KEY.decode()
    # ca.crt replaces the system CAs.
    assert tls.destination_ca_certificate == BACKEND_CA.pem.decode()
    assert tls.destination_system_ca is False
    assert tls.destination_server_name == "api.internal"
    assert route.upstream_scheme_from_client is False
    # Every proxy-ssl-* and backend-protocol honoured exactly: nothing to report.
    assert route.ingress_verdicts == ()


def test_the_key_is_redacted_where_tls_key_is():
    found = routes(full_secret(), ingress("mtls", https(**{"proxy-ssl-secret": "backend-mtls"})))
    route = only(found, "mtls")
    shown = convert.route_from_proto(convert.route_to_proto(route, with_key=False))
    assert shown.tls is not None
    assert shown.tls.backend_client_certificate == CLIENT_CERT.decode()
    assert shown.tls.backend_client_key == ""


def test_verification_differences_are_named():
    # proxy-ssl-verify off (ingress-nginx's default): nginx would not verify at all.
    found = routes(full_secret(), ingress("off", https(**{"proxy-ssl-secret": "backend-mtls"})))
    lines = verdicts(only(found, "off"))
    assert (
        "Secret backend-mtls's ca.crt though proxy-ssl-verify is off" in lines["backend-protocol"]
    )
    # Verified, but without proxy-ssl-name the name is SERVICE.NAMESPACE.svc.
    annotations = https(**{"proxy-ssl-secret": "backend-mtls", "proxy-ssl-verify": "on"})
    lines = verdicts(only(routes(full_secret(), ingress("on", annotations)), "on"))
    assert "SERVICE.NAMESPACE.svc" in lines["backend-protocol"]
    assert "proxy-ssl-verify" not in lines
    # SNI is always sent.
    annotations = https(**{"proxy-ssl-server-name": "off"})
    lines = verdicts(only(routes(ingress("sni", annotations)), "sni"))
    assert "SNI is always sent" in lines["proxy-ssl-server-name"]


def test_a_key_pair_without_ca_crt_is_presented_and_the_system_cas_verify():
    keypair = ssl_secret(**{"tls.crt": CLIENT_CERT.decode(), "tls.key": CLIENT_KEY.decode()})
    found = routes(keypair, ingress("pair", https(**{"proxy-ssl-secret": "backend-mtls"})))
    route = only(found, "pair")
    assert route.tls is not None
    assert route.tls.backend_client_certificate == CLIENT_CERT.decode()
    assert route.tls.destination_system_ca is True and not route.tls.destination_ca_certificate
    # ingress-nginx presents the certificate only when the Secret also has ca.crt.
    assert "presents none" in verdicts(route)["proxy-ssl-secret"]


def test_ca_crt_alone_verifies_without_a_client_certificate():
    only_ca = ssl_secret(**{"ca.crt": BACKEND_CA.pem.decode()})
    annotations = https(
        **{"proxy-ssl-secret": "backend-mtls", "proxy-ssl-verify": "on", "proxy-ssl-name": "a.b"}
    )
    route = only(routes(only_ca, ingress("ca", annotations)), "ca")
    assert route.tls is not None
    assert route.tls.destination_ca_certificate == BACKEND_CA.pem.decode()
    assert (route.tls.backend_client_certificate, route.tls.backend_client_key) == ("", "")
    assert route.ingress_verdicts == ()


def test_without_an_https_backend_a_valid_secret_does_nothing():
    # proxyssl.go's Ingresses: an HTTP backend, the Secret valid: served as it is.
    found = routes(full_secret(), ingress("plain", {P + "proxy-ssl-secret": "backend-mtls"}))
    route = only(found, "plain")
    assert route.tls is None and route.ingress_verdicts == ()


@pytest.mark.parametrize(
    "objects,reference,reason",
    [
        ((), "default/backend-mtls", "Secret default/backend-mtls not found"),
        ((full_secret(),), "other/backend-mtls", "in another namespace than the Ingress"),
        (
            (ssl_secret(**{"tls.crt": CLIENT_CERT.decode()}),),
            "backend-mtls",
            "has no tls.key",
        ),
        (
            (ssl_secret(**{"tls.crt": CLIENT_CERT.decode(), "tls.key": OTHER_KEY.decode()}),),
            "backend-mtls",
            "tls.key is not the key of tls.crt's first certificate",
        ),
        (
            (ssl_secret(**{"tls.crt": "not a certificate", "tls.key": CLIENT_KEY.decode()}),),
            "backend-mtls",
            "tls.crt is not PEM certificates",
        ),
        (
            (ssl_secret(**{"ca.crt": "-----BEGIN CERTIFICATE-----\nnope\n"}),),
            "backend-mtls",
            "ca.crt is not PEM certificates",
        ),
        ((ssl_secret(auth="user:hash"),), "backend-mtls", "neither tls.crt and tls.key nor"),
    ],
)
def test_a_secret_that_cannot_be_used_refuses_the_ingress_alone(objects, reference, reason):
    found = routes(
        *objects,
        ingress("broken", https(**{"proxy-ssl-secret": reference})),
        ingress("other", host="other.example.com"),
    )
    kind, message = refusal(found, "broken")
    assert kind == "InvalidAnnotation"
    assert reason in message and "proxy-ssl-secret" in message, message
    assert only(found, "other").ingress_refusal is None


def test_a_secret_with_bad_base64_refuses():
    broken = ssl_secret()
    broken["data"] = {"tls.crt": "%%%"}
    found = routes(broken, ingress("b64", https(**{"proxy-ssl-secret": "backend-mtls"})))
    assert "not valid base64" in refusal(found, "b64")[1]


def test_auto_http_marks_every_route_of_the_ingress():
    cert = LocalCA(name="edge").issue(dns=["app.example.com"])
    edge = {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "kubernetes.io/tls",
        "metadata": {"name": "edge", "namespace": "default"},
        "data": {
            "tls.crt": base64.b64encode(cert[0]).decode(),
            "tls.key": base64.b64encode(cert[1]).decode(),
        },
    }
    item = ingress(
        "auto",
        {P + "backend-protocol": "auto_http", P + "proxy-ssl-secret": "backend-mtls"},
        tls=True,
    )
    item["spec"]["tls"] = [{"hosts": ["app.example.com"], "secretName": "edge"}]
    found = routes(edge, full_secret(), item)
    plain, secure = only(found, "auto", 80), only(found, "auto", 443)
    for route in (plain, secure):
        # The proxy decides per request (the client's scheme); both carry the TLS to use.
        assert route.upstream_scheme_from_client is True
        assert route.tls is not None and route.tls.termination is TLSTermination.REENCRYPT
        assert route.tls.backend_client_certificate == CLIENT_CERT.decode()
    assert secure.tls is not None and secure.tls.certificate == cert[0].decode()
    line = verdicts(plain)["backend-protocol"]
    assert "HTTPS to the backend when the client came over HTTPS" in line


def test_catalogue_no_longer_lists_them_as_lacking():
    from waygate.resolver.ingress_nginx.catalogue import CATALOGUE, Verdict

    assert CATALOGUE["proxy-ssl-secret"].verdict is Verdict.HONOURED
    assert not CATALOGUE["proxy-ssl-secret"].proxy_lacks
    assert "AUTO_HTTP (per request" in CATALOGUE["backend-protocol"].note
