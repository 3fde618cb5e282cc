"""nginx's proxy_redirect, proxy_cookie_domain and proxy_cookie_path on response lines.

The rules of nginx's ngx_http_proxy_module as documented
(https://nginx.org/en/docs/http/ngx_http_proxy_module.html): proxy_redirect
compares the start of Location and of Refresh's url= case-sensitively;
proxy_cookie_domain compares the whole Domain case-insensitively, a leading dot
ignored on both sides and kept; proxy_cookie_path replaces a Path prefix.
"""

from __future__ import annotations

from waygate.proxy import filters
from waygate.proxy.http1 import RequestHead
from waygate.proxy.responserewrite import ResponseRules, _host_port, origin


def _rules(**kw: object) -> ResponseRules:
    return ResponseRules(**kw)  # type: ignore[arg-type]


def test_location_prefix_is_replaced_case_sensitively():
    rules = _rules(redirect_from=b"http://a.local/", redirect_to=b"https://b.test/app/")
    out = rules.rewrite([b"Location: http://a.local/x?y=1", b"X-Other: http://a.local/"])
    assert out == [b"Location: https://b.test/app/x?y=1", b"X-Other: http://a.local/"]
    assert rules.rewrite([b"location: HTTP://A.LOCAL/x"]) == [b"location: HTTP://A.LOCAL/x"]


def test_a_relative_replacement_is_made_absolute_with_the_requests_origin():
    rules = _rules(redirect_from=b"http://a.local/", redirect_to=b"/", origin=b"https://shop.test")
    assert rules.rewrite([b"Location: http://a.local/cart"]) == [
        b"Location: https://shop.test/cart"
    ]


def test_refresh_url_is_rewritten_from_url_on():
    rules = _rules(redirect_from=b"http://a.local/", redirect_to=b"http://b.test/")
    assert rules.rewrite([b"Refresh: 3; URL=http://a.local/z"]) == [
        b"Refresh: 3; URL=http://b.test/z"
    ]
    assert rules.rewrite([b"Refresh: 3"]) == [b"Refresh: 3"]


def test_cookie_domain_whole_match_case_insensitive_dot_kept():
    rules = _rules(cookie_domain=(b"localhost", b"example.org"))
    assert rules.rewrite([b"Set-Cookie: a=1; domain=.LOCALHOST; Path=/"]) == [
        b"Set-Cookie: a=1; domain=.example.org; Path=/"
    ]
    assert rules.rewrite([b"Set-Cookie: a=1; Domain=sub.localhost"]) == [
        b"Set-Cookie: a=1; Domain=sub.localhost"
    ]
    # The cookie's own value is never read as an attribute.
    assert rules.rewrite([b"Set-Cookie: domain=localhost"]) == [b"Set-Cookie: domain=localhost"]


def test_cookie_path_prefix_replaced():
    rules = _rules(cookie_path=(b"/one/", b"/"))
    assert rules.rewrite([b"Set-Cookie: a=1; Path=/one/two; Secure"]) == [
        b"Set-Cookie: a=1; Path=/two; Secure"
    ]
    assert rules.rewrite([b"Set-Cookie: a=1; Path=/other"]) == [b"Set-Cookie: a=1; Path=/other"]


def test_the_route_filters_run_after_the_rewrite():
    rules = _rules(
        redirect_from=b"/a/", redirect_to=b"/b/", set=(("Location", "/fixed"),), remove=("X-Drop",)
    )
    fields = b"\r\nLocation: /a/x\r\nX-Drop: 1\r\nX-Keep: 2"
    assert filters.modify_response_fields(fields, rules) == b"\r\nX-Keep: 2\r\nLocation: /fixed"
    assert rules.without_errors() is rules


def test_origin_port_only_when_asked_and_not_the_schemes():
    req = RequestHead()
    req.host = b"shop.test"
    req.fields = b"Host: shop.test:8443\r\nAccept: */*\r\n"
    assert origin(req, True, False) == b"https://shop.test"
    assert origin(req, True, True) == b"https://shop.test:8443"
    req.fields = b"Host: shop.test:443\r\n"
    assert origin(req, True, True) == b"https://shop.test"
    assert _host_port(b"Host: [::1]:8080\r\n") == b"8080"
    assert _host_port(b"Host: [::1]\r\n") == b""
