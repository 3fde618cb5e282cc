"""The `waygate` command: its command tree, placeholders, and one-line errors."""

from __future__ import annotations

import dataclasses
import socket
import subprocess
import sys

import pytest

from waygate import cli
from waygate.components import COMPONENTS


def run(capsys, *argv):
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse: --help and usage errors
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def test_help_lists_every_contract_command(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for command in (
        "up",
        "resolver",
        "certs",
        "proxy",
        "tunnel",
        "resolve",
        "routes",
        "cert",
        "health",
    ):
        assert f"    {command}" in out


@pytest.mark.parametrize("path", [("proxy", "serve"), ("tunnel", "agents")])
def test_commands_not_implemented_yet_say_so_and_fail(capsys, monkeypatch, path):
    # Every command has landed by now; the placeholder still guards the next one.
    # A service command whose app module is missing, and a client command whose
    # module is missing, are simulated by pointing at modules that do not exist.
    if path in {c.command for c in COMPONENTS}:
        component = next(c for c in COMPONENTS if c.command == path)
        missing = dataclasses.replace(component, app_module="waygate.proxy.not_landed")
        monkeypatch.setattr(
            cli, "COMPONENTS", tuple(missing if c is component else c for c in COMPONENTS)
        )
    else:
        _, help_text = cli.CLIENT_COMMANDS[path]
        monkeypatch.setitem(cli.CLIENT_COMMANDS, path, ("waygate.not_landed", help_text))
    code, out, err = run(capsys, *path, "--whatever")
    assert code == 2
    assert err == f"waygate: `waygate {' '.join(path)}` is not implemented yet\n"
    assert out == ""


def test_implemented_components_take_their_settings_as_flags(capsys):
    for component in COMPONENTS:
        if not component.implemented:
            continue
        code, out, _ = run(capsys, *component.command, "--help")
        assert code == 0, component
        assert "settings (flags > WAYGATE_* env > --config file)" in out
        for field, _ in component.ports:
            assert f"--{field.replace('_', '-')}" in out


def test_health_of_a_closed_port_is_one_line_and_exit_2(capsys):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the with-block ends
    code, out, err = run(capsys, "health", f"127.0.0.1:{port}", "--timeout", "2s", "--plaintext")
    assert code == 2
    assert err.startswith(f"waygate: cannot reach 127.0.0.1:{port}: UNAVAILABLE")
    assert err.count("\n") == 1 and out == ""


def test_bad_client_setting_is_exit_2(capsys):
    code, _, err = run(capsys, "health", "127.0.0.1:1", "--timeout", "soon")
    assert code == 2
    assert (
        err
        == "waygate: invalid setting timeout (from --timeout): not a duration: 'soon' (use e.g. 30s, 5m, 1h30m)\n"
    )


def test_up_refuses_ports_outside_the_range(capsys):
    code, _, err = run(capsys, "up", "--port-offset", "60000")
    assert code == 2
    assert err.startswith("waygate: invalid setting port_offset: 60000 puts ports outside 1..65535")


def test_unknown_command_is_a_usage_error(capsys):
    code, _, err = run(capsys, "frobnicate")
    assert code == 2
    assert "unknown command 'frobnicate'" in err


def test_console_entry_point_prints_no_traceback():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "waygate",
            "health",
            "127.0.0.1:1",
            "--timeout",
            "1s",
            "--plaintext",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    assert result.stderr.startswith("waygate: cannot reach 127.0.0.1:1")


def test_a_port_in_use_is_one_line_not_a_traceback():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        # The admin port is 0 too: a test never binds a default port (9001 may be busy).
        result = subprocess.run(
            [sys.executable, "-m", "waygate", "resolver", "serve", "--grpc-port", str(port),
             "--admin-port", "0"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"waygate: resolver: cannot listen on 127.0.0.1:{port}")
    assert "Traceback" not in result.stderr


def test_client_certificate_without_its_key_is_a_settings_error(capsys, tmp_path):
    cert = tmp_path / "cert.pem"
    cert.write_text("x")
    code, _, err = run(capsys, "health", "127.0.0.1:1", "--cert-file", str(cert))
    assert code == 2
    assert err == "waygate: invalid setting cert_file/key_file: give both or neither\n"


def test_up_with_an_unusable_state_directory_is_one_line(capsys, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    code, _, err = run(capsys, "up", "--state-dir", str(blocker / "state"))
    assert code == 1
    assert err.startswith("waygate: up: Not a directory")
