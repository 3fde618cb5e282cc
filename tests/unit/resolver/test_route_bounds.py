"""Bounded route inputs (issue 8 item 4) and the proxy's route fields (issues 9 and 10).

Paths are normalised or refused, every string field is bounded, errors repeat a
caller's value only as a short excerpt; SameSite, forwarded-headers mode,
keep-alive timeout, HSTS, client CA, upstream server name and the client
certificate survive the routes file and the proto both ways, and are validated.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tests.support.pki import LocalCA, self_signed
from waygate.core.errors import InvalidArgument
from waygate.resolver import convert
from waygate.resolver.filesource import parse_routes_file, route_to_document
from waygate.resolver.model import (
    HSTS,
    ForwardedHeadersMode,
    Route,
    RouteBackend,
    RouteTimeouts,
    RouteTLS,
    SameSite,
    StickySessions,
    TLSTermination,
)
from waygate.resolver.validation import MAX_PATH_LENGTH, MAX_PEM_LENGTH, validate_route

MIB = 1 << 20


def route(**changes: object) -> Route:
    base = Route("shop", "web", "shop.example.com", backends=(RouteBackend("web"),))
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def refused(r: Route) -> str:
    with pytest.raises(InvalidArgument) as info:
        validate_route(r)
    message = str(info.value)
    # A hostile value is never echoed whole: the message stays short.
    assert len(message) < 400, message
    return message


@pytest.mark.parametrize(
    ("path", "reason"),
    [
        ("/../../etc/passwd", "dot-segments"),
        ("/%2e%2e/admin", "dot-segments"),
        ("/%2E%2e/admin", "dot-segments"),
        ("/a/%2E/b", "dot-segments"),
        ("/a/..", "dot-segments"),
        ("/a/.", "dot-segments"),
        ("/a/..;/admin", "dot-segments"),
        ("/.;/x", "dot-segments"),
        ("/a/%2e%2e;jsessionid=1/b", "dot-segments"),
        ("/a//b", "empty segments"),
        ("//evil.example.com", "empty segments"),
        ("/a\x00b", "URL path characters"),
        ("/a\x1b[31mred", "URL path characters"),
        ("/a\r\nX-Injected: 1", "URL path characters"),
        ("/a b", "URL path characters"),
        ("/a\\..\\b", "URL path characters"),
        ("/caf\u00e9", "URL path characters"),
        ("/a%00b", "encoded"),
        ("/a%2fb", "encoded"),
        ("/a%5c..", "encoded"),
        ("/a%1b", "encoded"),
        ("/a%zz", "%XX"),
        ("/a%", "%XX"),
        ("/" + "a" * MIB, "longer than"),
        ("relative", "must start with '/'"),
    ],
)
def test_hostile_paths_are_refused_with_a_short_reason(path: str, reason: str) -> None:
    message = refused(route(path=path))
    assert "path" in message and reason in message


@pytest.mark.parametrize(
    ("path", "normalised"),
    [
        ("", "/"),
        ("/", "/"),
        ("/api/v1", "/api/v1"),
        ("/%7Euser", "/~user"),
        ("/a%2Db", "/a-b"),
        ("/a%3ab", "/a%3Ab"),
        ("/..a/b..", "/..a/b.."),
        ("/api/", "/api/"),
        ("/a;v=1/b", "/a;v=1/b"),
        ("/...;/x", "/...;/x"),
        ("/" + "a" * (MAX_PATH_LENGTH - 1), "/" + "a" * (MAX_PATH_LENGTH - 1)),
    ],
)
def test_paths_are_normalised(path: str, normalised: str) -> None:
    assert validate_route(route(path=path)).path == normalised


@pytest.mark.parametrize(
    "changes",
    [
        {"name": "x" * (3 * MIB)},
        {"namespace": "n" * MIB},
        {"host": "h" * (3 * MIB) + ".example.com"},
        {"host": "a\x1b[2J.example.com"},
        {"backends": (RouteBackend("s" * MIB),)},
        {"target_port": "p" * MIB},
        {"sticky": StickySessions(cookie_name="c" * MIB)},
        {"tls": RouteTLS(TLSTermination.EDGE, certificate="x" * (MAX_PEM_LENGTH + 1), key="k")},
        {"tls": RouteTLS(TLSTermination.REENCRYPT, destination_server_name="d" * MIB)},
    ],
)
def test_every_string_field_is_bounded_and_errors_stay_short(changes: dict[str, object]) -> None:
    refused(route(**changes))


def test_hsts_bounds() -> None:
    edge = RouteTLS(TLSTermination.EDGE)
    ok = validate_route(route(tls=dataclasses.replace(edge, hsts=HSTS(31536000, True, True))))
    assert ok.tls is not None and ok.tls.hsts == HSTS(31536000, True, True)
    assert validate_route(route(tls=dataclasses.replace(edge, hsts=HSTS(0))))
    assert "max_age" in refused(route(tls=dataclasses.replace(edge, hsts=HSTS(-1))))
    assert "max_age" in refused(route(tls=dataclasses.replace(edge, hsts=HSTS(3 * 365 * 86400))))
    assert "preload" in refused(route(tls=dataclasses.replace(edge, hsts=HSTS(3600, True, True))))
    assert "preload" in refused(
        route(tls=dataclasses.replace(edge, hsts=HSTS(31536000, False, True)))
    )
    passthrough = RouteTLS(TLSTermination.PASSTHROUGH, hsts=HSTS(3600))
    assert "tls.hsts" in refused(route(tls=passthrough))


def test_upstream_server_name_and_client_certificate_are_reencrypt_fields() -> None:
    reencrypt = RouteTLS(TLSTermination.REENCRYPT, destination_server_name="Console.Demo.svc.")
    checked = validate_route(route(tls=reencrypt))
    assert checked.tls is not None and checked.tls.destination_server_name == "console.demo.svc"
    assert "DNS" not in refused(
        route(tls=dataclasses.replace(reencrypt, destination_server_name="*.demo.svc"))
    )
    assert "host name" in refused(
        route(tls=dataclasses.replace(reencrypt, destination_server_name="bad_name.svc"))
    )
    for field in ("destination_server_name", "present_client_certificate"):
        value: object = "a.demo.svc" if field == "destination_server_name" else True
        for termination in (TLSTermination.EDGE, TLSTermination.PASSTHROUGH):
            message = refused(route(tls=RouteTLS(termination, **{field: value})))  # type: ignore[arg-type]
            assert f"tls.{field}" in message and "only reencrypt" in message


def test_client_ca_must_parse() -> None:
    ca = LocalCA()
    tls = RouteTLS(TLSTermination.EDGE, client_ca_certificate=ca.pem.decode())
    assert validate_route(route(tls=tls, auth_proxy_headers=True))
    bad = RouteTLS(TLSTermination.EDGE, client_ca_certificate="-----BEGIN CERTIFICATE-----\nno\n")
    assert "tls.client_ca_certificate" in refused(route(tls=bad))
    passthrough = RouteTLS(TLSTermination.PASSTHROUGH, client_ca_certificate=ca.pem.decode())
    assert "tls.client_ca_certificate" in refused(route(tls=passthrough))


def test_passthrough_sets_no_cookie_attributes() -> None:
    passthrough = RouteTLS(TLSTermination.PASSTHROUGH)
    message = refused(route(tls=passthrough, sticky=StickySessions(same_site=SameSite.NONE)))
    assert "sticky.same_site" in message


def full_route() -> Route:
    cert, key = self_signed("shop.example.com")
    ca = LocalCA()
    return validate_route(
        route(
            path="/api",
            tls=RouteTLS(
                TLSTermination.REENCRYPT,
                certificate=cert,
                key=key,
                destination_ca_certificate=ca.pem.decode(),
                client_ca_certificate=ca.pem.decode(),
                destination_server_name="web.shop.svc",
                present_client_certificate=True,
                hsts=HSTS(31536000, include_subdomains=True, preload=True),
            ),
            sticky=StickySessions(cookie_name="s", same_site=SameSite.STRICT),
            timeouts=RouteTimeouts(connect=2.5, keep_alive=120),
            auth_proxy_headers=True,
            forwarded_headers=ForwardedHeadersMode.IF_NONE,
        )
    )


def test_new_fields_survive_the_proto_both_ways() -> None:
    original = full_route()
    assert convert.route_from_proto(convert.route_to_proto(original)) == original
    redacted = convert.route_from_proto(convert.route_to_proto(original, with_key=False))
    assert redacted.tls is not None and redacted.tls.key == ""


def test_new_fields_survive_the_routes_file_both_ways(tmp_path: Path) -> None:
    import yaml

    original = full_route()
    text = yaml.safe_dump({"routes": [route_to_document(original)]})
    (parsed,) = parse_routes_file(tmp_path / "routes.yaml", text).routes
    assert parsed == original


def test_routes_file_keys_for_the_new_fields(tmp_path: Path) -> None:
    text = """\
