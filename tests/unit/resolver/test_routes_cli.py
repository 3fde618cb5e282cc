"""The routes CLI's documents (issue 29, findings 3 and 7), without a resolver:
`routes get -o yaml` in the routes file's spelling and back through `routes apply`'s
reader, NS/NAME for Gateway-derived names, the PATH column, and hostile apply files
as one-line errors naming path:line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from waygate.core.errors import InvalidArgument
from waygate.resolver import convert
from waygate.resolver.commands import _reference, load_route_documents, route_document, route_path
from waygate.resolver.model import (
    HeaderMatch,
    PathMatchType,
    Route,
    RouteBackend,
    RouteCondition,
    RouteMatch,
    RouteStatus,
    SameSite,
    StickySessions,
    ValueMatchType,
)


def test_a_document_applies_back_to_the_same_route() -> None:
    route = Route(
        "demo",
        "web",
        "web.example.com",
        backends=(RouteBackend("web"),),
        sticky=StickySessions(same_site=SameSite.NONE),
        status=RouteStatus((RouteCondition("Admitted", "True", "Admitted"),)),
    )
    document = route_document(convert.route_to_proto(route))
    assert document["sticky"] == {"sameSite": "None"}
    assert document["status"]["conditions"][0]["type"] == "Admitted"
    text = yaml.safe_dump(document)
    (applied,) = load_route_documents(Path("-"), text)
    assert applied == Route(
        "demo",
        "web",
        "web.example.com",
        backends=(RouteBackend("web"),),
        sticky=StickySessions(same_site=SameSite.NONE),
    )


def test_gateway_names_are_addressable_and_their_matches_shown() -> None:
    name = "httproute:canary:r0:demo/gw:80:api.localtest.me"
    assert _reference(f"demo/{name}") == ("demo", name)
    assert _reference("demo/") is None and _reference("/x") is None
    route = Route(
        "demo",
        name,
        "api.localtest.me",
        backends=(RouteBackend("echo"),),
        matches=(
            RouteMatch(PathMatchType.PREFIX, "/api", headers=(HeaderMatch("x-env", "canary"),)),
            RouteMatch(
                PathMatchType.REGEX,
                "/v[0-9]+",
                query=(HeaderMatch("q", "a.*", ValueMatchType.REGEX),),
                method="POST",
            ),
        ),
        origin="HTTPRoute demo/canary",
    )
    message = convert.route_to_proto(route)
    assert route_path(message) == "/api header:x-env=canary | ~/v[0-9]+ query:q~a.* POST"
    document = route_document(message)
    assert document["derived"]["from"] == "HTTPRoute demo/canary"
    with pytest.raises(InvalidArgument, match=r"-:\d+: this route is made from HTTPRoute"):
        load_route_documents(Path("-"), yaml.safe_dump(document))


@pytest.mark.parametrize(
    ("text", "error"),
    [
        ("2001-13-45\n", "f.yaml:1: expected routes"),
        ("routes: abc\n", "f.yaml:1: routes: must be a list"),
        ("routes:\n", "f.yaml: no routes in it"),
        ("{2001-13-45: x}\n", "f.yaml:1: bad value"),
        ("name: [x\n", "f.yaml:2: not YAML"),
        ("name: x\nhost: a.example.com\nto: w\nbackends: [{service: w}]\n", "give either"),
        (
            "name: x\nhost: a.example.com\nbackends:\n  - {service: w}\n  - {service: w}\n",
            "f.yaml:5:",
        ),
        (
            "apiVersion: waygate.io/v1\nkind: Route\nmetadata: {name: r}\nspec:\n"
            "  host: a.example.com\n  to: w\n  colour: red\n",
            "f.yaml:7: route default/r: unknown key 'colour'",
        ),
        ("kind: Route\nmetadata: [x]\nspec: {}\n", "f.yaml:2: expected a mapping"),
    ],
)
def test_a_bad_apply_file_is_one_error_naming_its_line(text: str, error: str) -> None:
    with pytest.raises(InvalidArgument) as info:
        load_route_documents(Path("f.yaml"), text)
    assert error in str(info.value), str(info.value)
