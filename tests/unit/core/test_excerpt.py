"""`excerpt`: what a log line or an error message may repeat of a caller's value."""

from waygate.core.errors import EXCERPT_LIMIT, excerpt


def test_short_values_are_quoted_whole() -> None:
    assert excerpt("demo/hello") == "'demo/hello'"


def test_long_values_are_cut_and_say_their_length() -> None:
    text = excerpt("x" * 4_000_000)
    assert len(text) < EXCERPT_LIMIT + 40
    assert text.endswith("... (4000000 characters)")


def test_control_characters_cannot_forge_a_log_line() -> None:
    text = excerpt('ok\n{"level": "INFO"}\x00' * 10)
    assert "\n" not in text and "\x00" not in text
    assert len(text) < EXCERPT_LIMIT + 40


def test_bytes_are_decoded_leniently() -> None:
    assert excerpt(b"\xff" * 10).startswith("'")
