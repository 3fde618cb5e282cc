"""Hostile route authors at admission (issue 31): regular expressions RE2 cannot express,
YAML amplification, the Gateway API CRDs' bounds, and hosts owned across route kinds."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.support.gatewayapi import GATEWAY_CLASS, conformance_text
from waygate.core.errors import InvalidArgument
from waygate.resolver.filesource import FileError
from waygate.resolver.manifests import ManifestsContent, parse_manifests
from waygate.resolver.model import (
    HeaderMatch,
    PathMatchType,
    Route,
    RouteBackend,
    RouteMatch,
    ValueMatchType,
)
from waygate.resolver.validation import validate_route

NS = "gateway-conformance-infra"


def parse(*texts: str) -> ManifestsContent:
    return parse_manifests([(Path(f"m{i}.yaml"), t) for i, t in enumerate(texts)])


# ---------------------------------------------------------------- regular expressions


def test_apply_route_refuses_a_match_pattern_re2_cannot_express() -> None:
    route = Route(
        namespace="demo",
        name="web",
        host="web.example.com",
        backends=(RouteBackend("web", 100),),
        matches=(RouteMatch(PathMatchType.REGEX, "/ok/[a-z]+"),),
    )
    assert validate_route(route).matches == route.matches
    looking = dataclasses.replace(
        route,
        matches=(
            RouteMatch(
                headers=(HeaderMatch("x-a", "(?!admin).*", ValueMatchType.REGEX),),
            ),
        ),
    )
    with pytest.raises(InvalidArgument, match=r"matches\[0\]\.headers\[0\]\.value: .*lookahead"):
        validate_route(looking)
    backreference = dataclasses.replace(
        route, matches=(RouteMatch(PathMatchType.REGEX, r"/(a)\1"),)
    )
    with pytest.raises(InvalidArgument, match=r"matches\[0\]\.path: .*backreferences"):
        validate_route(backreference)


@pytest.mark.parametrize(
    ("match", "field"),
    [
        ('{path: {type: RegularExpression, value: "/(a)\\\\1"}}', "matches[0].path.value"),
        (
            '{headers: [{name: x-a, type: RegularExpression, value: "(?<=a)b"}]}',
            "matches[0].headers[0].value",
        ),
        (
            '{queryParams: [{name: q, type: RegularExpression, value: "a++"}]}',
            "matches[0].queryParams[0].value",
        ),
    ],
)
def test_gateway_regex_matches_re2_cannot_express_are_refused_naming_the_line(
    match: str, field: str
) -> None:
    route = f"""apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata:
  name: bad
  namespace: {NS}
spec:
  parentRefs: [{{name: same-namespace}}]
  rules:
  - matches:
    - {match}
"""
    with pytest.raises(FileError) as caught:
        parse(GATEWAY_CLASS, conformance_text("base.yaml"), route)
    error = caught.value
    assert error.path == Path("m2.yaml") and error.line == 10
    assert f"HTTPRoute {NS}/bad: spec.rules[0].{field}: " in error.reason
    assert "not supported: Waygate matches with RE2" in error.reason
