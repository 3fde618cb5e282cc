"""The agent stream's Outbox coalesces DATA, and `join_queued` joins what waits for a dialer.

Invariants under test: a coalesced packet never exceeds `MAX_CHUNK`, joins
only one connection's consecutive chunks (never across another packet), keeps
the order of the puts, carries an EOF after its data, and a writer gathering a
large chunk stops as soon as the stream ends.
"""

from __future__ import annotations

import asyncio
import collections
import os
from typing import Any

from waygate.tunnel import mux
from waygate.tunnel.mux import GATHER_FROM, MAX_CHUNK, Outbox
from waygate.tunnel.v1 import tunnel_pb2 as pb

KIB = 1024

# `outbox.next()` is awaited directly (no wait_for task, whose start would let the
# scheduled puts run first): with something queued it cannot wait, and its
# gathering is bounded by GATHER_TURNS loop turns.


async def drain(outbox: Outbox) -> list[Any]:
    packets = []
    while len(outbox):
        packets.append(await outbox.next())
    return packets


async def test_chunks_of_one_connection_join_up_to_max_chunk_in_order() -> None:
    outbox = Outbox()
    chunks = [os.urandom(64 * KIB) for _ in range(9)] + [os.urandom(100)]
    for chunk in chunks:
        outbox.put_data(7, chunk)
    packets = await drain(outbox)
    assert [p.type for p in packets] == [pb.DATA] * len(packets)
    assert all(p.data.connect_id == 7 for p in packets)
    assert [len(p.data.data) for p in packets] == [MAX_CHUNK, MAX_CHUNK, 64 * KIB + 100]
    assert b"".join(p.data.data for p in packets) == b"".join(chunks)


async def test_no_join_across_connections_or_control_packets() -> None:
    outbox = Outbox()
    outbox.put_data(1, b"a" * 10)
    outbox.put_data(2, b"b" * 10)
    outbox.put_data(2, b"c" * 10)
    outbox.put(mux.window_update(1, 4096))
    outbox.put_data(2, b"d" * 10)
    outbox.put_data(1, b"e" * 10)
    packets = await drain(outbox)
    shown = [
        (p.data.connect_id, p.data.data)
        if p.type == pb.DATA
        else ("grant", p.window_update.connect_id)
        for p in packets
    ]
    assert shown == [
        (1, b"a" * 10),
        (2, b"b" * 10 + b"c" * 10),
        ("grant", 1),
        (2, b"d" * 10),
        (1, b"e" * 10),
    ]


async def test_eof_rides_on_the_data_before_it_and_nothing_joins_after_it() -> None:
    outbox = Outbox()
    outbox.put_data(3, b"x" * 10)
    outbox.put_data(3, b"y" * 10)
    outbox.put_eof(3)
    outbox.put_data(3, b"z")  # a sender bug: still never merged ahead of the EOF
    outbox.put_eof(4)  # nothing queued for 4: an EOF packet of its own
    first, second, third = await drain(outbox)
    assert (first.data.data, first.data.eof) == (b"x" * 10 + b"y" * 10, True)
    assert (second.data.data, second.data.eof) == (b"z", False)
    assert (third.data.connect_id, third.data.data, third.data.eof) == (4, b"", True)


async def test_a_large_chunk_gathers_what_the_readers_add_on_the_next_turns() -> None:
    outbox = Outbox()
    loop = asyncio.get_running_loop()
    outbox.put_data(5, b"1" * (64 * KIB))
    # Chunks that arrive on the loop's next turns, as a reader's next reads do.
    loop.call_soon(outbox.put_data, 5, b"2" * (64 * KIB))
    loop.call_soon(lambda: loop.call_soon(outbox.put_data, 5, b"3" * (64 * KIB)))
    packet = await outbox.next()
    assert packet.data.data == b"1" * (64 * KIB) + b"2" * (64 * KIB) + b"3" * (64 * KIB)
    assert not len(outbox)


async def test_a_gathered_packet_stops_at_max_chunk() -> None:
    outbox = Outbox()
    loop = asyncio.get_running_loop()
    outbox.put_data(5, b"1" * (200 * KIB))
    loop.call_soon(outbox.put_data, 5, b"2" * (64 * KIB))  # would exceed MAX_CHUNK
    first = await outbox.next()
    second = await outbox.next()
    assert (len(first.data.data), len(second.data.data)) == (200 * KIB, 64 * KIB)


async def test_small_data_is_written_at_once() -> None:
    outbox = Outbox()
    loop = asyncio.get_running_loop()
    outbox.put_data(5, b"GET / HTTP/1.1\r\n\r\n")
    loop.call_soon(outbox.put_data, 5, b"later")
    packet = await outbox.next()
    assert packet.data.data == b"GET / HTTP/1.1\r\n\r\n"
    assert len(packet.data.data) < GATHER_FROM


async def test_ending_the_stream_while_gathering_returns_the_end_marker() -> None:
    outbox = Outbox()
    marker = object()
    outbox.put_data(5, b"1" * (64 * KIB))
    asyncio.get_running_loop().call_soon(outbox.end, marker)
    assert await outbox.next() is marker
    assert not len(outbox)


def test_join_queued_stops_at_a_marker_and_at_max_chunk() -> None:
    marker = object()
    queued: collections.deque[Any] = collections.deque([b"b" * 10, marker, b"c"])
    assert mux.join_queued(b"a", queued) == b"a" + b"b" * 10
    assert list(queued) == [marker, b"c"]

    big = b"x" * (MAX_CHUNK - 10)
    queued = collections.deque([b"y" * 10, b"z"])
    assert mux.join_queued(big, queued) == big + b"y" * 10
    assert list(queued) == [b"z"]
