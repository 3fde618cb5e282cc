"""Gateway API and Ingress objects -> routes and statuses (waygate.resolver.gateway), and the
manifests source's all-or-nothing parse with `path:line: reason`."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.support.gatewayapi import GATEWAY_CLASS, conformance_text, tls_secret
from tests.support.pki import self_signed
from waygate.resolver.filesource import FileError
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.gateway.translate import ObjectStatus, _hostname_intersection
from waygate.resolver.manifests import ManifestsContent, parse_manifests
from waygate.resolver.model import PathMatchType

NS = "gateway-conformance-infra"


def parse(*texts: str) -> ManifestsContent:
    return parse_manifests([(Path(f"m{i}.yaml"), t) for i, t in enumerate(texts)])


def base(*tests: str) -> ManifestsContent:
    return parse(
        GATEWAY_CLASS,
        conformance_text("base.yaml"),
        *(conformance_text(t) for t in tests),
    )


def status_of(content: ManifestsContent, kind: str, name: str) -> dict[str, Any]:
    (found,) = [s.status for s in content.translation.statuses if s.kind == kind and s.name == name]
    return found


def reasons(conditions: list[dict[str, Any]]) -> dict[str, tuple[str, str]]:
    return {c["type"]: (c["status"], c["reason"]) for c in conditions}


@pytest.mark.parametrize(
    ("listener", "route", "expected"),
    [
        ("", (), [""]),
        ("", ("a.com",), ["a.com"]),
        ("a.com", (), ["a.com"]),
        ("very.specific.com", ("*.specific.com", "x.com"), ["very.specific.com"]),
        ("*.wildcard.io", ("foo.bar.wildcard.io", "wildcard.io"), ["foo.bar.wildcard.io"]),
        ("*.wildcard.io", ("*.foo.wildcard.io",), ["*.foo.wildcard.io"]),
        ("*.foo.wildcard.io", ("*.wildcard.io",), ["*.foo.wildcard.io"]),
        ("*.a.com", ("*.b.com",), []),
        ("a.com", ("b.com",), []),
    ],
)
def test_hostname_intersection(listener: str, route: tuple[str, ...], expected: list[str]) -> None:
    assert _hostname_intersection(listener, route) == expected


def test_gateway_class_of_another_controller_is_left_alone() -> None:
    other = GATEWAY_CLASS.replace("name: waygate", "name: other").replace(
        "waygate.io/gateway-controller", "example.com/theirs"
    )
    content = parse(other, conformance_text("base.yaml").replace("{GATEWAY_CLASS_NAME}", "other"))
    assert content.routes == [] and content.translation.statuses == []


def test_routes_carry_the_rule_listener_and_precedence_keys() -> None:
    content = base("httproute-matching.yaml")
    routes = sorted(
        (r for r in content.routes if r.origin == f"HTTPRoute {NS}/matching"),
        key=lambda r: r.rule_index,
    )
    assert [r.rule_index for r in routes] == [0, 1]
    first = routes[0]
    assert first.host == "" and first.listener_port == 80
    assert first.gateway == f"{NS}/same-namespace" and first.tls is None
    assert [m.path_type for m in first.matches] == [PathMatchType.PREFIX, PathMatchType.PREFIX]
    assert first.matches[1].headers[0].name == "version"
    # The service's named port, as its EndpointSlice names it.
    assert first.backends[0].port == "first-port" and first.backends[0].namespace == NS


def test_https_listener_takes_the_secret_and_reports_a_missing_one() -> None:
    content = base("httproute-https-listener.yaml")
    listeners = status_of(content, "Gateway", "same-namespace-with-https-listener")["listeners"]
    assert reasons(listeners[0]["conditions"])["ResolvedRefs"] == (
        "False",
        "InvalidCertificateRef",
    )
    assert (
        "tls-validity-checks-certificate does not exist" in listeners[0]["conditions"][1]["message"]
    )
    with_secret = parse(
        GATEWAY_CLASS,
        conformance_text("base.yaml"),
        conformance_text("httproute-https-listener.yaml"),
        tls_secret(NS, "tls-validity-checks-certificate"),
    )
    listeners = status_of(with_secret, "Gateway", "same-namespace-with-https-listener")["listeners"]
    assert all(
        reasons(item["conditions"])["Programmed"] == ("True", "Programmed") for item in listeners
    )
    routes = [r for r in with_secret.routes if r.name.startswith("httproute:httproute-https-test:")]
    assert routes and all(r.tls is not None and r.tls.certificate for r in routes)
    assert {r.listener_port for r in routes} == {443}


def test_listener_conflicts_and_unsupported_protocols() -> None:
    gateway = f"""apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: g, namespace: {NS}}}
