"""The store step: the authority's state written to its CAStore, one write at a time.

`StateWriter` wraps a `CAStore` (a directory, a Secret) for the authority: it
serialises the writes, counts them, and turns a store's OSError into a
FailedPrecondition naming the store. The authority changes what it stores by
changing memory first and then saving it (`save_or_restore`), or, for a
rotation that makes its files off the authority's lock, by `write_latest`.

Invariants:
- one write at a time (`StateWriter`'s own lock; a caller holding the
  authority's lock takes it inside that one, never the other way round); the
  count moves only with a write that succeeded;
- a write that fails leaves memory as the store has it: `save_or_restore`
  puts the state back to the checkpoint taken before the change;
- `write_latest` never writes files older than the last write: files made
  before another write came between are made again from the state it wrote.
No grpc; the only I/O is the store's.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from waygate.certs.castate import AuthorityState, Checkpoint
from waygate.certs.store import CAStore
from waygate.core.errors import FailedPrecondition


class StateWriter:
    """Writes the authority's state to `store`, serialised and counted."""

    def __init__(self, store: CAStore) -> None:
        self.store = store
        self._lock = threading.Lock()
        #: Writes so far: a rotation writing off the authority's lock compares it to
        #: know whether another write came between.
        self.saves = 0

    def save_or_restore(self, state: AuthorityState, checkpoint: Checkpoint) -> None:
        """Write `state`; if that fails, put it back to `checkpoint` and raise."""
        try:
            self.write(state.files())
        except BaseException:
            state.restore(checkpoint)
            raise

    def write(self, files: dict[str, bytes]) -> int:
        """Write `files`; returns the number of this write."""
        with self._lock:
            return self._write_holding_lock(files)

    def write_latest(self, make_files: Callable[[], dict[str, bytes]]) -> int:
        """Write what `make_files()` makes of the state in memory; made again when
        another write came between making and writing them (they would undo it).
        Returns the number of this write."""
        while True:
            follows = self.saves
            files = make_files()
            with self._lock:
                if follows == self.saves:
                    return self._write_holding_lock(files)

    def _write_holding_lock(self, files: dict[str, bytes]) -> int:
        try:
            self.store.save(files)
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot save the CA to {self.store.description}: {exc.strerror or exc}"
            ) from None
        self.saves += 1
        return self.saves
