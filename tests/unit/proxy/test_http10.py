"""waygate.proxy.http10's head rules (the request core's side is tested on real sockets in
tests/integration/proxy/test_ingress_http10_redirects.py)."""

from __future__ import annotations

from types import SimpleNamespace

from tests.unit.proxy.test_decision import Facts, ep, rt, view
from waygate.proxy import decision, http10
from waygate.proxy.decision import Forward, decide
from waygate.proxy.http1 import parse_request_head


def test_request_head_says_http_1_0_and_close():
    head = b"GET /a?b HTTP/1.1\r\nHost: x\r\nX-Forwarded-For: 1.2.3.4\r\n\r\n"
    assert http10.request_head(head, False) == (
        b"GET /a?b HTTP/1.0\r\nHost: x\r\nX-Forwarded-For: 1.2.3.4\r\nConnection: close\r\n\r\n"
    )


def test_a_head_without_fields():
    assert http10.request_head(b"GET / HTTP/1.1\r\n\r\n", False) == (
        b"GET / HTTP/1.0\r\nConnection: close\r\n\r\n"
    )


def test_the_chunked_coding_goes_and_the_length_comes_with_the_body():
    head = b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\ntraceparent: t\r\n\r\n"
    out = http10.request_head(head, True)
    assert out == b"POST / HTTP/1.0\r\nHost: x\r\ntraceparent: t\r\nConnection: close\r\n\r\n"
    forward = SimpleNamespace(http10=True, req=SimpleNamespace(chunked=True))
    with_length = http10.buffered_head(forward, out, SimpleNamespace(size=11))
    assert with_length.endswith(b"Connection: close\r\nContent-Length: 11\r\n\r\n")
    assert http10.buffered_head(None, out, SimpleNamespace(size=11)) == out


def test_a_header_value_naming_the_coding_is_left_alone():
    head = b"POST / HTTP/1.1\r\nX-Note: Transfer-Encoding: chunked\r\n\r\n"
    assert b"X-Note: Transfer-Encoding: chunked\r\n" in http10.request_head(head, False)


def test_only_a_route_with_it_has_the_rules_and_decide_builds_the_head():
    entry = next(iter(view([rt(upstream_http10=True)], [ep()]).table.entries()))
    assert decision.rule_names(entry) == (["http10_upgrade"], ["http10"])
    assert decision.rule_names(next(iter(view([rt()], [ep()]).table.entries()))) == ([], [])
    chunked = parse_request_head(
        b"POST /x HTTP/1.1\r\nHost: a.test\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    built = view([rt(upstream_http10=True, request_buffering=False)], [ep()])
    forward = decide(built, chunked, Facts(), 0.0)  # type: ignore[arg-type]
    assert isinstance(forward, Forward)
    assert forward.http10 and forward.buffer_body  # buffered whatever requestBuffering says
    assert forward.upstream_head.startswith(b"POST /x HTTP/1.0\r\n")
    assert forward.upstream_head.endswith(b"\r\nConnection: close\r\n\r\n")
    assert b"chunked" not in forward.upstream_head.lower()
