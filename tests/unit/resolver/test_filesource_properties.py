"""Property tests of the routes-file parser (issue 8 item 8): whatever the file holds,
parsing ends in a FileContent or a clean FileError naming the problem, never in
any other exception (which the resolver would turn into a crash or a traceback).
The same for ApplyRoute's input: any Route message converts and validates to a
route or to InvalidArgument, never to an INTERNAL.

Documents are generated in the file's own shape (the real key names, nested as
the format nests them) with hostile values, so the search reaches the
validation of every field, not only the top-level "unknown key" check.
"""

from __future__ import annotations

from pathlib import Path

import yaml
from google.protobuf import duration_pb2
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from waygate.core.errors import InvalidArgument
from waygate.resolver import convert, filesource, schema
from waygate.resolver.filesource import FileContent, FileError, parse_routes_file
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.validation import validate_route

PATH = Path("/routes.yaml")

texts = st.one_of(
    st.text(max_size=40),
    st.sampled_from(
        [
            "",
            "/",
            "/..",
            "/%2e%2e/admin",
            "/a%2F",
            "/a%",
            "*.example.com",
            "web",
            "shop",
            "80",
            "²",
            "٣",
            "0x10",
            "http",
            "edge",
            "reencrypt",
            "passthrough",
            "Redirect",
            "None",
            "Lax",
            "append",
            "if-none",
            "5s",
            "1h",
            "-1s",
            "1e400s",
            "nan",
            "10.0.0.1",
            "::1",
            "a" * 300,
            "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
        ]
    ),
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    texts,
)
anything = st.recursive(
    scalars,
    lambda inner: st.one_of(
        st.lists(inner, max_size=3), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=8,
)


def shaped(
    keys: tuple[str, ...] | dict[str, str], **nested: st.SearchStrategy
) -> st.SearchStrategy:
    """A mapping with some of `keys`, each value hostile or (for `nested`) shaped."""
    return st.fixed_dictionaries(
        {},
        optional={key: nested.get(key, anything) for key in keys} | {"unknownKey": anything},
    )


def listed(strategy: st.SearchStrategy) -> st.SearchStrategy:
    return st.one_of(st.lists(strategy, max_size=3), anything)


service_ports = shaped(filesource._SERVICE_PORT_KEYS)
endpoint_ports = shaped(filesource._ENDPOINT_PORT_KEYS)
endpoints = shaped(filesource._ENDPOINT_KEYS, ports=listed(endpoint_ports))
services = shaped(
    filesource._SERVICE_KEYS, ports=listed(service_ports), endpoints=listed(endpoints)
)


def keys(fields: tuple[schema.Field, ...]) -> tuple[str, ...]:
    return tuple(field.key for field in fields)


tls = shaped(keys(schema.TLS_FIELDS), hsts=shaped(keys(schema.HSTS_FIELDS)))
routes = shaped(
    keys(schema.ENTRY_FIELDS),
    backends=listed(shaped(keys(schema.BACKEND_FIELDS))),
    tls=st.one_of(tls, anything),
    sticky=shaped(keys(schema.STICKY_FIELDS)),
    timeouts=shaped(keys(schema.TIMEOUT_FIELDS)),
)
documents = st.fixed_dictionaries(
    {}, optional={"services": listed(services), "routes": listed(routes), "extra": anything}
)


def parses_cleanly(text: str) -> None:
    try:
        result = parse_routes_file(PATH, text)
    except FileError as error:
        assert str(error).startswith(str(PATH))
        # Reasons repeat values only as short excerpts.
        assert len(str(error)) < 2000, str(error)[:200]
    else:
        assert isinstance(result, FileContent)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
# Found while writing this test: str.isdigit() is true for "²", and int("²") raises.
@example({"services": [{"name": "a", "ports": [{"port": 80, "targetPort": "²"}]}]})
@example({"routes": [{"name": "a", "host": "a.b", "to": "a", "targetPort": "٣"}]})
def test_shaped_documents_parse_or_fail_cleanly(document: dict) -> None:
    parses_cleanly(yaml.safe_dump(document, allow_unicode=True))


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=300))
def test_arbitrary_text_parses_or_fails_cleanly(text: str) -> None:
    parses_cleanly(text)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.sampled_from(
            [
                "routes:",
                "services:",
                "  - ",
                "name: ",
                "{",
                "[",
                "&a ",
                "*a",
                "!!python/object ",
                "\t",
                "'",
                "\n",
                "host: x",
                "tls:",
                "    ",
            ]
        ),
        max_size=30,
    )
)
def test_yaml_shaped_fragments_parse_or_fail_cleanly(parts: list[str]) -> None:
    parses_cleanly("".join(parts))


# ---------------------------------------------------------------- ApplyRoute's input


def _duration(seconds: int, nanos: int) -> duration_pb2.Duration:
    return duration_pb2.Duration(seconds=seconds, nanos=nanos)


proto_durations = st.builds(
    _duration, st.integers(-(10**11), 10**11), st.integers(-999_999_999, 999_999_999)
)
enums = st.integers(min_value=0, max_value=7)
proto_routes = st.builds(
    pb.Route,
    namespace=texts,
    name=texts,
    host=texts,
    path=texts,
    backends=st.lists(
        st.builds(pb.RouteBackend, service=texts, weight=st.integers(0, 2**32 - 1)), max_size=5
    ),
    target_port=texts,
    tls=st.one_of(
        st.none(),
        st.builds(
            pb.RouteTLS,
            termination=enums,
            certificate=texts,
            key=texts,
            ca_certificate=texts,
            destination_ca_certificate=texts,
            insecure_edge_termination_policy=enums,
            hsts=st.one_of(
                st.none(),
                st.builds(
                    pb.HSTS,
                    max_age=proto_durations,
                    include_subdomains=st.booleans(),
                    preload=st.booleans(),
                ),
            ),
            client_ca_certificate=texts,
            destination_server_name=texts,
            present_client_certificate=st.booleans(),
        ),
    ),
    balance=enums,
    sticky=st.builds(
        pb.StickySessions, disable_cookies=st.booleans(), cookie_name=texts, same_site=enums
    ),
    timeouts=st.builds(
        pb.RouteTimeouts,
        connect=proto_durations,
        keep_alive=st.one_of(st.none(), proto_durations),
    ),
    auth_proxy_headers=st.booleans(),
    forwarded_headers=enums,
)


@settings(max_examples=400, deadline=None)
@given(proto_routes)
def test_any_apply_route_message_is_a_valid_route_or_invalid_argument(message: pb.Route) -> None:
    """What ApplyRoute does with its input before the file: never any other exception."""
    try:
        route = validate_route(convert.route_from_proto(message))
    except InvalidArgument as error:
        assert len(str(error)) < 2000
    else:
        assert route.path.startswith("/") and ".." not in route.path.split("/")
