"""The certs-client settings every process has: checked together, at start, in one line."""

from __future__ import annotations

import pytest

from waygate.core.settings import GrpcServerSettings, SettingsError, load_settings


@pytest.fixture
def files(tmp_path):
    token, ca = tmp_path / "resolver.token", tmp_path / "ca.pem"
    token.write_text("t" * 40)
    ca.write_text("not checked here: the rotation client reads it")
    return {
        "certs_address": "127.0.0.1:7002",
        "certs_token_file": str(token),
        "certs_ca_file": str(ca),
        "cert_identity": "spiffe://waygate.local/ns/local/sa/resolver",
    }


def load(**flags):
    return load_settings(GrpcServerSettings, flags=flags, env={})


def test_a_complete_certs_client_counts_as_tls(files) -> None:
    settings = load(**files, cert_sans="dns:resolver.waygate.local, ip:127.0.0.1", host="0.0.0.0")
    assert settings.tls_enabled
    assert settings.cert_sans == ("dns:resolver.waygate.local", "ip:127.0.0.1")
    assert settings.cert_renew_fraction == 0.7


@pytest.mark.parametrize("missing", ["certs_token_file", "certs_ca_file", "cert_identity"])
def test_each_part_is_required_with_certs_address(files, missing) -> None:
    del files[missing]
    with pytest.raises(
        SettingsError, match=f"invalid setting {missing}: required with certs_address"
    ):
        load(**files)


def test_parts_without_certs_address_are_a_mistake(files) -> None:
    del files["certs_address"]
    with pytest.raises(SettingsError, match="it needs certs_address"):
        load(**files)


def test_certs_and_static_files_exclude_each_other(files, tmp_path) -> None:
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(SettingsError, match="certs_address or tls_cert_file, not both"):
        load(**files, tls_cert_file=str(cert), tls_key_file=str(cert))


def test_a_missing_token_file_is_named(files, tmp_path) -> None:
    files["certs_token_file"] = str(tmp_path / "nope.token")
    with pytest.raises(SettingsError, match="nope.token is not a readable file"):
        load(**files)


def test_a_bad_san_is_named(files) -> None:
    with pytest.raises(SettingsError, match="invalid setting cert_sans: name 'ip:localhost'"):
        load(**files, cert_sans="ip:localhost")


@pytest.mark.parametrize("fraction", ["0.05", "0.8", "1"])
def test_renewal_must_come_before_the_warning_threshold(files, fraction) -> None:
    with pytest.raises(SettingsError, match="between 0.1 and 0.75"):
        load(**files, cert_renew_fraction=fraction)
