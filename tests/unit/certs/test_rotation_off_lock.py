"""RotateCA makes its key and writes the store without the authority's lock (issue 12).

Certify must not wait behind a rotation's slow parts: RSA key generation
(seconds) and the store write (a round trip to the API server for a Secret).
The rotation holds the lock only to check, to make the files it writes, and to
swap the new CA in; a write by someone else in between (the leaf bound, a
transition) is never undone by the rotation's. In-process, a real authority in
a temp directory; the store is the real directory store with a gate on the
rotation's write, and key generation is gated the same way.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import json
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.unit.certs.helpers import RESOLVER, RESOLVER_ID, Clock, make_csr, sign
from waygate.certs import castate as castate_module
from waygate.certs.auth import StaticTokenAuthenticator
from waygate.certs.authority import Authority, AuthorityConfig, CAState
from waygate.certs.policy import Policy
from waygate.certs.service import CertsService, SigningExecutor
from waygate.certs.store import DirectoryCAStore
from waygate.core.errors import FailedPrecondition

TOKEN = "t" * 40
WAIT = 10.0


class GatedStore:
    """The directory store; a write that adds a CA waits for `open_gate` once armed."""

    def __init__(self, path: Path) -> None:
        self.inner = DirectoryCAStore(path)
        self.description = self.inner.description
        self.armed = False
        self.entered = threading.Event()
        self.gate = threading.Event()
        self.fail_gated = False
        self._names: set[str] = set()

    def load(self) -> dict[str, bytes] | None:
        files = self.inner.load()
        self._names = set(files or ())
        return files

    def save(self, files: dict[str, bytes]) -> None:
        adds_a_ca = bool(set(files) - self._names) and bool(self._names)
        if self.armed and adds_a_ca:
            self.armed = False
            self.entered.set()
            assert self.gate.wait(WAIT), "the test never opened the gate"
            if self.fail_gated:
                raise OSError(28, "No space left on device")
        self.inner.save(files)
        self._names = set(files)

    def state(self) -> dict[str, Any]:
        return json.loads((self.inner.path / "state.json").read_text())  # type: ignore[no-any-return]


def open_gated(tmp_path: Path, clock: Clock) -> tuple[Authority, GatedStore]:
    store = GatedStore(tmp_path / "ca")
    authority = Authority.open(store, AuthorityConfig(), now=clock)
    return authority, store


def issue(authority: Authority) -> Any:
    csr, _ = make_csr()
    return sign(authority, csr, identity=RESOLVER_ID, requested_by="test")


def bound_of(state: dict[str, Any], name: str) -> dt.datetime:
    entry = next(e for e in state["authorities"] if e["name"] == name)
    return dt.datetime.fromisoformat(entry["leaf_bound"])


async def test_certify_is_answered_while_the_rotation_writes_the_store(tmp_path: Path) -> None:
    clock = Clock()
    authority, store = open_gated(tmp_path, clock)
    service = CertsService(
        StaticTokenAuthenticator([(TOKEN, RESOLVER)]),
        Policy("waygate.local"),
        executor=SigningExecutor(2, 8),
    )
    service.attach(authority)
    csr, _ = make_csr()
    from cryptography.hazmat.primitives import serialization

    der = csr.public_bytes(serialization.Encoding.DER)
    await service.certify(token=TOKEN, identity=RESOLVER_ID, csr_der=der, lifetime=None)
    store.armed = True
    rotation = asyncio.ensure_future(
        asyncio.to_thread(authority.rotate, propagation_delay=dt.timedelta(0))
    )
    try:
        assert await asyncio.to_thread(store.entered.wait, WAIT)
        # The rotation's write is in progress (held at the gate): Certify goes on.
        for _ in range(3):
            issued = await asyncio.wait_for(
                service.certify(token=TOKEN, identity=RESOLVER_ID, csr_der=der, lifetime=None),
                5,
            )
            assert issued.leaf.issuer == authority.active_authority().certificate.subject
        assert not rotation.done()
        assert len(authority.trust_bundle().authorities) == 1  # not published before stored
    finally:
        store.gate.set()
    result = await asyncio.wait_for(rotation, WAIT)
    assert len(authority.trust_bundle().authorities) == 2
    assert authority.active_authority().fingerprint == result.new_authority.fingerprint
    assert {e["name"] for e in store.state()["authorities"]} == {"ca-1", "ca-2"}
    service.close()


@contextlib.contextmanager
def rotation_making_its_key(
    authority: Authority, monkeypatch: pytest.MonkeyPatch
) -> Iterator[threading.Thread]:
    """A rotation in a thread, held while it makes its new key (an RSA-3072 key takes
    seconds); it goes on when the block ends, and has ended after it."""
    making, release = threading.Event(), threading.Event()
    generate = castate_module.generate_key

    def slow_generate(algorithm: str) -> Any:
        making.set()
        assert release.wait(WAIT)
        return generate(algorithm)

    monkeypatch.setattr(castate_module, "generate_key", slow_generate)
    rotating = threading.Thread(target=authority.rotate)
    rotating.start()
    try:
        assert making.wait(WAIT)
        yield rotating
    finally:
        release.set()
        rotating.join(WAIT)


def test_signing_goes_on_while_the_new_key_is_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    authority, _ = open_gated(tmp_path, clock)
    issue(authority)
    with rotation_making_its_key(authority, monkeypatch):
        signed: list[object] = []
        signer = threading.Thread(target=lambda: signed.append(issue(authority)))
        signer.start()
        signer.join(5)
        assert signed, "signing waited for the rotation's key generation"
    assert [a.state for a in authority.trust_bundle().authorities] == [
        CAState.ACTIVE,
        CAState.STAGED,
    ]


def test_a_write_before_the_rotations_write_is_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The leaf bound raised while the new key is made is in what the rotation writes."""
    clock = Clock()
    authority, store = open_gated(tmp_path, clock)
    issue(authority)
    with rotation_making_its_key(authority, monkeypatch):
        clock.advance(dt.timedelta(hours=3))  # past the stored bound: this leaf writes it
        leaf = issue(authority).leaf
        raised = bound_of(store.state(), "ca-1")
        assert raised >= leaf.not_valid_after_utc
    state = store.state()
    assert {e["name"] for e in state["authorities"]} == {"ca-1", "ca-2"}
    assert bound_of(state, "ca-1") == raised


