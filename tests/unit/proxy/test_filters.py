"""HTTPRoute filters on heads (waygate.proxy.filters): header modifiers, path rewrites,
redirect locations, and the lines a filter may never touch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from waygate.proxy.filters import (
    PathRewrite,
    modify_request_fields,
    modify_response_fields,
    redirect_location,
    replaced_path,
    rewritten_request,
)
from waygate.proxy.http1 import parse_request_head
from waygate.resolver.model import HeaderModifier, PathModifierType, Redirect, Rewrite

FULL, PREFIX = PathModifierType.FULL, PathModifierType.PREFIX


@pytest.mark.parametrize(
    ("path", "prefix", "kind", "replacement", "expected"),
    [
        (b"/prefix/one/two", b"/prefix/one", PREFIX, "/one", b"/one/two"),
        (b"/strip-prefix/three", b"/strip-prefix", PREFIX, "/", b"/three"),
        (b"/strip-prefix", b"/strip-prefix", PREFIX, "/", b"/"),
        (b"/a/b", b"/", PREFIX, "/x", b"/x/a/b"),
        (b"/a/b", b"/a", PREFIX, "/x/", b"/x/b"),
        (b"/full/one/two", b"/full/one", FULL, "/one", b"/one"),
        (b"/kept", b"/", PathModifierType.NONE, "", b"/kept"),
    ],
)
def test_replaced_path(
    path: bytes, prefix: bytes, kind: PathModifierType, replacement: str, expected: bytes
) -> None:
    assert replaced_path(path, prefix, kind, replacement) == expected


@pytest.mark.parametrize(
    ("prefix", "replacement"),
    [(b"/api", "/"), (b"/api", ""), (b"/api", "/v2"), (b"/api", "/v2/"), (b"/", "/x"), (b"/", "/")],
)
@pytest.mark.parametrize("path", [b"/api", b"/api/", b"/api/a/b", b"/api//a", b"/x"])
def test_a_prepared_prefix_rewrite_is_the_spec_rule_and_keeps_the_query(
    prefix: bytes, replacement: str, path: bytes
) -> None:
    if not path.startswith(prefix):
        return  # (routing gives a rewrite only the paths its prefix matched)
    rewrite = PathRewrite(Rewrite(path_type=PREFIX, path=replacement), None, prefix)
    for query in (b"", b"?q=1"):
        req = parse_request_head(b"GET " + path + query + b" HTTP/1.1\r\nHost: a\r\n\r\n")
        out = rewrite.applied(req, path)
        assert out.target == replaced_path(path, prefix, PREFIX, replacement) + query
        assert req.target == path + query and out is not req


def test_request_modifier_sets_adds_removes_and_never_touches_framing() -> None:
    fields = (
        b"Host: a\r\nX-Set: old\r\nx-set: older\r\nX-Add: 1\r\nX-Gone: x\r\nContent-Length: 3\r\n"
    )
    modifier = HeaderModifier(
        set=(("X-Set", "new"), ("Host", "evil")),
        add=(("X-Add", "2"), ("Transfer-Encoding", "chunked")),
        remove=("x-gone", "content-length"),
    )
    assert modify_request_fields(fields, modifier) == (
        b"Host: a\r\nX-Add: 1\r\nContent-Length: 3\r\nX-Set: new\r\nX-Add: 2\r\n"
    )


def test_response_modifier_keeps_the_block_form() -> None:
    fields = b"\r\nContent-Type: a\r\nX-Header-Remove: v"
    modifier = HeaderModifier(add=(("X-Add", "v"),), remove=("X-Header-Remove",))
    assert modify_response_fields(fields, modifier) == b"\r\nContent-Type: a\r\nX-Add: v"
    assert modify_response_fields(b"", modifier) == b"\r\nX-Add: v"


def test_rewrite_changes_host_line_and_path_keeping_the_query() -> None:
    req = parse_request_head(b"GET /p/x?q=1 HTTP/1.1\r\nHost: a.example\r\nX: y\r\n\r\n")
    out = rewritten_request(req, Rewrite("b.example", PREFIX, "/n"), None, b"/p")
    assert out.fields == b"Host: b.example\r\nX: y\r\n" and out.target == b"/n/x?q=1"
    # The original head is untouched (it still frames the client's side).
    assert req.target == b"/p/x?q=1" and out.host == b"a.example"


@pytest.mark.parametrize(
    ("redirect", "secure", "listener", "expected"),
    [
        (Redirect(hostname="example.org"), False, 80, b"http://example.org/orig?q"),
        (Redirect(port=8083), False, 80, b"http://example.com:8083/orig?q"),
        (Redirect(scheme="https"), False, 80, b"https://example.com/orig?q"),
        (Redirect(scheme="http", port=80), True, 443, b"http://example.com/orig?q"),
        (Redirect(), False, 8080, b"http://example.com:8080/orig?q"),
        (Redirect(path_type=FULL, path="/new"), True, 443, b"https://example.com/new?q"),
    ],
)
def test_redirect_location(
    redirect: Redirect, secure: bool, listener: int, expected: bytes
) -> None:
    req = SimpleNamespace(host=b"example.com", target=b"/orig?q")
    location = redirect_location(req, redirect, b"/", secure=secure, listener_port=listener)
    assert location == expected


@pytest.mark.parametrize("replacement", ["/", "/v2/", "/a/b/"])
@pytest.mark.parametrize(
    "target", ["/api", "/api/", "/api//x", "/api/64", "/api/x/y?q=1&r", "/api?q", "/apix/y"]
)
def test_the_inline_slash_prefix_rewrite_is_the_general_ones(replacement: str, target: str):
    # shape_slash_prefix (the request core's runner for the commonest rewrite alone)
    # gives what `target` gives, with and without a query.
    rewrite = PathRewrite(Rewrite(path_type=PREFIX, path=replacement), None, b"/api")
    assert rewrite.slash_prefix
    head = parse_request_head(f"GET {target} HTTP/1.1\r\nHost: a.test\r\n\r\n".encode())
    query = head.target.find(b"?")
    path = head.target if query < 0 else head.target[:query]
    forward = SimpleNamespace(path=path, rewritten_target=None, response_modifier=None)
    rewrite.shape_slash_prefix(forward, head, None)
    assert forward.rewritten_target == rewrite.target(head, path)
    assert not PathRewrite(Rewrite(path_type=PREFIX, path="/x"), None, b"/api").slash_prefix


def test_a_remembered_route_modifier_rewrites_as_the_general_one_and_keeps_its_last_block():
    # filters.remembered: the route's ResponseHeaderModifier prepared once per entry
    # gives what the general rewrite gives, and a block seen again its remembered result.
    from waygate.proxy.filters import SetFields, modify_response_fields, remembered

    modifier = HeaderModifier(
        set=(("X-Set", "v"),), add=(("X-Add", "a"),), remove=("Server", "X-Gone")
    )
    kept = remembered(modifier)
    assert isinstance(kept, SetFields) and remembered(None) is None
    block = b"\r\nServer: nginx/1.22.1\r\nX-Set: old\r\nX-Gone: g\r\nContent-Type: text/plain"
    expected = modify_response_fields(block, modifier)
    assert b"Server" not in expected and b"X-Set: v" in expected and b"X-Add: a" in expected
    first = modify_response_fields(block, kept)
    assert first == expected
    assert modify_response_fields(block, kept) is first  # the same block: remembered
    other = block.replace(b"text/plain", b"text/html")
    assert modify_response_fields(other, kept) == modify_response_fields(other, modifier)


def test_the_inline_slash_prefix_rewrite_keeps_the_routes_response_modifier():
    modifier = HeaderModifier(remove=("Server",))
    rewrite = PathRewrite(Rewrite(path_type=PREFIX, path="/"), None, b"/api", modifier)
    assert rewrite.slash_prefix
    head = parse_request_head(b"GET /api/64 HTTP/1.1\r\nHost: a.test\r\n\r\n")
    forward = SimpleNamespace(path=head.target, rewritten_target=None, response_modifier=None)
    rewrite.shape_slash_prefix(forward, head, None)
    assert forward.rewritten_target == b"/64" and forward.response_modifier is modifier
    held = object()  # a CORS answer's modifier already holds the route's own lines
    forward = SimpleNamespace(path=head.target, rewritten_target=None, response_modifier=held)
    rewrite.shape_slash_prefix(forward, head, None)
    assert forward.response_modifier is held
