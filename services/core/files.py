"""Writing files that others read while Waygate runs: keys, certificates, bundles.

A write goes to a temporary file in the same directory, gets its mode before
any byte is written (a key is never readable by others, not even for a
moment), is flushed to disk, and replaces the target by rename: a reader sees
the old file or the new one, never half of one, and after a crash the file is
whole, old or new.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path


def write_file_atomically(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
    # The rename itself survives a crash only once the directory is on disk too.
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)