def test_a_write_between_the_rotations_write_and_its_swap_is_not_undone(
    tmp_path: Path,
) -> None:
    """A leaf that raises the bound while the rotation writes: its write (made without
    the new CA) lands after the rotation's, so the swap writes the state again."""
    clock = Clock()
    authority, store = open_gated(tmp_path, clock)
    issue(authority)
    store.armed = True
    rotating = threading.Thread(target=authority.rotate)
    rotating.start()
    signer: threading.Thread | None = None
    try:
        assert store.entered.wait(WAIT)
        clock.advance(dt.timedelta(hours=3))
        leaves: list[Any] = []
        signer = threading.Thread(target=lambda: leaves.append(issue(authority)))
        signer.start()
        # The signer holds the authority's lock and waits for the store (the rotation
        # is writing); the rotation's swap will then wait for the signer.
        for _ in range(500):
            if not authority._lock.acquire(blocking=False):
                break
            authority._lock.release()
            threading.Event().wait(0.01)
        else:
            raise AssertionError("the signer never took the lock")
    finally:
        store.gate.set()
        rotating.join(WAIT)
        if signer is not None:
            signer.join(WAIT)
    assert leaves
    state = store.state()
    assert {e["name"] for e in state["authorities"]} == {"ca-1", "ca-2"}
    assert bound_of(state, "ca-1") >= leaves[0].leaf.not_valid_after_utc
    assert len(authority.trust_bundle().authorities) == 2
    # What a restart loads is what memory holds.
    reopened = Authority.open(DirectoryCAStore(tmp_path / "ca"), AuthorityConfig(), now=clock)
    assert [a.fingerprint for a in reopened.trust_bundle().authorities] == [
        a.fingerprint for a in authority.trust_bundle().authorities
    ]


