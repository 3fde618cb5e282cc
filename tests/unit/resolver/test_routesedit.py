"""routesedit: one route's entry changed in the routes file's text, every other byte kept."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from waygate.resolver import routesedit
from waygate.resolver.filesource import EXAMPLE_ROUTES, parse_routes_file
from waygate.resolver.model import (
    BalancePolicy,
    Route,
    RouteBackend,
    RouteTimeouts,
    SameSite,
    StickySessions,
)
from waygate.resolver.schema import route_to_document

FILE = """\
# The routes.
services: []   # none here
routes:
  # a: the first
  - namespace: demo
    name: a   # keep me
    host: a.example.com
    to: web
    tls:
      termination: edge
      certificate: |
        -----BEGIN CERTIFICATE-----
        AAAA
        -----END CERTIFICATE-----

  # b: a flow entry
  - {namespace: demo, name: b, host: b.example.com, to: web}
  - name: c
    host: "c.example.com"
    to: web
"""


def entry(**fields: object) -> dict[str, object]:
    return {"namespace": "demo", "host": "x.example.com", "to": "web", **fields}


def test_replacing_an_entry_keeps_every_other_line_and_its_own_comments() -> None:
    pem = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    document = entry(
        name="a", host="a.example.com", path="/v2", tls={"termination": "edge", "certificate": pem}
    )
    text = routesedit.apply(FILE, ("demo", "a"), document)
    # One line added at the entry's end; its own comment, the blank line after it
    # and everything else byte for byte.
    assert text == FILE.replace(
        "        -----END CERTIFICATE-----\n\n",
        "        -----END CERTIFICATE-----\n    path: /v2\n\n",
    )
    assert yaml.safe_load(text)["routes"][0]["path"] == "/v2"


def test_a_flow_entry_stays_a_flow_entry() -> None:
    text = routesedit.apply(FILE, ("demo", "b"), entry(name="b", host="b.example.com", path="/b"))
    assert "  - {namespace: demo, name: b, host: b.example.com, to: web, path: /b}\n" in text
    assert text.replace(", path: /b", "") == FILE


def test_the_default_namespace_is_left_implicit_and_quotes_kept() -> None:
    text = routesedit.apply(
        FILE,
        ("default", "c"),
        entry(namespace="default", name="c", host="c.example.com", path="/c"),
    )
    assert text == FILE + "    path: /c\n"


def test_a_new_route_is_appended_in_the_last_entrys_style() -> None:
    text = routesedit.apply(
        FILE, ("demo", "d"), entry(name="d", backends=[{"service": "w", "weight": 3}])
    )
    assert text.startswith(FILE)
    added = text[len(FILE) :]
    assert added == (
        "  - namespace: demo\n    host: x.example.com\n    to: web\n    name: d\n"
        "    backends:\n      - service: w\n        weight: 3\n"
    )
    assert yaml.safe_load(text)["routes"][-1]["name"] == "d"


def test_deleting_removes_only_the_entry_lines() -> None:
    text = routesedit.delete(FILE, ("demo", "a"))
    assert "name: a" not in text and "# a: the first" in text and "# b: a flow entry" in text
    assert [r["name"] for r in yaml.safe_load(text)["routes"]] == ["b", "c"]
    text = routesedit.delete(FILE, ("demo", "b"))
    assert text == FILE.replace(
        "  - {namespace: demo, name: b, host: b.example.com, to: web}\n", ""
    )


@pytest.mark.parametrize(
    "text",
    [
        "",
        "# only comments\n",
        "services: []\n",
        "routes: []\n",
        "routes: [{namespace: demo, name: z, host: z.example.com, to: web}]\n",
        "routes:\n- namespace: demo\n  name: z\n  host: z.example.com\n  to: web\n",
    ],
)
def test_other_shapes_go_through_the_round_trip_whole(text: str) -> None:
    added = routesedit.apply(text, ("demo", "n"), entry(name="n"))
    routes = yaml.safe_load(added)["routes"]
    assert routes[-1]["name"] == "n"
    if "# only comments" in text:
        assert "# only comments" in added
    removed = routesedit.delete(added, ("demo", "n"))
    assert [r["name"] for r in yaml.safe_load(removed)["routes"] or []] == [
        r["name"] for r in (yaml.safe_load(text) or {}).get("routes") or []
    ]


# ---------------------------------------------------------------- properties

EXAMPLE = EXAMPLE_ROUTES.read_text()
KEYS = [r.key for r in parse_routes_file(EXAMPLE_ROUTES, EXAMPLE).routes]
labels = st.from_regex(r"[a-z][a-z0-9]{0,8}", fullmatch=True)
routes = st.builds(
    Route,
    namespace=st.sampled_from(["demo", "waygate", "default", "other"]),
    name=st.one_of(st.sampled_from([k[1] for k in KEYS]), labels),
    host=labels.map(lambda label: f"{label}.example.com"),
    path=st.sampled_from(["/", "/api", "/a/b/"]),
    backends=st.lists(labels, min_size=1, max_size=4, unique=True).map(
        lambda names: tuple(RouteBackend(n, 1 + i) for i, n in enumerate(names))
    ),
    balance=st.sampled_from(list(BalancePolicy)),
    sticky=st.builds(StickySessions, same_site=st.sampled_from(list(SameSite))),
    timeouts=st.builds(RouteTimeouts, connect=st.sampled_from([None, 2.0, 0.25])),
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(routes, st.booleans())
def test_an_edit_changes_that_route_only_and_keeps_every_comment(route: Route, remove: bool):
    """Whatever the route, the file still loads, holds exactly the old routes with
    that one applied (or removed), and keeps every comment line of the example."""
    before = {r.key: r for r in parse_routes_file(EXAMPLE_ROUTES, EXAMPLE).routes}
    if remove:
        text = routesedit.delete(EXAMPLE, route.key)
        before.pop(route.key, None)
    else:
        text = routesedit.apply(EXAMPLE, route.key, route_to_document(route))
        before[route.key] = route
    after = {r.key: r for r in parse_routes_file(EXAMPLE_ROUTES, text).routes}
    assert after == before
    comments = [line.strip() for line in EXAMPLE.splitlines() if line.strip().startswith("#")]
    kept = [line.strip() for line in text.splitlines() if line.strip().startswith("#")]
    # A removed route's own comments (none in the example's entries) may go; others stay.
    assert kept == comments
