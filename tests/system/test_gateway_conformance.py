"""The Gateway API conformance suite's HTTPRoute core cases, against real processes.

One `waygate resolver serve --manifests DIR` and one `waygate proxy serve` for
the module; each test puts one conformance test's manifests (unchanged files of
kubernetes-sigs/gateway-api v1.6.1, see tests/support/gatewayapi) in DIR, as
the suite applies them, and asserts what the suite's Go test asserts: which
backend served each request, or the status code; the route's and Gateway's
conditions. The expected cases are transcribed from conformance/tests/*.go.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
import pytest_asyncio

from tests.support.gatewayapi import INFRA, Conformance
from tests.support.poll import until

pytestmark = [pytest.mark.system, pytest.mark.asyncio(loop_scope="module")]

V1, V2, V3 = (f"{INFRA}/infra-backend-v{n}" for n in (1, 2, 3))
WEB = "gateway-conformance-web-backend/web-backend"


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def suite(tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Conformance]:
    conformance = await Conformance(tmp_path_factory.mktemp("manifests")).start()
    try:
        yield conformance
    finally:
        await conformance.stop()


def conditions(item: dict[str, Any], parent: str = "") -> dict[str, tuple[str, str]]:
    """type -> (status, reason) of an object, or of its parent Gateway `parent` (routes)."""
    status = item["status"]
    if parent:
        (found,) = [p for p in status["parents"] if p["parentRef"]["name"] == parent]
        listed = found["conditions"]
    else:
        listed = status["conditions"]
    return {c["type"]: (c["status"], c["reason"]) for c in listed}


async def route_status(suite: Conformance, name: str, namespace: str = INFRA) -> dict[str, Any]:
    found: list[dict[str, Any]] = []

    async def present() -> bool:
        items = await suite.gateways("--kind", "HTTPRoute", "-n", namespace)
        found[:] = [i for i in items if i["metadata"]["name"] == name]
        return bool(found)

    await until(present, f"the status of HTTPRoute {namespace}/{name}", timeout=20)
    return found[0]


async def expect(suite: Conformance, cases: list[tuple[dict[str, Any], str | int]]) -> None:
    """Each (request, backend or status): the first waits for the reload, the rest are
    then asserted at once (as the suite's cases are, after the route is accepted)."""
    first, answer = cases[0]
    if isinstance(answer, str):
        await suite.eventually(**first, backend=answer)
    else:
        await suite.eventually(**first, status=answer)
    for request, answer in cases[1:]:
        response = await suite.request(**request)
        if isinstance(answer, str):
            assert (response.status, response.backend) == (200, answer), request
        else:
            assert response.status == answer, (request, response)


async def test_simple_same_namespace(suite: Conformance) -> None:
    await suite.apply("httproute-simple-same-namespace.yaml")
    await expect(suite, [({"path": "/"}, V1)])
    status = await route_status(suite, "gateway-conformance-infra-test")
    assert conditions(status, "same-namespace") == {
        "Accepted": ("True", "Accepted"),
        "ResolvedRefs": ("True", "ResolvedRefs"),
    }
    (gateway,) = [
        g
        for g in await suite.gateways("--kind", "Gateway")
        if g["metadata"]["name"] == "same-namespace"
    ]
    assert conditions(gateway)["Programmed"] == ("True", "Programmed")
    assert gateway["status"]["listeners"][0]["attachedRoutes"] == 1


async def test_matching(suite: Conformance) -> None:
    await suite.apply("httproute-matching.yaml")
    await expect(
        suite,
        [
            ({"path": "/v2"}, V2),
            ({"path": "/"}, V1),
            ({"path": "/example"}, V1),
            ({"path": "/", "headers": {"Version": "one"}}, V1),
            ({"path": "/v2/example"}, V2),
            ({"path": "/", "headers": {"Version": "two"}}, V2),
            ({"path": "/v2/"}, V2),
            ({"path": "/v2example"}, V1),
            ({"path": "/foo/v2/example"}, V1),
        ],
    )


async def test_exact_path_matching(suite: Conformance) -> None:
    await suite.apply("httproute-exact-path-matching.yaml")
    await expect(
        suite,
        [
            ({"path": "/two"}, V2),
            ({"path": "/one"}, V1),
            ({"path": "/"}, 404),
            ({"path": "/one/example"}, 404),
            ({"path": "/two/"}, 404),
            ({"path": "/Two"}, 404),
        ],
    )


async def test_header_matching(suite: Conformance) -> None:
    await suite.apply("httproute-header-matching.yaml")
    await expect(
        suite,
        [
            ({"headers": {"Color": "yellow"}}, V2),
            ({"headers": {"Version": "one"}}, V1),
            ({"headers": {"Version": "two"}}, V2),
            ({"headers": {"Version": "two", "Color": "orange"}}, V1),
            ({"headers": {"Version": "two", "Color": "blue"}}, V2),
            ({"headers": {"Color": "orange"}}, 404),
            ({"headers": {"Some-Other-Header": "one"}}, 404),
            ({"headers": {"Color": "blue"}}, V1),
            ({"headers": {"Color": "green"}}, V1),
            ({"headers": {"Color": "red"}}, V2),
            ({"headers": {"Color": "purple"}}, 404),
        ],
    )


async def test_query_param_matching(suite: Conformance) -> None:
    await suite.apply("httproute-query-param-matching.yaml")
    await expect(
        suite,
        [
            ({"path": "/?animal=hydra", "headers": {"version": "four"}}, V3),
            ({"path": "/?animal=whale"}, V1),
            ({"path": "/?animal=dolphin"}, V2),
            ({"path": "/?animal=dolphin&color=blue"}, V3),
            ({"path": "/?ANIMAL=Whale"}, V3),
            ({"path": "/?animal=whale&otherparam=irrelevant"}, V1),
            ({"path": "/?animal=dolphin&color=yellow"}, V2),
            ({"path": "/?color=blue"}, 404),
            ({"path": "/?animal=dog"}, 404),
            ({"path": "/?animal=whaledolphin"}, 404),
            ({"path": "/"}, 404),
            ({"path": "/path1?animal=whale"}, V1),
            ({"path": "/?animal=whale", "headers": {"version": "one"}}, V2),
            ({"path": "/path2?animal=whale", "headers": {"version": "two"}}, V3),
            ({"path": "/path3?animal=shark"}, V1),
            ({"path": "/path4?animal=kraken", "headers": {"version": "three"}}, V1),
            ({"path": "/?animal=shark"}, 404),
            ({"path": "/path4?animal=kraken"}, 404),
            ({"path": "/path5?animal=hydra"}, V1),
        ],
    )


async def test_method_matching(suite: Conformance) -> None:
    await suite.apply("httproute-method-matching.yaml")
    await expect(
        suite,
        [
            ({"path": "/", "method": "PATCH", "headers": {"version": "four"}}, V2),
            ({"path": "/", "method": "POST"}, V1),
            ({"path": "/", "method": "GET"}, V2),
            ({"path": "/", "method": "HEAD"}, 404),
            ({"path": "/path1", "method": "GET"}, V1),
            ({"path": "/", "method": "PUT", "headers": {"version": "one"}}, V2),
            ({"path": "/path2", "method": "POST", "headers": {"version": "two"}}, V3),
            ({"path": "/path3", "method": "PATCH"}, V1),
            ({"path": "/path4", "method": "DELETE", "headers": {"version": "three"}}, V1),
            ({"path": "/", "method": "PUT"}, 404),
            ({"path": "/path4", "method": "DELETE"}, 404),
            ({"path": "/path5", "method": "PATCH"}, V1),
        ],
    )


async def test_path_match_order(suite: Conformance) -> None:
    await suite.apply("httproute-path-match-order.yaml")
    await expect(
        suite,
        [
            ({"path": "/match/any"}, V3),
            ({"path": "/match/exact/one"}, V3),
            ({"path": "/match/exact"}, V2),
            ({"path": "/match"}, V1),
            ({"path": "/match/prefix/one/any"}, V2),
            ({"path": "/match/prefix/any"}, V1),
        ],
    )


async def test_matching_across_routes(suite: Conformance) -> None:
    await suite.apply("httproute-matching-across-routes.yaml")
    await expect(
        suite,
        [
            ({"host": "example.com", "path": "/", "headers": {"Version": "two"}}, V2),
            ({"host": "example.com", "path": "/"}, V1),
            ({"host": "example.com", "path": "/example"}, V1),
            ({"host": "example.net", "path": "/example"}, V1),
            ({"host": "example.com", "path": "/example", "headers": {"Version": "one"}}, V1),
            ({"host": "example.com", "path": "/v2"}, V2),
            ({"host": "example.net", "path": "/v2"}, V1),
            ({"host": "example.com", "path": "/v2/example"}, V2),
        ],
    )


async def test_listener_hostname_matching(suite: Conformance) -> None:
    await suite.apply("httproute-listener-hostname-matching.yaml")
    await expect(
        suite,
        [
            ({"host": "multiple.prefixes.foo.com"}, V3),
            ({"host": "bar.com"}, V1),
            ({"host": "foo.bar.com"}, V2),
            ({"host": "baz.bar.com"}, V3),
            ({"host": "boo.bar.com"}, V3),
            ({"host": "multiple.prefixes.bar.com"}, V3),
            ({"host": "foo.com"}, 404),
            ({"host": "no.matching.host"}, 404),
        ],
    )


async def test_hostname_intersection(suite: Conformance) -> None:
    await suite.apply("httproute-hostname-intersection.yaml")
    await expect(
        suite,
        [
            ({"host": "foo.bar.anotherwildcard.io", "path": "/s4"}, V1),
            ({"host": "very.specific.com", "path": "/s1"}, V1),
            ({"host": "very.specific.com:1234", "path": "/s1"}, V1),
            ({"host": "non.matching.com", "path": "/s1"}, 404),
            ({"host": "foo.wildcard.io", "path": "/s1"}, 404),
            ({"host": "foo.wildcard.io", "path": "/s2"}, V2),
            ({"host": "foo.bar.wildcard.io", "path": "/s2"}, V2),
            ({"host": "wildcard.io", "path": "/s2"}, 404),
            ({"host": "very.specific.com", "path": "/s3"}, V3),
            ({"host": "foo.specific.com", "path": "/s3"}, 404),
            ({"host": "foo.anotherwildcard.io", "path": "/s4"}, V1),
            ({"host": "anotherwildcard.io", "path": "/s4"}, 404),
        ],
    )
    status = await route_status(suite, "no-intersecting-hosts")
    accepted = conditions(status, "httproute-hostname-intersection")["Accepted"]
    assert accepted == ("False", "NoMatchingListenerHostname")


async def test_cross_namespace_and_reference_grant(suite: Conformance) -> None:
    await suite.apply("httproute-cross-namespace.yaml")
    await expect(suite, [({"path": "/"}, WEB)])
    await suite.apply("httproute-reference-grant.yaml")
    await expect(suite, [({"path": "/"}, WEB)])
    status = await route_status(suite, "reference-grant")
    assert conditions(status, "same-namespace")["ResolvedRefs"] == ("True", "ResolvedRefs")


async def test_invalid_cross_namespace_backend_ref(suite: Conformance) -> None:
    await suite.apply("httproute-invalid-cross-namespace-backend-ref.yaml")
    await expect(suite, [({"path": "/"}, 500)])
    status = await route_status(suite, "invalid-cross-namespace-backend-ref")
    assert conditions(status, "same-namespace") == {
        "Accepted": ("True", "Accepted"),
        "ResolvedRefs": ("False", "RefNotPermitted"),
    }


async def test_invalid_backend_refs_answer_500(suite: Conformance) -> None:
    await suite.apply("httproute-invalid-nonexistent-backendref.yaml")
    await expect(suite, [({"path": "/"}, 500)])
    status = await route_status(suite, "invalid-nonexistent-backend-ref")
    assert conditions(status, "same-namespace")["ResolvedRefs"] == ("False", "BackendNotFound")
    await suite.apply("httproute-invalid-backendref-unknown-kind.yaml")
    await expect(suite, [({"path": "/v2"}, 500)])
    status = await route_status(suite, "invalid-backend-ref-unknown-kind")
    assert conditions(status, "same-namespace")["ResolvedRefs"] == ("False", "InvalidKind")


async def test_weight(suite: Conformance) -> None:
    await suite.apply("httproute-weight.yaml")
    await suite.eventually("/", backend=V1)
    seen: dict[str, int] = {}
    for _ in range(100):
        response = await suite.request("/")
        seen[response.backend] = seen.get(response.backend, 0) + 1
    # 70/30 by smooth weighted round robin: exact over 100 requests; weight 0 gets none.
    assert seen == {V1: 70, V2: 30}


async def test_disallowed_kind_and_invalid_parent(suite: Conformance) -> None:
    await suite.apply("httproute-disallowed-kind.yaml")
    status = await route_status(suite, "disallowed-kind")
    assert conditions(status, "tlsroutes-only")["Accepted"] == ("False", "NotAllowedByListeners")
    await suite.apply("httproute-invalid-parentref-not-matching-section-name.yaml")
    status = await route_status(suite, "httproute-listener-not-matching-section-name")
    assert conditions(status, "same-namespace")["Accepted"] == ("False", "NoMatchingParent")


async def test_a_bad_edit_is_rejected_whole_and_the_last_good_state_keeps_serving(
    suite: Conformance,
) -> None:
    await suite.apply("httproute-simple-same-namespace.yaml")
    await expect(suite, [({"path": "/"}, V1)])
    bad = """apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: bad-regex
  namespace: gateway-conformance-infra
spec:
  parentRefs:
  - name: same-namespace
  rules:
  - matches:
    - path:
        type: RegularExpression
        value: "/(unclosed"
    backendRefs:
    - name: infra-backend-v2
      port: 8080
"""
    await suite.apply("httproute-matching.yaml", extra=bad, wait=False)
    assert suite.resolver is not None
    resolver = suite.resolver
    await until(
        lambda: any("manifests rejected" in str(e.get("msg")) for e in resolver.logs),
        "the rejection in the resolver's log",
    )
    (line,) = {str(e["msg"]) for e in resolver.logs if "manifests rejected" in str(e.get("msg"))}
    # path:line of the offending field and the reason.
    assert "10-test.yaml:" in line and "invalid regular expression" in line
    assert "spec.rules[0].matches[0].path.value" in line
    # matching.yaml would send /v2 to v2: the rejected edit changed nothing.
    response = await suite.request("/v2")
    assert response.backend == V1


# ---------------------------------------------------------------- filters


async def test_request_header_modifier(suite: Conformance) -> None:
    await suite.apply("httproute-request-header-modifier.yaml")
    await suite.eventually("/set", backend=V1)
    cases = [
        ("/set", {"Some-Other-Header": "val"}, {"X-Header-Set": "set-overwrites-values"}, []),
        (
            "/set",
            {"Some-Other-Header": "val", "X-Header-Set": "some-other-value"},
            {"Some-Other-Header": "val", "X-Header-Set": "set-overwrites-values"},
            [],
        ),
        ("/add", {"Some-Other-Header": "val"}, {"X-Header-Add": "add-appends-values"}, []),
        (
            "/add",
            {"X-Header-Add": "some-other-value"},
            {"X-Header-Add": "some-other-value,add-appends-values"},
            [],
        ),
        ("/remove", {"X-Header-Remove": "val"}, {}, ["X-Header-Remove"]),
        (
            "/multiple",
            {
                "X-Header-Set-2": "set-val-2",
                "X-Header-Add-2": "add-val-2",
                "X-Header-Remove-2": "remove-val-2",
                "Another-Header": "another-header-val",
            },
            {
                "X-Header-Set-1": "header-set-1",
                "X-Header-Set-2": "header-set-2",
                "X-Header-Add-1": "header-add-1",
                "X-Header-Add-2": "add-val-2,header-add-2",
                "X-Header-Add-3": "header-add-3",
                "Another-Header": "another-header-val",
            },
            ["X-Header-Remove-1", "X-Header-Remove-2"],
        ),
    ]
    for path, sent, expected, absent in cases:
        response = await suite.request(path, headers=sent)
        assert response.backend == V1
        for name, value in expected.items():
            assert response.request_header(name) == value, (path, name)
        for name in absent:
            assert response.request_header(name) is None, (path, name)


async def test_response_header_modifier(suite: Conformance) -> None:
    await suite.apply("httproute-response-header-modifier.yaml")
    await suite.eventually("/set", backend=V1)
    echo = "X-Echo-Set-Header"
    response = await suite.request(
        "/set", headers={echo: "Some-Other-Header:val,X-Header-Set:some-other-value"}
    )
    assert response.response_header("Some-Other-Header") == "val"
    assert response.response_header("X-Header-Set") == "set-overwrites-values"
    response = await suite.request("/add", headers={echo: "X-Header-Add:header-val-1"})
    assert response.response_header("X-Header-Add") == "header-val-1,add-appends-values"
    response = await suite.request("/remove", headers={echo: "X-Header-Remove:val"})
    assert response.response_header("X-Header-Remove") is None


async def test_redirects(suite: Conformance) -> None:
    await suite.apply(
        "httproute-redirect-host-and-status.yaml",
        "httproute-redirect-path.yaml",
        "httproute-redirect-port.yaml",
        "httproute-redirect-scheme.yaml",
    )
    await suite.eventually("/hostname-redirect", status=302)
    expected = {
        "/hostname-redirect": (302, "http://example.org/hostname-redirect"),
        "/host-and-status": (301, "http://example.org/host-and-status"),
        "/original-prefix/lemon": (302, "http://example.com/replacement-prefix/lemon"),
        "/full/path/original": (302, "http://example.com/full-path-replacement"),
        "/port": (302, "http://example.com:8083/port"),
        "/port-and-host": (302, "http://example.org:8083/port-and-host"),
        "/port-and-status": (301, "http://example.com:8083/port-and-status"),
        "/scheme": (302, "https://example.com/scheme"),
    }
    for path, (status, location) in expected.items():
        response = await suite.request(path)
        assert (response.status, response.header("Location")) == (status, location), path


async def test_url_rewrites(suite: Conformance) -> None:
    await suite.apply("httproute-rewrite-path.yaml", "httproute-rewrite-host.yaml")
    await suite.eventually("/prefix/one/two", backend=V1)
    for sent, seen in (
        ("/prefix/one/two", "/one/two"),
        ("/strip-prefix/three", "/three"),
        ("/strip-prefix", "/"),
        ("/full/one/two", "/one"),
        ("/strip-prefix/three?q=1", "/three?q=1"),
    ):
        response = await suite.request(sent)
        assert response.echo["target"] == seen, sent
    response = await suite.request("/one", host="rewrite.example")
    assert response.request_header("Host") == "one.example.org"
    # The client's host stays visible to the backend.
    assert response.request_header("X-Forwarded-Host") == "rewrite.example"


async def test_request_mirror_copies_without_slowing_the_primary(suite: Conformance) -> None:
    await suite.apply("httproute-request-mirror.yaml")
    mirror = suite.backends[(INFRA, "infra-backend-v2")]
    await suite.eventually("/mirror", backend=V1)
    path = "/mirror-and-modify-headers"
    response = await suite.request(path, headers={"X-Header-Remove": "x"})
    assert response.backend == V1
    # The copy arrives on its own (never waited for by the primary).
    await until(lambda: any(r["target"] == path for r in mirror.requests), "the mirrored copy")
    (copy,) = [r for r in mirror.requests if r["target"] == path]
    names = {k.lower(): v for k, v in copy["headers"]}  # type: ignore[union-attr]
    assert names["x-header-set"] == "set-overwrites-values" and "x-header-remove" not in names


async def test_backend_request_timeout_answers_504(suite: Conformance) -> None:
    route = f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: timeouts, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  rules:
  - matches: [{{path: {{type: PathPrefix, value: /slow}}}}]
    timeouts: {{request: 1s, backendRequest: 500ms}}
    backendRefs: [{{name: infra-backend-v1, port: 8080}}]
  - backendRefs: [{{name: infra-backend-v2, port: 8080}}]
"""
    await suite.apply(extra=route)
    await suite.eventually("/", backend=V2)
    response = await suite.request("/slow?s=3")
    assert response.status == 504
    assert (await suite.request("/slow?s=0")).backend == V1
