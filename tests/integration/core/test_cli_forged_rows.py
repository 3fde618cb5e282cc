"""Route fields cannot forge CLI output (issue 31, finding 10): newlines, escape
sequences and bidi overrides in a route's fields and status are shown escaped by
`waygate routes`, `waygate gateways` and `waygate check`, one row per object."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.core.test_check_kube import check, cluster, route
from waygate.core.clientcli import printable, table
from waygate.resolver.commands import format_route_change, format_routes, format_sources
from waygate.resolver.gateway.commands import format_gateways
from waygate.resolver.v1 import resolver_pb2 as pb

__all__ = ["cluster"]  # the fixture, used by name

FORGED = "x\n✔ route demo/evil: Admitted\x1b[2K\x1b]0;owned\x07\u202e"


def assert_unforged(text: str) -> None:
    assert "\x1b" not in text and "\x07" not in text and "\u202e" not in text
    assert not any(line.startswith("✔ route demo/evil") for line in text.splitlines())
    assert "\\x1b[2K" in text and "\\n" in text and "\\u202e" in text


def test_printable_keeps_plain_text_and_escapes_the_rest() -> None:
    assert printable("demo/echo  ok ✔ café") == "demo/echo  ok ✔ café"
    assert printable("a\nb\tc\x1b[31m\x85\u2028") == "a\\nb\\tc\\x1b[31m\\x85\\u2028"
    assert table(("A", "B"), [("1", "x\ny")]) == "A  B\n1  x\\ny"


def test_routes_table_and_watch_lines_escape_route_fields() -> None:
    forged = pb.Route(
        namespace="demo",
        name="ingress:" + FORGED,
        host="echo.localtest.me",
        path="/\x1b[2J",
        status=pb.RouteStatus(
            conditions=[
                pb.RouteCondition(
                    type="Admitted", status="False", reason="HostAlreadyClaimed", message=FORGED
                )
            ]
        ),
    )
    for wide in (False, True):
        text = format_routes([forged], wide)
        assert len(text.splitlines()) == 2
        assert_unforged(text)
    line = format_route_change(forged)
    assert len(line.splitlines()) == 1
    assert_unforged(line)
    sources = format_sources(
        [pb.RouteSourceState(source="manifests:/m", valid=False, last_error=FORGED)]
    )
    assert len(sources.splitlines()) == 2
    assert_unforged(sources)


def test_gateways_table_escapes_object_fields() -> None:
    objects = [
        pb.GatewayObjectStatus(
            kind="HTTPRoute",
            namespace="evil",
            name=FORGED,
            parents=[
                pb.GatewayParentStatus(
                    gateway_namespace="evil",
                    gateway_name="gw",
                    section_name=FORGED,
                    conditions=[
                        pb.GatewayCondition(
                            type="Accepted", status="False", reason="X", message=FORGED
                        )
                    ],
                )
            ],
        )
    ]
    text = format_gateways(objects)
    assert len(text.splitlines()) == 2
    assert_unforged(text)


def test_check_escapes_a_route_objects_status(
    capsys: pytest.CaptureFixture[str], cluster: tuple[object, Path]
) -> None:
    api, kubeconfig = cluster
    api.create(route("ghost", ("False", "ServiceNotFound", FORGED)))  # type: ignore[attr-defined]
    code, out, _ = check(capsys, kubeconfig)
    assert code == 1
    assert "✖ route demo/ghost: ServiceNotFound: x\\n✔ route demo/evil" in out
    assert_unforged(out)
