"""The proxy's remembering HPACK coders code exactly as hpack's own (sans-IO)."""

from __future__ import annotations

import hpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from waygate.proxy import hpackcache

# A few names and values, so that blocks repeat and fields get indexed, plus
# never-indexed fields, oversized values and table size changes in between.
names = st.sampled_from([b"server", b"date", b"etag", b"x-a", b"set-cookie", b":status"])
values = st.one_of(
    st.sampled_from([b"1", b"2", b"nginx", b"Mon, 23 Nov 2026 04:00:00 GMT"]),
    st.binary(min_size=0, max_size=40),
    st.just(b"v" * 300),  # larger than a 64- or 256-byte table: clears it
)
field = st.one_of(
    st.tuples(names, values),
    st.builds(hpack.NeverIndexedHeaderTuple, names, values),
    st.builds(hpack.HeaderTuple, names, values),
)
block = st.lists(field, min_size=0, max_size=8)
step = st.one_of(
    st.tuples(st.just("block"), st.sampled_from(range(4))),  # repeat one of 4 blocks
    st.tuples(st.just("new"), block),
    st.tuples(st.just("resize"), st.sampled_from([0, 64, 256, 4096])),
)


@settings(max_examples=200, deadline=None)
@given(first=st.lists(block, min_size=4, max_size=4), steps=st.lists(step, max_size=40))
def test_same_bytes_and_fields_as_hpack(first, steps):
    """Every block encodes to hpack's bytes, and decodes to hpack's fields,
    whatever came before it (repeats, new fields, evictions, size changes)."""
    ours_enc, ref_enc = hpackcache.Encoder(), hpack.Encoder()
    ours_dec, ref_dec = hpackcache.Decoder(), hpack.Decoder()
    blocks = list(first)
    for kind, arg in [("block", i) for i in range(4)] * 2 + steps:
        if kind == "resize":
            # (Setting the size it has already loses a pending update in hpack
            # itself: not a case h2 produces, not one to compare.)
            if arg != ref_enc.header_table_size:
                ours_enc.header_table_size = ref_enc.header_table_size = arg
            continue
        if kind == "new":
            blocks[len(steps) % 4] = arg
            headers = arg
        else:
            headers = blocks[arg]
        encoded = ours_enc.encode(list(headers))
        assert encoded == ref_enc.encode(list(headers))
        decoded = ours_dec.decode(encoded, raw=True)
        expected = ref_dec.decode(encoded, raw=True)
        assert decoded == expected
        assert [type(f) for f in decoded] == [type(f) for f in expected]  # never-indexed kept
        assert ours_dec.header_table.dynamic_entries == ref_dec.header_table.dynamic_entries


def test_a_repeated_block_is_served_from_memory_and_a_new_value_is_coded_again():
    encoder, decoder, reference = hpackcache.Encoder(), hpackcache.Decoder(), hpack.Encoder()
    fields = [(b":status", b"200"), (b"server", b"nginx"), (b"date", b"d1")]
    first = encoder.encode(list(fields))  # literals that index: not remembered
    assert encoder._blocks == {}
    second = encoder.encode(list(fields))  # all indexed now: remembered
    assert second != first and encoder._blocks == {tuple(fields): second}
    assert encoder.encode(list(fields)) is second
    decoder.decode(first, raw=True)
    assert decoder.decode(second, raw=True) == fields
    assert decoder._blocks == {second: fields}
    # A new Date indexes a field: the table changed, the old indices moved.
    third = encoder.encode([*fields[:2], (b"date", b"d2")])
    assert decoder.decode(third, raw=True)[2] == (b"date", b"d2")
    fourth = encoder.encode(list(fields))
    for headers in (fields, fields, [*fields[:2], (b"date", b"d2")]):
        reference.encode(list(headers))
    assert fourth != second and fourth == reference.encode(list(fields))
    assert encoder._blocks == {tuple(fields): fourth}
    assert decoder.decode(fourth, raw=True) == fields
    assert decoder._blocks == {fourth: fields}


def test_a_never_indexed_field_is_never_served_as_a_plain_one():
    encoder = hpackcache.Encoder()
    plain = [(b"server", b"nginx")]
    encoder.encode(list(plain))
    remembered = encoder.encode(list(plain))
    assert encoder._blocks == {tuple(plain): remembered}
    # Equal to the remembered key as a tuple, but coded by hpack (which indexes
    # a never-indexed field already in the table, RFC 7541 section 7.1.3 allows it).
    secret = [hpack.NeverIndexedHeaderTuple(b"server", b"nginx")]
    calls = []
    original = hpack.Encoder.add
    hpack.Encoder.add = lambda self, *a, **k: calls.append(a) or original(self, *a, **k)
    try:
        encoder.encode(secret)
    finally:
        hpack.Encoder.add = original
    assert calls == [((b"server", b"nginx"), True, True)]


def test_limits_are_checked_on_remembered_blocks():
    """A block decoded before the header list limit shrank is refused after it."""
    encoder, decoder = hpackcache.Encoder(), hpackcache.Decoder()
    fields = [(b"x-a", b"v" * 100)]
    decoder.decode(encoder.encode(list(fields)), raw=True)
    block = encoder.encode(list(fields))
    assert decoder.decode(block, raw=True) == fields
    decoder.max_header_list_size = 50
    with pytest.raises(hpack.OversizedHeaderListError):
        decoder.decode(block, raw=True)


def test_memory_is_bounded():
    encoder, decoder = hpackcache.Encoder(), hpackcache.Decoder()
    for count in range(1, hpackcache.ENTRIES * 2):
        fields = [(b":method", b"GET")] * count  # the static table's: no change
        decoder.decode(encoder.encode(list(fields)), raw=True)
    assert len(encoder._blocks) == len(decoder._blocks) == hpackcache.ENTRIES
    big = [(b":status", b"200")] * (hpackcache.FIELDS + 1)
    decoder.decode(encoder.encode(list(big)), raw=True)
    assert tuple(big) not in encoder._blocks
    assert all(len(key) <= hpackcache.BLOCK_BYTES for key in decoder._blocks)
