"""HTTP/2 no more lenient than HTTP/1.1 (issue 31, finding 10): what the HTTP/1.1
rule book refuses is refused on HTTP/2 too, with the same status, and a
backend's malformed response field is a 502 with its reason, never relayed."""

from __future__ import annotations

import pytest

from tests.support.h2attack import RawH2
from tests.support.h2client import H2Client
from tests.support.h2harness import H2Backend, running_h2_proxy, serve_h2_upstreams
from tests.support.poll import until
from tests.support.proxyharness import endpoint, route, table

AUTHORITY = b"echo.test"


@pytest.mark.parametrize(
    ("fields", "status"),
    [
        ([(b"content-length", b"007")], 400),  # HTTP/1.1: no leading zeros
        ([(b"content-length", b"0" * 19)], 400),
    ],
    ids=["leading_zeros", "nineteen_digits"],
)
async def test_content_length_by_the_http1_rule(upstream, fields, status):
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_h2_proxy(routes) as (_, port):
        client = await RawH2.connect(port)
        try:
            request = [*RawH2.request(AUTHORITY, b"/cl", b"POST"), *fields]
            client.send(client.headers(1, request, end_stream=False))
            await until(lambda: 1 in client.statuses, "the answer", timeout=10)
        finally:
            await client.close()
    assert client.statuses[1] == status
    assert not upstream.requests


@pytest.mark.parametrize(
    ("scheme", "path", "status"),
    [
        (b"ftp", b"/", 400),
        (b"gopher", b"/", 400),
        (b"http", b"/" + b"a" * (8 * 1024), 414),  # as its HTTP/1.1 request line would be
        (b"https", b"/" + b"a" * (8 * 1024 - 30), 200),
        (b"https", b"/plain", 200),
    ],
    ids=["ftp", "gopher", "long_path", "path_below_the_limit", "https"],
)
async def test_scheme_and_path_length(upstream, scheme, path, status):
    routes = table([route("echo.test", [("echo", 100)])], [endpoint("echo", upstream.port)])
    async with running_h2_proxy(routes) as (_, port):
        client = await RawH2.connect(port)
        try:
            fields = [
                (b":method", b"GET"),
                (b":scheme", scheme),
                (b":authority", AUTHORITY),
                (b":path", path),
            ]
            client.send(client.headers(1, fields))
            await until(lambda: 1 in client.statuses, "the answer", timeout=10)
        finally:
            await client.close()
    assert client.statuses[1] == status
    assert len(upstream.requests) == (1 if status == 200 else 0)


@pytest.mark.parametrize(
    "answer",
    [
        [(b":status", b"200"), (b"x-bad", b"a\x01b")],
        [(b":status", b"200"), (b"x-bad", b"a\x7fb")],
        [(b":status", b"2x0")],
    ],
    ids=["control", "delete", "status"],
)
async def test_backend_malformed_response_field_is_a_502_not_relayed(answer):
    backend = await H2Backend(answer_fields=answer).start()
    routes = [route("h2.test", [("h2", 100)], upstream_protocol="h2c")]
    async with running_h2_proxy(table(routes, [endpoint("h2", backend.port)])) as (server, port):
        serve_h2_upstreams(server, routes)
        client = await H2Client.connect(port)
        try:
            response = await client.request("GET", "/bad", "h2.test")
            healthy = await client.request("GET", "/bad", "h2.test")  # the connection lives on
        finally:
            await client.close()
    await backend.stop()
    assert response.status == 502
    assert response.header(b"x-waygate-error") == b"upstream sent a malformed response head"
    assert response.header(b"x-bad") is None
    assert healthy.status == 502
