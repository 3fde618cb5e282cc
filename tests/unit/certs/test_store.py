"""DirectoryCAStore: private modes, whole-set atomic replace, unsafe keys refused."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from waygate.certs.store import DirectoryCAStore
from waygate.core.errors import FailedPrecondition


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_nothing_stored_yet(tmp_path: Path) -> None:
    assert DirectoryCAStore(tmp_path / "ca").load() is None


def test_save_and_load_round_trip_with_private_modes(tmp_path: Path) -> None:
    store = DirectoryCAStore(tmp_path / "ca")
    files = {"ca-1.key.pem": b"KEY", "ca-1.cert.pem": b"CERT", "state.json": b"{}"}
    store.save(files)
    assert store.load() == files
    assert mode(tmp_path / "ca") == 0o700
    assert {mode(p) for p in (tmp_path / "ca").iterdir()} == {0o600}


def test_save_replaces_the_whole_set(tmp_path: Path) -> None:
    store = DirectoryCAStore(tmp_path / "ca")
    store.save({"a.cert.pem": b"1", "state.json": b"x"})
    store.save({"b.cert.pem": b"2", "state.json": b"y"})
    assert store.load() == {"b.cert.pem": b"2", "state.json": b"y"}
    assert not list((tmp_path / "ca").glob("*.tmp"))


def test_key_readable_by_others_refuses_to_load(tmp_path: Path) -> None:
    store = DirectoryCAStore(tmp_path / "ca")
    store.save({"ca-1.key.pem": b"KEY", "state.json": b"{}"})
    (tmp_path / "ca" / "ca-1.key.pem").chmod(0o644)
    with pytest.raises(FailedPrecondition, match=r"ca-1\.key\.pem has mode 0644.*chmod 600"):
        store.load()


def test_leftover_temp_file_is_ignored(tmp_path: Path) -> None:
    store = DirectoryCAStore(tmp_path / "ca")
    store.save({"state.json": b"{}"})
    (tmp_path / "ca" / "state.json.tmp").write_bytes(b"half")
    assert store.load() == {"state.json": b"{}"}


def test_store_path_that_is_a_file(tmp_path: Path) -> None:
    (tmp_path / "ca").write_text("oops")
    with pytest.raises(FailedPrecondition, match="not a directory"):
        DirectoryCAStore(tmp_path / "ca").load()


def test_bad_file_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a CA store file name"):
        DirectoryCAStore(tmp_path / "ca").save({"../escape": b"x"})