spec:
  gatewayClassName: waygate
  listeners:
  - {{name: a, port: 80, protocol: HTTP, hostname: x.com}}
  - {{name: b, port: 80, protocol: HTTP, hostname: x.com}}
  - {{name: c, port: 81, protocol: HTTP}}
  - {{name: d, port: 81, protocol: HTTPS, tls: {{certificateRefs: [{{name: s}}]}}}}
  - {{name: e, port: 9000, protocol: UDP}}
"""
    content = parse(GATEWAY_CLASS, gateway, tls_secret(NS, "s"))
    listeners = {
        item["name"]: reasons(item["conditions"])
        for item in status_of(content, "Gateway", "g")["listeners"]
    }
    assert listeners["a"]["Conflicted"] == ("True", "HostnameConflict")
    assert listeners["c"]["Conflicted"] == ("True", "ProtocolConflict")
    assert listeners["d"]["Conflicted"] == ("True", "ProtocolConflict")
    assert listeners["e"]["Accepted"] == ("False", "UnsupportedProtocol")
    assert all(item["Programmed"][0] == "False" for item in listeners.values())
    assert reasons(status_of(content, "Gateway", "g")["conditions"])["Accepted"] == (
        "False",
        "ListenersNotValid",
    )


def test_weights_beyond_the_proxy_range_are_scaled_in_proportion() -> None:
    route = f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: w, namespace: {NS}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  rules:
  - backendRefs:
    - {{name: infra-backend-v1, port: 8080, weight: 1000000}}
    - {{name: infra-backend-v2, port: 8080, weight: 250000}}
    - {{name: infra-backend-v3, port: 8080, weight: 0}}
"""
    content = base()
    content = parse(GATEWAY_CLASS, conformance_text("base.yaml"), route)
    (made,) = [r for r in content.routes if r.origin.endswith("/w")]
    assert [b.weight for b in made.backends] == [256, 64, 0]


@pytest.mark.parametrize(
    ("rule", "field", "reason"),
    [
        (
            "matches: [{path: {type: RegularExpression, value: '/(x'}}]",
            "spec.rules[0].matches[0].path.value",
            "invalid regular expression",
        ),
        (
            "filters: [{type: Teleport}]",
            "spec.rules[0].filters[0].type",
            "unsupported filter type 'Teleport'",
        ),
        (
            "backendRefs: [{name: infra-backend-v1, port: 70000}]",
            "spec.rules[0].backendRefs[0].port",
            "70000 is outside 0..65535",
        ),
        (
            "backendRefs: [{name: infra-backend-v1}]",
            "spec.rules[0].backendRefs[0].port",
            "is required for a Service",
        ),
    ],
)
def test_a_bad_object_rejects_the_whole_file_naming_its_line(
    rule: str, field: str, reason: str
) -> None:
    route = f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: bad
  namespace: {NS}
spec:
  parentRefs: [{{name: same-namespace}}]
  rules:
  - {rule}
