"""waygate.proxy.captures: rewrite-target with capture groups, without sockets (through
every pair of protocols: tests/integration/proxy/test_request_core.py)."""

from __future__ import annotations

import re

from tests.unit.proxy.test_decision import Facts, ep, req, view
from waygate.proxy import captures, decision
from waygate.proxy.decision import Forward, decide
from waygate.resolver.model import PathMatchType, Route, RouteBackend, RouteMatch


def test_groups_expand_and_missing_ones_are_empty():
    match = re.fullmatch(r"/a(/|$)(.*)", "/a")
    assert match is not None
    assert captures.expand("/x/$2/$1/$9", match) == "/x///"
    match = re.fullmatch(r"/api/(v\d)/(.*)", "/api/v1/items/3")
    assert match is not None and captures.expand("/$2?v=$1", match) == "/items/3?v=v1"


def test_the_query_is_kept_and_a_non_match_is_left_alone():
    regex = re.compile(r"(?i)(?:/api/(v[0-9]+)/(.*)).*")
    head = req("/Api/v3/a?b=1")
    out = captures.rewritten(head, regex, "/$2/$1", b"/Api/v3/a")
    assert out is not None and out.target == b"/a/v3?b=1" and head.target == b"/Api/v3/a?b=1"
    assert captures.rewritten(head, regex, "/$1", b"/other") is None


def test_decide_rewrites_only_a_route_with_a_capture_target():
    match = RouteMatch(PathMatchType.REGEX, "(?i)(?:/shop/(.*)).*")
    route = Route(
        namespace="demo",
        name="r",
        host="a.test",
        backends=(RouteBackend("web"),),
        matches=(match,),
        rewrite_target="/store/$1",
    )
    forward = decide(view([route], [ep()]), req("/shop/hat?c=red"), Facts(), 0.0)
    assert isinstance(forward, Forward)
    assert forward.upstream_head.startswith(b"GET /store/hat?c=red HTTP/1.1\r\n")
    entry = next(iter(view([route], [ep()]).table.entries()))
    assert decision.rule_names(entry)[1] == ["capture_rewrite"]
