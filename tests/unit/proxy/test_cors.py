"""waygate.proxy.cors: ingress-nginx's CORS rule, without sockets (through every pair of
protocols: tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

from typing import Any

from tests.unit.proxy.test_decision import Facts, ep, req, rt, view
from waygate.proxy import cors, decision
from waygate.proxy.decision import Answer, Forward, decide
from waygate.resolver.model import Cors


def policy(*origins: str, **kw: Any) -> cors.CorsPolicy:
    return cors.CorsPolicy(Cors(allow_origins=origins, **kw))


def origin(value: str) -> Any:
    return req(extra=f"Origin: {value}\r\n")


def test_origins_match_whole_and_case_insensitively_with_one_label_wildcards():
    # ingress-nginx's buildOriginRegex: `*.` is one label ([A-Za-z0-9-]+), `~*` matching.
    rule = policy("https://*.example.com", "http://exact.test:8080")
    assert rule.allowed(origin("https://a.example.com")) is not None
    assert rule.allowed(origin("HTTPS://A-1.Example.COM")) is not None
    assert rule.allowed(origin("http://exact.test:8080")) is not None
    for refused in (
        "https://a.b.example.com",  # two labels
        "https://example.com",  # no label
        "http://exact.test",  # another port
        "http://exact.test:80800",
        "https://evil.test/https://a.example.com",  # ingress-nginx's end-only anchor
        "https://aexample.com",
    ):
        assert rule.allowed(origin(refused)) is None, refused
    assert rule.allowed(req()) is None  # no Origin: not a CORS request


def test_the_allowed_origin_is_echoed_and_any_origin_is_a_star():
    headers = dict(policy("https://a.test").allowed(origin("https://a.test")) or ())
    assert headers["Access-Control-Allow-Origin"] == "https://a.test"
    assert headers["Access-Control-Allow-Credentials"] == "true"
    assert headers["Access-Control-Max-Age"] == "1728000"
    assert "Access-Control-Expose-Headers" not in headers
    anyone = policy("*", allow_credentials=False)
    assert anyone.allowed(req()) is anyone.response_any
    assert dict(anyone.response_any)["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in dict(anyone.response_any)


def test_a_preflight_is_a_204_without_a_body():
    rule = policy("*")
    response = rule.preflight(rule.response_any)
    assert response.startswith(b"HTTP/1.1 204 No Content\r\n")
    assert response.endswith(b"Content-Length: 0\r\n\r\n")
    assert b"Content-Type: text/plain charset=UTF-8\r\n" in response


def test_decide_answers_the_preflight_and_shapes_the_answer_once_per_entry():
    built = view([rt(cors=Cors(allow_origins=("https://a.test",)))], [ep()])
    options = req(extra="Origin: https://a.test\r\n")
    options.method = b"OPTIONS"
    answer = decide(built, options, Facts(), 0.0)
    assert isinstance(answer, Answer) and answer.kind == decision.ANSWER_RESPONSE
    assert answer.status == 204 and not answer.refused
    assert "Access-Control-Allow-Origin: https://a.test" in answer.reason
    forward = decide(built, origin("https://a.test"), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.response_modifier is not None
    assert ("Access-Control-Allow-Origin", "https://a.test") in forward.response_modifier.set
    entry = next(iter(built.table.entries()))
    gates, shapers = decision.rules_of(entry)  # type: ignore[misc]
    assert [r.name for r in gates] == ["cors"] and [r.name for r in shapers] == ["cors"]
    assert isinstance(entry.policies["cors"], cors.CorsPolicy)
    plain = decide(view([rt()], [ep()]), origin("https://a.test"), Facts(), 0.0)
    assert isinstance(plain, Forward) and plain.response_modifier is None
