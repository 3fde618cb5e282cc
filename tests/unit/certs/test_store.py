"""DirectoryCAStore: private modes, whole-set atomic replace, unsafe keys and foreign files refused."""

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
    store.save({"ca-1.cert.pem": b"1", "state.json": b"x"})
    store.save({"ca-2.cert.pem": b"2", "state.json": b"y"})
    assert store.load() == {"ca-2.cert.pem": b"2", "state.json": b"y"}
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


def test_bad_file_names_that_are_not_own_names_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a CA store file name"):
        DirectoryCAStore(tmp_path / "ca").save({".bashrc": b"x"})


def home_like(directory: Path) -> dict[str, tuple[bytes, int]]:
    """A directory as a user's home is: dotfiles, a subdirectory, mode 0755."""
    directory.mkdir()
    (directory / ".bashrc").write_text("alias ll='ls -l'\n")
    (directory / ".profile").write_text("PATH=$HOME/bin:$PATH\n")
    (directory / "notes").mkdir()
    directory.chmod(0o755)
    return {p.name: (p.read_bytes(), mode(p)) for p in directory.iterdir() if p.is_file()}


def test_directory_with_foreign_files_is_refused_and_left_alone(tmp_path: Path) -> None:
    home = tmp_path / "home"
    before = home_like(home)
    with pytest.raises(FailedPrecondition) as refused:
        DirectoryCAStore(home).load()
    message = str(refused.value)
    assert "\n" not in message
    assert "3 entries certs did not write" in message
    for name in (".bashrc", ".profile", "notes"):
        assert repr(name) in message
    assert {p.name: (p.read_bytes(), mode(p)) for p in home.iterdir() if p.is_file()} == before
    assert mode(home) == 0o755


def test_refusal_names_a_few_foreign_files_and_counts_the_rest(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    ca.mkdir()
    for index in range(12):
        (ca / f"file-{index:02}").write_text("x")
    with pytest.raises(FailedPrecondition, match=r"12 entries .* and 7 more"):
        DirectoryCAStore(ca).load()


def test_own_name_that_is_a_symlink_is_foreign(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    ca.mkdir()
    (tmp_path / "elsewhere").write_text("{}")
    (ca / "state.json").symlink_to(tmp_path / "elsewhere")
    with pytest.raises(FailedPrecondition, match="'state.json'"):
        DirectoryCAStore(ca).load()


def test_save_never_deletes_or_remodes_what_is_not_its_own(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    ca.mkdir(mode=0o750)
    ca.chmod(0o750)
    store = DirectoryCAStore(ca)
    store.save({"ca-1.cert.pem": b"1", "state.json": b"x"})
    (ca / "stranger.txt").write_text("mine")  # appears after the load, before a save
    store.save({"ca-2.cert.pem": b"2", "state.json": b"y"})
    assert (ca / "stranger.txt").read_text() == "mine"
    assert not (ca / "ca-1.cert.pem").exists()
    assert mode(ca) == 0o750


def test_empty_existing_directory_is_used_and_keeps_its_mode(tmp_path: Path) -> None:
    ca = tmp_path / "ca"
    ca.mkdir()
    ca.chmod(0o711)
    store = DirectoryCAStore(ca)
    assert store.load() is None
    store.save({"ca-1.key.pem": b"KEY", "state.json": b"{}"})
    assert store.load() == {"ca-1.key.pem": b"KEY", "state.json": b"{}"}
    assert mode(ca) == 0o711
    assert mode(ca / "ca-1.key.pem") == 0o600