"""
    with pytest.raises(FileError) as caught:
        parse(GATEWAY_CLASS, conformance_text("base.yaml"), route)
    error = caught.value
    assert error.path == Path("m2.yaml") and error.line == 9
    assert f"HTTPRoute {NS}/bad: {field}: " in error.reason and reason in error.reason


def test_unknown_kinds_are_skipped_and_duplicates_refused() -> None:
    content = base()
    assert any("apps/v1 Deployment" in s for s in content.skipped)
    with pytest.raises(FileError, match="defined twice"):
        parse(GATEWAY_CLASS, GATEWAY_CLASS)


def test_ingress_routes_hosts_paths_default_backend_and_tls() -> None:
    cert, key = self_signed("web.example.com")
    manifests = f"""apiVersion: networking.k8s.io/v1
kind: IngressClass
metadata: {{name: waygate}}
spec: {{controller: waygate.io/ingress-controller}}
---
apiVersion: v1
kind: Service
metadata: {{name: web, namespace: shop}}
spec: {{ports: [{{name: http, port: 80, targetPort: 8080}}]}}
---
apiVersion: v1
kind: Secret
type: kubernetes.io/tls
metadata: {{name: web-tls, namespace: shop}}
data:
  tls.crt: {base64.b64encode(cert.encode()).decode()}
  tls.key: {base64.b64encode(key.encode()).decode()}
---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata: {{name: web, namespace: shop}}
spec:
  ingressClassName: waygate
  defaultBackend: {{service: {{name: web, port: {{number: 80}}}}}}
  tls: [{{hosts: [web.example.com], secretName: web-tls}}]
  rules:
  - host: web.example.com
    http:
      paths:
      - {{path: /api, pathType: Prefix, backend: {{service: {{name: web, port: {{name: http}}}}}}}}
      - {{path: /exact, pathType: Exact, backend: {{service: {{name: web, port: {{number: 80}}}}}}}}
---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata: {{name: theirs, namespace: shop}}
spec:
  ingressClassName: nginx
  defaultBackend: {{service: {{name: web, port: {{number: 80}}}}}}
"""
    content = parse_manifests([(Path("i.yaml"), manifests)], addresses=("192.0.2.7",))
    routes = {(r.host, r.matches[0].path, r.listener_port): r for r in content.routes}
    assert set(routes) == {
        ("web.example.com", "/api", 80),
        ("web.example.com", "/api", 443),
        ("web.example.com", "/exact", 80),
        ("web.example.com", "/exact", 443),
        ("", "/", 80),
    }
    assert routes[("web.example.com", "/exact", 80)].matches[0].path_type is PathMatchType.EXACT
    secure = routes[("web.example.com", "/api", 443)]
    assert secure.tls is not None and secure.tls.certificate == cert
    # Port 80 of the service, by the name its EndpointSlices use.
    assert routes[("", "/", 80)].backends[0].port == "http"
    assert status_of(content, "Ingress", "web") == {
        "loadBalancer": {"ingress": [{"ip": "192.0.2.7"}]}
    }
    assert not [s for s in content.translation.statuses if s.name == "theirs"]


def test_status_board_keeps_transition_times_while_a_status_holds() -> None:
    times = iter(["t1", "t2", "t3"])
    board = StatusBoard(clock=lambda: next(times))

    def status(accepted: str) -> ObjectStatus:
        return ObjectStatus(
            "Gateway",
            "ns",
            "g",
            1,
            {"conditions": [{"type": "Accepted", "status": accepted, "reason": "R"}]},
        )

    board.replace([status("True")])
    assert [s.name for s in board.take_changed()] == ["g"]
    board.replace([status("True")])
    assert board.take_changed() == []
    item = board.get("Gateway", "ns", "g")
    assert item is not None and item.status["conditions"][0]["lastTransitionTime"] == "t1"
    board.replace([status("False")])
    item = board.get("Gateway", "ns", "g")
    assert item is not None and item.status["conditions"][0]["lastTransitionTime"] == "t3"
    assert [s.name for s in board.take_changed()] == ["g"]


def test_the_conformance_base_parses_with_every_service() -> None:
    content = base()
    names = {s.name for s in content.services}
    assert {"infra-backend-v1", "app-backend-v1", "web-backend"} <= names
    gateways = [s for s in content.translation.statuses if s.kind == "Gateway"]
    assert {g.name for g in gateways} >= {"same-namespace", "all-namespaces", "backend-namespaces"}
    assert yaml.safe_dump(gateways[0].status)


def test_gateway_routes_share_hosts_across_namespaces_in_the_status_book() -> None:
    from datetime import UTC, datetime

    from waygate.resolver.model import Route, RouteBackend, RouteMatch, Service, ServicePort
    from waygate.resolver.status import RouteStatusBook

    def made(namespace: str, name: str) -> Route:
        return Route(
            namespace=namespace,
            name=name,
            host="",
            backends=(RouteBackend("web", 1, "shared", "http"),),
            matches=(RouteMatch(),),
            listener_port=80,
            gateway="infra/gw",
        )

    routes = {r.key: r for r in (made("a", "r"), made("b", "r"))}
    web = Service("shared", "web", ports=(ServicePort("http", 80, "8080"),))
    book = RouteStatusBook()
    statuses = book.update(
        routes,
        lambda ns, name: web if (ns, name) == ("shared", "web") else None,
        lambda ns, name: (),
        changed_routes=list(routes),
        now=datetime.now(UTC),
    )
    assert all(s.admitted for s in statuses.values()) and len(statuses) == 2
    # The backend is looked up in its own namespace: found, only without endpoints.
    assert {s.condition("ResolvedRefs").reason for s in statuses.values()} == {"NoReadyEndpoints"}


def test_grpc_route_matches_service_and_method_paths_over_http2() -> None:
    route = f"""apiVersion: gateway.networking.k8s.io/v1
