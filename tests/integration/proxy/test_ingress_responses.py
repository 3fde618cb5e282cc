"""ingress-nginx's response-side annotations in the request core, through every pair of protocols.

proxy-redirect-from/-to, proxy-cookie-domain/-path, custom-http-errors with
default-backend and disable-proxy-intercept-errors, use-port-in-redirects,
connection-proxy-header and enable-access-log "false" (waygate.proxy.
responserewrite, .errorpages), against a real proxy on real sockets with real
backends: `RecordingUpstream` (HTTP/1.1: `/status/NNN` answers that status, as
httpbun in ingress-nginx's e2e tests; anything else echoes what it received, as
their echo server) and `H2Backend` (h2c). The assertions ported from
kubernetes/ingress-nginx's test/e2e/annotations/*.go name their source.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.integration.proxy.test_request_core import HOST, PAIRS, _dead_port, _held, ask
from tests.support.h2harness import H2Backend
from tests.support.proxyharness import RecordingUpstream, running_proxy
from waygate.proxy.routing import Defaults, build_table
from waygate.proxy.upstream_tls import UpstreamTLS
from waygate.resolver.model import (
    Endpoint,
    EndpointPort,
    InsecureEdgePolicy,
    Route,
    RouteBackend,
    RouteTLS,
    Service,
    ServicePort,
    StickySessions,
    TLSTermination,
)


def _sent(answer: Any) -> dict[str, str]:
    """The request headers the RecordingUpstream that answered echoed, by lower-case name."""
    return {k.lower(): v for k, v in json.loads(answer.body)["headers"]}


SERVICE = Service(
    namespace="demo",
    name="svc",
    ports=(
        ServicePort("http", 80, "http"),
        ServicePort("grpc", 81, "h2", app_protocol="kubernetes.io/h2c"),
    ),
)
ERRORS = Service(namespace="demo", name="errors", ports=(ServicePort("http", 80, "http"),))


@pytest.fixture
async def backend_pair() -> AsyncIterator[tuple[RecordingUpstream, RecordingUpstream]]:
    """The route's backend and the error backend (default-backend `errors`)."""
    main, errors = RecordingUpstream("svc"), RecordingUpstream("errors")
    await main.start()
    await errors.start()
    yield main, errors
    await main.stop()
    await errors.stop()


def _route(backend: str = "http/1.1", **kw: Any) -> Route:
    port = "grpc" if backend == "h2c" else "http"
    return Route(
        namespace="demo",
        name="shop-0",
        host=HOST,
        backends=(RouteBackend(service="svc", port=port, weight=1),),
        origin="Ingress demo/shop",
        sticky=StickySessions(disable_cookies=True),  # (as ingress-nginx without affinity)
        **kw,
    )


def _table(route: Route, main_port: int, h2_port: int = 0, errors_port: int = 0) -> Any:
    endpoints: dict[tuple[str, str], tuple[Endpoint, ...]] = {}
    if main_port or h2_port:
        endpoints[SERVICE.key] = (
            Endpoint(
                namespace="demo",
                service="svc",
                address="127.0.0.1",
                ports=(EndpointPort("http", main_port), EndpointPort("h2", h2_port)),
            ),
        )
    if errors_port:
        endpoints[ERRORS.key] = (
            Endpoint(
                namespace="demo",
                service="errors",
                address="127.0.0.1",
                ports=(EndpointPort("http", errors_port),),
            ),
        )
    return build_table(
        {route.key: route},
        endpoints,
        {SERVICE.key: SERVICE, ERRORS.key: ERRORS},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
    )


@contextlib.asynccontextmanager
async def _h2_answering(fields: list[tuple[bytes, bytes]]) -> AsyncIterator[H2Backend]:
    backend = H2Backend(answer_fields=fields)
    await backend.start()
    try:
        yield backend
    finally:
        await backend.stop()


def _echo(headers: list[tuple[str, str]]) -> tuple[str, str]:
    return ("X-Echo-Set-Header", ",".join(f"{k}:{v}" for k, v in headers))


