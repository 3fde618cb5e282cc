"""proxy-body-size in decision.decide, without sockets (the streamed count through every
pair of protocols: tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

from tests.unit.proxy.test_decision import Facts, ep, rt, view
from waygate.proxy import bodylimit, decision
from waygate.proxy.decision import Answer, Forward, decide
from waygate.proxy.http1 import ChunkedReader, parse_request_head


def post(framing: str) -> object:
    return parse_request_head(f"POST /x HTTP/1.1\r\nHost: a.test\r\n{framing}\r\n\r\n".encode())


def test_a_larger_content_length_is_413_and_a_chunked_body_is_counted():
    built = view([rt(max_request_body=100)], [ep()])
    refused = decide(built, post("Content-Length: 101"), Facts(), 0.0)  # type: ignore[arg-type]
    assert isinstance(refused, Answer)
    assert (refused.status, refused.kind, refused.route) == (413, bodylimit.KIND, "demo/r")
    assert "100 bytes" in refused.reason
    exact = decide(built, post("Content-Length: 100"), Facts(), 0.0)  # type: ignore[arg-type]
    assert isinstance(exact, Forward) and exact.body_limit == 0  # its length is its bound
    chunked = decide(built, post("Transfer-Encoding: chunked"), Facts(), 0.0)  # type: ignore[arg-type]
    assert isinstance(chunked, Forward) and chunked.body_limit == 100


def test_only_a_route_with_a_limit_has_the_gate():
    entry = next(iter(view([rt(max_request_body=1)], [ep()]).table.entries()))
    assert decision.rule_names(entry)[0] == ["body_size"]
    plain = decide(view([rt()], [ep()]), post("Content-Length: 99999999"), Facts(), 0.0)  # type: ignore[arg-type]
    assert isinstance(plain, Forward)


def test_the_chunked_reader_counts_the_announced_sizes():
    reader = ChunkedReader()
    reader.feed(b"5\r\nhello\r\n10\r\nabc")
    assert reader.payload == 5 + 16  # the second chunk counted when announced
