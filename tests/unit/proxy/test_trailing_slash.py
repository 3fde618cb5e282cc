"""ingress-nginx's HTTPS redirect without preserve-trailing-slash (filters.redirect_location)."""

from __future__ import annotations

from tests.unit.proxy.test_decision import req
from waygate.proxy import filters
from waygate.resolver.model import Redirect


def location(target: str, strip: bool) -> bytes:
    redirect = Redirect(scheme="https", status=308, strip_trailing_slash=strip)
    return filters.redirect_location(req(target), redirect, b"/", secure=False, listener_port=0)


def test_the_trailing_slash_of_path_and_query_is_dropped_unless_preserved():
    assert location("/a/", True) == b"https://a.test/a"
    assert location("/a/", False) == b"https://a.test/a/"
    assert location("/", True) == b"https://a.test/"  # never "/" itself
    assert location("/a/?q=1", True) == b"https://a.test/a/?q=1"  # as nginx's $request_uri
    assert location("/a?q=/", True) == b"https://a.test/a?q="
