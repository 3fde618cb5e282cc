"""No service imports `waygate up`'s supervisor: the topology they need (ports,
identities, UpContext) lives in waygate.components (issue 17 item 9)."""

from __future__ import annotations

import ast
from pathlib import Path

SERVICES = Path(__file__).resolve().parents[2] / "services"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


def test_no_service_module_imports_the_supervisor() -> None:
    offenders = [
        str(path.relative_to(SERVICES))
        for path in SERVICES.rglob("*.py")
        if path.name != "supervisor.py"
        and path.relative_to(SERVICES).parts[0] not in ("cli.py",)
        and "waygate.supervisor" in imported_modules(path)
    ]
    assert offenders == []
