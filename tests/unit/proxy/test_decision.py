"""decision.decide without sockets: every per-request rule's answer from a view, a
request head and the facts of a connection (the integration side, through every
pair of protocols, is tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest

from waygate.core import httpheaders
from waygate.proxy import decision, http1
from waygate.proxy.decision import Answer, Forward, decide, release_pick, repick
from waygate.proxy.http1 import ForwardedContext, parse_request_head, parse_response_head
from waygate.proxy.routing import Defaults, PassiveHealth, Target, build_table
from waygate.proxy.view import ProxyView
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    InsecureEdgePolicy,
    Redirect,
    Route,
    RouteAccess,
    RouteBackend,
    RouteFilters,
    RouteTLS,
    Service,
    ServicePort,
    TLSTermination,
)

PROXY = Path(__file__).resolve().parents[3] / "services" / "proxy"


class Facts:
    """A client connection's facts (what decide reads of it)."""

    def __init__(self, secure: bool = False, identity: Any = b"") -> None:
        self.context = ForwardedContext("192.0.2.7", 8080)
        self.client_key = b"192.0.2.7"
        self.secure = secure
        self.identity = identity

    def client_identity(self, route: Any) -> Any:
        return self.identity


def view(routes: list[Route], endpoints: list[Endpoint], services: list[Service] = ()) -> Any:  # type: ignore[assignment]
    grouped: dict[tuple[str, str], tuple[Endpoint, ...]] = {}
    for ep in endpoints:
        grouped[ep.service_key] = (*grouped.get(ep.service_key, ()), ep)
    table = build_table(
        {r.key: r for r in routes},
        grouped,
        {s.key: s for s in services},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
    )
    return ProxyView(table, PassiveHealth(), 0.0)


def ep(address: str = "10.0.0.1", namespace: str = "demo", service: str = "web") -> Endpoint:
    return Endpoint(namespace, service, address, (EndpointPort("http", 8080),))


def rt(**kw: Any) -> Route:
    kw.setdefault("backends", (RouteBackend("web"),))
    return Route(namespace="demo", name="r", host="a.test", **kw)


def req(target: str = "/x", host: str = "a.test", extra: str = "") -> http1.RequestHead:
    return parse_request_head(f"GET {target} HTTP/1.1\r\nHost: {host}\r\n{extra}\r\n".encode())


CASES = [
    # (name, routes, request, expected status or None for Forward, kind, route label)
    ("healthz", [rt()], req(http1.HEALTHZ_PATH.decode()), 200, decision.ANSWER_HEALTHZ, ""),
    (
        "options any",
        [rt()],
        parse_request_head(b"OPTIONS * HTTP/1.1\r\nHost: a.test\r\n\r\n"),
        200,
        decision.ANSWER_OPTIONS,
        "",
    ),
    ("no route", [rt()], req(host="b.test"), 503, "no_route", ""),
    (
        "edge redirect",
        [
            rt(
                tls=RouteTLS(
                    TLSTermination.EDGE,
                    insecure_edge_termination_policy=InsecureEdgePolicy.REDIRECT,
                )
            )
        ],
        req(),
        302,
        decision.ANSWER_REDIRECT,
        "demo/r",
    ),
    ("https only", [rt(tls=RouteTLS(TLSTermination.EDGE))], req(), 503, "https_only", "demo/r"),
    (
        "route redirect",
        [rt(filters=RouteFilters(redirect=Redirect(hostname="c.test", status=301)))],
        req(),
        301,
        decision.ANSWER_ROUTE_REDIRECT,
        "demo/r",
    ),
    (
        "invalid backendRef",
        [rt(backends=(RouteBackend("web", invalid="not granted"),))],
        req(),
        500,
        "invalid_backend",
        "demo/r",
    ),
    ("no endpoint", [rt(backends=(RouteBackend("gone"),))], req(), 503, "no_endpoint", "demo/r"),
    # Access (waygate.proxy.access; the client is 192.0.2.7): tests/unit/proxy/test_access.py.
    (
        "allowed address",
        [rt(access=RouteAccess(allow=("192.0.2.0/24",)))],
        req(),
        None,
        "",
        "demo/r",
    ),
    (
        "address not allowed",
        [rt(access=RouteAccess(allow=("10.0.0.0/8",)))],
        req(),
        403,
        "access_denied",
        "demo/r",
    ),
    (
        "no credentials",
        [rt(access=RouteAccess(auth_type="basic", auth_realm="r", credentials=("a:{PLAIN}b",)))],
        req(),
        401,
        "unauthorized",
        "demo/r",
    ),
    (
        "credentials",
        [rt(access=RouteAccess(auth_type="basic", credentials=("a:{PLAIN}b",)))],
        req(extra="Authorization: Basic YTpi\r\n"),
        None,
        "",
        "demo/r",
    ),
    ("forward", [rt()], req(), None, "", "demo/r"),
]


