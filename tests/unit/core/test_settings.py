"""Settings: precedence flags > WAYGATE_* env > YAML file > default, and one-line errors."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from waygate.core.settings import (
    GrpcServerSettings,
    SettingsError,
    load_settings,
    parse_duration,
    setting,
)


@dataclasses.dataclass(frozen=True, kw_only=True)
class DemoSettings(GrpcServerSettings):
    grpc_port: int = setting(7001, help="gRPC port")
    names: tuple[str, ...] = setting((), help="names")
    routes_file: Path | None = setting(None, help="routes")


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_defaults_when_nothing_is_given():
    s = load_settings(DemoSettings, env={})
    assert (s.grpc_port, s.host, s.shutdown_grace, s.names) == (7001, "127.0.0.1", 10.0, ())


def test_flag_beats_env_beats_file_beats_default(tmp_path):
    config = write(tmp_path, "grpc_port: 7100\nadmin-port: 9100\nlog_level: debug\n")
    env = {"WAYGATE_GRPC_PORT": "7200", "WAYGATE_ADMIN_PORT": "9200"}
    s = load_settings(
        DemoSettings, flags={"grpc_port": "7300", "admin_port": None}, env=env, config_file=config
    )
    assert s.grpc_port == 7300  # flag
    assert s.admin_port == 9200  # env (flag not given)
    assert s.log_level == "debug"  # file
    assert s.max_concurrent_unary == 1000  # default


def test_config_file_from_env(tmp_path):
    config = write(tmp_path, "names: [a, b]\nshutdown_grace: 1m30s\n")
    s = load_settings(DemoSettings, env={"WAYGATE_CONFIG": str(config)})
    assert s.names == ("a", "b")
    assert s.shutdown_grace == 90.0


def test_settings_are_frozen():
    s = load_settings(DemoSettings, env={})
    with pytest.raises(dataclasses.FrozenInstanceError):
        s.grpc_port = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("flags", "env", "expected"),
    [
        (
            {"grpc_port": "seventy"},
            {},
            "invalid setting grpc_port (from --grpc-port): not an integer: 'seventy'",
        ),
        (
            {},
            {"WAYGATE_GRPC_PORT": "70000"},
            "invalid setting grpc_port (from WAYGATE_GRPC_PORT): must be a port number",
        ),
        (
            {},
            {"WAYGATE_LOG_LEVEL": "loud"},
            "invalid setting log_level (from WAYGATE_LOG_LEVEL): must be one of",
        ),
        (
            {"shutdown_grace": "soon"},
            {},
            "invalid setting shutdown_grace (from --shutdown-grace): not a duration",
        ),
        (
            {"shutdown_grace": "0s"},
            {},
            "invalid setting shutdown_grace (from --shutdown-grace): must be greater than 0",
        ),
        ({"insecure": "maybe"}, {}, "invalid setting insecure (from --insecure): not a boolean"),
    ],
)
def test_invalid_values_name_the_setting_and_the_source(flags, env, expected):
    with pytest.raises(SettingsError) as caught:
        load_settings(DemoSettings, flags=flags, env=env)
    message = str(caught.value)
    assert message.startswith(expected)
    assert "\n" not in message


def test_unknown_key_in_file_is_refused(tmp_path):
    config = write(tmp_path, "grpc_prot: 1\n")
    with pytest.raises(SettingsError, match="unknown setting 'grpc_prot' in config file"):
        load_settings(DemoSettings, env={}, config_file=config)


def test_malformed_yaml_names_the_line(tmp_path):
    config = write(tmp_path, "grpc_port: 1\nnames: [a,\n")
    with pytest.raises(SettingsError, match=r"config\.yaml:\d+ is not valid YAML"):
        load_settings(DemoSettings, env={}, config_file=config)


def test_missing_config_file_is_a_clear_error(tmp_path):
    with pytest.raises(SettingsError, match="cannot read config file .*nope.yaml"):
        load_settings(DemoSettings, env={}, config_file=tmp_path / "nope.yaml")


def test_non_loopback_listener_needs_tls_or_insecure():
    with pytest.raises(
        SettingsError, match="invalid setting host: 0.0.0.0 is not a loopback address"
    ):
        load_settings(DemoSettings, flags={"host": "0.0.0.0"}, env={})
    assert load_settings(DemoSettings, flags={"host": "0.0.0.0", "insecure": True}, env={}).insecure
    assert load_settings(DemoSettings, flags={"host": "::1"}, env={}).host == "::1"


def test_tls_files_must_come_in_pairs_and_exist(tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    with pytest.raises(SettingsError, match="give both or neither"):
        load_settings(DemoSettings, flags={"tls_cert_file": str(cert)}, env={})
    with pytest.raises(SettingsError, match="tls_key_file: .*missing.pem is not a readable file"):
        load_settings(
            DemoSettings,
            flags={"tls_cert_file": str(cert), "tls_key_file": str(tmp_path / "missing.pem")},
            env={},
        )


def test_otlp_endpoint_reads_the_standard_variable_and_ours_wins():
    standard = {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}
    assert load_settings(DemoSettings, env=standard).otlp_endpoint == "http://collector:4317"
    both = {**standard, "WAYGATE_OTLP_ENDPOINT": "http://jaeger:4317"}
    assert load_settings(DemoSettings, env=both).otlp_endpoint == "http://jaeger:4317"


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("30", 30.0),
        ("250ms", 0.25),
        ("1h30m", 5400.0),
        ("24h", 86400.0),
        ("1d", 86400.0),
        ("1.5s", 1.5),
    ],
)
def test_parse_duration(text, seconds):
    assert parse_duration(text) == seconds


@pytest.mark.parametrize("text", ["", "h", "1x", "1h 30m", "-5s", "5s1"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="not a duration"):
        parse_duration(text)


@pytest.mark.parametrize(
    "text", ["shutdown_grace: [1]\n", "shutdown_grace: {a: 1}\n", "shutdown_grace: true\n"]
)
def test_a_yaml_value_of_the_wrong_shape_is_a_settings_error(tmp_path, text):
    with pytest.raises(SettingsError, match="invalid setting shutdown_grace .*not a valid value"):
        load_settings(DemoSettings, env={}, config_file=write(tmp_path, text))


def test_client_commands_and_up_read_their_own_config_variable(tmp_path):
    from waygate.core.clientcli import ClientSettings
    from waygate.supervisor import UpSettings

    service_file = write(tmp_path, "grpc_port: 7100\n")
    env = {"WAYGATE_CONFIG": str(service_file)}
    # A service's file in the environment does not break the client or up...
    assert load_settings(ClientSettings, env=env).timeout == 10.0
    assert load_settings(UpSettings, env=env).port_offset == 0
    # ...which read theirs from their own variables.
    client_file = tmp_path / "client.yaml"
    client_file.write_text("timeout: 3s\n")
    assert (
        load_settings(ClientSettings, env={"WAYGATE_CLIENT_CONFIG": str(client_file)}).timeout
        == 3.0
    )