routes:
  - namespace: shop
    name: web
    host: shop.example.com
    to: web
    forwardedHeaders: never
    sticky: {sameSite: None}
    timeouts: {keepAlive: 90s}
    tls:
      termination: edge
      hsts: {maxAge: 1h, includeSubdomains: true}
"""
    (parsed,) = parse_routes_file(tmp_path / "routes.yaml", text).routes
    assert parsed.forwarded_headers is ForwardedHeadersMode.NEVER
    assert parsed.sticky.same_site is SameSite.NONE and parsed.timeouts.keep_alive == 90
    assert parsed.tls is not None and parsed.tls.hsts == HSTS(3600, include_subdomains=True)
    from waygate.resolver.filesource import FileError

    with pytest.raises(FileError, match=r"routes.yaml:6: .*forwardedHeaders.*not one of"):
        parse_routes_file(tmp_path / "routes.yaml", text.replace("never", "sometimes"))
    with pytest.raises(FileError, match=r"routes.yaml:11: .*preload needs"):
        parse_routes_file(
            tmp_path / "routes.yaml",
            text.replace("includeSubdomains: true}", "includeSubdomains: true, preload: true}"),
        )


def test_every_timeout_field_survives_the_proto_and_the_routes_file(tmp_path: Path) -> None:
    """The converters read the timeout fields from RouteTimeouts itself: a field
    added there travels everywhere without another list to update."""
    import dataclasses

    import yaml

    names = [f.name for f in dataclasses.fields(RouteTimeouts)]
    timeouts = RouteTimeouts(**{name: float(i + 1) for i, name in enumerate(names)})
    original = dataclasses.replace(full_route(), timeouts=timeouts)
    assert convert.route_from_proto(convert.route_to_proto(original)).timeouts == timeouts
    text = yaml.safe_dump({"routes": [route_to_document(original)]})
    (parsed,) = parse_routes_file(tmp_path / "routes.yaml", text).routes
    assert parsed.timeouts == timeouts