@pytest.mark.parametrize(
    ("name", "routes", "request_head", "status", "kind", "label"), CASES, ids=[c[0] for c in CASES]
)
def test_each_rule_answers_or_forwards(name, routes, request_head, status, kind, label):
    decided = decide(view(routes, [ep()]), request_head, Facts(), 100.0)
    if status is None:
        assert isinstance(decided, Forward)
        assert decided.entry.options.name == label
        assert decided.target == Target("10.0.0.1", 8080, namespace="demo", service="web")
        assert decided.upstream_head.startswith(b"GET /x HTTP/1.1\r\nHost: a.test\r\n")
        return
    assert isinstance(decided, Answer)
    assert (decided.status, decided.kind, decided.route) == (status, kind, label)
    if kind == decision.ANSWER_ROUTE_REDIRECT:
        assert decided.reason == "http://c.test/x"


def test_a_client_certificate_refusal_and_identity():
    route = rt(tls=RouteTLS(TLSTermination.EDGE, client_ca_certificate="CA"))
    refused = decide(view([route], [ep()]), req(), Facts(secure=True, identity=(403, "no")), 0.0)
    assert refused == Answer(403, "no", "client_certificate", "demo/r")
    forward = decide(
        view([route], [ep()]), req(), Facts(secure=True, identity=b"X-Id: alice\r\n"), 0.0
    )
    assert isinstance(forward, Forward)
    assert forward.upstream_head.endswith(b"X-Id: alice\r\n\r\n")


def test_the_http2_flag_uses_the_backends_namespace_and_port():
    service = Service(
        "other",
        "svc",
        ports=(
            ServicePort("http", 80, "http"),
            ServicePort("grpc", 81, "grpc", app_protocol="kubernetes.io/h2c"),
        ),
    )
    endpoint = Endpoint(
        "other", "svc", "10.0.0.9", (EndpointPort("http", 8080), EndpointPort("grpc", 9090))
    )
    for port, http2, number in (("grpc", True, 9090), ("http", False, 8080)):
        route = rt(backends=(RouteBackend("svc", namespace="other", port=port),))
        forward = decide(view([route], [endpoint], [service]), req(), Facts(), 0.0)
        assert isinstance(forward, Forward)
        assert (forward.http2, forward.target.port) == (http2, number)


