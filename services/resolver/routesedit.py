"""One route's entry edited in the routes file's text; every other byte kept.

ApplyRoute and DeleteRoute change one route of the routes file. Re-emitting
the whole file drops every comment; a round-trip YAML library (ruamel.yaml)
over the whole file keeps them but is pure Python, about 3.5 times the cost of
the rest of an apply on an 800 KiB file. So libyaml composes the file (fast)
to find the lines of the route's entry; only those lines go through
ruamel.yaml's round trip, where the route's document is merged in place (keys
and comments that stay the same stay where they are); the rest of the text is
not touched. A new route is appended after the last entry, in its style.
Structures this does not handle line by line (no `routes` list yet, a
flow-style list, an entry not written as `- key: ...`) go through ruamel.yaml
whole, with the same merge.

Sans-IO and pure: text in, text out. The caller parses the result again before
it writes anything (a text that no longer loads is refused).
"""

from __future__ import annotations

import io
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import yaml
from ruamel.yaml import YAML
from ruamel.yaml.comments import CommentedMap, CommentedSeq
from ruamel.yaml.scalarstring import LiteralScalarString, SingleQuotedScalarString
from ruamel.yaml.util import load_yaml_guess_indent

RouteKey = tuple[str, str]

_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
# What precedes an entry's first key on its line: the sequence's dash.
_DASH = re.compile(r"^ *- +$")


def apply(text: str, key: RouteKey, document: dict[str, Any]) -> str:
    """`text` with route `key`'s entry made to say `document` (appended if absent)."""
    found = _entries(text)
    if found is None:
        return _whole(text, lambda routes: _apply_whole(routes, key, document))
    lines = text.splitlines(keepends=True)
    for entry in found:
        if entry.key == key:
            block = lines[entry.first : entry.last + 1]
            lines[entry.first : entry.last + 1] = _merged(block, entry.column, document)
            return "".join(lines)
    last = found[-1]
    if not lines[last.last].endswith("\n"):
        lines[last.last] += "\n"
    sample = lines[last.first : last.last + 1]
    lines[last.last + 1 : last.last + 1] = _written(sample, last.column, document)
    return "".join(lines)


def delete(text: str, key: RouteKey) -> str:
    """`text` without route `key`'s entry."""
    found = _entries(text)
    if found is None:
        return _whole(text, lambda routes: _delete_whole(routes, key))
    lines = text.splitlines(keepends=True)
    for entry in reversed(found):
        if entry.key == key:
            del lines[entry.first : entry.last + 1]
    return "".join(lines)


# ---------------------------------------------------------------- finding entries


@dataclass(frozen=True)
class _Entry:
    first: int  # 0-based line of its first key (after the dash)
    last: int  # its last line, inclusive (its last value's)
    column: int  # where its keys start
    key: RouteKey | None


def _entries(text: str) -> list[_Entry] | None:
    """The routes list's entries by line, or None when it is not a non-empty block list
    of entries that each start on their dash's line."""
    try:
        root = yaml.compose(text, Loader=_Loader)
    except yaml.YAMLError:
        return None
    if not isinstance(root, yaml.MappingNode):
        return None
    routes = next(
        (v for k, v in root.value if isinstance(k, yaml.ScalarNode) and k.value == "routes"),
        None,
    )
    if not isinstance(routes, yaml.SequenceNode) or routes.flow_style or not routes.value:
        return None
    lines = text.splitlines()
    entries = []
    for item in routes.value:
        start, end = item.start_mark, _content_end(item)
        last = end.line if end.column > 0 else end.line - 1
        while last > start.line and not lines[last].strip():
            last -= 1  # blank lines a literal block swallowed stay the file's
        if last < start.line or not _DASH.match(lines[start.line][: start.column]):
            return None
        entries.append(_Entry(start.line, last, start.column, _identity(item)))
    return entries


def _content_end(node: yaml.Node) -> yaml.Mark:
    """Where a block node's content ends: its last value's end, not the next token's
    start (which lies past the comments that introduce the next entry)."""
    if isinstance(node, yaml.MappingNode) and node.value and not node.flow_style:
        return _content_end(node.value[-1][1])
    if isinstance(node, yaml.SequenceNode) and node.value and not node.flow_style:
        return _content_end(node.value[-1])
    return node.end_mark


def _identity(node: yaml.Node) -> RouteKey | None:
    if not isinstance(node, yaml.MappingNode):
        return None
    fields = {
        k.value: v.value
        for k, v in node.value
        if isinstance(k, yaml.ScalarNode) and isinstance(v, yaml.ScalarNode)
    }
    return (str(fields.get("namespace") or "default"), str(fields.get("name")))


# ---------------------------------------------------------------- one entry


def _editor() -> YAML:
    """ruamel.yaml's round-trip mode (one per edit: it is not thread-safe)."""
    editor = YAML(typ="rt")
    editor.preserve_quotes = True
    # Never fold a long line (a PEM body, a long path) the author wrote on one.
    editor.width = 1 << 16
    return editor


