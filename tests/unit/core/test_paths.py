"""waygate.core.paths: one form for percent-escapes, the same for str and raw bytes."""

from __future__ import annotations

import pytest

from waygate.core.paths import normalize_escapes, normalize_request_path


@pytest.mark.parametrize(
    ("raw", "normal"),
    [
        ("/admin", "/admin"),
        ("/%61dmin", "/admin"),
        ("/%7eu/%7E", "/~u/~"),
        ("/a%2db%5F", "/a-b_"),
        ("/a%3ab%c3%a9", "/a%3Ab%C3%A9"),
        ("/a%2fb", "/a%2Fb"),
        ("/a%zz%4", "/a%zz%4"),
        ("/%2e%2E", "/.."),
    ],
)
def test_escapes_have_one_form(raw: str, normal: str) -> None:
    assert normalize_escapes(raw) == normal
    assert normalize_request_path(raw.encode()) == normal.encode()