def test_tracing_at_the_ratio_and_parent_based(monkeypatch):
    from waygate.core.tracing import configure_tracing

    configure_tracing("decision-test", None)
    sampled = view([rt()], [ep()])
    sampled.trace_ratio = 1.0
    forward = decide(sampled, req(), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.span is not None
    assert (
        forward.traceparent is not None
        and b"traceparent: " + forward.traceparent.encode() in forward.upstream_head
    )
    unsampled_parent = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-00"
    forward = decide(sampled, req(extra=f"traceparent: {unsampled_parent}\r\n"), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.span is None and forward.traceparent is None
    forward = decide(view([rt()], [ep()]), req(), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.span is None


def test_grpc_timeout_sets_the_deadline_only_when_shorter():
    forward = decide(view([rt()], [ep()]), req(), Facts(), 100.0, grpc_timeout=0.5)
    assert isinstance(forward, Forward) and forward.deadline == 100.5
    forward = decide(view([rt()], [ep()]), req(), Facts(), 100.0, grpc_timeout=10_000.0)
    assert isinstance(forward, Forward) and forward.deadline == 0.0


@pytest.mark.parametrize(
    ("head", "route", "grpc", "buffered"),
    [
        ("POST /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\n", {}, False, True),
        ("POST /x HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n", {}, False, True),
        ("GET /x HTTP/1.1\r\nHost: a.test\r\n\r\n", {}, False, False),  # no body: nothing to hold
        ("POST /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 0\r\n\r\n", {}, False, False),
        (
            "POST /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\n",
            {"request_buffering": False},  # a streaming route
            False,
            False,
        ),
        ("POST /x HTTP/1.1\r\nHost: a.test\r\nContent-Length: 5\r\n\r\n", {}, True, False),
    ],
    ids=["length", "chunked", "bodiless", "empty", "route off", "grpc"],
)
def test_request_buffering_is_decided_once(head, route, grpc, buffered):
    decided = decide(
        view([rt(**route)], [ep()]), parse_request_head(head.encode()), Facts(), 0.0, grpc=grpc
    )
    assert type(decided) is Forward
    assert decided.buffer_body is buffered


def test_the_pick_is_counted_and_released_and_repick_moves_it():
    built = view([rt()], [ep("10.0.0.1"), ep("10.0.0.2")])
    forward = decide(built, req(), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.counted
    picker = forward.backend.picker
    first = forward.target
    assert picker.inflight(first) == 1
    assert repick(built, forward, Facts(), first)
    assert forward.target != first and picker.inflight(first) == 0
    assert picker.inflight(forward.target) == 1
    release_pick(forward)
    assert picker.inflight(forward.target) == 0 and not forward.counted


def test_rules_are_chosen_once_per_entry_and_none_for_a_plain_route():
    plain = next(iter(view([rt()], [ep()]).table.entries()))
    assert decision.rules_of(plain) is False
    tls = next(iter(view([rt(tls=RouteTLS(TLSTermination.EDGE))], [ep()]).table.entries()))
    assert decision.rule_names(tls) == (["edge_tls"], [])


def test_decision_is_sans_io():
    tree = ast.parse((PROXY / "decision.py").read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import)
        for alias in node.names
    } | {
        node.module.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.ImportFrom) and node.module
    }
    assert not imported & {"asyncio", "socket", "ssl", "selectors", "uvloop", "threading"}
    assert "create_task" not in (PROXY / "decision.py").read_text()


# ---------------------------------------------------------------- one rule book each


def test_the_response_hop_by_hop_fields_are_the_rule_books():
    # (Connection and Transfer-Encoding have values of their own to check.)
    names = sorted(httpheaders.HOP_BY_HOP - {b"connection", b"transfer-encoding"})
    fields = "".join(f"{name.decode()}: x\r\n" for name in names)
    head = f"HTTP/1.1 200 OK\r\nContent-Length: 0\r\n{fields}X-Kept: 1\r\n\r\n".encode()
    response = parse_response_head(head)
    assert response.fields == b"\r\nX-Kept: 1"


def test_flow_control_water_marks_come_from_core_flow_only():
    offenders = []
    for path in PROXY.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.BinOp | ast.Constant):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.endswith(
                        ("HIGH_WATER", "LOW_WATER")
                    ):
                        offenders.append(f"{path.name}: {target.id}")
    assert offenders == []


def test_a_target_only_rewrite_keeps_the_clients_head_and_sends_the_new_target():
    """A prefix URLRewrite alone: the upstream head carries the new target, the
    client's head is not copied (it stays the client's: the access log, auth's
    X-Original-URL), and a rule that reads the backend's request gets it whole."""
    from waygate.resolver.model import PathModifierType, Rewrite, UrlMirror

    rewrite = RouteFilters(rewrite=Rewrite(path_type=PathModifierType.PREFIX, path="/"))
    client = req("/api/64?q=1")
    out = decide(view([rt(path="/api", filters=rewrite)], [ep()]), client, Facts(), 0.0)
    assert isinstance(out, Forward)
    assert out.upstream_head.startswith(b"GET /64?q=1 HTTP/1.1\r\n")
    assert out.req is client and client.target == b"/api/64?q=1"
    upstream = out.upstream_request()
    assert upstream is not client and upstream.target == b"/64?q=1"
    assert out.rewritten_target is None and out.upstream_request() is upstream
    # A rule after it (mirror-target's $request_uri) reads the rewritten target.
    mirrored = rt(path="/api", filters=rewrite, url_mirror=UrlMirror("http://m.test$request_uri"))
    out = decide(view([mirrored], [ep()]), req("/api/64"), Facts(), 0.0)
    assert isinstance(out, Forward) and out.mirrors
    assert out.mirrors[0][1].startswith(b"GET /64 HTTP/1.1\r\n")
    assert out.upstream_head.startswith(b"GET /64 HTTP/1.1\r\n")


def test_the_access_gate_keeps_a_keep_alive_peers_verdict_and_decides_a_new_peer():
    """The access rule bound to the entry's check: the same connection's next request
    (the peer's very bytes) gets the kept verdict inline; another peer is decided."""
    table = view([rt(access=RouteAccess(allow=("10.0.0.0/8",)))], [ep()])
    outside, inside = Facts(), Facts()
    inside.context = ForwardedContext("10.0.0.9", 8080)
    for facts, allowed in ((outside, False), (outside, False), (inside, True), (inside, True)):
        for _ in range(2):
            out = decide(table, req(), facts, 0.0)  # type: ignore[arg-type]
            if allowed:
                assert isinstance(out, Forward)
            else:
                assert isinstance(out, Answer) and out.status == 403
                assert out.kind == "access_denied" and out.route == "demo/r"
    assert decide(table, req(), outside, 0.0).status == 403  # type: ignore[arg-type,union-attr]


def test_the_upstream_scope_follows_the_clients_scheme_only_where_the_route_says():
    """ingress-nginx AUTO_HTTP (upstream_scheme_from_client): TLS to the backend for a
    client over TLS, plain for a plain one; a reencrypt route's scope otherwise."""
    tls = RouteTLS(
        TLSTermination.REENCRYPT, insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW
    )
    for auto in (False, True):
        the_view = view([rt(tls=tls, upstream_scheme_from_client=auto)], [ep()])
        secure = decide(the_view, req(), Facts(secure=True), 0.0)
        plain = decide(the_view, req(), Facts(secure=False), 0.0)
        assert isinstance(secure, Forward) and isinstance(plain, Forward)
        assert secure.upstream_scope is not None
        assert secure.upstream_scope == secure.entry.upstream_scope
        assert (plain.upstream_scope is None) is auto
    plain_route = decide(view([rt()], [ep()]), req(), Facts(secure=True), 0.0)
    assert isinstance(plain_route, Forward) and plain_route.upstream_scope is None


def test_ingress_nginx_opentelemetry_annotations_decide_the_span_and_the_context_sent():
    # enable-opentelemetry "false" (tracing_off): no span, the client's traceparent
    # goes on as it came; opentelemetry-trust-incoming-span "false"
    # (untrusted_trace_context): the client's context is neither continued nor passed
    # on; opentelemetry-operation-name (span_name): the span's name per request.
    from waygate.core.tracing import configure_tracing

    configure_tracing("decision-test", None)
    client = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    traced = req("/a/b?c=1", extra=f"traceparent: {client}\r\n")

    off = view([rt(tracing_off=True)], [ep()])
    off.trace_ratio = 1.0
    for request in (traced, req()):
        forward = decide(off, request, Facts(), 0.0)
        assert isinstance(forward, Forward) and forward.span is None
    assert b"traceparent: " + client.encode() in decide(off, traced, Facts(), 0.0).upstream_head  # type: ignore[union-attr]

    untrusted = view(
        [rt(untrusted_trace_context=True, span_name="HTTP $request_method $uri")], [ep()]
    )
    forward = decide(untrusted, traced, Facts(), 0.0)  # ratio 0: not sampled, nothing sent
    assert isinstance(forward, Forward) and forward.span is None
    assert b"traceparent" not in forward.upstream_head
    untrusted.trace_ratio = 1.0
    forward = decide(untrusted, traced, Facts(secure=True), 0.0)
    assert isinstance(forward, Forward) and forward.span is not None
    sent = forward.traceparent
    assert sent is not None and client.split("-")[1] not in sent  # a trace of its own
    assert b"traceparent: " + sent.encode() in forward.upstream_head
    assert forward.span.name == "HTTP GET /a/b"  # type: ignore[attr-defined]

    named = view([rt(span_name="$scheme://$host$request_uri $request_method")], [ep()])
    forward = decide(named, traced, Facts(secure=True), 0.0)  # trusted: continued
    assert isinstance(forward, Forward) and forward.traceparent is not None
    assert client.split("-")[1] in forward.traceparent
    assert forward.span.name == "https://a.test/a/b?c=1 GET"  # type: ignore[attr-defined]