# ---------------------------------------------------------------- proxy_redirect


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_proxy_redirect_rewrites_location_and_refresh(backend_pair, client, backend):
    # ingress-nginx e2e annotations/proxy.go "should set proxy_redirect to hello.com
    # goodbye.com": nginx's proxy_redirect FROM TO, here with its effect asserted.
    main, _ = backend_pair
    route = _route(backend, redirect_from="http://hello.com/", redirect_to="http://goodbye.com/")
    sent = [("Location", "http://hello.com/a?b=1"), ("Refresh", "5; url=http://hello.com/r")]
    fields = [(b":status", b"302"), *((k.lower().encode(), v.encode()) for k, v in sent)]
    async with (
        _h2_answering(fields) as h2,
        running_proxy(_table(route, main.port, h2.port)) as (
            _,
            port,
        ),
    ):
        answer = await ask(client, port, "/go", [_echo(sent)])
    assert answer.headers["location"] == "http://goodbye.com/a?b=1"
    assert answer.headers["refresh"] == "5; url=http://goodbye.com/r"


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_proxy_redirect_to_a_path_is_made_absolute_without_port_by_default(
    backend_pair, client
):
    # nginx's header filter makes a rewritten relative Location absolute
    # (absolute_redirect on, ingress-nginx's default) with port_in_redirect off
    # (use-port-in-redirects "false", the default): no port, whatever the Host said.
    main, _ = backend_pair
    route = _route(redirect_from="http://backend.local:8080/", redirect_to="/shop/")
    async with running_proxy(_table(route, main.port)) as (_, port):
        moved = await ask(client, port, "/", [_echo([("Location", "http://backend.local:8080/x")])])
        other = await ask(client, port, "/", [_echo([("Location", "http://elsewhere/x")])])
    assert moved.headers["location"] == "http://core.test/shop/x"
    assert other.headers["location"] == "http://elsewhere/x"  # no match: as the backend sent it


async def test_use_port_in_redirects_keeps_the_port_the_client_addressed(backend_pair):
    main, _ = backend_pair
    route = _route(redirect_from="/old/", redirect_to="/new/", port_in_redirects=True)
    async with running_proxy(_table(route, main.port)) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"GET / HTTP/1.1\r\nHost: core.test:8443\r\nX-Echo-Set-Header: Location:/old/x\r\n"
            b"Connection: close\r\n\r\n"
        )
        data = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
    assert b"\r\nLocation: http://core.test:8443/new/x\r\n" in data


# ---------------------------------------------------------------- proxy_cookie_*


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_proxy_cookie_domain_and_path_rewrite_set_cookie(backend_pair, client, backend):
    # ingress-nginx e2e annotations/proxy.go "should setup proxy cookies":
    # proxy-cookie-domain "localhost example.org", proxy-cookie-path "/one/ /".
    main, _ = backend_pair
    route = _route(backend, cookie_domain="localhost example.org", cookie_path="/one/ /")
    cookie = "id=7; Domain=.LocalHost; Path=/one/two; HttpOnly"
    fields = [(b":status", b"200"), (b"set-cookie", cookie.encode())]
    async with (
        _h2_answering(fields) as h2,
        running_proxy(_table(route, main.port, h2.port)) as (
            _,
            port,
        ),
    ):
        answer = await ask(client, port, "/", [_echo([("Set-Cookie", cookie)])])
    assert answer.headers["set-cookie"] == "id=7; Domain=.example.org; Path=/two; HttpOnly"


# ---------------------------------------------------------------- custom-http-errors


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_custom_http_errors_go_to_the_default_backend(backend_pair, client):
    # ingress-nginx e2e annotations/disableproxyintercepterrors.go "client test to check
    # response - with intercept enabled": custom-http-errors 404 with default-backend the
    # echo service; GET /status/404 answers 200 (the error backend's status: error_page
    # CODE = @custom_...), its body naming x-code=404, x-ingress-name, x-service-name and
    # x-request-id.
    main, errors = backend_pair
    route = _route(custom_http_errors=(404, 503), default_backend="errors")
    async with running_proxy(_table(route, main.port, errors_port=errors.port)) as (server, port):
        answer = await ask(
            client,
            port,
            "/status/404?q=1",
            [("X-Request-ID", "proxy_intercept_errors"), ("Accept", "text/html")],
        )
        passed = await ask(client, port, "/status/500")
    assert answer.status == 200
    asked = json.loads(answer.body)
    assert (asked["method"], asked["target"]) == ("GET", "/")  # nginx: rewrite (.*) / break
    sent = _sent(answer)
    assert sent["x-code"] == "404"
    assert sent["x-format"] == "text/html"
    assert sent["x-original-uri"] == "/status/404?q=1"
    assert (sent["x-namespace"], sent["x-ingress-name"]) == ("demo", "shop")
    assert (sent["x-service-name"], sent["x-service-port"]) == ("svc", "http")
    assert sent["x-request-id"] == "proxy_intercept_errors"
    assert sent["host"] == HOST
    # A status not listed passes as the backend sent it.
    assert (passed.status, passed.body) == (500, b"status 500")
    assert len(errors.requests) == 1
    # Counted once, under the route, with the status the client got.
    assert server.metrics.requests[("demo/shop-0", b"GET", 2)] == 1
    assert server.metrics.requests[("demo/shop-0", b"GET", 5)] == 1


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_the_error_backend_of_an_https_backend_is_asked_in_plain_http(backend_pair, client):
    # backend-protocol HTTPS (or AUTO_HTTP for an HTTPS client, or proxy-ssl-secret):
    # the route reencrypts, but the template's @custom_ location proxies to
    # `http://upstream_balancer`; the error backend, plain as ingress-nginx's default
    # backend is, answers. (It was dialled with the route's TLS: a failed handshake,
    # and the proxy's own 502 page.) The route's backend refuses: the proxy's own 502.
    _, errors = backend_pair
    tls = RouteTLS(
        termination=TLSTermination.REENCRYPT,
        insecure_edge_termination_policy=InsecureEdgePolicy.ALLOW,
        destination_system_ca=True,
    )
    route = _route(custom_http_errors=(502,), default_backend="errors", tls=tls)
    dead = await _dead_port()
    async with running_proxy(_table(route, dead, errors_port=errors.port)) as (server, port):
        server.upstream_tls = UpstreamTLS(lambda: None, lambda: None, server.dialer.connect)
        answer = await ask(client, port, "/page")
    assert answer.status == 200, answer.body
    assert _sent(answer)["x-code"] == "502"
    assert len(errors.requests) == 1


