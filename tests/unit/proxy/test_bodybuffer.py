"""Request buffering's buffer (waygate.proxy.bodybuffer): memory, then a file, both bounded."""

from __future__ import annotations

import os
import stat

import pytest

from waygate.proxy.bodybuffer import BufferLimits, BufferRefused, RequestBuffers


def drain(buffer, limit: int = 7) -> bytes:
    out = bytearray()
    while True:
        piece = buffer.read(limit)
        if not piece:
            return bytes(out)
        assert len(piece) <= limit
        out += piece


def test_a_small_body_stays_in_memory_and_is_replayed_in_order():
    buffers = RequestBuffers(BufferLimits(memory_per_request=100, memory_total=1000, max_body=1000))
    buffer = buffers.new_buffer()
    buffer.write([b"hello ", b"", b"world"])
    assert (buffer.size, buffer.memory, buffer.file) == (11, 11, None)
    assert buffers.memory_used == 11 and buffers.files_open == 0
    assert drain(buffer, 4) == b"hello world"
    assert buffers.memory_used == 0  # given back as it is read
    buffer.close()
    assert buffers.memory_used == 0


def test_past_the_memory_bound_it_spills_to_an_unnamed_0600_file(tmp_path):
    buffers = RequestBuffers(
        BufferLimits(
            memory_per_request=10, memory_total=1000, max_body=10_000, directory=str(tmp_path)
        )
    )
    buffer = buffers.new_buffer()
    body = bytes(range(256)) * 20
    pieces = [body[i : i + 9] for i in range(0, len(body), 9)]
    buffer.write(pieces)
    assert buffer.memory == 9  # the first piece; the rest in the file
    assert buffers.files_open == 1 and buffers.memory_used == 9
    mode = os.fstat(buffer.file.fileno()).st_mode
    assert stat.S_IMODE(mode) == 0o600
    assert list(tmp_path.iterdir()) == []  # no name on disk: nothing left behind by a crash
    assert buffer.remaining == len(body)
    assert drain(buffer, 1000) == body
    buffer.close()
    buffer.close()  # idempotent
    assert (buffers.files_open, buffers.memory_used) == (0, 0)


def test_the_memory_total_across_requests_spills_the_next_one(tmp_path):
    buffers = RequestBuffers(
        BufferLimits(
            memory_per_request=100, memory_total=150, max_body=1000, directory=str(tmp_path)
        )
    )
    first, second = buffers.new_buffer(), buffers.new_buffer()
    first.write([b"a" * 100])
    second.write([b"b" * 60])  # 160 > 150 across both: to a file
    assert (first.memory, second.memory, buffers.files_open) == (100, 0, 1)
    first.close()
    second.close()
    assert (buffers.files_open, buffers.memory_used) == (0, 0)


def test_a_body_over_the_bound_is_refused_413_with_the_reason():
    buffers = RequestBuffers(BufferLimits(memory_per_request=10, memory_total=100, max_body=50))
    with pytest.raises(BufferRefused) as declared:
        buffers.check(51)
    assert declared.value.status == 413 and "50 bytes" in declared.value.reason
    buffers.check(50)
    buffers.check(-1)  # chunked: counted as it comes
    buffer = buffers.new_buffer()
    buffer.write([b"x" * 50])
    with pytest.raises(BufferRefused) as grown:
        buffer.write([b"y"])
    assert grown.value.status == 413 and grown.value.kind == "body_too_large"
    buffer.close()
    assert (buffers.files_open, buffers.memory_used) == (0, 0)


def test_an_unwritable_directory_is_a_503_that_says_why(tmp_path):
    missing = tmp_path / "gone"
    buffers = RequestBuffers(
        BufferLimits(memory_per_request=1, memory_total=100, max_body=100, directory=str(missing))
    )
    buffer = buffers.new_buffer()
    with pytest.raises(BufferRefused) as refused:
        buffer.write([b"xy"])
    assert refused.value.status == 503
    assert refused.value.reason.startswith("request body could not be buffered: ")
    buffer.close()
    assert (buffers.files_open, buffers.memory_used) == (0, 0)


def test_the_files_of_every_body_together_are_bounded(tmp_path):
    buffers = RequestBuffers(
        BufferLimits(
            memory_per_request=0,
            memory_total=0,
            max_body=1000,
            files_total=150,
            directory=str(tmp_path),
        )
    )
    first, second = buffers.new_buffer(), buffers.new_buffer()
    first.write([b"a" * 100])
    with pytest.raises(BufferRefused) as full:
        second.write([b"b" * 60])
    assert full.value.status == 503 and full.value.kind == "buffers_full"
    assert buffers.file_bytes == 100
    first.close()
    second.write([b"b" * 60])  # room again once the first body is gone
    second.close()
    assert (buffers.files_open, buffers.file_bytes, buffers.memory_used) == (0, 0, 0)
