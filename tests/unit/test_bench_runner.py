"""`make bench`'s runner (bench/__main__.py): which benchmarks run and what options reach
them. The benchmarks themselves are not run here (minutes each); `subprocess.run` is
replaced by a recorder, the one stand-in."""

from __future__ import annotations

import subprocess
from pathlib import Path
from typing import Any

import pytest

import bench.__main__ as runner


class Recorded:
    def __init__(self) -> None:
        self.commands: list[list[str]] = []

    def __call__(self, command: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        self.commands.append(command)
        return subprocess.CompletedProcess(command, 0, stdout="report\n", stderr="")


@pytest.fixture
def recorded(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Recorded:
    record = Recorded()
    monkeypatch.setattr(runner.subprocess, "run", record)
    (tmp_path / "tunnel").mkdir()
    (tmp_path / "tunnel" / "__main__.py").write_text("")
    (tmp_path / "h2").mkdir()
    (tmp_path / "h2" / "__main__.py").write_text("")
    monkeypatch.setattr(runner, "HERE", tmp_path)
    return record


def test_options_after_the_separator_reach_the_one_benchmark(recorded: Recorded) -> None:
    assert runner.main(["tunnel", "--", "--mib", "256"]) == 0
    assert [c[2:] for c in recorded.commands] == [["bench.tunnel", "--mib", "256"]]


def test_without_names_every_benchmark_runs_without_options(recorded: Recorded) -> None:
    assert runner.main([]) == 0
    assert [c[2:] for c in recorded.commands] == [["bench.h2"], ["bench.tunnel"]]


@pytest.mark.parametrize("argv", [["tunnel", "h2", "--", "--mib", "1"], ["--", "--mib", "1"]])
def test_options_need_exactly_one_benchmark(
    recorded: Recorded, argv: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    assert runner.main(argv) == 2
    assert "exactly one benchmark" in capsys.readouterr().err
    assert recorded.commands == []


def test_an_unknown_benchmark_is_named(
    recorded: Recorded, capsys: pytest.CaptureFixture[str]
) -> None:
    assert runner.main(["nosuch"]) == 2
    assert "no benchmark named nosuch; have h2, tunnel" in capsys.readouterr().err