async def test_the_error_request_gets_a_request_id_and_no_body(backend_pair):
    main, errors = backend_pair
    route = _route(custom_http_errors=(503,), default_backend="errors")
    async with running_proxy(_table(route, main.port, errors_port=errors.port)) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /status/503 HTTP/1.1\r\nHost: core.test\r\nContent-Length: 5\r\n"
            b"X-Code: 200\r\nConnection: close\r\n\r\nhello"
        )
        data = await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
    assert data.startswith(b"HTTP/1.1 200 ")
    assert main.requests[-1]["body_length"] == 5  # the backend had the whole request
    asked = errors.requests[-1]
    assert (asked["method"], asked["body_length"]) == ("GET", 0)
    sent = {k.lower(): v for k, v in asked["headers"]}  # type: ignore[attr-defined]
    assert "content-length" not in sent
    assert sent["x-code"] == "503"  # the client's X-Code replaced
    assert len(sent["x-request-id"]) == 32


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
@pytest.mark.parametrize("error_backend", ["http/1.1", "h2c"])
async def test_an_http2_backends_listed_status_goes_to_the_default_backend(
    backend_pair, client, error_backend
):
    # The same rule for a backend that speaks HTTP/2 (h2bridge for an HTTP/1.1 client,
    # the HTTP/2 stream handed to the error backend's exchange for an h2c one), with an
    # error backend of either protocol.
    main, errors = backend_pair
    error_port = ServicePort("h2", 81, "h2", app_protocol="kubernetes.io/h2c")
    first = error_port if error_backend == "h2c" else ServicePort("http", 80, "http")
    services = {SERVICE.key: SERVICE, ERRORS.key: dataclasses.replace(ERRORS, ports=(first,))}
    route = _route("h2c", custom_http_errors=(404,), default_backend="errors")
    async with (
        _h2_answering([(b":status", b"404"), (b"x-from", b"backend")]) as h2,
        _h2_answering([(b":status", b"200"), (b"x-from", b"errors")]) as h2_errors,
    ):
        error_endpoint = Endpoint(
            namespace="demo",
            service="errors",
            address="127.0.0.1",
            ports=(
                EndpointPort("h2", h2_errors.port)
                if error_backend == "h2c"
                else EndpointPort("http", errors.port),
            ),
        )
        main_endpoint = Endpoint(
            namespace="demo",
            service="svc",
            address="127.0.0.1",
            ports=(EndpointPort("http", main.port), EndpointPort("h2", h2.port)),
        )
        table = build_table(
            {route.key: route},
            {SERVICE.key: (main_endpoint,), ERRORS.key: (error_endpoint,)},
            services,
            defaults=Defaults(),
            cookie_key=b"k" * 32,
        )
        async with running_proxy(table) as (server, port):
            answer = await ask(client, port, "/missing", [("X-Request-ID", "r-1")])
            held = _held(server)
    assert answer.status == 200
    assert answer.headers.get("x-from") != "backend"
    if error_backend == "h2c":
        assert answer.headers["x-from"] == "errors"
        fields = dict(h2_errors.headers[-1])
        assert (fields[b":path"], fields[b"x-code"]) == (b"/", b"404")
        assert fields[b"x-original-uri"] == b"/missing"
        assert fields[b"x-request-id"] == b"r-1"
    else:
        sent = _sent(answer)
        assert (sent["x-code"], sent["x-original-uri"]) == ("404", "/missing")
    assert (held["waiting"], held["in_flight"], held["h2_streams"]) == ({}, {}, 0)
    assert server.metrics.requests[("demo/shop-0", b"GET", 2)] == 1


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_custom_http_errors_without_default_backend_answer_the_proxy_page(
    backend_pair, client
):
    main, _ = backend_pair
    route = _route(custom_http_errors=(404,))
    async with running_proxy(_table(route, main.port)) as (server, port):
        answer = await ask(client, port, "/status/404")
        head = await ask(client, port, "/status/404", method="HEAD")
    assert answer.status == 404
    assert b"status 404" not in answer.body
    assert "custom-http-errors" in answer.headers.get("x-waygate-error", "")
    assert (head.status, head.body) == (404, b"")
    assert server.metrics.refused["custom_http_error"] == 2


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_disable_proxy_intercept_errors_passes_the_backends_answer(backend_pair, client):
    # ingress-nginx e2e annotations/disableproxyintercepterrors.go "client test to check
    # response - with intercept disabled": GET /status/404 answers 404 from the backend.
    main, errors = backend_pair
    route = _route(
        custom_http_errors=(404,), default_backend="errors", intercept_errors_disabled=True
    )
    async with running_proxy(_table(route, main.port, errors_port=errors.port)) as (_, port):
        answer = await ask(client, port, "/status/404", [("X-Request-ID", "x")])
    assert (answer.status, answer.body) == (404, b"status 404")
    assert errors.requests == []


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_default_backend_without_endpoints_gets_x_code_503(backend_pair, client):
    # ingress-nginx e2e annotations/default_backend.go "should use a custom default
    # backend as upstream": the Ingress's Service has no endpoint; GET /alma/armud
    # answers 200 with x-code=503, x-ingress-name, x-service-name=invalid and the
    # client's x-request-id. (The request as it is: its path kept.)
    _, errors = backend_pair
    route = Route(
        namespace="demo",
        name="default-backend-0",
        host=HOST,
        backends=(RouteBackend(service="invalid", weight=1),),
        origin="Ingress demo/default-backend",
        default_backend="errors",
    )
    async with running_proxy(_table(route, 0, errors_port=errors.port)) as (_, port):
        answer = await ask(client, port, "/alma/armud", [("x-request-id", "something-unique")])
    assert answer.status == 200
    asked = json.loads(answer.body)
    assert asked["target"] == "/alma/armud"
    sent = _sent(answer)
    assert sent["x-code"] == "503"
    assert sent["x-ingress-name"] == "default-backend"
    assert sent["x-service-name"] == "invalid"
    assert sent["x-request-id"] == "something-unique"
    assert "x-original-uri" not in sent