kind: GRPCRoute
metadata: {{name: g, namespace: {NS}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  rules:
  - matches:
    - method: {{service: echo.Echo, method: Say}}
    - method: {{service: echo.Echo}}
    backendRefs: [{{name: infra-backend-v1, port: 8080}}]
"""
    content = parse(GATEWAY_CLASS, conformance_text("base.yaml"), route)
    (made,) = [r for r in content.routes if r.origin == f"GRPCRoute {NS}/g"]
    assert [(m.path_type, m.path, m.method) for m in made.matches] == [
        (PathMatchType.EXACT, "/echo.Echo/Say", "POST"),
        (PathMatchType.PREFIX, "/echo.Echo", "POST"),
    ]
    assert made.upstream_protocol == "grpc"


# ---------------------------------------------------------------- BackendTLSPolicy


def ca_config_map(name: str = "tls-checks-ca-certificate") -> str:
    from tests.support.pki import LocalCA

    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": NS},
            "data": {"ca.crt": LocalCA().pem.decode()},
        }
    )


def policy_ancestor(content: ManifestsContent, name: str) -> dict[str, tuple[str, str]]:
    status = status_of(content, "BackendTLSPolicy", name)
    (ancestor,) = status["ancestors"]
    assert ancestor["ancestorRef"] == {
        "group": "gateway.networking.k8s.io",
        "kind": "Gateway",
        "namespace": NS,
        "name": "same-namespace",
    }
    return reasons(ancestor["conditions"])


def test_backend_tls_policy_makes_the_rule_reencrypt_to_its_hostname() -> None:
    content = parse(
        GATEWAY_CLASS,
        conformance_text("base.yaml"),
        conformance_text("backendtlspolicy.yaml"),
        ca_config_map(),
        tls_secret(NS, "tls-validity-checks-certificate", "https-listener.org"),
    )
    (http,) = [
        r
        for r in content.routes
        if r.origin == f"HTTPRoute {NS}/backendtlspolicy" and r.rule_index == 0
    ]
    assert http.tls is not None and http.tls.termination.value == "reencrypt"
    assert http.tls.destination_server_name == "abc.example.com"
    assert "BEGIN CERTIFICATE" in http.tls.destination_ca_certificate
    assert not http.tls.destination_system_ca and not http.tls.certificate
    # An HTTP listener: still served on the plain port.
    assert http.tls.insecure_edge_termination_policy.value == "Allow"
    (https,) = [
        r for r in content.routes if r.origin == f"HTTPRoute {NS}/backendtlspolicy-reencrypt"
    ]
    assert https.tls is not None and https.tls.certificate  # the listener's own, kept
    assert https.tls.termination.value == "reencrypt"
    # A Service no policy targets stays plain.
    plain = base("httproute-simple-same-namespace.yaml")
    assert all(r.tls is None for r in plain.routes if r.listener_port == 80)


def test_backend_tls_policy_conflicts_resolve_to_the_oldest_then_by_name() -> None:
    content = parse(
        GATEWAY_CLASS,
        conformance_text("base.yaml"),
        conformance_text("backendtlspolicy-conflict-resolution.yaml"),
        ca_config_map(),
    )
    assert policy_ancestor(content, "conflicted-without-section-name-1")["Accepted"] == (
        "True",
        "Accepted",
    )
    assert policy_ancestor(content, "conflicted-without-section-name-2")["Accepted"] == (
        "False",
        "Conflicted",
    )
    assert policy_ancestor(content, "conflicted-with-section-name-2")["Accepted"] == (
        "False",
        "Conflicted",
    )
    # One with a sectionName and one without are not in conflict: each has its ports.
    for name in ("not-conflicted-with-section-name", "not-conflicted-without-section-name"):
        assert policy_ancestor(content, name)["Accepted"] == ("True", "Accepted")
    by_path = {
        r.matches[0].path: r
        for r in content.routes
        if r.origin == f"HTTPRoute {NS}/backendtlspolicy-conflict-resolution"
    }
    winner = by_path["/backendtlspolicy-conflicted-without-section-name"].tls
    assert winner is not None and winner.destination_server_name == "other.example.com"
    section = by_path["/backendtlspolicy-not-conflicted-with-section-name"].tls
    whole = by_path["/backendtlspolicy-not-conflicted-without-section-name"].tls
    assert section is not None and whole is not None
    assert section.destination_server_name != whole.destination_server_name


def test_backend_tls_policy_missing_config_map_fails_closed_with_the_reason() -> None:
    content = base("backendtlspolicy-invalid-ca-certificate-ref.yaml")
    conditions = policy_ancestor(content, "nonexistent-ca-certificate-ref")
    assert conditions == {
        "Accepted": ("False", "NoValidCACertificate"),
        "ResolvedRefs": ("False", "InvalidCACertificateRef"),
    }
    (route,) = [
        r
        for r in content.routes
        if r.origin.endswith("/backendtlspolicy-invalid-ca-certificate-ref") and r.rule_index == 0
    ]
    (backend,) = route.backends
    assert "nonexistent-ca-certificate does not exist" in backend.invalid


@pytest.mark.parametrize(
    ("validation", "reason"),
    [
        (
            "{hostname: a.example.com, wellKnownCACertificates: System, "
            "caCertificateRefs: [{group: '', kind: ConfigMap, name: x}]}",
            "must not contain both caCertificateRefs and wellKnownCACertificates",
        ),
        ("{hostname: a.example.com}", "must specify either caCertificateRefs or"),
        ("{wellKnownCACertificates: System}", "validation.hostname: is required"),
        (
            "{hostname: '*.example.com', wellKnownCACertificates: System}",
            "is not a valid hostname",
        ),
        (
            "{hostname: a.example.com, wellKnownCACertificates: System, "
            "subjectAltNames: [{type: URI, hostname: a.example.com}]}",
            "type URI takes uri",
        ),
    ],
)
def test_backend_tls_policy_schema_errors_name_the_line(validation: str, reason: str) -> None:
    bad = f"""apiVersion: gateway.networking.k8s.io/v1
kind: BackendTLSPolicy
metadata: {{name: bad, namespace: {NS}}}
spec:
  targetRefs: [{{group: '', kind: Service, name: infra-backend-v1}}]
  validation: {validation}
"""
    with pytest.raises(FileError) as caught:
        parse(GATEWAY_CLASS, bad)
    assert reason in str(caught.value)
    assert "m1.yaml:" in str(caught.value)


def test_backend_tls_policy_well_known_system_verifies_with_the_system_cas() -> None:
    policy = f"""apiVersion: gateway.networking.k8s.io/v1
kind: BackendTLSPolicy
metadata: {{name: system, namespace: {NS}}}
spec:
  targetRefs: [{{group: '', kind: Service, name: infra-backend-v1}}]
  validation: {{hostname: public.example.com, wellKnownCACertificates: System,
    subjectAltNames: [{{type: Hostname, hostname: '*.example.com'}}]}}
"""
    content = parse(
        GATEWAY_CLASS,
        conformance_text("base.yaml"),
        conformance_text("httproute-simple-same-namespace.yaml"),
        policy,
    )
    (route,) = [r for r in content.routes if r.origin.endswith("/gateway-conformance-infra-test")]
    assert route.tls is not None and route.tls.destination_system_ca
    assert route.tls.destination_ca_certificate == ""
    assert route.tls.destination_san_hostnames == ("*.example.com",)
    assert policy_ancestor(content, "system")["Accepted"] == ("True", "Accepted")


def test_listener_reports_set_programmed_false_while_their_stream_lasts() -> None:
    from waygate.resolver.model import ListenerState

    content = base("httproute-simple-same-namespace.yaml")
    board = StatusBoard()
    board.replace(content.translation.statuses)
    board.take_changed()

    def programmed() -> tuple[str, str, str]:
        found = board.get("Gateway", NS, "same-namespace")
        assert found is not None
        (listener,) = found.status["listeners"]
        (condition,) = [c for c in listener["conditions"] if c["type"] == "Programmed"]
        return condition["status"], condition["reason"], condition["message"]

    assert programmed()[0] == "True"
    stream = object()
    board.report_listeners(
        stream,
        "edge-1/42",
        [
            ListenerState(
                f"{NS}/same-namespace", 80, "HTTP", 0, "PortUnavailable", "port 80 is in use"
            )
        ],
    )
    assert programmed() == ("False", "PortUnavailable", "proxy edge-1/42: 'port 80 is in use'")
    # The Kubernetes writer sees the change; the Gateway has no programmed listener left.
    assert [s.name for s in board.take_changed()] == ["same-namespace"]
    gateway = board.get("Gateway", NS, "same-namespace")
    assert gateway is not None
    assert reasons(gateway.status["conditions"])["Programmed"] == ("False", "Invalid")
    # A new translation keeps the report laid over it.
    board.replace(content.translation.statuses)
    assert programmed()[0] == "False"
    board.forget_listeners(stream)
    assert programmed()[0] == "True"


def test_listener_reports_are_checked_before_they_reach_a_condition() -> None:
    import re

    from waygate.resolver.gateway.status import LISTENER_MESSAGE_LIMIT, UNKNOWN_LISTENER_REASON
    from waygate.resolver.model import ListenerState

    content = base("httproute-simple-same-namespace.yaml")
    board = StatusBoard()
    board.replace(content.translation.statuses)

    def programmed() -> dict[str, Any]:
        found = board.get("Gateway", NS, "same-namespace")
        assert found is not None
        (listener,) = found.status["listeners"]
        (condition,) = [c for c in listener["conditions"] if c["type"] == "Programmed"]
        return condition

    def state(reason: str, message: str) -> list[ListenerState]:
        return [ListenerState(f"{NS}/same-namespace", 80, "HTTP", 0, reason, message)]

    # A reason the CRD's pattern refuses (the whole status write would fail) and
    # a megabyte message: a fixed reason, a bounded message.
    board.report_listeners(object(), "edge-9", state("no such reason!", "x" * 1_000_000))
    condition = programmed()
    assert condition["reason"] == UNKNOWN_LISTENER_REASON
    assert re.fullmatch(r"[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?", condition["reason"])
    assert len(condition["message"]) < LISTENER_MESSAGE_LIMIT + 100
    assert "1000000 characters" in condition["message"]

    # Proxies are listed by name, whichever stream reported first: the same
    # reports after a reconnect (in another order) give the same status.
    board = StatusBoard()
    board.replace(content.translation.statuses)
    board.report_listeners(object(), "edge-b", state("PortUnavailable", "b in use"))
    board.report_listeners(object(), "edge-a", state("Pending", "a pending"))
    first = programmed()
    assert (first["reason"], first["message"]) == (
        "Pending",
        "proxy edge-a: 'a pending'; proxy edge-b: 'b in use'",
    )


# ---------------------------------------------------------------- conflicts across Gateways


def two_gateways(first: str, second: str) -> str:
    """Gateway "zz-old" (created first, named last) and "aa-new" with these listeners,
    and a route attached to each."""

    def gateway(name: str, created: str, listener: str) -> str:
        return f"""apiVersion: gateway.networking.k8s.io/v1
kind: Gateway
metadata: {{name: {name}, namespace: {NS}, creationTimestamp: "{created}"}}
spec:
  gatewayClassName: waygate
  listeners: [{listener}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: to-{name}, namespace: {NS}}}
spec:
  parentRefs: [{{name: {name}}}]
  rules: [{{backendRefs: [{{name: infra-backend-v1, port: 8080}}]}}]
"""

    return (
        gateway("zz-old", "2026-01-01T00:00:00Z", first)
        + "---\n"
        + gateway("aa-new", "2026-02-01T00:00:00Z", second)
    )


def listener_conditions(content: ManifestsContent, gateway: str) -> dict[str, tuple[str, str]]:
    (listener,) = status_of(content, "Gateway", gateway)["listeners"]
    return reasons(listener["conditions"])


def conflict_message(content: ManifestsContent, gateway: str) -> str:
    (listener,) = status_of(content, "Gateway", gateway)["listeners"]
    (condition,) = [c for c in listener["conditions"] if c["type"] == "Conflicted"]
    return str(condition["message"])


def with_sharing(sharing: str, *texts: str) -> ManifestsContent:
    return parse_manifests(
        [(Path(f"m{i}.yaml"), t) for i, t in enumerate((GATEWAY_CLASS, *texts))], sharing=sharing
    )


def test_across_gateways_a_protocol_clash_on_one_port_conflicts_the_younger() -> None:
    secret = tls_secret(NS, "cert", "a.example.com")
    content = with_sharing(
        "share",
        conformance_text("base.yaml"),
        secret,
        two_gateways(
            "{name: web, port: 8080, protocol: HTTP}",
            "{name: web, port: 8080, protocol: HTTPS, tls: {certificateRefs: [{name: cert}]}}",
        ),
    )
    assert listener_conditions(content, "zz-old")["Conflicted"] == ("False", "NoConflicts")
    young = listener_conditions(content, "aa-new")
    assert young["Conflicted"] == ("True", "ProtocolConflict")
    assert young["Programmed"] == ("False", "Invalid")
    assert f"older Gateway {NS}/zz-old" in conflict_message(content, "aa-new")
    # The younger Gateway's route is not served; the older one's is.
    gateways = {r.gateway for r in content.routes if r.listener_port == 8080}
    assert gateways == {f"{NS}/zz-old"}


@pytest.mark.parametrize(("sharing", "conflicted"), [("share", False), ("exclusive", True)])
def test_across_gateways_one_hostname_is_shared_or_exclusive(
    sharing: str, conflicted: bool
) -> None:
    content = with_sharing(
        sharing,
        conformance_text("base.yaml"),
        two_gateways(
            "{name: web, port: 8080, protocol: HTTP, hostname: a.example.com}",
            "{name: web, port: 8080, protocol: HTTP, hostname: a.example.com}",
        ),
    )
    young = listener_conditions(content, "aa-new")["Conflicted"]
    assert young == (("True", "HostnameConflict") if conflicted else ("False", "NoConflicts"))
    other_hosts = with_sharing(
        sharing,
        conformance_text("base.yaml"),
        two_gateways(
            "{name: web, port: 8080, protocol: HTTP, hostname: a.example.com}",
            "{name: web, port: 8080, protocol: HTTP, hostname: b.example.com}",
        ),
    )
    assert listener_conditions(other_hosts, "aa-new")["Conflicted"][0] == "False"


def test_across_gateways_one_https_hostname_with_two_certificates_conflicts() -> None:
    content = with_sharing(
        "share",
        conformance_text("base.yaml"),
        tls_secret(NS, "one", "a.example.com"),
        tls_secret(NS, "two", "a.example.com"),
        two_gateways(
            "{name: s, port: 443, protocol: HTTPS, hostname: a.example.com, "
            "tls: {certificateRefs: [{name: one}]}}",
            "{name: s, port: 443, protocol: HTTPS, hostname: a.example.com, "
            "tls: {certificateRefs: [{name: two}]}}",
        ),
    )
    assert listener_conditions(content, "aa-new")["Conflicted"] == ("True", "HostnameConflict")
    assert "another certificate" in conflict_message(content, "aa-new")


def test_separate_proxies_per_gateway_see_no_conflicts_across_gateways() -> None:
    content = with_sharing(
        "separate",
        conformance_text("base.yaml"),
        two_gateways(
            "{name: web, port: 8080, protocol: HTTP}",
            "{name: web, port: 8080, protocol: TLS, tls: {mode: Passthrough}}",
        ),
    )
    assert listener_conditions(content, "aa-new")["Conflicted"] == ("False", "NoConflicts")


def test_gateways_table_shows_a_policy_per_gateway_and_an_unused_one() -> None:
    from waygate.resolver import convert
    from waygate.resolver.gateway.commands import format_gateways

    unused = f"""apiVersion: gateway.networking.k8s.io/v1
kind: BackendTLSPolicy
metadata: {{name: unused, namespace: {NS}}}
spec:
  targetRefs: [{{group: '', kind: Service, name: nobody}}]
  validation: {{hostname: a.example.com, wellKnownCACertificates: System}}
"""
    content = parse(
        GATEWAY_CLASS,
        conformance_text("base.yaml"),
        conformance_text("backendtlspolicy-invalid-ca-certificate-ref.yaml"),
        unused,
    )
    table = format_gateways(
        [
            convert.gateway_status_to_proto(s.kind, s.namespace, s.name, s.generation, s.status)
            for s in content.translation.statuses
            if s.kind == "BackendTLSPolicy"
        ]
    )
    rows = {line.split()[2]: line for line in table.splitlines()[1:]}
    assert (
        f"{NS}/same-namespace: Accepted=False(NoValidCACertificate: ConfigMap"
        in (rows["nonexistent-ca-certificate-ref"])
    )
    assert "not used by a route of Waygate's Gateways" in rows["unused"]


def test_a_mirror_to_a_backend_with_a_backend_tls_policy_is_left_out() -> None:
    """Mirrors are sent in clear: never to a Service whose policy asks for TLS."""
    route = f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: mirrored, namespace: {NS}}}
spec:
  parentRefs: [{{name: same-namespace}}]
  hostnames: [mirror.example.com]
  rules:
  - filters:
    - {{type: RequestMirror, requestMirror: {{backendRef: {{name: infra-backend-v2, port: 8080}}}}}}
    - {{type: RequestMirror, requestMirror: {{backendRef: {{name: infra-backend-v3, port: 8080}}}}}}
    backendRefs: [{{name: infra-backend-v1, port: 8080}}]
---
apiVersion: gateway.networking.k8s.io/v1
kind: BackendTLSPolicy
metadata: {{name: v2-tls, namespace: {NS}}}
spec:
  targetRefs: [{{group: '', kind: Service, name: infra-backend-v2}}]
  validation: {{hostname: v2.example.com, wellKnownCACertificates: System}}
"""
    content = parse(GATEWAY_CLASS, conformance_text("base.yaml"), route)
    (made,) = [r for r in content.routes if r.origin.endswith("/mirrored")]
    assert made.filters is not None
    assert [m.service for m in made.filters.mirrors] == ["infra-backend-v3"]
    assert made.tls is None  # the primary backend has no policy
