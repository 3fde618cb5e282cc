"""Issue 8: `waygate cert issue` never takes its token from the command line.

A command line is readable by every local user (/proc/PID/cmdline), so
`--token SECRET` is refused - exit 2, one line naming the alternatives, no
call made, nothing written - while `--token-file` and WAYGATE_CERTS_TOKEN
work against a real certs process.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.processes import certs_serve_argv, run_cli, start_service

pytestmark = pytest.mark.system

TOKEN = "token-test-" + "t" * 40
IDENTITY = "spiffe://waygate.local/ns/local/sa/user"


async def test_token_on_the_command_line_is_refused_and_file_or_env_work(tmp_path: Path) -> None:
    user = {"token": TOKEN, "name": "user", "allowed": [f"uri:{IDENTITY}"]}
    certs = await start_service(certs_serve_argv(tmp_path, [user]))
    try:
        issue = ("cert", "issue", "--addr", certs.grpc_address, "--identity", IDENTITY)

        code, out, err = await run_cli(
            *issue, "--token", TOKEN, "--out", str(tmp_path / "argv"), cwd=tmp_path
        )
        assert code == 2 and out == ""
        (line,) = err.strip().splitlines()
        assert line.startswith("waygate: --token is not accepted")
        assert "--token-file" in line and "WAYGATE_CERTS_TOKEN" in line
        assert TOKEN not in err
        assert not (tmp_path / "argv").exists()
        # Even with a valid token file beside it: the secret was already exposed.
        token_file = tmp_path / "user.token"
        token_file.write_text(TOKEN + "\n")
        token_file.chmod(0o600)
        code, _, err = await run_cli(
            *issue, "--token", TOKEN, "--token-file", str(token_file),
            "--out", str(tmp_path / "both"), cwd=tmp_path,
        )  # fmt: skip
        assert code == 2 and "--token is not accepted" in err

        code, out, err = await run_cli(
            *issue, "--token-file", str(token_file), "--out", str(tmp_path / "file"), cwd=tmp_path
        )
        assert code == 0, err
        assert (tmp_path / "file" / "cert.pem").is_file()

        code, _, err = await run_cli(
            *issue, "--out", str(tmp_path / "env"), cwd=tmp_path,
            env={"WAYGATE_CERTS_TOKEN": TOKEN},
        )  # fmt: skip
        assert code == 0, err
        assert (tmp_path / "env" / "cert.pem").is_file()

        code, _, err = await run_cli(*issue, "--out", str(tmp_path / "none"), cwd=tmp_path)
        assert code == 2
        assert (
            err.strip()
            == "waygate: give --token-file FILE or set WAYGATE_CERTS_TOKEN (never --token)"
        )
        code, _, err = await run_cli(
            *issue, "--token-file", str(tmp_path / "missing.token"),
            "--out", str(tmp_path / "none"), cwd=tmp_path,
        )  # fmt: skip
        assert code == 2 and "cannot read token file" in err and "Traceback" not in err
        assert not (tmp_path / "none").exists()
    finally:
        assert await certs.stop() == 0
