"""Where Certify's checks and signature run (issue 12, per-call CPU).

A thread hand-off costs more CPU than a P-256 check or signature, so a small
CSR with a quick key is checked on the event loop and signed there by a quick
CA key when the authority's lock is free and nothing needs writing. Everything
slow or waiting goes to the signing pool: large CSRs, P-384 checks, RSA CA
signatures, a held lock (a rotation, a store write), a store write of the
leaf bound, a CA transition due. These tests record the thread each step runs
on (in-process: a real authority in a temp directory, real static tokens).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import threading
from pathlib import Path
from typing import Any

import pytest
from cryptography import x509

from tests.unit.certs.helpers import RESOLVER, RESOLVER_ID, Clock, csr_der, open_authority
from waygate.certs import service as service_module
from waygate.certs.auth import StaticTokenAuthenticator
from waygate.certs.authority import Authority, CAState
from waygate.certs.policy import Policy
from waygate.certs.service import QUICK_CSR_BYTES, CertsService, SigningExecutor

TOKEN = "t" * 40
LOOP = "MainThread"


class Recorder:
    """The threads on which the CSR check and the signature ran, per call."""

    def __init__(self, service: CertsService, monkeypatch: pytest.MonkeyPatch) -> None:
        self.checks: list[str] = []
        self.signatures: list[str] = []
        verify = service_module.verify_csr

        def recording_verify(*args: Any, **kwargs: Any) -> None:
            self.checks.append(threading.current_thread().name)
            verify(*args, **kwargs)

        monkeypatch.setattr(service_module, "verify_csr", recording_verify)
        authority = service.authority
        sign = authority._sign

        def recording_sign(*args: Any, **kwargs: Any) -> Any:
            issued = sign(*args, **kwargs)
            if issued is not None:
                self.signatures.append(threading.current_thread().name)
            return issued

        monkeypatch.setattr(authority, "_sign", recording_sign)


def make_service(tmp_path: Path, clock: Clock | None = None, **config: object) -> CertsService:
    service = CertsService(
        StaticTokenAuthenticator([(TOKEN, RESOLVER)]),
        Policy("waygate.local"),
        replica="here/1",
        executor=SigningExecutor(2, 8),
    )
    service.attach(open_authority(tmp_path / "ca", clock, **config))
    return service


async def certify(service: CertsService, der: bytes | None = None) -> x509.Certificate:
    issued = await service.certify(
        token=TOKEN, identity=RESOLVER_ID, csr_der=der or csr_der(), lifetime=None
    )
    return issued.leaf


async def test_a_p256_csr_is_checked_and_signed_on_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(tmp_path)
    await certify(service)  # the first leaf raises the stored leaf bound (a write)
    recorder = Recorder(service, monkeypatch)
    submitted: list[object] = []
    run = service.executor.run

    async def counting_run(function: Any, *args: Any, **kwargs: Any) -> Any:
        submitted.append(function)
        return await run(function, *args, **kwargs)

    monkeypatch.setattr(service.executor, "run", counting_run)
    leaf = await certify(service)
    assert recorder.checks == [LOOP] and recorder.signatures == [LOOP]
    assert submitted == []
    assert leaf.serial_number > 0
    assert len(service.authority.list_issued()) == 2


async def test_the_first_leaf_raises_the_stored_bound_in_a_signing_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(tmp_path)
    recorder = Recorder(service, monkeypatch)
    saves: list[str] = []
    store = service.authority.store
    save = store.save

    def recording_save(files: dict[str, bytes]) -> None:
        saves.append(threading.current_thread().name)
        save(files)

    monkeypatch.setattr(store, "save", recording_save)
    await certify(service)
    assert recorder.checks == [LOOP]
    assert len(saves) == 1 and saves[0].startswith("certs-sign")
    assert recorder.signatures and recorder.signatures[0].startswith("certs-sign")


@pytest.mark.parametrize("algorithm", ["rsa-2048"])
async def test_an_rsa_ca_signs_in_a_signing_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, algorithm: str
) -> None:
    service = make_service(tmp_path, key_algorithm=algorithm)
    await certify(service)
    recorder = Recorder(service, monkeypatch)
    await certify(service)
    assert recorder.checks == [LOOP]
    assert len(recorder.signatures) == 1 and recorder.signatures[0].startswith("certs-sign")


async def test_a_p384_csr_is_checked_in_a_signing_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ec

    from tests.unit.certs.helpers import make_csr

    service = make_service(tmp_path)
    await certify(service)
    recorder = Recorder(service, monkeypatch)
    csr, _ = make_csr(key=ec.generate_private_key(ec.SECP384R1()))
    await certify(service, csr.public_bytes(serialization.Encoding.DER))
    assert len(recorder.checks) == 1 and recorder.checks[0].startswith("certs-sign")
    assert recorder.signatures == [LOOP]


async def test_a_large_csr_is_parsed_and_checked_in_a_signing_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(tmp_path)
    await certify(service)
    recorder = Recorder(service, monkeypatch)
    loads: list[str] = []
    load = service_module.load_csr

    def recording_load(*args: Any, **kwargs: Any) -> Any:
        loads.append(threading.current_thread().name)
        return load(*args, **kwargs)

    monkeypatch.setattr(service_module, "load_csr", recording_load)
    # Long names the tokens file allows: a real CSR over QUICK_CSR_BYTES.
    label = "a" * 60
    names = [f"dns:{label}{i}.{label}.{label}.example" for i in range(24)]
    caller = StaticTokenAuthenticator(
        [(TOKEN, RESOLVER.__class__(name="big", allowed=(f"uri:{RESOLVER_ID}", *names)))]
    )
    service.authenticator = caller
    der = csr_der((f"uri:{RESOLVER_ID}", *names))
    assert len(der) > QUICK_CSR_BYTES
    leaf = await certify(service, der)
    assert len(leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName).value) == 25
    assert len(loads) == 1 and loads[0].startswith("certs-sign")
    assert len(recorder.checks) == 1 and recorder.checks[0].startswith("certs-sign")


async def test_certify_never_waits_for_a_held_lock_on_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    service = make_service(tmp_path)
    await certify(service)
    recorder = Recorder(service, monkeypatch)
    authority = service.authority
    held, release = threading.Event(), threading.Event()

    def hold_the_lock() -> None:  # what a rotation or a store write does
        with authority._lock:
            held.set()
            release.wait(10)

    holder = threading.Thread(target=hold_the_lock)
    holder.start()
    try:
        assert held.wait(5)
        call = asyncio.ensure_future(certify(service))
        ticks = 0
        for _ in range(10):  # the loop keeps running while the call waits in a thread
            await asyncio.sleep(0.01)
            ticks += 1
        assert ticks == 10 and not call.done()
    finally:
        release.set()
        holder.join(5)
    leaf = await asyncio.wait_for(call, 5)
    assert leaf.serial_number > 0
    assert len(recorder.signatures) == 1 and recorder.signatures[0].startswith("certs-sign")


async def test_a_due_transition_is_applied_in_a_signing_thread(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = Clock()
    service = make_service(tmp_path, clock)
    await certify(service)
    authority: Authority = service.authority
    await asyncio.to_thread(authority.rotate, propagation_delay=dt.timedelta(minutes=10))
    await certify(service)  # staged, not yet due: the old CA signs on the loop
    recorder = Recorder(service, monkeypatch)
    clock.advance(dt.timedelta(minutes=11))
    leaf = await certify(service)
    assert len(recorder.signatures) == 1 and recorder.signatures[0].startswith("certs-sign")
    active = authority.active_authority()
    assert active.state is CAState.ACTIVE
    assert leaf.issuer == active.certificate.subject
