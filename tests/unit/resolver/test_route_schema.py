"""One Route schema (issue 28 item 6; issue 31 finding 8 for Routes).

`waygate.resolver.schema` declares a route's fields once; these tests hold every
other place to it: the Route CRD's YAML, the model's dataclasses, the proto's
messages, `convert.py` both ways, the routes-file reader and writer and the CRD
reader. A field added in one place and not the others fails here. The bounds
(the CRD's maxLength/maxItems) are enforced on every Route source with the
place named, and a source's route budget likewise.
"""

from __future__ import annotations

import dataclasses
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.support.pki import LocalCA, self_signed
from waygate.core.errors import InvalidArgument
from waygate.resolver import convert, model, schema
from waygate.resolver.filesource import FileError, parse_routes_file
from waygate.resolver.kube_convert import route_from
from waygate.resolver.manifests import parse_manifests
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.validation import validate_route

CRD = Path(__file__).resolve().parents[3] / "deploy" / "kustomize" / "base" / "crd-route.yaml"


@pytest.fixture(scope="module")
def crd_schema() -> dict[str, Any]:
    crd = yaml.safe_load(CRD.read_text())
    (version,) = crd["spec"]["versions"]
    return version["schema"]["openAPIV3Schema"]


def test_the_crd_yaml_says_what_the_schema_declares(crd_schema):
    """Types, required keys, enums, patterns, maxLength and maxItems: field by field."""
    assert schema.structural(crd_schema["properties"]["spec"]) == schema.openapi_spec()


# The dataclass each nested field builds, by the proto message that carries it.
MESSAGES = {
    model.Route: pb.Route,
    model.RouteBackend: pb.RouteBackend,
    model.RouteTLS: pb.RouteTLS,
    model.HSTS: pb.HSTS,
    model.StickySessions: pb.StickySessions,
    model.RouteTimeouts: pb.RouteTimeouts,
}
# Model attribute -> proto field, where the names differ.
PROTO_NAMES = {"created": "creation_timestamp"}


def declared(owner: type) -> set[str]:
    if owner is model.Route:
        return {f.attr for f in schema.ENTRY_FIELDS if f.attr}
    (parent,) = [f for f, _ in schema.all_fields() if f.model_type is owner]
    return {f.attr for f in parent.fields}


@pytest.mark.parametrize("owner", list(MESSAGES), ids=lambda t: t.__name__)
def test_every_model_field_is_declared_or_derived(owner):
    derived = set(schema.DERIVED.get(owner.__name__, {}))
    fields = {f.name for f in dataclasses.fields(owner)}
    assert declared(owner) & derived == set(), "declared and derived at once"
    assert fields == declared(owner) | derived, (
        "a model field neither in the Route schema nor in schema.DERIVED (with why)"
    )


@pytest.mark.parametrize("owner", list(MESSAGES), ids=lambda t: t.__name__)
def test_every_proto_field_is_a_model_field(owner):
    """The proto carries exactly the model's fields but the resolver's own."""
    proto = {f.name for f in MESSAGES[owner].DESCRIPTOR.fields}
    own = schema.RESOLVER_ONLY.get(owner.__name__, frozenset())
    assert own <= set(schema.DERIVED.get(owner.__name__, {}))
    fields = {PROTO_NAMES.get(f.name, f.name) for f in dataclasses.fields(owner)} - own
    assert proto == fields


def full_route() -> model.Route:
    """A route with every declared field away from its default (checked below)."""
    cert, key = self_signed("shop.example.com")
    ca = LocalCA().pem.decode()
    return validate_route(
        model.Route(
            "shop",
            "web",
            "shop.example.com",
            path="/api",
            backends=(model.RouteBackend("web", 200), model.RouteBackend("canary", 3)),
            target_port="https",
            tls=model.RouteTLS(
                model.TLSTermination.REENCRYPT,
                certificate=cert,
                key=key,
                ca_certificate=ca,
                destination_ca_certificate=ca,
                client_ca_certificate=ca,
                destination_server_name="web.shop.svc",
                present_client_certificate=True,
                insecure_edge_termination_policy=model.InsecureEdgePolicy.REDIRECT,
                hsts=model.HSTS(2 * 31536000, include_subdomains=True, preload=True),
            ),
            balance=model.BalancePolicy.ROUND_ROBIN,
            sticky=model.StickySessions(
                disable_cookies=True, cookie_name="s", same_site=model.SameSite.STRICT
            ),
            timeouts=model.RouteTimeouts(
                **{name: float(i + 1) for i, name in enumerate(model.TIMEOUT_FIELDS)}
            ),
            auth_proxy_headers=True,
            forwarded_headers=model.ForwardedHeadersMode.IF_NONE,
            upstream_protocol="h2",
            request_buffering=False,
        )
    )