def test_a_failed_rotation_write_changes_nothing(tmp_path: Path) -> None:
    clock = Clock()
    authority, store = open_gated(tmp_path, clock)
    issue(authority)
    before = store.state()
    version = authority.trust_bundle().version
    store.armed, store.fail_gated = True, True
    store.gate.set()
    with pytest.raises(FailedPrecondition, match="No space left on device"):
        authority.rotate()
    assert store.state() == before
    assert authority.trust_bundle().version == version
    assert len(authority.trust_bundle().authorities) == 1
    # And the next rotation works (no lock or generation left behind).
    rotation = authority.rotate()
    assert rotation.new_authority.state is CAState.STAGED
    assert {e["name"] for e in store.state()["authorities"]} == {"ca-1", "ca-2"}


def test_two_rotations_at_once_make_one_new_ca(tmp_path: Path) -> None:
    clock = Clock()
    authority, store = open_gated(tmp_path, clock)
    results: list[object] = []

    def rotate() -> None:
        try:
            results.append(authority.rotate())
        except FailedPrecondition as exc:
            results.append(exc)

    threads = [threading.Thread(target=rotate) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(WAIT)
    assert sorted(type(r).__name__ for r in results) == ["FailedPrecondition", "Rotation"]
    assert {e["name"] for e in store.state()["authorities"]} == {"ca-1", "ca-2"}
    assert len(authority.trust_bundle().authorities) == 2


def test_a_write_after_the_rotations_files_were_made_makes_them_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Files made before another write would undo it: the rotation makes them again."""
    clock = Clock()
    authority, store = open_gated(tmp_path, clock)
    issue(authority)
    made, release = threading.Event(), threading.Event()
    calls: list[int] = []
    rotation_files = authority._rotation_files

    def gated_files(*args: Any) -> Any:
        result = rotation_files(*args)
        calls.append(len(calls))
        if len(calls) == 1:
            made.set()
            assert release.wait(WAIT)
        return result

    monkeypatch.setattr(authority, "_rotation_files", gated_files)
    rotating = threading.Thread(target=authority.rotate)
    rotating.start()
    try:
        assert made.wait(WAIT)
        clock.advance(dt.timedelta(hours=3))
        leaf = issue(authority).leaf
        raised = bound_of(store.state(), "ca-1")
        assert raised >= leaf.not_valid_after_utc
    finally:
        release.set()
        rotating.join(WAIT)
    assert len(calls) == 2
    state = store.state()
    assert {e["name"] for e in state["authorities"]} == {"ca-1", "ca-2"}
    assert bound_of(state, "ca-1") == raised


def test_the_first_leaves_of_a_new_ca_need_no_store_write(tmp_path: Path) -> None:
    """Right after an immediate switch every workload renews: the rotation's own write
    (off the lock) already stored a bound covering them, so none of them writes."""
    clock = Clock()
    authority, store = open_gated(tmp_path, clock)
    issue(authority)
    rotation = authority.rotate(propagation_delay=dt.timedelta(0))
    assert authority.active_authority().fingerprint == rotation.new_authority.fingerprint
    new_name = f"ca-{store.state()['generation']}"
    before = (store.inner.path / "state.json").read_bytes()
    leaves = []
    for _ in range(3):
        clock.advance(dt.timedelta(minutes=10))
        leaves.append(issue(authority).leaf)
    assert (store.inner.path / "state.json").read_bytes() == before
    assert all(leaf.issuer == rotation.new_authority.certificate.subject for leaf in leaves)
    assert bound_of(store.state(), new_name) >= max(leaf.not_valid_after_utc for leaf in leaves)


def test_a_rotation_whose_write_was_adopted_before_its_swap_is_in_once(tmp_path: Path) -> None:
    """The store's watch may bring the rotation's own write back (`adopt`) before the
    rotation swaps the new CA in: the new CA is then in once, and the rotation succeeds."""
    clock = Clock()
    authority, store = open_gated(tmp_path, clock)
    issue(authority)
    save = store.save

    def save_then_adopt(files: dict[str, bytes]) -> None:
        save(files)
        if len(files) > 3:  # the rotation's write: two CAs
            assert authority.adopt(files)

    store.save = save_then_adopt  # type: ignore[method-assign]
    rotation = authority.rotate()
    names = [a.fingerprint for a in authority.trust_bundle().authorities]
    assert len(names) == 2 and len(set(names)) == 2
    assert rotation.new_authority.fingerprint == names[1]
    assert [a.state for a in authority.trust_bundle().authorities] == [
        CAState.ACTIVE,
        CAState.STAGED,
    ]
