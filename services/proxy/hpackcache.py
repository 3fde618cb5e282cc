"""HPACK coding that remembers header blocks which leave the header table as it was.

The proxy's HTTP/2 connections (`waygate.proxy.http2.h2_connection`) use these
in place of hpack's `Encoder` and `Decoder`. A proxy sends and receives the
same fields over and over (a backend's response head differs from the last one
in a Date per second, a client's request in its :path): once every field of a
block is in the dynamic table, the block is all indexed references, its coding
does not change the table, and the same fields encode to the same bytes (and the
same bytes decode to the same fields) until the table changes. hpack's
pure-Python coding of such a block is a loop of Python calls per field (about a
tenth of the proxy's CPU per HTTP/2 request); a dictionary look-up replaces it.

Invariants:
- the bytes sent and the fields decoded are exactly hpack's: a block is reused
  only if coding it left the table unchanged (its `generation`, bumped by every
  insertion, eviction or resize, the same before and after) and the table, the
  size limits and any pending size update are still as they were then; anything
  else is coded by hpack itself (table size updates, literals that index,
  never-indexed fields, blocks that fail).
- bounded: at most `ENTRIES` blocks per coder, each at most `BLOCK_BYTES` long
  (encoded) and `FIELDS` fields; all are forgotten when the table changes.
- the encoder's dynamic table is at most `MAX_ENCODER_TABLE` bytes, whatever
  SETTINGS_HEADER_TABLE_SIZE the peer advertises (RFC 7541 section 4.2 lets an
  encoder use less, and it says so with a size update): a peer's settings cannot
  make the proxy keep more than that per connection. The decoder's table is
  bounded by the size the proxy advertises (h2's default, 4,096).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from typing import Any

import hpack
from hpack.table import HeaderTable

# Per coder: blocks remembered, and the largest one (a block that changes
# nothing is indexed references and short non-indexing literals).
ENTRIES = 32
BLOCK_BYTES = 512
FIELDS = 64
# The encoder's table: HPACK's default size, the most a peer's SETTINGS may get.
MAX_ENCODER_TABLE = 4096
_HEADER_TUPLE = itertools.repeat(hpack.HeaderTuple)


class CountedTable(HeaderTable):
    """hpack's header table with a count of its changes (`generation`)."""

    generation = 0

    def add(self, name: bytes, value: bytes) -> None:
        self.generation += 1
        super().add(name, value)

    def _set_maxsize(self, newmax: int) -> None:
        self.generation += 1
        HeaderTable.maxsize.fset(self, newmax)  # type: ignore[attr-defined]

    maxsize = property(HeaderTable.maxsize.fget, _set_maxsize)  # type: ignore[assignment,attr-defined]


class Encoder(hpack.Encoder):
    """hpack's encoder; a block of plain (name, value) tuples whose encoding
    left the table as it was is remembered (see the module doc)."""

    def __init__(self) -> None:
        super().__init__()
        self.header_table: CountedTable = CountedTable()
        self._blocks: dict[tuple[Any, ...], bytes] = {}
        self._generation = 0

    @property
    def header_table_size(self) -> int:
        return self.header_table.maxsize

    @header_table_size.setter
    def header_table_size(self, value: int) -> None:
        # h2 sets this from the peer's SETTINGS_HEADER_TABLE_SIZE: at most ours.
        hpack.Encoder.header_table_size.fset(self, min(value, MAX_ENCODER_TABLE))  # type: ignore[attr-defined]

    def encode(self, headers: Any, huffman: bool = True) -> bytes:
        table = self.header_table
        if table.resized or not huffman or type(headers) is not list or len(headers) > FIELDS:
            return super().encode(headers, huffman)
        blocks = self._blocks
        if table.generation != self._generation:
            blocks.clear()
            self._generation = table.generation
        # A HeaderTuple (a never-indexed one is one) equals the plain tuple of
        # its name and value: only plain 2-tuples are remembered, and a block
        # with a HeaderTuple is never served (the check runs in C: map, isinstance).
        key = tuple(headers)
        encoded = blocks.get(key)
        if encoded is not None and not any(map(isinstance, key, _HEADER_TUPLE)):
            return encoded
        encoded = super().encode(headers, huffman)
        if (
            table.generation == self._generation
            and len(encoded) <= BLOCK_BYTES
            and len(blocks) < ENTRIES
            and _plain(key)
        ):
            blocks[key] = encoded
        return encoded


class Decoder(hpack.Decoder):
    """hpack's decoder; a block whose decoding left the table as it was is
    remembered with its fields (see the module doc)."""

    def __init__(
        self, max_header_list_size: int = hpack.hpack.DEFAULT_MAX_HEADER_LIST_SIZE
    ) -> None:
        super().__init__(max_header_list_size)
        self.header_table: CountedTable = CountedTable()
        self._blocks: dict[bytes, list[Any]] = {}
        self._stamp: tuple[int, int, int] = (-1, 0, 0)

    def decode(self, data: bytes, raw: bool = False) -> Iterable[Any]:
        if not raw or len(data) > BLOCK_BYTES:
            return super().decode(data, raw)
        table = self.header_table
        # What the result depends on besides the bytes: the table, and the two
        # limits decoding checks (h2 sets both from the SETTINGS it sends).
        stamp = (table.generation, self.max_header_list_size, self.max_allowed_table_size)
        blocks = self._blocks
        if stamp != self._stamp:
            blocks.clear()
            self._stamp = stamp
        else:
            remembered = blocks.get(data)
            if remembered is not None:
                return list(remembered)
        fields = list(super().decode(data, raw))
        if table.generation == stamp[0] and len(blocks) < ENTRIES and len(fields) <= FIELDS:
            blocks[bytes(data)] = fields
            return list(fields)
        return fields


def _plain(fields: tuple[Any, ...]) -> bool:
    return all(type(field) is tuple and len(field) == 2 for field in fields)
