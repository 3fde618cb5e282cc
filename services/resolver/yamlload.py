"""The one YAML loader of the resolver's sources: the routes file and the manifests.

What a hostile (or careless) author could make of YAML is bounded here, before
anything is built from it, and every refusal is a `FileError` naming
`path:line: reason`:
- Size: a source's bytes are read up to `MAX_YAML_BYTES` (one more byte says
  it is too large) and refused past it, before parsing: parsing costs several
  times the text in memory, and Python keeps much of it after.
- Alias expansion: an alias is one more reference to the same node, cheap to
  hold but not to use: a 16 KB manifest of nested aliases amounts to 1,000
  rules of 1,000 matches, which every later step walks. A document whose
  aliases expand it past `ALIAS_EXPANSION` times its written nodes (and past
  `ALIAS_EXPANSION_FLOOR` nodes) is refused, naming the anchor expanded most;
  a recursive alias is refused too.
- Duplicate keys: YAML says a mapping's keys are unique, PyYAML keeps the last
  one silently; a second key is refused with both lines (a typo must not
  silently replace what the author meant).
- Nesting: libyaml refuses flow nesting past 1,000 levels; the walk here is
  iterative, so no depth reaches Python's recursion limit.

Sans-IO except `read_bounded`; thread-safe (no shared state): the sources parse
in worker threads.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from waygate.core.errors import excerpt

#: A routes file, or a manifests file or directory (all its files together).
MAX_YAML_BYTES = 8 << 20
#: Nodes a document may amount to with its aliases expanded, per node written...
ALIAS_EXPANSION = 10
#: ...once past this many (small documents may use aliases freely).
ALIAS_EXPANSION_FLOOR = 10_000

# libyaml's parser when PyYAML has it (several times faster on large files); its
# nodes carry the same line marks.
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_MERGE_TAG = "tag:yaml.org,2002:merge"
# Expanded sizes are capped here (far past any limit): nested aliases double per
# level, and the walk need not carry numbers of hundreds of digits.
_SIZE_CAP = 1 << 48
# What building a value may raise: a timestamp such as 2026-13-45 is a ValueError,
# a huge float an OverflowError (PyYAML's constructors), besides YAML's own.
_CONSTRUCT_ERRORS = (yaml.YAMLError, ValueError, OverflowError)


class FileError(Exception):
    """A source file is unusable; the message is `path:line: reason`."""

    def __init__(self, path: Path, line: int | None, reason: str) -> None:
        self.path, self.line, self.reason = path, line, reason
        where = f"{path}:{line}" if line is not None else str(path)
        super().__init__(f"{where}: {reason}")


def read_bounded(path: Path, budget: int = MAX_YAML_BYTES) -> bytes:
    """The file's bytes when there are at most `budget`; FileError past it (only
    `budget` + 1 bytes are ever read). OSError passes through."""
    with path.open("rb") as handle:
        data = handle.read(budget + 1)
    if len(data) > budget:
        raise FileError(path, None, too_large(budget))
    return data


def too_large(budget: int = MAX_YAML_BYTES) -> str:
    return f"larger than {budget >> 20} MiB (the limit of a YAML source; not parsed)"


def _line(node: yaml.Node) -> int:
    return int(node.start_mark.line) + 1


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [part for pair in node.value for part in pair]
    if isinstance(node, yaml.SequenceNode):
        return list(node.value)
    return []


def check_document(path: Path, root: yaml.Node) -> None:
    """FileError when `root`'s document expands too far through aliases, aliases
    itself, or repeats a mapping key (see the module docstring)."""
    expanded: dict[int, int] = {}  # id(node) -> its size with aliases expanded (capped)
    uses: dict[int, int] = {}
    nodes: dict[int, yaml.Node] = {}
    open_nodes: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        if finished:
            open_nodes.discard(key)
            size = 1 + sum(expanded[id(child)] for child in _children(node))
            expanded[key] = min(size, _SIZE_CAP)
            continue
        uses[key] = uses.get(key, 0) + 1
        if key in open_nodes:
            raise FileError(path, _line(node), "a YAML alias refers to a node that contains it")
        if key in expanded or key in nodes:
            continue
        nodes[key] = node
        if isinstance(node, yaml.MappingNode):
            _check_keys(path, node)
        open_nodes.add(key)
        stack.append((node, True))
        stack.extend((child, False) for child in reversed(_children(node)))
    written = len(nodes)
    total = expanded[id(root)]
    allowed = max(ALIAS_EXPANSION_FLOOR, ALIAS_EXPANSION * written)
    if total > allowed:
        worst = max((k for k in nodes if uses[k] > 1), key=lambda k: expanded[k] * (uses[k] - 1))
        raise FileError(
            path,
            _line(nodes[worst]),
            f"YAML aliases of the node on this line expand the document to "
            f"{'more than ' if total >= _SIZE_CAP else ''}{total:,} nodes (it has {written:,} "
            f"written; at most {ALIAS_EXPANSION} times as many, or {ALIAS_EXPANSION_FLOOR:,})",
        )


def _check_keys(path: Path, node: yaml.MappingNode) -> None:
    seen: dict[str, int] = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == _MERGE_TAG:
            continue
        key = str(key_node.value)
        if key in seen:
            raise FileError(
                path,
                _line(key_node),
                f"key {excerpt(key)} appears twice in one mapping (first on line {seen[key]})",
            )
        seen[key] = _line(key_node)


class YAMLDocuments:
    """The checked documents of one YAML text, composed one at a time.

    `documents()` yields every document's root node, each checked before it is
    yielded; `construct(node)` builds Python values from a node of it. Use as a
    context manager (or call `close`): the loader holds libyaml's parser."""

    def __init__(self, path: Path, text: str) -> None:
        self.path = path
        self._loader = _Loader(text)

    def __enter__(self) -> YAMLDocuments:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._loader.dispose()

    def _invalid(self, exc: Exception, node: yaml.Node | None = None) -> FileError:
        if isinstance(exc, yaml.MarkedYAMLError):
            mark = exc.problem_mark or exc.context_mark
            line = mark.line + 1 if mark is not None else None
            return FileError(self.path, line, f"not valid YAML: {exc.problem or exc}")
        line = _line(node) if node is not None else None
        if not isinstance(exc, yaml.YAMLError):  # a value its type refuses (2026-13-45)
            return FileError(self.path, line, str(exc))
        return FileError(self.path, line, f"not valid YAML: {exc}")

    def documents(self) -> Iterator[yaml.Node]:
        while True:
            try:
                if not self._loader.check_node():
                    return
                node = self._loader.get_node()
            except yaml.YAMLError as exc:
                raise self._invalid(exc) from None
            if node is not None:
                check_document(self.path, node)
                yield node

    def single(self) -> yaml.Node | None:
        """The text's only document (None: empty); FileError when there are more."""
        found = None
        for node in self.documents():
            if found is not None:
                raise FileError(self.path, _line(node), "expected one YAML document, found more")
            found = node
        return found

    def construct(self, node: yaml.Node) -> Any:
        """The Python value of `node`, a node inside a document."""
        try:
            return self._loader.construct_object(node, deep=True)
        except _CONSTRUCT_ERRORS as exc:
            raise self._invalid(exc, node) from None

    def construct_document(self, node: yaml.Node) -> Any:
        """The Python value of a document's root (what it built is then let go)."""
        try:
            return self._loader.construct_document(node)
        except _CONSTRUCT_ERRORS as exc:
            raise self._invalid(exc, node) from None


__all__ = [
    "ALIAS_EXPANSION",
    "ALIAS_EXPANSION_FLOOR",
    "MAX_YAML_BYTES",
    "FileError",
    "YAMLDocuments",
    "check_document",
    "read_bounded",
    "too_large",
]
