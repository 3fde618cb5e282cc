"""`waygate cert inspect`: what it shows and the exit status for fresh, low and expired."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization

from tests.unit.certs.helpers import RESOLVER_ID, Clock, make_csr, open_authority, sign
from waygate.certs.commands import inspect_certificate
from waygate.cli import main

HOUR = dt.timedelta(hours=1)


@pytest.fixture
def leaf(tmp_path: Path):  # type: ignore[no-untyped-def]
    clock = Clock()
    authority = open_authority(tmp_path / "ca", clock, backdate=dt.timedelta(0))
    return clock, sign(authority, make_csr()[0], identity=RESOLVER_ID, requested_by="t").leaf


def test_fresh_certificate(leaf) -> None:  # type: ignore[no-untyped-def]
    clock, cert = leaf
    lines, status = inspect_certificate(cert, clock())
    text = "\n".join(lines)
    assert status == 0
    assert "subject:        (empty)" in text
    assert f"uri:{RESOLVER_ID}" in text and "dns:resolver.waygate.local" in text
    assert "ip:127.0.0.1" in text
    assert "issuer:         CN=waygate.local CA 1,O=Waygate" in text
    assert "remaining life: 1d0h (100% of its lifetime)" in text


def test_under_twenty_percent_is_exit_2(leaf) -> None:  # type: ignore[no-untyped-def]
    clock, cert = leaf
    lines, status = inspect_certificate(cert, clock() + 20 * HOUR)
    assert status == 2 and "RENEW SOON" in lines[-1] and "4h0m (17%" in lines[-1]
    assert inspect_certificate(cert, clock() + 19 * HOUR)[1] == 0


def test_expired_is_exit_1(leaf) -> None:  # type: ignore[no-untyped-def]
    clock, cert = leaf
    lines, status = inspect_certificate(cert, clock() + 25 * HOUR)
    assert status == 1 and "EXPIRED 1h0m ago" in lines[-1]


def test_inspect_files(tmp_path: Path, leaf, capsys) -> None:  # type: ignore[no-untyped-def]
    _, cert = leaf
    pem_file = tmp_path / "cert.pem"
    pem_file.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    der_file = tmp_path / "cert.der"
    der_file.write_bytes(cert.public_bytes(serialization.Encoding.DER))
    # The fixture's clock is in the past: by the wall clock the leaf has expired.
    assert main(["cert", "inspect", str(pem_file)]) == 1
    assert main(["cert", "inspect", str(der_file)]) == 1
    garbage = tmp_path / "garbage.pem"
    garbage.write_text("hello")
    assert main(["cert", "inspect", str(garbage)]) == 1
    assert "holds no PEM or DER certificate" in capsys.readouterr().err
    assert main(["cert", "inspect", str(tmp_path / "absent.pem")]) == 1
    assert "cannot read" in capsys.readouterr().err
