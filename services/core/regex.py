"""Linear-time regular expressions for route matches and rewrites (RE2 semantics).

Every regular expression a route author writes (Gateway API `RegularExpression`
path, header and query matches, GRPCRoute method matches, ingress-nginx
`use-regex` paths and `rewrite-target`) is compiled here and nowhere else, so
no request can make the proxy backtrack: Python's `re` takes exponential time
on `(a+)+$` against `aaaa…!`, RE2 (google-re2, Google's maintained binding)
takes time linear in the input, whatever the pattern.

Invariants:
- `compile_linear(pattern)` answers a `LinearPattern` or raises `RegexRefused`
  whose `reason` says, for people, why RE2 cannot express the pattern
  (backreferences, lookaround, possessive quantifiers...) or that it is too
  large. Admission (the resolver's schema step) calls `refusal()` and refuses
  the object with that reason, as Envoy refuses what RE2 cannot compile; the
  proxy then only ever compiles patterns that were admitted.
- A pattern is at most `MAX_PATTERN` characters and its compiled program at
  most `MAX_PROGRAM_BYTES` (RE2's `max_mem`: a pattern such as `(a{999}){999}`
  is refused instead of taking memory per route).
- Matching is on `str` (RE2 in UTF-8 mode); `fullmatch`, `match` and `search`
  keep Python's meaning.
- RE2 never logs here (`log_errors` off): a refusal is a value, not stderr noise.
- Per request cost: a miss is one RE2 call on the UTF-8 bytes (about 0.9 us; the
  binding's public `fullmatch` builds a Match through a generator every time,
  about 4 us), so scanning many regex routes stays cheap; only a hit builds the
  Match object, through the binding's own API, so it means what `re`'s does.
"""

from __future__ import annotations

from typing import Any, Protocol

import re2  # type: ignore[import-untyped,unused-ignore]
from re2 import _re2  # type: ignore[import-untyped,unused-ignore]

# The Gateway API leaves the length to the implementation; 1 KiB is what
# waygate.resolver.gateway.spec has always accepted.
MAX_PATTERN = 1024
# RE2's budget for one compiled pattern (program and DFA cache); past it the
# pattern is refused at compile time, and a DFA that outgrows its cache falls
# back to RE2's NFA, still linear.
MAX_PROGRAM_BYTES = 1 << 20

_OPTIONS = re2.Options()
_OPTIONS.log_errors = False
_OPTIONS.max_mem = MAX_PROGRAM_BYTES
# The probe: the same pattern without submatches, asked only whether it matches.
_PROBE_OPTIONS = re2.Options()
_PROBE_OPTIONS.log_errors = False
_PROBE_OPTIONS.max_mem = MAX_PROGRAM_BYTES
_PROBE_OPTIONS.never_capture = True
_BOTH = _re2.RE2.Anchor.ANCHOR_BOTH
_START = _re2.RE2.Anchor.ANCHOR_START
_ANYWHERE = _re2.RE2.Anchor.UNANCHORED
_NO_MATCH = (-1, -1)


class LinearPattern(Protocol):
    """What callers may use of a compiled pattern (re.Pattern's names)."""

    @property
    def pattern(self) -> str: ...

    def fullmatch(self, text: str, /) -> Any: ...

    def match(self, text: str, /) -> Any: ...

    def search(self, text: str, /) -> Any: ...

    def sub(self, replacement: str, text: str, /) -> str: ...


class RegexRefused(ValueError):
    """A pattern RE2 cannot express (or too large); `reason` is for people."""

    def __init__(self, pattern: str, reason: str) -> None:
        super().__init__(reason)
        self.pattern = pattern
        self.reason = reason


class _Match:
    """A hit, its Match object built on first use (`group()`, `span()`, `m[1]`...):
    a routing decision only asks whether there was one."""

    __slots__ = ("_find", "_found", "_text")

    def __init__(self, find: Any, text: str) -> None:
        self._find = find
        self._text = text
        self._found: Any = None

    def _real(self) -> Any:
        if self._found is None:
            self._found = self._find(self._text)
        return self._found

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real(), name)

    def __getitem__(self, group: int | str) -> Any:
        return self._real()[group]

    def __bool__(self) -> bool:
        return True


class _Pattern:
    """A compiled pattern: a capture-free probe for the answer, the binding's
    pattern for the Match object of a hit."""

    __slots__ = ("_full", "_probe", "pattern")

    def __init__(self, pattern: str, full: Any, probe: Any) -> None:
        self.pattern = pattern
        self._full = full
        self._probe = probe

    def _hit(self, anchor: Any, text: str) -> bool:
        data = text.encode()
        return bool(self._probe.Match(anchor, data, 0, len(data))[0] != _NO_MATCH)

    def fullmatch(self, text: str, /) -> Any:
        return _Match(self._full.fullmatch, text) if self._hit(_BOTH, text) else None

    def match(self, text: str, /) -> Any:
        return _Match(self._full.match, text) if self._hit(_START, text) else None

    def search(self, text: str, /) -> Any:
        return _Match(self._full.search, text) if self._hit(_ANYWHERE, text) else None

    def sub(self, replacement: str, text: str, /) -> str:
        return str(self._full.sub(replacement, text))


def compile_linear(pattern: str) -> LinearPattern:
    """`pattern` compiled with RE2; RegexRefused when RE2 cannot express it."""
    if len(pattern) > MAX_PATTERN:
        raise RegexRefused(pattern, f"longer than {MAX_PATTERN} characters")
    try:
        full = re2.compile(pattern, options=_OPTIONS)
        probe = _re2.RE2(pattern.encode(), _PROBE_OPTIONS)
    except re2.error as exc:
        raise RegexRefused(pattern, _explain(exc)) from None
    if not probe.ok():
        raise RegexRefused(pattern, _explain(re2.error(probe.error())))
    return _Pattern(pattern, full, probe)


def refusal(pattern: str) -> str | None:
    """Why `pattern` cannot be admitted, or None when it can."""
    try:
        compile_linear(pattern)
    except RegexRefused as exc:
        return exc.reason
    return None


# RE2's own messages, with what they mean for someone who wrote a Perl/PCRE pattern.
_HINTS = (
    ("invalid escape sequence: \\", "backreferences are not supported"),
    ("invalid perl operator: (?=", "lookahead is not supported"),
    ("invalid perl operator: (?!", "lookahead is not supported"),
    ("invalid perl operator: (?<", "lookbehind is not supported"),
    ("bad repetition operator: ++", "possessive quantifiers are not supported"),
    ("bad repetition operator: *+", "possessive quantifiers are not supported"),
    ("bad repetition operator: ?+", "possessive quantifiers are not supported"),
    ("pattern too large", "the pattern is too large"),
)


def _explain(exc: Exception) -> str:
    raw = exc.args[0] if exc.args else exc
    message = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else str(raw)
    for needle, hint in _HINTS:
        if needle in message:
            return f"{message} ({hint}: Waygate matches with RE2, linear time)"
    return f"{message} (Waygate matches with RE2 syntax, linear time)"


__all__ = ["MAX_PATTERN", "LinearPattern", "RegexRefused", "compile_linear", "refusal"]
