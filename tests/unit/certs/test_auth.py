"""Static tokens file: 0600 only, validated entries, constant-time lookup."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from waygate.certs.auth import ADMIN_GROUP, StaticTokenAuthenticator, TokensFileError

TOKEN_A = "a" * 40
TOKEN_B = "b" * 40


def write(path: Path, data: object, mode: int = 0o600) -> Path:
    path.write_text(yaml.safe_dump(data))
    path.chmod(mode)
    return path


async def test_tokens_map_to_callers(tmp_path: Path) -> None:
    path = write(
        tmp_path / "tokens.yaml",
        {
            "tokens": [
                {"token": TOKEN_A, "name": "resolver", "allowed": ["dns:resolver.waygate.local"]},
                {"token": TOKEN_B, "name": "ops", "admin": True},
            ]
        },
    )
    auth = StaticTokenAuthenticator.from_file(path)
    resolver = await auth.authenticate(TOKEN_A)
    assert resolver is not None and resolver.name == "resolver"
    assert resolver.allowed == ("dns:resolver.waygate.local",) and not resolver.is_admin
    ops = await auth.authenticate(TOKEN_B)
    assert ops is not None and ops.is_admin and ADMIN_GROUP in ops.groups
    assert await auth.authenticate("c" * 40) is None
    assert await auth.authenticate(TOKEN_A[:-1]) is None
    assert await auth.authenticate("") is None


def test_group_readable_tokens_file_is_refused(tmp_path: Path) -> None:
    path = write(tmp_path / "t.yaml", {"tokens": []}, mode=0o640)
    with pytest.raises(TokensFileError, match=r"mode 0640.*chmod 600"):
        StaticTokenAuthenticator.from_file(path)


def test_missing_tokens_file(tmp_path: Path) -> None:
    with pytest.raises(TokensFileError, match="cannot read tokens file"):
        StaticTokenAuthenticator.from_file(tmp_path / "absent.yaml")


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"token": "short", "name": "x"}, "at least 32 characters"),
        ({"token": TOKEN_A}, "name must be"),
        ({"token": TOKEN_A, "name": "x", "allowed": "dns:x"}, "allowed must be a list"),
        ({"token": TOKEN_A, "name": "x", "allowed": ["host:x"]}, "must be dns:NAME"),
        ({"token": TOKEN_A, "name": "x", "admin": "yes"}, "admin must be true or false"),
        ({"token": TOKEN_A, "name": "x", "colour": "red"}, "unknown field 'colour'"),
    ],
)
def test_bad_entries_are_named(tmp_path: Path, entry: dict, message: str) -> None:
    path = write(tmp_path / "t.yaml", {"tokens": [entry]})
    with pytest.raises(TokensFileError, match=f"entry 1.*{message}"):
        StaticTokenAuthenticator.from_file(path)


def test_duplicate_tokens_are_refused(tmp_path: Path) -> None:
    path = write(
        tmp_path / "t.yaml",
        {"tokens": [{"token": TOKEN_A, "name": "x"}, {"token": TOKEN_A, "name": "y"}]},
    )
    with pytest.raises(TokensFileError, match="entry 2: token is the same"):
        StaticTokenAuthenticator.from_file(path)