def test_the_full_route_sets_every_declared_field():
    """So that the round trips below cover a field as soon as it is declared."""
    unset = []

    def walk(obj: Any, fields: tuple[schema.Field, ...], where: str) -> None:
        for field in fields:
            if not field.attr:
                continue
            value = getattr(obj, field.attr)
            if value == schema._default(type(obj), field) or value is None:
                unset.append(f"{where}{field.key}")
            elif field.kind == schema.OBJECT:
                walk(value, field.fields, f"{where}{field.key}.")
            elif field.kind == schema.LIST:
                for item in value:
                    walk(item, field.fields, f"{where}{field.key}[].")

    walk(full_route(), schema.ENTRY_FIELDS, "")
    assert unset == ["namespace"] or unset == [], unset


def test_every_field_survives_the_proto_both_ways():
    route = full_route()
    assert convert.route_from_proto(convert.route_to_proto(route)) == route


def test_every_field_survives_the_routes_file_both_ways(tmp_path: Path):
    route = full_route()
    text = yaml.safe_dump({"routes": [schema.route_to_document(route)]})
    (parsed,) = parse_routes_file(tmp_path / "routes.yaml", text).routes
    assert parsed == route


def test_every_field_survives_a_route_object_and_passes_the_crd(crd_schema):
    route = full_route()
    obj = {
        "apiVersion": "waygate.io/v1",
        "kind": "Route",
        "metadata": {"namespace": route.namespace, "name": route.name},
        "spec": schema.spec_document(route),
    }
    jsonschema.validate(obj, crd_schema)
    assert route_from(obj) == route


def test_the_document_spells_enums_as_the_file_does():
    document = schema.route_to_document(full_route())
    assert document["sticky"]["sameSite"] == "Strict"
    assert document["tls"]["termination"] == "reencrypt"
    assert document["tls"]["insecureEdgeTerminationPolicy"] == "Redirect"
    assert document["balance"] == "roundrobin"
    assert document["timeouts"]["connect"] == "1s"


def crd(spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "apiVersion": "waygate.io/v1",
        "kind": "Route",
        "metadata": {"namespace": "demo", "name": "r"},
        "spec": spec,
    }


def test_the_crd_path_refuses_unknown_keys_as_the_routes_file_does(tmp_path: Path):
    with pytest.raises(InvalidArgument, match=r"route demo/r: spec.tls: unknown key 'mode'"):
        route_from(crd({"host": "a.example.com", "to": "web", "tls": {"mode": "edge"}}))
    with pytest.raises(InvalidArgument, match=r"route demo/r: spec: unknown key 'colour'"):
        route_from(crd({"host": "a.example.com", "to": "web", "colour": "blue"}))
    with pytest.raises(FileError, match=r"r.yaml:5: route demo/r: unknown key 'colour'"):
        parse_routes_file(
            tmp_path / "r.yaml",
            "routes:\n  - namespace: demo\n    name: r\n    host: a.example.com\n"
            "    colour: blue\n    to: web\n",
        )


def manifest(tmp_path: Path, spec_lines: str) -> Path:
    path = tmp_path / "routes.yaml"
    path.write_text(
        "apiVersion: waygate.io/v1\nkind: Route\nmetadata: {namespace: demo, name: r}\n"
        "spec:\n  host: a.example.com\n" + spec_lines
    )
    return path


def test_a_manifest_route_error_names_the_line_of_the_key(tmp_path: Path):
    path = manifest(tmp_path, "  to: web\n  sticky:\n    colour: blue\n")
    with pytest.raises(FileError, match=rf"{path}:8: route demo/r: spec.sticky: unknown key"):
        parse_manifests([(path, path.read_text())])
    path = manifest(tmp_path, "  to: web\n  balance: fastest\n")
    with pytest.raises(FileError, match=rf"{path}:7: .*spec.balance: 'fastest' is not one of"):
        parse_manifests([(path, path.read_text())])
    path = manifest(
        tmp_path, "  backends:\n    - {service: web}\n    - {service: web, weight: 5}\n"
    )
    # validation's error (a duplicate backend) points at its item too.
    with pytest.raises(FileError, match=rf"{path}:8: .*backends\[1\].service"):
        parse_manifests([(path, path.read_text())])