async def test_an_intercepted_exchange_releases_what_it_held(backend_pair):
    main, errors = backend_pair
    route = _route(custom_http_errors=(404,), default_backend="errors")
    table = _table(route, main.port, errors_port=errors.port)
    async with running_proxy(table) as (server, port):
        for _ in range(3):
            assert (await ask("http/1.1", port, "/status/404")).status == 200
        held = _held(server)
        assert (held["waiting"], held["in_flight"]) == ({}, {})
        assert all(count <= 0 for count in held["opened"].values())
        fallback = next(iter(server.table.entries())).policies["default_backend"].picker
        assert [fallback.inflight(t) for t in fallback.targets] == [0]
    assert len(errors.requests) == 3


# ---------------------------------------------------------------- connection, access log


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
@pytest.mark.parametrize("value", ["keep-alive", "close"])
async def test_connection_proxy_header_is_what_the_backend_gets(backend_pair, client, value):
    # ingress-nginx e2e annotations/connection.go "set connection header to keep-alive":
    # the echo backend sees connection=keep-alive.
    main, _ = backend_pair
    route = _route(connection_header=value)
    async with running_proxy(_table(route, main.port)) as (_, port):
        answers = [await ask(client, port, "/") for _ in range(2)]
    assert [a.status for a in answers] == [200, 200]
    assert [_sent(a)["connection"] for a in answers] == [value] * 2


