"""certs Settings (flags/env, cross-field checks) and what `waygate up` passes."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pytest

from waygate.certs.app import Settings, up_arguments
from waygate.components import UpContext
from waygate.core.settings import SettingsError, load_settings


def test_defaults_follow_the_design() -> None:
    settings = load_settings(Settings, env={})
    assert (settings.grpc_port, settings.admin_port) == (7002, 9002)
    assert settings.key_algorithm == "ecdsa-p256"
    config = settings.authority_config()
    assert config.default_lifetime == dt.timedelta(hours=24)
    assert config.ca_lifetime == dt.timedelta(days=365)
    assert config.trust_domain == "waygate.local"


def test_durations_and_choices_from_flags_and_env() -> None:
    settings = load_settings(
        Settings,
        flags={"leaf_lifetime": "1h", "key_algorithm": "rsa-3072"},
        env={"WAYGATE_MAX_LEAF_LIFETIME": "2d"},
    )
    assert settings.leaf_lifetime == 3600 and settings.max_leaf_lifetime == 2 * 86400
    with pytest.raises(SettingsError, match="key_algorithm.*must be one of"):
        load_settings(Settings, flags={"key_algorithm": "dsa"}, env={})


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"leaf_lifetime": "8d"}, "leaf_lifetime: longer than max_leaf_lifetime"),
        ({"max_leaf_lifetime": "400d"}, "must be shorter than ca_lifetime"),
        ({"serving_sans": "host:x"}, "must be dns:NAME"),
        ({"host": "0.0.0.0"}, "not a loopback address and no TLS"),
    ],
)
def test_inconsistent_settings_are_refused(flags: dict, message: str) -> None:
    with pytest.raises(SettingsError, match=message):
        load_settings(Settings, flags=flags, env={})


def test_self_issued_tls_counts_as_tls_for_non_loopback_hosts() -> None:
    settings = load_settings(
        Settings,
        flags={"host": "0.0.0.0", "serving_identity": "spiffe://waygate.local/ns/x/sa/certs"},
        env={},
    )
    assert settings.tls_enabled


def test_up_arguments(tmp_path: Path) -> None:
    argv = up_arguments(UpContext(state_dir=tmp_path, port_offset=0))
    flags = dict(zip(argv[::2], argv[1::2], strict=True))
    assert flags["--ca-dir"] == str(tmp_path / "certs")
    assert flags["--tokens-file"] == str(tmp_path / "tokens.yaml")
    assert flags["--bundle-file"] == str(tmp_path / "ca.pem")
    assert flags["--serving-identity"] == "spiffe://waygate.local/ns/local/sa/certs"
    assert "dns:certs.waygate.local" in flags["--serving-sans"]
    assert "localhost" not in flags["--serving-sans"]  # pkilint calls a localhost SAN an ERROR
