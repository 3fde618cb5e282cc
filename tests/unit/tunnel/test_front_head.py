"""The HTTPS front's request rules (sans-IO): target, node mapping, the forwarded head."""

from __future__ import annotations

import pytest

from waygate.tunnel.front import (
    BadRequest,
    Destination,
    destination,
    error_response,
    node_address_map,
    parse_head,
    upstream_head,
)

NODES = node_address_map(("10.0.0.5=Edge-1", "fd00::5=edge-2"))


def test_host_header_names_an_address_of_a_mapped_node() -> None:
    head = parse_head(b"GET /containerLogs/ns/pod/c HTTP/1.1\r\nHost: 10.0.0.5:10250\r\n\r\n")
    assert (head.host, head.port, head.target) == ("10.0.0.5", 10250, b"/containerLogs/ns/pod/c")
    assert destination(head, NODES) == Destination("edge-1", "10.0.0.5:10250", "10.0.0.5", 10250)


def test_absolute_form_wins_over_host_and_becomes_origin_form() -> None:
    head = parse_head(b"GET http://[fd00::5]:10250/stats?x=1 HTTP/1.1\r\nHost: other:1\r\n\r\n")
    assert destination(head, NODES) == Destination("edge-2", "[fd00::5]:10250", "fd00::5", 10250)
    assert upstream_head(head).startswith(b"GET /stats?x=1 HTTP/1.1\r\n")


def test_a_node_name_as_host_dials_the_agents_default_host() -> None:
    head = parse_head(b"GET / HTTP/1.1\r\nHost: Edge-1.:8090\r\n\r\n")
    assert destination(head, NODES) == Destination("edge-1", "127.0.0.1:8090", "edge-1", 8090)


@pytest.mark.parametrize(
    ("head", "status", "message"),
    [
        (b"GET / HTTP/1.1\r\n\r\n", 400, "no Host header"),
        (b"GET / HTTP/1.1\r\nHost: 10.0.0.5\r\n\r\n", 400, "HOST:PORT"),
        (b"GET / HTTP/1.1\r\nHost: 10.0.0.5:99999\r\n\r\n", 400, "HOST:PORT"),
        (b"GET / HTTP/1.1\r\nHost: a:1\r\nHost: b:2\r\n\r\n", 400, "more than one Host"),
        (
            b"GET / HTTP/1.1\r\nHost: 10.0.0.6:10250\r\n\r\n",
            400,
            "no edge node is known for address 10.0.0.6",
        ),
        (b"GARBAGE\r\n\r\n", 400, "malformed request"),
    ],
)
def test_requests_that_cannot_be_forwarded(head: bytes, status: int, message: str) -> None:
    with pytest.raises(BadRequest, match=message) as caught:
        destination(parse_head(head), NODES)
    assert caught.value.status == status


def test_forwarded_head_drops_hop_by_hop_and_identity_headers_and_asks_to_close() -> None:
    head = parse_head(
        b"POST /exec HTTP/1.1\r\nHost: 10.0.0.5:10250\r\nConnection: keep-alive, X-Foo\r\n"
        b"Keep-Alive: 5\r\nX-Remote-User: admin\r\nImpersonate-User: root\r\n"
        b"X-Remote-Extra-Scopes: all\r\nX-Forwarded-Client-Cert: x\r\nContent-Length: 3\r\n"
        b"Authorization: Bearer t\r\n\r\n"
    )
    forwarded = upstream_head(head)
    assert forwarded == (
        b"POST /exec HTTP/1.1\r\nHost: 10.0.0.5:10250\r\nContent-Length: 3\r\n"
        b"Authorization: Bearer t\r\nConnection: close\r\n\r\n"
    )


def test_an_upgrade_keeps_its_upgrade_headers() -> None:
    head = parse_head(
        b"GET /exec/ns/p/c?command=sh HTTP/1.1\r\nHost: 10.0.0.5:10250\r\n"
        b"Connection: Upgrade\r\nUpgrade: websocket\r\nSec-WebSocket-Key: k\r\n\r\n"
    )
    assert head.upgrade
    forwarded = upstream_head(head)
    assert forwarded.endswith(
        b"Sec-WebSocket-Key: k\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n"
    )
    assert b"close" not in forwarded


def test_node_address_map_refuses_bad_pairs() -> None:
    for bad in ("10.0.0.5", "node=edge-1", "10.0.0.5="):
        with pytest.raises(ValueError, match="ADDR=NODE"):
            node_address_map((bad,))


def test_error_response_is_one_line_with_its_length() -> None:
    response = error_response(503, "no agent\r\nfor node x")
    head, _, body = response.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503 Service Unavailable\r\n")
    assert body == b"no agent  for node x\n"
    assert f"Content-Length: {len(body)}".encode() in head and b"Connection: close" in head


def test_headers_the_connection_header_names_are_dropped_but_never_host() -> None:
    head = parse_head(
        b"GET / HTTP/1.1\r\nHost: 10.0.0.5:10250\r\nConnection: X-Secret, host\r\n"
        b"X-Secret: s\r\nAccept: */*\r\n\r\n"
    )
    assert upstream_head(head) == (
        b"GET / HTTP/1.1\r\nHost: 10.0.0.5:10250\r\nAccept: */*\r\nConnection: close\r\n\r\n"
    )


def test_parse_head_reads_the_first_head_only() -> None:
    head = parse_head(
        b"GET /a HTTP/1.1\r\nHost: 10.0.0.5:10250\r\n\r\n"
        b"POST /b HTTP/1.0\r\nHost: 10.0.0.6:1\r\nX-Second: 1\r\n\r\n"
    )
    assert (head.method, head.target, head.version) == (b"GET", b"/a", "1.1")
    assert [n for n, _ in head.headers] == [b"Host"]
