"""The `waygate` command tree: --version, "did you mean", completion scripts, the
state-directory discovery and `-o` rendering (in-process; no server needed)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import yaml

from waygate.cli import build_parser, completion_script, main
from waygate.core.clientcli import (
    ClientSettings,
    NoStateDirectory,
    UpRecord,
    find_state_dir,
    render,
    resolve_address,
)


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("waygate ") and out.split()[1][0].isdigit()


@pytest.mark.parametrize(
    ("argv", "suggestion"),
    [
        (["rotes"], "did you mean 'routes'?"),
        (["cert", "rotate"], "did you mean 'rotate-ca'?"),
        (["routes", "--wach"], "did you mean '--watch'?"),
        (["cert", "inspect", "x.pem", "--outptu", "json"], "did you mean '--output'?"),
    ],
)
def test_unknown_commands_and_flags_get_a_suggestion(
    argv: list[str], suggestion: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert suggestion in capsys.readouterr().err


def complete(script: str, words: list[str]) -> list[str]:
    """What bash's completion function offers for `words` (the last one being typed)."""
    program = (
        script
        + f"\nCOMP_WORDS=({' '.join(repr(w) for w in words)}); COMP_CWORD={len(words) - 1}\n"
        + '_waygate; printf "%s\\n" "${COMPREPLY[@]}"\n'
    )
    result = subprocess.run(
        ["bash", "--norc", "-c", program], capture_output=True, text=True, timeout=30, check=True
    )
    return result.stdout.split()


def test_bash_completion_follows_the_command_tree() -> None:
    script = completion_script("bash", build_parser())
    assert complete(script, ["waygate", "ro"]) == ["routes"]
    assert complete(script, ["waygate", "cert", "ro"]) == ["rotate-ca"]
    assert sorted(complete(script, ["waygate", "routes", ""])) == ["apply", "delete", "get"]
    assert "--watch" in complete(script, ["waygate", "routes", "--w"])
    assert "--output" in complete(script, ["waygate", "routes", "get", "--o"])


def test_zsh_and_fish_scripts_name_the_same_commands() -> None:
    parser = build_parser()
    zsh = completion_script("zsh", parser)
    assert zsh.startswith("autoload -U +X bashcompinit") and "rotate-ca" in zsh
    fish = completion_script("fish", parser)
    assert "complete -c waygate -f -n '__fish_use_subcommand' -a '" in fish
    assert "__fish_seen_subcommand_from cert' -a 'issue bundle inspect status rotate-ca'" in fish


def test_the_state_directory_is_found_in_a_parent(tmp_path: Path) -> None:
    state = tmp_path / ".waygate"
    state.mkdir()
    deep = tmp_path / "a" / "b"
    deep.mkdir(parents=True)
    assert find_state_dir(deep) == state
    UpRecord("127.0.0.1", 100, 1, {}).write(state)
    record = UpRecord.read(state)
    assert record is not None and record.address(7001) == "127.0.0.1:7101"


def test_no_state_directory_says_how_to_point_at_one(tmp_path: Path) -> None:
    import argparse

    settings = ClientSettings(state_dir=None)
    args = argparse.Namespace(addr=None, default_port=7001)
    # The working directory of the test run may hold a .waygate: only ask
    # what happens when none is found.
    if find_state_dir() is None:
        with pytest.raises(NoStateDirectory, match="--state-dir DIR or WAYGATE_STATE_DIR"):
            resolve_address(args, settings)
    explicit = ClientSettings(state_dir=None, plaintext=True)
    assert resolve_address(args, explicit) == "127.0.0.1:7001"
    given = ClientSettings(state_dir=tmp_path)
    UpRecord("127.0.0.1", 200, 1, {}).write(tmp_path)
    assert resolve_address(args, given) == "127.0.0.1:7201"


def test_render_formats() -> None:
    document = {"routes": [{"name": "a"}]}
    assert json.loads(render(document, "json", lambda wide: "")) == document
    assert yaml.safe_load(render(document, "yaml", lambda wide: "")) == document
    assert render(document, "wide", lambda wide: f"wide={wide}") == "wide=True"
    assert render(document, "table", lambda wide: f"wide={wide}") == "wide=False"
