"""ingress-nginx's traffic annotations in the request core, for HTTP/1.1 and HTTP/2 clients.

A real proxy on real sockets in front of real HTTP/1.1 backends
(`RecordingUpstream`, whose JSON answer names the upstream that served it). The
assertions are ingress-nginx's own, ported from kubernetes/ingress-nginx
test/e2e/annotations/canary.go (controller v1.15) and its balancer.lua
(`route_to_alternative_balancer`): the sticky cookie first, then the header, the
cookie, the weight.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import pytest

from tests.integration.proxy.test_request_core import (
    CLIENTS,
    HOST,
    Backends,
    _dead_port,
    _held,
    ask,
    built,
    core_route,
    post,
)
from tests.support.h2client import H2Client
from tests.support.h2harness import H2Backend
from tests.support.poll import until
from tests.support.proxyharness import RecordingUpstream, running_proxy
from waygate.proxy.routing import Defaults, RouteTable, build_table
from waygate.resolver.model import (
    BalancePolicy,
    Canary,
    Endpoint,
    EndpointPort,
    Route,
    RouteBackend,
    Service,
    ServicePort,
    StickySessions,
    UrlMirror,
)


class Upstreams:
    def __init__(self) -> None:
        self.main = RecordingUpstream("main")
        self.canary = RecordingUpstream("canary")

    def endpoints(self) -> dict[tuple[str, str], tuple[Endpoint, ...]]:
        return {
            ("web", name): (
                Endpoint(
                    namespace="web",
                    service=name,
                    address="127.0.0.1",
                    ports=(EndpointPort("http", upstream.port),),
                ),
            )
            for name, upstream in (("main", self.main), ("canary", self.canary))
        }


@pytest.fixture
async def upstreams() -> AsyncIterator[Upstreams]:
    made = Upstreams()
    await made.main.start()
    await made.canary.start()
    yield made
    await made.main.stop()
    await made.canary.stop()


def canary_table(upstreams: Upstreams, policy: Canary, **kw: Any) -> RouteTable:
    route = Route(
        namespace="web",
        name="ingress:main",
        host=HOST,
        backends=(RouteBackend("main", 100), RouteBackend("canary", 0)),
        sticky=kw.pop("sticky", StickySessions(disable_cookies=True)),
        canary=policy,
        **kw,
    )
    return build_table(
        {route.key: route}, upstreams.endpoints(), {}, defaults=Defaults(), cookie_key=b"k" * 32
    )


async def served_by(client: str, port: int, headers: list[tuple[str, str]]) -> str:
    answer = await ask(client, port, "/info", headers)
    assert answer.status == 200
    return str(json.loads(answer.body)["upstream"])


# ---------------------------------------------------------------- canary


@pytest.mark.parametrize("client", CLIENTS)
async def test_canary_precedence_header_then_cookie_then_weight(upstreams, client):
    # canary.go Context("when canaried by header with value and cookie"): a header
    # value that does not match leaves the cookie to decide; Context("when canaried
    # by cookie") It("respects always and never values"): anything else is the
    # weight's (0 here: main).
    policy = Canary(1, header="CanaryByHeader", header_value="DoCanary", cookie="CanaryByCookie")
    async with running_proxy(canary_table(upstreams, policy)) as (_, port):
        cases = {
            "header": [("CanaryByHeader", "DoCanary"), ("Cookie", "CanaryByCookie=never")],
            "other header, cookie always": [
                ("CanaryByHeader", "otherheadervalue"),
                ("Cookie", "CanaryByCookie=always"),
            ],
            "cookie never": [("Cookie", "x=1; CanaryByCookie=never")],
            "bad cookie value": [("Cookie", "CanaryByCookie=badcookievalue")],
            "nothing": [],
        }
        seen = {name: await served_by(client, port, headers) for name, headers in cases.items()}
    assert seen == {
        "header": "canary",
        "other header, cookie always": "canary",
        "cookie never": "main",
        "bad cookie value": "main",
        "nothing": "main",
    }


@pytest.mark.parametrize("client", CLIENTS)
async def test_canary_header_always_and_never_beat_the_cookie(upstreams, client):
    # balancer.lua: header "always"/"never" decide before the cookie is read.
    policy = Canary(1, header="CanaryByHeader", cookie="CanaryByCookie", weight=100)
    async with running_proxy(canary_table(upstreams, policy)) as (_, port):
        never = await served_by(
            client, port, [("CanaryByHeader", "never"), ("Cookie", "CanaryByCookie=always")]
        )
        always = await served_by(
            client, port, [("CanaryByHeader", "always"), ("Cookie", "CanaryByCookie=never")]
        )
        weighted = await served_by(client, port, [])
    assert (never, always, weighted) == ("main", "canary", "canary")


async def test_canary_weight_of_max_100_and_the_total(upstreams):
    # canary.go It("should route requests split between mainline and canary if canary
    # weight is 50"): both sides get requests (generous bounds, never exact shares).
    async with running_proxy(canary_table(upstreams, Canary(1, weight=50))) as (_, port):
        sides = [await served_by("http/1.1", port, []) for _ in range(60)]
    assert sides.count("main") >= 10 and sides.count("canary") >= 10


@pytest.mark.parametrize("client", CLIENTS)
async def test_a_redispatch_stays_on_the_side_the_canary_chose(upstreams, client):
    # A failed connect goes to another endpoint of the same side: a request the
    # header sent to the canary is never answered by the main backends instead.
    dead = await _dead_port()
    endpoints = upstreams.endpoints()
    endpoints[("web", "canary")] += (
        Endpoint(
            namespace="web",
            service="canary",
            address="127.0.0.1",
            ports=(EndpointPort("http", dead),),
        ),
    )
    route = Route(
        namespace="web",
        name="ingress:main",
        host=HOST,
        backends=(RouteBackend("main", 100), RouteBackend("canary", 0)),
        balance=BalancePolicy.ROUND_ROBIN,
        sticky=StickySessions(disable_cookies=True),
        canary=Canary(1, header="X-Canary"),
    )
    table = build_table(
        {route.key: route}, endpoints, {}, defaults=Defaults(), cookie_key=b"k" * 32
    )
    async with running_proxy(table) as (server, port):
        sides = [await served_by(client, port, [("X-Canary", "always")]) for _ in range(4)]
        assert sides == ["canary"] * 4
        assert server.metrics.redispatches >= 1


def _cookie(answer_headers: dict[str, str], name: str) -> str | None:
    value = answer_headers.get("set-cookie", "")
    if not value.startswith(name + "="):
        return None
    return value.split(";")[0]


@pytest.mark.parametrize("client", CLIENTS)
async def test_affinity_canary_behavior_sticky(upstreams, client):
    # canary.go Context("canary affinity behavior") It("always routes traffic to canary
    # if first request was affinitized to canary (default behavior)"): the first request
    # forced by header; then the cookie alone keeps it on the canary. (Weight 0, not
    # canary.go's 1: a request the header does not decide must land on main every time
    # here, where a 1% draw would make the test fail once in a hundred runs.)
    policy = Canary(1, header="ForceCanary", header_value="yes", weight=0)
    sticky = StickySessions(cookie_name="aff")
    async with running_proxy(canary_table(upstreams, policy, sticky=sticky)) as (_, port):
        forced = await ask(client, port, "/info", [("ForceCanary", "yes")])
        assert json.loads(forced.body)["upstream"] == "canary"
        cookie = _cookie(forced.headers, "aff")
        assert cookie is not None
        sides = {await served_by(client, port, [("Cookie", cookie)]) for _ in range(10)}
        assert sides == {"canary"}
        # balancer.lua: a request affinitized to the main backend stays there, even
        # when its header asks for the canary.
        main = await ask(client, port, "/info", [("ForceCanary", "no")])
        assert json.loads(main.body)["upstream"] == "main"
        main_cookie = _cookie(main.headers, "aff")
        assert main_cookie is not None
        kept = await served_by(client, port, [("ForceCanary", "yes"), ("Cookie", main_cookie)])
        assert kept == "main"


@pytest.mark.parametrize("client", CLIENTS)
async def test_affinity_canary_behavior_legacy(upstreams, client):
    # canary.go It("routes traffic to either mainline or canary backend (legacy
    # behavior)"): the canary's answer sets no affinity cookie.
    policy = Canary(1, header="ForceCanary", header_value="yes", weight=50, legacy_affinity=True)
    sticky = StickySessions(cookie_name="aff")
    async with running_proxy(canary_table(upstreams, policy, sticky=sticky)) as (_, port):
        forced = await ask(client, port, "/info", [("ForceCanary", "yes")])
        assert json.loads(forced.body)["upstream"] == "canary"
        assert _cookie(forced.headers, "aff") is None
        sides = [await served_by(client, port, []) for _ in range(40)]
    assert "main" in sides and "canary" in sides


# ---------------------------------------------------------------- limit-rate

PAIRS = [(client, backend) for client in CLIENTS for backend in ("http/1.1", "h2c")]


@pytest.mark.parametrize(("client", "backend"), PAIRS)
@pytest.mark.parametrize("after", [0, 1024])
async def test_limit_rate_paces_the_body_after_limit_rate_after(client, backend, after):
    # nginx's limit_rate (ingress-nginx limit-rate, KB/s; limitrate.go checks only the
    # rendered `limit_rate 1k;`): at most after + rate x (t + 1) body bytes by time t,
    # so a body of `size` bytes takes at least (size - after - rate) / rate seconds.
    # A lower bound on the time, never an upper one (load only slows a test down).
    rate = 1024
    backends = Backends()
    await backends.h1.start()
    await backends.h2.start()
    try:
        route = core_route(backend, limit_rate=rate, limit_rate_after=after)
        # /nolength: the HTTP/2 backend's body in two DATA frames and trailers.
        path = ("/nolength-" if backend == "h2c" else "/p-") + "a" * (1300 + after)
        async with running_proxy(built([route], [backends.endpoint()])) as (_, port):
            loop = asyncio.get_running_loop()
            began = loop.time()
            answer = await ask(client, port, path)
            took = loop.time() - began
            again = await ask(client, port, "/short")  # the connection's pool is intact
    finally:
        await backends.h1.stop()
        await backends.h2.stop()
    assert answer.status == 200 and again.status == 200
    assert path.encode() in answer.body
    size = len(answer.body)
    assert size > after + rate
    assert took >= 0.9 * (size - after - rate) / rate, (size, took)


async def test_an_http2_backends_trailers_follow_the_paced_body():
    # The backend's trailers (gRPC's status lives there) and its END_STREAM arrive
    # while the body is held back: they go after the body's last byte, trailers kept.
    backends = Backends()
    await backends.h1.start()
    await backends.h2.start()
    try:
        route = core_route("h2c", limit_rate=1024)
        path = "/nolength-" + "a" * 1300
        async with running_proxy(built([route], [backends.endpoint()])) as (_, port):
            h2 = await H2Client.connect(port)
            try:
                response = await h2.request("GET", path, HOST)
            finally:
                await h2.close()
    finally:
        await backends.h1.stop()
        await backends.h2.stop()
    assert response.status == 200
    assert response.body == b"first," + path.encode()
    assert (b"x-trailer", b"t") in response.trailers


@pytest.mark.parametrize(("client", "backend"), PAIRS)
async def test_a_client_gone_while_paced_leaves_nothing_behind(client, backend):
    # The client goes while its answer is held back: the exchange ends, every slot
    # and count it held is given back, the pacing timer lets go, the endpoint serves.
    backends = Backends()
    await backends.h1.start()
    await backends.h2.start()
    try:
        route = core_route(backend, limit_rate=1024)
        path = "/p-" + "a" * 4000  # 4 KB at 1 KB/s: held back for seconds
        async with running_proxy(built([route], [backends.endpoint()])) as (server, port):
            if client == "h2c":
                h2 = await H2Client.connect(port)
                stream = h2.start("GET", path, HOST)
                h2.flush()
            else:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {HOST}\r\n\r\n".encode())
            await until(lambda: backends.requests(backend) == 1, "the backend asked")
            if client == "h2c":
                h2.h2.reset_stream(stream)
                h2.flush()
                await h2.close()
            else:
                writer.transport.abort()
            await until(lambda: not any(_held(server).values()), "everything given back")
            assert (await ask(client, port, "/after")).status == 200
    finally:
        await backends.h1.stop()
        await backends.h2.stop()


# ---------------------------------------------------------------- mirror-target


def mirrored_table(upstreams: Upstreams, mirror: UrlMirror, **route_fields: Any) -> RouteTable:
    route = Route(
        namespace="web",
        name="mirrored",
        host=HOST,
        backends=(RouteBackend("main", 1),),
        url_mirror=mirror,
        **route_fields,
    )
    return build_table(
        {route.key: route}, upstreams.endpoints(), {}, defaults=Defaults(), cookie_key=b"k" * 32
    )


@pytest.mark.parametrize("client", CLIENTS)
async def test_mirror_target_with_request_uri_and_mirror_host(upstreams, client):
    # mirror.go: It("should set mirror-target to https://test.env.com/$request_uri"):
    # nginx proxy_pass's the copy to the URL, `$request_uri` the request's target, Host
    # mirror-host (annotations.md "Mirror"); the answer is dropped.
    copies = upstreams.canary
    target = f"http://127.0.0.1:{copies.port}/copy$request_uri"
    mirror = UrlMirror(target, host="test.env.com")
    async with running_proxy(mirrored_table(upstreams, mirror)) as (server, port):
        assert await served_by(client, port, [("X-Trace", "t1")]) == "main"
        await until(lambda: copies.requests, "the copy reached the mirror")
        await until(lambda: server.mirrors.sent == 1, "the copy's answer was read")
    [copy] = copies.requests
    assert copy["target"] == "/copy/info"
    headers = {k.lower(): v for k, v in copy["headers"]}  # type: ignore[attr-defined]
    assert headers["host"] == "test.env.com" and headers["x-trace"] == "t1"
    assert len(upstreams.main.requests) == 1


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("request_body", [True, False], ids=["body-on", "body-off"])
async def test_mirror_request_body(upstreams, client, request_body):
    # mirror.go: It("should set mirror-target to http://localhost/mirror") with
    # "mirror_request_body on" (the default), It("should disable mirror-request-body"):
    # the buffered body goes with the copy, or none (no framing headers either).
    # Without a path in the URL the request's query goes with the copy (nginx passes
    # the request's args).
    copies = upstreams.canary
    mirror = UrlMirror(f"http://127.0.0.1:{copies.port}", request_body=request_body)
    async with running_proxy(mirrored_table(upstreams, mirror)) as (server, port):
        assert (await post(client, port, b"hello", length=True)).status == 200
        assert await served_by(client, port, []) == "main"
        await until(lambda: server.mirrors.sent == 2, "the copies")
    copied = sorted((c["method"], c["target"], c["body_length"]) for c in copies.requests)
    assert copied == [("GET", "/", 0), ("POST", "/", 5 if request_body else 0)]
    for copy in copies.requests:
        names = {k.lower() for k, _ in copy["headers"]}  # type: ignore[attr-defined]
        assert ("content-length" in names) == (copy["method"] == "POST" and request_body)
        assert "transfer-encoding" not in names
    assert [r["body_length"] for r in upstreams.main.requests] == [5, 0]


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize("http10", [False, True], ids=["http11", "http10"])
async def test_a_body_of_unknown_length_is_copied_as_the_payload(upstreams, client, http10):
    # Chunked from an HTTP/1.1 client, without a content-length from an HTTP/2 one: the
    # buffered body is chunk-framed on its way upstream (bare for proxy-http-version
    # 1.0): the copy carries its framing with it, never the chunks as its content.
    copies = upstreams.canary
    mirror = UrlMirror(f"http://127.0.0.1:{copies.port}", request_body=True)
    async with running_proxy(mirrored_table(upstreams, mirror, upstream_http10=http10)) as (
        server,
        port,
    ):
        assert (await post(client, port, b"hello", length=False)).status == 200
        await until(lambda: server.mirrors.sent == 1, "the copy")
    assert [(c["method"], c["body_length"]) for c in copies.requests] == [("POST", 5)]
    assert [r["body_length"] for r in upstreams.main.requests] == [5]


async def test_a_body_past_the_copys_bound_is_not_copied(upstreams):
    copies = upstreams.canary
    mirror = UrlMirror(f"http://127.0.0.1:{copies.port}/$request_uri")
    async with running_proxy(mirrored_table(upstreams, mirror)) as (server, port):
        assert (await post("http/1.1", port, b"x" * 70000, length=True)).status == 200
        assert server.mirrors.dropped == 1 and server.mirrors.sent == 0
    assert upstreams.main.requests[0]["body_length"] == 70000 and not copies.requests


async def test_a_mirror_that_never_answers_neither_slows_nor_grows(upstreams):
    # Fire and forget, bounded per route: the backend's answers come at once while
    # the route's copies in flight stay at its bound (the rest dropped, counted).
    silent = await asyncio.start_server(lambda r, w: None, "127.0.0.1", 0)
    port_of_silent = silent.sockets[0].getsockname()[1]
    mirror = UrlMirror(f"http://127.0.0.1:{port_of_silent}/$request_uri")
    try:
        async with running_proxy(mirrored_table(upstreams, mirror)) as (server, port):
            bound = 32
            answers = [await served_by("http/1.1", port, []) for _ in range(bound + 4)]
            assert answers == ["main"] * (bound + 4)
            assert server.mirrors.dropped >= 4
            assert len(server.mirrors.tasks) <= bound
    finally:
        silent.close()


# ---------------------------------------------------------------- proxy-next-upstream


class Failing:
    """An HTTP/1.1 backend answering every request with `answer` (a status or a
    malformed head), keeping count."""

    def __init__(self, answer: bytes) -> None:
        self.answer = answer
        self.requests = 0
        self.server: asyncio.AbstractServer | None = None
        self.port = 0

    async def start(self) -> Failing:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                while await reader.readuntil(b"\r\n\r\n"):
                    self.requests += 1
                    writer.write(self.answer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            finally:
                writer.close()

        self.server = await asyncio.start_server(serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    def stop(self) -> None:
        assert self.server is not None
        self.server.close()


SERVICE_UNAVAILABLE = b"HTTP/1.1 503 Service Unavailable\r\nContent-Length: 4\r\n\r\ngone"
MALFORMED = b"HTTP/1.1 200 OK\r\nBad Header : x\r\n\r\n"


def next_upstream_table(good: int, bad: int, tokens: str, **kw: Any) -> RouteTable:
    route = Route(
        namespace="web",
        name="retried",
        host=HOST,
        backends=(RouteBackend("main", 1),),
        balance=BalancePolicy.ROUND_ROBIN,
        next_upstream=tokens,
        **kw,
    )
    endpoints = tuple(
        Endpoint(
            namespace="web",
            service="main",
            address="127.0.0.1",
            ports=(EndpointPort("http", port),),
        )
        for port in (bad, good)
    )
    return build_table(
        {route.key: route},
        {("web", "main"): endpoints},
        {},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
    )


@pytest.mark.parametrize("client", CLIENTS)
@pytest.mark.parametrize(
    ("tokens", "answer"),
    [("error timeout http_503", SERVICE_UNAVAILABLE), ("invalid_header", MALFORMED)],
    ids=["http_503", "invalid_header"],
)
async def test_next_upstream_drops_the_answer_and_tries_another_endpoint(
    upstreams, client, tokens, answer
):
    # proxy.go It("should build proxy next upstream") ("error timeout http_502"; ingress-
    # nginx checks the rendered proxy_next_upstream): here the behaviour itself, as
    # nginx's proxy_next_upstream documents it: the failing endpoint's answer is never
    # seen by the client while another endpoint answers.
    bad = await Failing(answer).start()
    try:
        table = next_upstream_table(upstreams.main.port, bad.port, tokens)
        async with running_proxy(table) as (server, port):
            answers = [await ask(client, port, "/info") for _ in range(4)]
            assert [a.status for a in answers] == [200] * 4
            assert bad.requests >= 1
            assert server.metrics.redispatches >= 1
            # The dropped answers' connections gave back what they held.
            await until(lambda: not any(_held(server).values()), "everything given back")
    finally:
        bad.stop()
    assert len(upstreams.main.requests) == 4


@pytest.mark.parametrize("client", CLIENTS)
async def test_next_upstream_resends_only_what_it_can_send_exactly(upstreams, client):
    # nginx: a non-idempotent request (POST) only with non_idempotent; here a body
    # only when it was buffered whole (request buffering, the default), replayed to
    # the next endpoint; when no try is left the last answer goes to the client as
    # it came; proxy-next-upstream-timeout bounds the tries from the request's start.
    bad = await Failing(SERVICE_UNAVAILABLE).start()

    async def posts(table: RouteTable) -> list[int]:
        async with running_proxy(table) as (server, port):
            found = sorted(
                [(await post(client, port, b"hello", length=True)).status for _ in (1, 2)]
            )
            await until(lambda: not any(_held(server).values()), "everything given back")
            return found

    try:
        good, failing = upstreams.main.port, bad.port
        assert await posts(next_upstream_table(good, failing, "http_503")) == [200, 503]
        resent = next_upstream_table(good, failing, "http_503 non_idempotent")
        assert await posts(resent) == [200, 200]
        # The first table's 200 and both of these: each body whole at the good endpoint.
        assert [r["body_length"] for r in upstreams.main.requests] == [5, 5, 5]
        streamed = next_upstream_table(
            good, failing, "http_503 non_idempotent", request_buffering=False
        )
        assert await posts(streamed) == [200, 503]
        only_bad = next_upstream_table(failing, failing, "http_503", next_upstream_tries=2)
        async with running_proxy(only_bad) as (_, port):
            assert (await ask(client, port, "/info")).status == 503
        timed_out = next_upstream_table(good, failing, "http_503", next_upstream_timeout=1e-9)
        async with running_proxy(timed_out) as (_, port):
            statuses = sorted([(await ask(client, port, "/info")).status for _ in range(2)])
            assert statuses == [200, 503]
    finally:
        bad.stop()


@pytest.mark.parametrize(
    ("client", "tokens", "fields"),
    [
        ("http/1.1", "http_503", [(b":status", b"503")]),
        ("h2c", "http_503", [(b":status", b"503")]),
        ("h2c", "invalid_header", [(b":status", b"200"), (b"x-bad", b"a\x01b")]),
        # Through an HTTP/1.1 client's bridge: the same field refused with the same rule.
        ("http/1.1", "invalid_header", [(b":status", b"200"), (b"x-bad", b"a\x01b")]),
    ],
    ids=["http_503-http/1.1", "http_503-h2c", "invalid_header-h2c", "invalid_header-http/1.1"],
)
async def test_next_upstream_with_http2_backends(client, tokens, fields):
    # The same rule where the backend speaks HTTP/2: the answer's stream is reset and
    # the request goes to another endpoint (an HTTP/2 client's stream, or the HTTP/1.1
    # client's bridge).
    good = await H2Backend().start()
    bad = await H2Backend(answer_fields=fields).start()
    service = Service(
        namespace="web",
        name="main",
        ports=(ServicePort("h2", 80, "h2", app_protocol="kubernetes.io/h2c"),),
    )
    route = Route(
        namespace="web",
        name="retried",
        host=HOST,
        backends=(RouteBackend("main", 1),),
        balance=BalancePolicy.ROUND_ROBIN,
        next_upstream=tokens,
    )
    endpoints = tuple(
        Endpoint(
            namespace="web", service="main", address="127.0.0.1", ports=(EndpointPort("h2", p),)
        )
        for p in (bad.port, good.port)
    )
    table = build_table(
        {route.key: route},
        {("web", "main"): endpoints},
        {service.key: service},
        defaults=Defaults(),
        cookie_key=b"k" * 32,
    )
    try:
        async with running_proxy(table) as (server, port):
            answers = [await ask(client, port, "/h2") for _ in range(4)]
            assert [a.status for a in answers] == [200] * 4
            assert server.metrics.redispatches >= 1
            await until(lambda: not any(_held(server).values()), "everything given back")
    finally:
        await good.stop()
        await bad.stop()
    assert len(good.processed) == 4 and bad.processed