async def test_connection_proxy_header_leaves_an_http2_backend_without_one():
    async with _h2_answering([(b":status", b"200")]) as h2:
        route = _route("h2c", connection_header="close")
        async with running_proxy(_table(route, 0, h2.port)) as (_, port):
            assert (await ask("http/1.1", port, "/")).status == 200
    assert b"connection" not in dict(h2.headers[-1])


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_enable_access_log_false_writes_no_line_for_the_route(backend_pair, client, caplog):
    # ingress-nginx e2e annotations/disableaccesslog.go: `access_log off` for the
    # location; here: the route's requests leave no access-log line, others do.
    caplog.set_level(logging.INFO, logger="waygate.proxy.access")
    main, _ = backend_pair
    quiet = _route(access_log_disabled=True)
    loud = Route(
        namespace="demo",
        name="loud",
        host="loud.test",
        backends=(RouteBackend(service="svc", port="http", weight=1),),
    )
    endpoints = {
        SERVICE.key: (
            Endpoint(
                namespace="demo",
                service="svc",
                address="127.0.0.1",
                ports=(EndpointPort("http", main.port),),
            ),
        )
    }
    table = build_table(
        {quiet.key: quiet, loud.key: loud},
        endpoints,
        {SERVICE.key: SERVICE},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
    )
    async with running_proxy(table) as (server, port):
        assert (await ask(client, port, "/quiet")).status == 200
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /loud HTTP/1.1\r\nHost: loud.test\r\nConnection: close\r\n\r\n")
        await asyncio.wait_for(reader.read(-1), 10)
        writer.close()
        assert server.metrics.requests[("demo/shop-0", b"GET", 2)] == 1  # still counted
    lines = [r for r in caplog.records if r.name == "waygate.proxy.access"]
    assert [line.route for line in lines] == ["demo/loud"]  # type: ignore[attr-defined]


@pytest.mark.parametrize("client", ["http/1.1", "h2c"])
async def test_an_http2_backends_listed_status_without_default_backend(backend_pair, client):
    main, _ = backend_pair
    route = _route("h2c", custom_http_errors=(404,))
    async with (
        _h2_answering([(b":status", b"404"), (b"x-from", b"backend")]) as h2,
        running_proxy(_table(route, main.port, h2.port)) as (server, port),
    ):
        answer = await ask(client, port, "/missing")
        held = _held(server)
    assert answer.status == 404
    assert "x-from" not in answer.headers
    assert "custom-http-errors" in answer.headers["x-waygate-error"]
    assert (held["in_flight"], held["h2_streams"]) == ({}, 0)
    assert server.metrics.requests[("demo/shop-0", b"GET", 4)] == 1


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_the_proxys_own_listed_failure_goes_to_the_default_backend(
    backend_pair, client, backend
):
    # nginx's error_page applies to its own errors too (with or without
    # proxy_intercept_errors): a backend that refuses the connection is a 502 the
    # error backend answers, with X-Code 502; without a default-backend the proxy's
    # own page keeps its reason.
    _, errors = backend_pair
    dead = await _dead_port()
    route = _route(backend, custom_http_errors=(502,), default_backend="errors")
    plain = _route(backend, custom_http_errors=(502,))
    async with running_proxy(_table(route, dead, dead, errors.port)) as (server, port):
        answer = await ask(client, port, "/down?x=1", [("X-Request-ID", "r-2")])
        held = _held(server)
    async with running_proxy(_table(plain, dead, dead)) as (_, port):
        own = await ask(client, port, "/down")
    assert answer.status == 200
    sent = _sent(answer)
    assert (sent["x-code"], sent["x-original-uri"], sent["x-request-id"]) == (
        "502",
        "/down?x=1",
        "r-2",
    )
    assert "x-format" not in sent  # no Accept: nginx sends no empty header
    assert (held["waiting"], held["in_flight"], held["h2_streams"]) == ({}, {}, 0)
    assert own.status == 502
    assert "custom-http-errors" not in own.headers.get("x-waygate-error", "")


async def test_disabled_interception_still_takes_the_proxys_own_failures(backend_pair):
    # disable-proxy-intercept-errors turns proxy_intercept_errors off: the backend's
    # answers pass, but nginx's error_page still takes its own 502.
    _, errors = backend_pair
    dead = await _dead_port()
    route = _route(
        custom_http_errors=(502,), default_backend="errors", intercept_errors_disabled=True
    )
    async with running_proxy(_table(route, dead, errors_port=errors.port)) as (_, port):
        answer = await ask("http/1.1", port, "/down")
    assert (answer.status, _sent(answer)["x-code"]) == (200, "502")