FIVE_BACKENDS = [{"service": f"s{i}"} for i in range(5)]


@pytest.mark.parametrize(
    ("spec", "reason"),
    [
        ({"host": "a.example.com", "backends": FIVE_BACKENDS}, "backends: 5 items; at most 4"),
        ({"host": "a" * 254 + ".example.com", "to": "web"}, "host: 266 characters"),
        ({"host": "a.example.com", "to": "w" * 64}, "to: 64 characters"),
        ({"host": "a.example.com", "to": "web", "path": "/" + "a" * 1024}, "path: 1025 char"),
        (
            {"host": "a.example.com", "backends": [{"service": "s" * 100}]},
            r"backends\[0\].service: 100 characters",
        ),
        ({"host": "a.example.com", "to": "web", "targetPort": "p" * 16}, "targetPort: 16 char"),
        (
            {"host": "a.example.com", "to": "web", "sticky": {"cookieName": "c" * 300}},
            "sticky.cookieName: 300 characters",
        ),
        (
            {
                "host": "a.example.com",
                "to": "web",
                "tls": {"termination": "edge", "key": "k" * 70000},
            },
            "tls.key: 70000 characters",
        ),
    ],
)
def test_bounds_are_enforced_on_every_route_source(tmp_path: Path, spec, reason, crd_schema):
    # The API server would refuse it too (the CRD declares the same bound) ...
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(crd(spec), crd_schema)
    # ... and so does the resolver, for a Route from the API, ...
    with pytest.raises(InvalidArgument, match=f"route demo/r: spec.{reason}"):
        route_from(crd(spec))
    # ... a Route in a manifests file (with its line) ...
    path = tmp_path / "routes.yaml"
    path.write_text(yaml.safe_dump(crd(spec), width=1 << 20))
    with pytest.raises(FileError, match=rf"{path}:\d+: route demo/r: spec.{reason}"):
        parse_manifests([(path, path.read_text())])
    # ... and the routes file (with its line).
    entry = {"namespace": "demo", "name": "r", **spec}
    text = yaml.safe_dump({"routes": [entry]}, width=1 << 20)
    with pytest.raises(FileError, match=rf"r.yaml:\d+: route demo/r: {reason}"):
        parse_routes_file(tmp_path / "r.yaml", text)


def test_the_routes_file_budget_names_the_first_route_past_it(tmp_path: Path):
    entries = [{"namespace": "demo", "name": "r0", "host": "a.example.com", "to": "web"}]
    entries += [{**entries[0], "name": f"r{i}", "path": f"/{i}"} for i in range(1, 4)]
    text = yaml.safe_dump({"routes": entries}, default_flow_style=False, sort_keys=False)
    assert len(parse_routes_file(tmp_path / "r.yaml", text, max_routes=4).routes) == 4
    starts = [i + 1 for i, line in enumerate(text.splitlines()) if line.startswith("- ")]
    with pytest.raises(
        FileError, match=rf"r.yaml:{starts[3]}: 4 routes; a source may produce at most 3"
    ):
        parse_routes_file(tmp_path / "r.yaml", text, max_routes=3)


def test_the_file_source_keeps_its_last_good_state_past_its_budget(tmp_path: Path):
    from waygate.resolver.filesource import FileSource
    from waygate.resolver.store import Store

    path = tmp_path / "routes.yaml"
    one = {"namespace": "demo", "name": "a", "host": "a.example.com", "to": "web"}
    path.write_text(yaml.safe_dump({"routes": [one]}))
    source = FileSource(Store(), path, max_routes=1)
    assert source.load()
    path.write_text(yaml.safe_dump({"routes": [one, {**one, "name": "b"}]}))
    assert not source.load()
    assert source.last_error is not None and "at most 1 (--max-routes-per-source)" in (
        source.last_error
    )
    assert [r.name for r in source.store.routes()] == ["a"]


@pytest.mark.parametrize(
    "text",
    [
        "routes:\n- name: x\n  host: 2001-13-45\n  to: w\n",
        "services:\n- name: 2001-13-45\n",
    ],
)
def test_a_value_yaml_cannot_construct_is_an_error_on_its_line(tmp_path: Path, text: str):
    """A date-shaped value that is no date raised a bare ValueError (a traceback)."""
    with pytest.raises(FileError, match=r"r.yaml:[23]: .*bad value: month must be in 1..12"):
        parse_routes_file(tmp_path / "r.yaml", text)