def _dedented(block: list[str], column: int) -> str:
    out = [block[0][column:]]
    for line in block[1:]:
        out.append(line[column:] if not line[:column].strip() else line.lstrip(" "))
    return "".join(out)


def _indented(text: str, prefix: str, column: int) -> list[str]:
    lines = text.splitlines(keepends=True)
    return [prefix + lines[0]] + [
        (" " * column + line) if line.strip() else line for line in lines[1:]
    ]


def _styled(editor: YAML, sample: str, dash_offset: int) -> None:
    """Nested blocks indented as the entry `sample` indents them."""
    _, indent, sequence_offset = load_yaml_guess_indent(sample, yaml=_editor())
    mapping = indent - (sequence_offset or 0) if indent else 2
    mapping = max(mapping, 2)
    editor.indent(mapping=mapping, sequence=mapping + dash_offset, offset=dash_offset)


def _merged(block: list[str], column: int, document: dict[str, Any]) -> list[str]:
    prefix = block[0][:column]
    editor = _editor()
    source = _dedented(block, column)
    _styled(editor, source, prefix.index("-") if "-" in prefix else 0)
    data = editor.load(source)
    if isinstance(data, CommentedMap):
        merge(data, document, top=True)
    else:
        data = block_style(document)
    out = io.StringIO()
    editor.dump(data, out)
    return _indented(out.getvalue(), prefix, column)


def _written(sample: list[str], column: int, document: dict[str, Any]) -> list[str]:
    prefix = sample[0][:column]
    editor = _editor()
    _styled(editor, _dedented(sample, column), prefix.index("-") if "-" in prefix else 0)
    out = io.StringIO()
    editor.dump(block_style(document), out)
    return _indented(out.getvalue(), prefix, column)


# ---------------------------------------------------------------- the whole file


def _whole(text: str, edit: Callable[[CommentedSeq], None]) -> str:
    editor = _editor()
    document, indent, sequence_offset = load_yaml_guess_indent(text, yaml=editor)
    kept = ""
    if document is None:
        # An empty file, or one of comments only: they stay, the routes follow.
        document, kept = CommentedMap(), text if text.endswith("\n") or not text else text + "\n"
    if not isinstance(document, CommentedMap):
        raise ValueError("the routes file is not a YAML mapping")
    indent, sequence_offset = indent or 2, sequence_offset or 0
    editor.indent(mapping=max(indent - sequence_offset, 2), sequence=indent, offset=sequence_offset)
    routes = document.get("routes")
    if not isinstance(routes, CommentedSeq):
        routes = document["routes"] = CommentedSeq(routes or [])
    edit(routes)
    if kept and not routes:
        return text
    out = io.StringIO()
    editor.dump(document, out)
    return kept + out.getvalue()


def _key_of(entry: Any) -> RouteKey | None:
    if not isinstance(entry, dict):
        return None
    return (str(entry.get("namespace") or "default"), str(entry.get("name")))


def _apply_whole(routes: CommentedSeq, key: RouteKey, document: dict[str, Any]) -> None:
    for index, existing in enumerate(routes):
        if _key_of(existing) == key:
            if isinstance(existing, CommentedMap):
                merge(existing, document, top=True)
            else:
                routes[index] = block_style(document)
            return
    routes.append(block_style(document))


def _delete_whole(routes: CommentedSeq, key: RouteKey) -> None:
    for index in reversed(range(len(routes))):
        if _key_of(routes[index]) == key:
            del routes[index]


# ---------------------------------------------------------------- merging


def block_style(value: Any) -> Any:
    """A written value in the file's style: PEM and other multi-line text as `|`."""
    if isinstance(value, dict):
        mapping = CommentedMap()
        for key, item in value.items():
            mapping[key] = block_style(item)
        return mapping
    if isinstance(value, list):
        return CommentedSeq(block_style(item) for item in value)
    if isinstance(value, str):
        if "\n" in value:
            return LiteralScalarString(value)
        if _read_as_other(value):
            # ruamel.yaml writes YAML 1.2, where `on`, `yes` or `1_000` are plain text;
            # the resolver reads the file as YAML 1.1 (PyYAML), where they are not.
            return SingleQuotedScalarString(value)
    return value


def _read_as_other(text: str) -> bool:
    """Whether PyYAML would read `text`, written plain, as anything but that text."""
    try:
        return yaml.safe_load(text) != text
    except yaml.YAMLError:
        return True


def merge(existing: CommentedMap, new: dict[str, Any], *, top: bool = False) -> None:
    """Make `existing` say what `new` says, in place: keys (and their comments)
    whose values stay are kept where they are; new keys go last."""
    for key in list(existing):
        if key not in new:
            del existing[key]
    for key, value in new.items():
        current = existing.get(key)
        if isinstance(value, dict) and isinstance(current, CommentedMap):
            merge(current, value)
        elif top and key == "namespace" and key not in existing and value == "default":
            continue  # the entry left it to the default; so does the route
        elif current != value:
            existing[key] = block_style(value)
