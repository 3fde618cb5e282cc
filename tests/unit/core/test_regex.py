"""Route regular expressions are RE2 (waygate.core.regex): linear time, and what RE2
cannot express is refused with a reason people can act on."""

from __future__ import annotations

import re

import pytest

from waygate.core.regex import MAX_PATTERN, RegexRefused, compile_linear, refusal

# The audit's pattern (issue 31, finding 6): exponential for a backtracking engine.
REDOS = r"/redos/(a+)+$"


def test_the_audit_pattern_is_answered_without_backtracking() -> None:
    pattern = compile_linear(REDOS)
    # 40 a's: Python's `re` would take hours on this; the assertion is the answer, the
    # time is the suite's timeout (pytest-timeout), and bench/ measures the rest.
    assert pattern.fullmatch("/redos/" + "a" * 40 + "!") is None
    assert pattern.search("/redos/" + "a" * 40 + "!") is None
    assert pattern.fullmatch("/redos/aaa") is not None
    assert pattern.pattern == REDOS


@pytest.mark.parametrize(
    ("pattern", "hint"),
    [
        (r"/(a)\1", "backreferences are not supported"),
        (r"/x(?=y)", "lookahead is not supported"),
        (r"/x(?!y)", "lookahead is not supported"),
        (r"/(?<=a)b", "lookbehind is not supported"),
        (r"/a++", "possessive quantifiers are not supported"),
        (r"/[a", "missing ]"),
        (r"/(a{999}){999}", "invalid repetition size"),
    ],
)
def test_what_re2_cannot_express_is_refused_with_the_reason(pattern: str, hint: str) -> None:
    reason = refusal(pattern)
    assert reason is not None and hint in reason and "RE2" in reason
    with pytest.raises(RegexRefused) as caught:
        compile_linear(pattern)
    assert caught.value.reason == reason and caught.value.pattern == pattern


def test_a_pattern_over_the_length_bound_is_refused() -> None:
    assert refusal("a" * MAX_PATTERN) is None
    assert refusal("a" * (MAX_PATTERN + 1)) == f"longer than {MAX_PATTERN} characters"


@pytest.mark.parametrize(
    ("pattern", "text"),
    [
        (r"/api/v[0-9]+/.*", "/api/v12/users"),
        (r"/(?P<svc>[^/]+)/(?P<m>[^/]+)", "/pkg.Svc/Method"),
        (r"(?i)/Mixed", "/mIXED"),
        (r"/caf\x{e9}", "/café"),
        (r"\d+", "123"),
    ],
)
def test_common_route_patterns_mean_what_they_mean_in_python(pattern: str, text: str) -> None:
    ours = compile_linear(pattern)
    assert ours.fullmatch(text) is not None
    if "\\x{" not in pattern:  # RE2's \x{...} is not Python syntax
        assert re.fullmatch(pattern, text) is not None
    assert ours.fullmatch("x" + text) is None


def test_rewrites_substitute_groups() -> None:
    assert compile_linear(r"/old/(.*)").sub(r"/new/\1", "/old/x/y") == "/new/x/y"


def test_a_hit_builds_its_match_on_first_use_as_re_would() -> None:
    pattern = compile_linear(r"/api/(v[0-9]+)/users/(?P<user>[^/]+)")
    found = pattern.fullmatch("/api/v12/users/zoë")
    assert found is not None and found
    assert found.group(1) == "v12" and found["user"] == "zoë" and found.span() == (0, 18)
    assert pattern.search("see /api/v1/users/a").group(0) == "/api/v1/users/a"
    assert pattern.match("see /api/v1/users/a") is None


@pytest.mark.parametrize(
    "pattern", [r"/a[0-9]*", r"(?i)/É+", r"/x/.*/y", r"/(a|b)+c?", r"/café/\w+", r"/\d{2,3}$"]
)
def test_the_probe_and_the_match_agree(pattern: str) -> None:
    """The capture-free probe decides; the binding's pattern builds the Match: they must
    never disagree (waygate.core.regex relies on the binding's internals for speed)."""
    import re2  # type: ignore[import-untyped,unused-ignore]

    compiled = compile_linear(pattern)
    binding = re2.compile(pattern)
    texts = ["/a", "/a12", "/éÉ", "/x//y", "/x/é/y", "/abbac", "/café/été", "/123", "/1234", ""]
    for text in texts:
        for method in ("fullmatch", "match", "search"):
            ours = getattr(compiled, method)(text)
            theirs = getattr(binding, method)(text)
            assert (ours is None) == (theirs is None), (pattern, method, text)
            if ours is not None:
                assert ours.group(0) == theirs.group(0), (pattern, method, text)
    # RE2's classes are ASCII (\w, \d), Python's Unicode: what a route author gets.
    assert compile_linear(r"\w+").fullmatch("été") is None
