"""waygate.proxy.cors: ingress-nginx's CORS rule, without sockets (through every pair of
protocols: tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

from typing import Any

from tests.unit.proxy.test_decision import Facts, ep, req, rt, view
from waygate.proxy import cors, decision, filters
from waygate.proxy.decision import Answer, Forward, decide
from waygate.resolver.model import Cors, HeaderModifier, RouteFilters


def policy(*origins: str, **kw: Any) -> cors.CorsPolicy:
    return cors.CorsPolicy(Cors(allow_origins=origins, **kw))


def origin(value: str) -> Any:
    return req(extra=f"Origin: {value}\r\n")


def test_origins_match_whole_and_case_insensitively_with_one_label_wildcards():
    # ingress-nginx's buildOriginRegex: `*.` is one label ([A-Za-z0-9-]+), `~*` matching.
    rule = policy("https://*.example.com", "http://exact.test:8080")
    assert rule.answer(origin("https://a.example.com")) is not None
    assert rule.answer(origin("HTTPS://A-1.Example.COM")) is not None
    assert rule.answer(origin("http://exact.test:8080")) is not None
    for refused in (
        "https://a.b.example.com",  # two labels
        "https://example.com",  # no label
        "http://exact.test",  # another port
        "http://exact.test:80800",
        "https://evil.test/https://a.example.com",  # ingress-nginx's end-only anchor
        "https://aexample.com",
    ):
        assert rule.answer(origin(refused)) is None, refused
    assert rule.answer(req()) is None  # no Origin: not a CORS request


def test_the_allowed_origin_is_echoed_and_any_origin_is_a_star():
    answer = policy("https://a.test").answer(origin("https://a.test"))
    assert answer is not None
    headers = dict(answer.headers)
    assert headers["Access-Control-Allow-Origin"] == "https://a.test"
    assert headers["Access-Control-Allow-Credentials"] == "true"
    assert headers["Access-Control-Max-Age"] == "1728000"
    assert "Access-Control-Expose-Headers" not in headers
    anyone = policy("*", allow_credentials=False)
    assert anyone.answer(req()) is anyone.any_answer is not None
    assert dict(anyone.any_answer.headers)["Access-Control-Allow-Origin"] == "*"
    assert "Access-Control-Allow-Credentials" not in dict(anyone.any_answer.headers)


def test_the_origin_is_read_in_any_spelling_and_its_answer_prepared_once():
    rule = policy("https://a.test")
    first = rule.answer(req(extra="ORIGIN:  https://a.test \r\n"))
    assert first is not None and ("Access-Control-Allow-Origin", "https://a.test") in first.headers
    assert rule.answer(req(extra="ORIGIN:  https://a.test \r\n")) is first  # remembered
    assert rule.answer(req(extra="origin: https://b.test\r\n")) is None
    assert rule.answer(req(extra="X-Origin: https://a.test\r\n")) is None  # another field
    # The first Origin field counts (nginx's $http_origin).
    assert rule.answer(req(extra="Origin: https://b.test\r\nOrigin: https://a.test\r\n")) is None


def test_remembered_origins_are_bounded(monkeypatch: Any):
    monkeypatch.setattr(cors, "MAX_REMEMBERED", 3)
    rule = policy("https://*.a.test")
    for index in range(10):
        assert rule.answer(origin(f"https://x{index}.a.test")) is not None
        assert rule.answer(origin(f"https://evil{index}.test")) is None
        assert len(rule.known) <= 3


def test_the_answer_lines_are_appended_and_replace_the_backends_own():
    answer = policy("https://a.test").answer(origin("https://a.test"))
    assert answer is not None
    block = b"\r\nContent-Type: text/plain"
    out = filters.modify_response_fields(block, answer.fields)
    assert out == block + answer.fields.block
    assert out.count(b"Access-Control-Allow-Origin: https://a.test") == 1
    # The backend's own Access-Control-* lines (any spelling) give way, as more_set_headers.
    sent = block + b"\r\naccess-control-allow-origin: *\r\nACCESS-CONTROL-MAX-AGE: 5"
    out = filters.modify_response_fields(sent, answer.fields)
    assert b"access-control-allow-origin" not in out and b"MAX-AGE" not in out
    assert out.startswith(block) and out.count(b"Access-Control-") == 5
    # One the rule does not set is the backend's to keep.
    kept = block + b"\r\nAccess-Control-Expose-Headers: X-Kept"
    assert b"X-Kept" in filters.modify_response_fields(kept, answer.fields)


def test_a_block_seen_again_gets_its_answer_again_and_any_spelling_is_found():
    """SetFields keeps the last block and its result (a remembered parse's copies
    share the block's bytes): the same bytes get the same answer; other bytes are
    searched in every spelling."""
    answer = policy("https://a.test").answer(origin("https://a.test"))
    assert answer is not None
    block = b"\r\nServer: x"
    first = filters.modify_response_fields(block, answer.fields)
    assert filters.modify_response_fields(block, answer.fields) is first
    for spelling in (
        b"aCCESs-cONTROL-mAX-aGE",
        b"ACCESS-CONTROL-MAX-AGE",
        b"access-control-max-age",
    ):
        sent = block + b"\r\n" + spelling + b": 5"
        out = filters.modify_response_fields(sent, answer.fields)
        assert spelling not in out and out.count(b"Access-Control-Max-Age: ") == 1
        assert filters.modify_response_fields(sent, answer.fields) is out
    assert filters.modify_response_fields(block, answer.fields) == first


def test_the_routes_own_response_modifier_applies_first():
    base = HeaderModifier(
        set=(("Access-Control-Max-Age", "1"), ("X-Set", "v")),
        add=(("X-Add", "w"),),
        remove=("X-Gone",),
    )
    answer = cors.CorsPolicy(Cors(allow_origins=("*",)), base).answer(req())
    assert answer is not None
    out = filters.modify_response_fields(b"\r\nX-Gone: x\r\nX-Set: old", answer.fields)
    assert b"X-Gone" not in out and b"X-Set: v" in out and b"X-Add: w" in out
    assert b"Access-Control-Max-Age: 1728000" in out and b"Max-Age: 1\r" not in out + b"\r"


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
    assert decision.rule_names(entry) == (["cors"], [])
    assert isinstance(entry.policies["cors"], cors.CorsPolicy)
    plain = decide(view([rt()], [ep()]), origin("https://a.test"), Facts(), 0.0)
    assert isinstance(plain, Forward) and plain.response_modifier is None


def test_a_route_with_response_headers_and_cors_gets_both():
    modifier = HeaderModifier(set=(("X-Route", "r"),))
    built = view([rt(cors=Cors(), filters=RouteFilters(response_headers=modifier))], [ep()])
    forward = decide(built, origin("https://any.test"), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.response_modifier is not None
    out = filters.modify_response_fields(b"", forward.response_modifier)
    assert b"X-Route: r" in out and b"Access-Control-Allow-Origin: *" in out
    # A route whose CORS does not apply keeps its own modifier.
    listed = Cors(allow_origins=("https://a.test",))
    built = view([rt(cors=listed, filters=RouteFilters(response_headers=modifier))], [ep()])
    forward = decide(built, origin("https://b.test"), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.response_modifier is not None
    # (kept once per route entry as a filters.remembered SetFields over it)
    assert forward.response_modifier.base is modifier  # type: ignore[union-attr]
    out = filters.modify_response_fields(b"\r\nX-Route: old", forward.response_modifier)
    assert out == b"\r\nX-Route: r"


def test_an_http2_backends_own_lines_give_way_the_same():
    # The HTTP/2 upstream's answer goes through the same rule (h2upstream._modified).
    from waygate.proxy.h2upstream import _modified

    answer = policy("https://a.test").answer(origin("https://a.test"))
    assert answer is not None
    sent = [(b"content-type", b"text/plain"), (b"access-control-allow-origin", b"*")]
    out = _modified(sent, answer.fields, 200)
    assert out[0] == (b"content-type", b"text/plain")
    assert [v for n, v in out if n == b"access-control-allow-origin"] == [b"https://a.test"]
    assert (b"access-control-max-age", b"1728000") in out


def test_cors_and_the_response_rewrites_compose():
    # proxy-redirect-* (responserewrite) after CORS: both apply, CORS's lines set.
    route = rt(cors=Cors(), redirect_from="http://in.test/", redirect_to="https://a.test/")
    forward = decide(view([route], [ep()]), origin("https://b.test"), Facts(), 0.0)
    assert isinstance(forward, Forward) and forward.response_modifier is not None
    sent = b"\r\nLocation: http://in.test/x\r\nAccess-Control-Allow-Origin: https://evil.test"
    out = filters.modify_response_fields(sent, forward.response_modifier)
    assert b"Location: https://a.test/x" in out
    assert out.count(b"Access-Control-Allow-Origin") == 1 and b"Allow-Origin: *" in out


def test_a_prepared_answer_composes_with_added_lines():
    # An auth service's Set-Cookie (extauth) added to a CORS answer, on every answer
    # or on add_header's statuses only: the CORS lines stay set.
    answer = policy("https://a.test").answer(origin("https://a.test"))
    assert answer is not None
    cookie = (("Set-Cookie", "s=1"),)
    for modifier in (
        filters.with_added(answer.fields, cookie),
        filters.StatusHeaders.over(answer.fields, cookie),
    ):
        out = filters.modify_response_fields(b"\r\nAccess-Control-Max-Age: 5", modifier, 200)
        assert b"Set-Cookie: s=1" in out and b"Access-Control-Allow-Origin: https://a.test" in out
        assert b"Max-Age: 5" not in out


def test_a_connection_repeating_its_fields_gets_its_answer_and_new_fields_are_read_anew():
    # The per-connection memo (ForwardedContext.cors_*) answers a keep-alive client's
    # repeated head without a search; different fields, another route's policy or a new
    # table are decided afresh, never with the remembered answer.
    built = view([rt(cors=Cors(allow_origins=("https://a.test",)))], [ep()])
    facts = Facts()
    allowed, other = origin("https://a.test"), origin("https://evil.test")
    first = decide(built, allowed, facts, 0.0)
    assert isinstance(first, Forward) and first.cors is not None
    assert facts.context.cors_fields == allowed.fields
    again = decide(built, origin("https://a.test"), facts, 0.0)  # equal bytes, new object
    assert isinstance(again, Forward) and again.cors is first.cors
    refused = decide(built, other, facts, 0.0)
    assert isinstance(refused, Forward) and refused.cors is None
    assert decide(built, other, facts, 0.0).cors is None  # type: ignore[union-attr]
    assert decide(built, allowed, facts, 0.0).cors is first.cors  # type: ignore[union-attr]
    # A new table's policy (the route's origins changed) does not take the old answer.
    narrowed = view([rt(cors=Cors(allow_origins=("https://b.test",)))], [ep()])
    assert decide(narrowed, allowed, facts, 0.0).cors is None  # type: ignore[union-attr]
    # Another connection decides for itself.
    assert decide(built, allowed, Facts(), 0.0).cors is not None  # type: ignore[union-attr]