def test_the_readme_names_every_key_of_the_route_format():
    readme = (Path(__file__).resolve().parents[3] / "README.md").read_text()
    section = readme[readme.index("**One route format**") :]
    section = section[: section.index("**kubectl habits.**")]
    missing = [f.key for f, _ in schema.all_fields() if f.key not in section]
    assert missing == [], f"README's route format paragraph lacks {missing}"


def test_a_manifests_source_past_its_budget_names_the_object(tmp_path: Path):
    path = tmp_path / "m.yaml"
    documents = [
        crd({"host": f"r{i}.example.com", "to": "web"})
        | {"metadata": {"namespace": "demo", "name": f"r{i}"}}
        for i in range(3)
    ]
    path.write_text(yaml.safe_dump_all(documents, sort_keys=False))
    assert len(parse_manifests([(path, path.read_text())], max_routes=3).routes) == 3
    third = path.read_text().split("---").pop(2)
    assert "r2" in third
    line = path.read_text().splitlines().index("apiVersion: waygate.io/v1", 2 * 5) + 1
    with pytest.raises(
        FileError, match=rf"m.yaml:{line}: 3 routes; a source may produce at most 2"
    ):
        parse_manifests([(path, path.read_text())], max_routes=2)


# A value for every field in schema.DERIVED (the Gateway API's and the resolver's):
# a field added there needs one here, and then travels through the proto or fails.
DERIVED_SAMPLES: dict[str, dict[str, Any]] = {
    "Route": {
        "created": datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC),
        "status": model.RouteStatus(
            (model.RouteCondition("Accepted", "True", "Accepted", "ok", None, 3),)
        ),
        "matches": (
            model.RouteMatch(
                model.PathMatchType.EXACT,
                "/x",
                headers=(model.HeaderMatch("x-env", "canary"),),
                query=(model.HeaderMatch("q", "1", model.ValueMatchType.REGEX),),
                method="GET",
            ),
        ),
        "filters": model.RouteFilters(
            request_headers=model.HeaderModifier(set=(("a", "1"),), remove=("b",)),
            rewrite=model.Rewrite(path_type=model.PathModifierType.PREFIX, path="/y"),
            mirrors=(model.Mirror("shadow", percent=50),),
        ),
        "request_timeout": 1.5,
        "backend_request_timeout": 0.5,
        "listener_port": 8080,
        "gateway": "demo/gw",
        "listener_protocol": "HTTP",
        "origin": "HTTPRoute demo/x",
        "rule_index": 2,
        "access": model.RouteAccess(
            block=("192.0.2.0/24",),
            deny=("10.1.0.0/16",),
            allow=("10.0.0.0/8",),
            block_user_agents=("~*bot",),
            block_referers=("spam.example",),
            trusted_proxies=("0.0.0.0/0",),
            auth_type="basic",
            auth_realm="staff",
            credentials=("ann:{PLAIN}pw",),
            satisfy_any=True,
        ),
        "proxy_protocol_from_client": True,
        "proxy_protocol_to_backend": True,
        "rate_limit": model.RateLimit(rps=5, rpm=300, connections=2, allow=("10.0.0.0/8",)),
        "external_auth": model.ExternalAuth(
            "http://auth.example.com/check",
            method="POST",
            signin="https://login.example.com/",
            response_headers=("X-User",),
            proxy_set_headers=(("X-Tenant", "a"),),
            cache_key="$http_authorization",
            cache_durations=((200, 300.0), (401, 60.0)),
        ),
        "cors": model.Cors(("https://a.test",), "GET", "X-A", "X-B", False, 5),
        "max_request_body": 1048576,
        "next_upstream": "error",
        "next_upstream_tries": 5,
        "rewrite_target": "/x/$2",
        "default_backend": "fallback",
        "hash_by": "$request_uri",
        "hash_subset_size": 3,
        "redirect_from": "http://backend.local/",
        "redirect_to": "/app/",
        "cookie_domain": "backend.local example.org",
        "cookie_path": "/one/ /",
        "custom_http_errors": (404, 503),
        "intercept_errors_disabled": True,
        "port_in_redirects": True,
        "connection_header": "close",
        "access_log_disabled": True,
        "client_proxy_protocol": True,
        "canary": model.Canary(1, 10, 200, "X-Canary", "yes", "", "canary", True),
        "limit_rate": 10240,
        "limit_rate_after": 1024,
        "url_mirror": model.UrlMirror("https://m.example$request_uri", "m", False),
        "next_upstream_timeout": 2.5,
        "upstream_scheme_from_client": True,
        "upstream_http10": True,
        "redirect_location": "https://x.example.com/a?b=c",
        "client_address_header": "cf-connecting-ip",
        "span_name": "HTTP $request_method web",
        "tracing_off": True,
        "untrusted_trace_context": True,
    },
    "RouteBackend": {
        "namespace": "other",
        "port": "http",
        "invalid": "not granted",
        "use_cluster_ip": True,
    },
    "StickySessions": {
        "cookie_path": "/app",
        "cookie_domain": "example.com",
        "cookie_max_age": 60,
        "cookie_secure": True,
    },
    "RouteTLS": {
        "destination_system_ca": True,
        "destination_san_hostnames": ("a.example.com",),
        "destination_san_uris": ("spiffe://x/y",),
        "backend_client_certificate": "-----BEGIN CERTIFICATE-----\nclient\n",
        "backend_client_key": "-----BEGIN PRIVATE KEY-----\nclient\n",
        "protocols": ("TLSv1.3",),
        "ciphers": "ECDHE-ECDSA-AES256-GCM-SHA384",
    },
}


