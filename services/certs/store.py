"""Where the CA keeps its keys, certificates and rotation state.

A `CAStore` holds one flat mapping of file name -> bytes (PEM keys and
certificates, rotation state as JSON). The authority serialises everything it
must remember into that mapping and saves it whole, so a store only has to
replace a set of files atomically.

`DirectoryCAStore` keeps the set in a directory. Invariants:
- it touches only its own names (`state.json`, `ca-N.key.pem`,
  `ca-N.cert.pem`, `ca-N.anchor.pem` and their `.tmp` save names): a directory holding anything
  else (`.bashrc`, a subdirectory, ...) is refused at load with a one-line
  FailedPrecondition naming those entries, and a save never deletes, renames
  or re-modes anything else, so a mistyped `--ca-dir` (a home directory)
  loses nothing;
- a directory it creates is 0700; an existing one keeps its mode (it is not
  ours to change); every file it writes is 0600 (private keys among them);
- a save writes every file to a temporary name, fsyncs, then renames, so a
  crash leaves either the old file or the new one, never half of one; own
  files no longer in the set are removed afterwards;
- a load refuses (FailedPrecondition, naming the file) a key file that group
  or others may read, or one that cannot be read at all: the CA never signs
  with a key that may have leaked, and never silently makes a new CA over an
  existing one it failed to read.

`SecretCAStore` (Kubernetes) lives in `waygate.certs.kube_store`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
from pathlib import Path
from typing import Protocol

from waygate.core.errors import FailedPrecondition, excerpt

log = logging.getLogger(__name__)

DIRECTORY_MODE = 0o700
FILE_MODE = 0o600
_TEMP_SUFFIX = ".tmp"
#: Every name a CA store holds (the authority's state and its CAs' key and certificate).
OWN_NAME = re.compile(r"state\.json|ca-[0-9]{1,9}\.(key|cert|anchor)\.pem")
#: How many foreign entries a refusal names before "and N more".
_NAMED_FOREIGN = 5


class CAStore(Protocol):
    #: Human description of where the CA lives, e.g. "directory /x/ca".
    description: str

    def load(self) -> dict[str, bytes] | None:
        """The stored set, or None when nothing is stored yet (first start)."""
        ...

    def save(self, files: dict[str, bytes]) -> None:
        """Replace the whole stored set atomically."""
        ...


def write_refusal(store: CAStore, what: str) -> str | None:
    """Why `store`'s replica may not write `what` (another replica or the parent
    process writes), or None. Stores without an election (a directory) always write."""
    refusal = getattr(store, "refusal", None)
    return refusal(what) if refusal is not None else None


def _is_key_file(name: str) -> bool:
    return name.endswith(".key") or name.endswith("key.pem")


def is_own_name(name: str) -> bool:
    """Is `name` one certs writes in a CA directory (a temporary save name included)?"""
    return OWN_NAME.fullmatch(name.removesuffix(_TEMP_SUFFIX)) is not None


class DirectoryCAStore:
    """A CA file set in a private directory (embedded mode)."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.description = f"directory {self.path}"

    def load(self) -> dict[str, bytes] | None:
        if not self.path.exists():
            return None
        if not self.path.is_dir():
            raise FailedPrecondition(f"CA store {self.path} is not a directory")
        files: dict[str, bytes] = {}
        try:
            entries = sorted(self.path.iterdir())
        except OSError as exc:
            raise FailedPrecondition(
                f"cannot read CA directory {self.path}: {exc.strerror}"
            ) from None
        foreign = [e.name for e in entries if not is_own_name(e.name) or not _regular_file(e)]
        if foreign:
            named = ", ".join(excerpt(name) for name in foreign[:_NAMED_FOREIGN])
            more = len(foreign) - _NAMED_FOREIGN
            raise FailedPrecondition(
                f"CA directory {self.path} holds {len(foreign)} entries certs did not write: "
                f"{named}{f' and {more} more' if more > 0 else ''}; refusing to use it "
                "(point --ca-dir at a new or empty directory, or at one certs created)"
            )
        for entry in entries:
            if entry.name.endswith(_TEMP_SUFFIX):
                continue  # left by a save that crashed before its rename
            if _is_key_file(entry.name):
                mode = stat.S_IMODE(entry.stat().st_mode)
                if mode & 0o077:
                    raise FailedPrecondition(
                        f"CA key file {entry} has mode {mode:04o}: it must be readable by its "
                        f"owner only; fix it with `chmod 600 {entry}` (and consider the key leaked "
                        "if others could read it)"
                    )
            try:
                files[entry.name] = entry.read_bytes()
            except OSError as exc:
                raise FailedPrecondition(f"cannot read CA file {entry}: {exc.strerror}") from None
        return files or None

    def save(self, files: dict[str, bytes]) -> None:
        for name in files:
            if not OWN_NAME.fullmatch(name):
                raise ValueError(f"not a CA store file name: {name!r}")
        if not self.path.exists():
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with contextlib.suppress(FileExistsError):
                self.path.mkdir(mode=DIRECTORY_MODE)
                # mkdir's mode passes through the umask; ours is exact.
                os.chmod(self.path, DIRECTORY_MODE)
        written: list[tuple[Path, Path]] = []
        try:
            for name, data in files.items():
                final = self.path / name
                temp = self.path / (name + _TEMP_SUFFIX)
                fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, FILE_MODE)
                with os.fdopen(fd, "wb") as handle:
                    os.fchmod(handle.fileno(), FILE_MODE)
                    handle.write(data)
                    handle.flush()
                    os.fsync(handle.fileno())
                written.append((temp, final))
        except BaseException:
            for temp, _ in written:
                with contextlib.suppress(OSError):
                    temp.unlink()
            raise
        # Renames come last so a failure above leaves the previous set untouched.
        for temp, final in written:
            os.replace(temp, final)
        for entry in self.path.iterdir():
            # Only our own names: whatever else appeared since the load is not ours to remove.
            if entry.name not in files and is_own_name(entry.name) and _regular_file(entry):
                with contextlib.suppress(OSError):
                    entry.unlink()
        dir_fd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        log.debug("CA store saved", extra={"store": self.description, "files": len(files)})


def _regular_file(path: Path) -> bool:
    """A regular file, not a symbolic link (a link could point anywhere)."""
    try:
        return stat.S_ISREG(path.lstat().st_mode)
    except OSError:
        return False
