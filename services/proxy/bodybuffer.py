"""Request buffering: a request's body taken in whole before any upstream resource is used.

As nginx's `proxy_request_buffering on` and HAProxy's `option
http-buffer-request`: with a route's `requestBuffering` on (the default;
`decision.Forward.buffer_body`), the drivers (`exchange.Exchange`,
`h2upstream.H2Exchange`) keep the body here until its last byte, and only
then take an endpoint's connection or stream; the body is then replayed
from here as the upstream takes it. A slow upload (finding 9 of issue 31:
POSTs trickling a byte every few seconds) holds only the proxy's own
memory or disk, never a backend's connection slot, and the minimum body
rate and client timeout still cut it.

Invariants:
- memory: at most `memory_per_request` bytes per body, and at most
  `memory_total` bytes across every body of the process (`RequestBuffers`);
  what does not fit goes to one temporary file per body;
- disk: at most `files_total` bytes in the temporary files of every body of
  the process together (past it: 503, the buffers are full: a disk that
  fills would stop more than this proxy);
- a body over `max_body` bytes (memory and file together; a declared
  Content-Length over it refuses at once) is refused (`BufferRefused`,
  413 with the reason), as is a file that cannot be written (503);
- the file is made in `directory` with mode 0600 and no name left on disk
  (`tempfile.TemporaryFile`: O_TMPFILE, or unlinked at once), so a crash
  leaves nothing behind; `close` frees memory and file however the exchange
  ends, and `RequestBuffers` counts both (`memory_used`, `files_open`) for
  tests and metrics;
- the order is kept: the bytes in memory come first, then the file's.

Sans-IO as far as asyncio goes: no tasks, no loop; the file's reads and
writes are plain blocking calls on a local disk (as nginx's), made only for
bodies past the memory bounds.
"""

from __future__ import annotations

import os
import tempfile
from typing import Any, NamedTuple

# Bytes read back from the file per replay step (the upstream's flow control
# paces the steps).
REPLAY_CHUNK = 64 * 1024


class BufferLimits(NamedTuple):
    """The bounds of request buffering (the `--request-buffer-*` settings)."""

    memory_per_request: int = 64 * 1024
    memory_total: int = 64 * 1024 * 1024
    max_body: int = 64 * 1024 * 1024
    directory: str = ""  # "" : the system's temporary directory
    files_total: int = 1024 * 1024 * 1024


class BufferRefused(Exception):
    """A body that cannot be buffered: the status, reason and refusal kind to answer with."""

    def __init__(self, status: int, reason: str, kind: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason
        self.kind = kind


class RequestBuffers:
    """The process's request buffers: their bounds, and the memory and files they hold."""

    __slots__ = ("file_bytes", "files_open", "limits", "memory_used")

    def __init__(self, limits: BufferLimits) -> None:
        self.limits = limits
        self.memory_used = 0
        self.files_open = 0
        self.file_bytes = 0  # in the files of every body

    def check(self, declared: int) -> None:
        """Raises BufferRefused when a declared body length (-1: none) is over the bound."""
        limit = self.limits.max_body
        if declared > limit:
            raise BufferRefused(413, too_large(limit), "body_too_large")

    def new_buffer(self) -> BodyBuffer:
        return BodyBuffer(self)


def too_large(limit: int) -> str:
    return (
        "request body larger than the proxy buffers (" + str(limit) + " bytes); "
        "a route may turn request buffering off"
    )


class BodyBuffer:
    """One request body: memory up to the bounds, then a temporary file."""

    __slots__ = ("buffers", "chunks", "file", "file_read", "file_size", "memory", "size")

    def __init__(self, buffers: RequestBuffers) -> None:
        self.buffers = buffers
        self.chunks: list[bytes] = []
        self.memory = 0  # bytes of `chunks`
        self.size = 0  # bytes taken in (memory and file)
        self.file: Any = None
        self.file_size = 0
        self.file_read = 0  # file bytes replayed

    def write(self, pieces: list[bytes]) -> None:
        """Take in body bytes; raises BufferRefused past the bound or when the file fails."""
        buffers = self.buffers
        limits = buffers.limits
        for piece in pieces:
            size = len(piece)
            if not size:
                continue
            total = self.size + size
            if total > limits.max_body:
                raise BufferRefused(413, too_large(limits.max_body), "body_too_large")
            self.size = total
            if (
                self.file is None
                and self.memory + size <= limits.memory_per_request
                and buffers.memory_used + size <= limits.memory_total
            ):
                self.chunks.append(piece)
                self.memory += size
                buffers.memory_used += size
                continue
            self._spill(piece)

    def _spill(self, piece: bytes) -> None:
        buffers = self.buffers
        if buffers.file_bytes + len(piece) > buffers.limits.files_total:
            raise BufferRefused(
                503,
                "the proxy's request buffers are full ("
                + str(buffers.limits.files_total)
                + " bytes on disk); try again later",
                "buffers_full",
            )
        file = self.file
        try:
            if file is None:
                file = self.file = tempfile.TemporaryFile(  # noqa: SIM115 (kept open: closed by close())
                    dir=self.buffers.limits.directory or None, buffering=0
                )
                self.buffers.files_open += 1
            view = memoryview(piece)
            while view:
                written = file.write(view)
                view = view[written:]
        except OSError as exc:
            raise BufferRefused(
                503, "request body could not be buffered: " + os.strerror(exc.errno or 0), "buffer"
            ) from None
        self.file_size += len(piece)
        buffers.file_bytes += len(piece)

    def read(self, limit: int = REPLAY_CHUNK) -> bytes:
        """The next bytes to replay (at most `limit`; b"" at the end). Memory
        is given back as it is read."""
        chunks = self.chunks
        if chunks:
            piece = chunks.pop(0) if len(chunks[0]) <= limit else self._split(limit)
            self.memory -= len(piece)
            self.buffers.memory_used -= len(piece)
            return piece
        file = self.file
        if file is None or self.file_read >= self.file_size:
            return b""
        try:
            data = os.pread(
                file.fileno(), min(limit, self.file_size - self.file_read), self.file_read
            )
        except OSError:
            data = b""
        if not data:  # (the file shrank under us: end the replay, the upstream sees a short body)
            self.file_read = self.file_size
            return b""
        self.file_read += len(data)
        return data

    def _split(self, limit: int) -> bytes:
        first = self.chunks[0]
        self.chunks[0] = first[limit:]
        return first[:limit]

    @property
    def remaining(self) -> int:
        """Bytes still to replay."""
        return self.memory + self.file_size - self.file_read

    def close(self) -> None:
        """Free the memory and the file (idempotent)."""
        if self.memory:
            self.buffers.memory_used -= self.memory
            self.memory = 0
        self.chunks = []
        file = self.file
        if file is not None:
            self.file = None
            self.buffers.files_open -= 1
            self.buffers.file_bytes -= self.file_size
            file.close()