def test_every_derived_field_survives_the_proto_both_ways():
    assert {k: set(v) for k, v in DERIVED_SAMPLES.items()} == {
        k: set(v) - schema.RESOLVER_ONLY.get(k, frozenset()) for k, v in schema.DERIVED.items()
    }
    route = full_route()
    assert route.tls is not None
    route = dataclasses.replace(
        route,
        backends=tuple(
            dataclasses.replace(b, **DERIVED_SAMPLES["RouteBackend"]) for b in route.backends
        ),
        tls=dataclasses.replace(route.tls, **DERIVED_SAMPLES["RouteTLS"]),
        **DERIVED_SAMPLES["Route"],
    )
    assert convert.route_from_proto(convert.route_to_proto(route)) == route


def test_route_credentials_are_withheld_as_private_keys_are():
    """htpasswd hashes are secrets: a reply without keys carries no credentials."""
    access = DERIVED_SAMPLES["Route"]["access"]
    route = dataclasses.replace(full_route(), access=access)
    shown = convert.route_from_proto(convert.route_to_proto(route, with_key=False))
    assert shown.access == dataclasses.replace(access, credentials=())
    assert shown.tls is not None and not shown.tls.key


def test_the_backend_client_key_is_withheld_as_the_serving_key_is():
    """proxy-ssl-secret's tls.key: the same one redaction (convert's with_key) as tls.key."""
    route = full_route()
    assert route.tls is not None
    tls = dataclasses.replace(
        route.tls, **DERIVED_SAMPLES["RouteTLS"], termination=model.TLSTermination.REENCRYPT
    )
    route = dataclasses.replace(route, tls=tls)
    shown = convert.route_from_proto(convert.route_to_proto(route, with_key=False))
    assert shown.tls is not None
    assert shown.tls.backend_client_certificate == tls.backend_client_certificate
    assert (shown.tls.key, shown.tls.backend_client_key) == ("", "")
    kept = convert.route_from_proto(convert.route_to_proto(route))
    assert kept.tls is not None and kept.tls.backend_client_key == tls.backend_client_key


_json = st.recursive(
    st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=-(2**70), max_value=2**70),
        st.floats(),
        st.text(max_size=20),
        st.sampled_from(["edge", "Lax", "5s", "1e999", "web", "a.example.com", "/x", "x" * 300]),
    ),
    lambda inner: st.one_of(
        st.lists(inner, max_size=5), st.dictionaries(st.text(max_size=8), inner, max_size=3)
    ),
    max_leaves=10,
)


def _shaped(fields: tuple[schema.Field, ...]) -> st.SearchStrategy:
    nested = {f.key: _shaped(f.fields) for f in fields if f.kind == schema.OBJECT}
    nested |= {
        f.key: st.lists(_shaped(f.fields), max_size=6) for f in fields if f.kind == schema.LIST
    }
    return st.fixed_dictionaries(
        {},
        optional={f.key: st.one_of(nested.get(f.key, _json), _json) for f in fields}
        | {"unknownKey": _json},
    )


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.one_of(_shaped(schema.SPEC_FIELDS), _json))
def test_a_route_object_of_any_shape_is_a_route_or_an_invalid_argument(spec: Any):
    """The CRD path never raises anything but InvalidArgument (a status, not a crash)."""
    try:
        route = route_from(crd(spec))
    except InvalidArgument as exc:
        assert len(str(exc)) < 2000
    else:
        assert isinstance(route, model.Route)
