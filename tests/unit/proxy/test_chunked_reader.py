"""ChunkedReader's bulk path and its bounds against pathological chunking (issue 18
item 6): whatever the split of the input, the output is the canonical chunked body
(or the bare payload); 1-byte chunks and oversized extensions are refused."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waygate.proxy.http1 import BadMessage, ChunkedReader

chunk = st.tuples(
    st.binary(min_size=1, max_size=300),
    st.sampled_from([b"", b";a=b", b";ext"]),
    st.booleans(),  # a zero-padded size line
)


def encode(chunks: list[tuple[bytes, bytes, bool]]) -> bytes:
    out = b""
    for data, extension, padded in chunks:
        out += (b"00%X" if padded else b"%x") % len(data) + extension + b"\r\n" + data + b"\r\n"
    return out + b"0;last=1\r\nTrailer-Field: x\r\n\r\n"


def feed_in_pieces(reader: ChunkedReader, body: bytes, cuts: list[int]) -> tuple[bytes, int]:
    out = b""
    used = 0
    for start, end in zip([0, *cuts], [*cuts, len(body)], strict=True):
        pieces, consumed = reader.feed(body[start:end])
        out += b"".join(pieces)
        used += consumed
    return out, used


@settings(max_examples=300, deadline=None)
@given(
    st.lists(chunk, max_size=40),
    st.lists(st.integers(min_value=0, max_value=20000), max_size=8),
)
def test_any_split_gives_the_canonical_body_and_the_payload(chunks, cuts) -> None:
    body = encode(chunks)
    cuts = sorted({c for c in cuts if 0 < c < len(body)})
    canonical = b"".join(b"%x\r\n%s\r\n" % (len(d), d) for d, _, _ in chunks) + b"0\r\n\r\n"
    payload = b"".join(d for d, _, _ in chunks)
    rechunked = ChunkedReader()
    out, used = feed_in_pieces(rechunked, body + b"NEXT", [*cuts, len(body)])
    assert rechunked.done and out == canonical and used == len(body)
    plain = ChunkedReader(rechunk=False)
    out, used = feed_in_pieces(plain, body, cuts)
    assert plain.done and out == payload and used == len(body)


def test_one_byte_chunks_are_refused_past_the_budget() -> None:
    body = b"1\r\nx\r\n" * 2000 + b"0\r\n\r\n"
    assert ChunkedReader().feed(body)[1] == len(body)  # no budget (responses): taken
    with pytest.raises(BadMessage, match="too many small chunks"):
        ChunkedReader(chunk_budget=1024).feed(body)


def test_large_chunks_never_touch_the_budget() -> None:
    body = (b"1000\r\n" + b"y" * 4096 + b"\r\n") * 2000 + b"0\r\n\r\n"
    reader = ChunkedReader(chunk_budget=16)
    assert reader.feed(body)[1] == len(body) and reader.done


def test_chunk_extensions_are_bounded_per_body() -> None:
    body = (b"1;" + b"e" * 100 + b"\r\nx\r\n") * 50 + b"0\r\n\r\n"
    with pytest.raises(BadMessage, match="chunk extensions larger than 4 KiB"):
        ChunkedReader().feed(body)
