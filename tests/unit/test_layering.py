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


# ---------------------------------------------------------------- issue 28 item 8

SERVICE_PACKAGES = ("certs", "proxy", "resolver", "tunnel")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SERVICES).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["waygate", *parts])


def _imports(path: Path) -> set[str]:
    """Every waygate module `path` imports, at any depth (function bodies and
    TYPE_CHECKING blocks included): `from waygate.x import y` counts as
    waygate.x.y when that is a module, else as waygate.x."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("waygate"):
            for alias in node.names:
                candidate = node.module + "." + alias.name
                relative = Path(*candidate.split(".")[1:])
                if (SERVICES / relative).with_suffix(".py").exists() or (
                    SERVICES / relative
                ).is_dir():
                    names.add(candidate)
                else:
                    names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names if a.name.startswith("waygate"))
    return names


def _graph(package: str) -> dict[str, set[str]]:
    modules = {_module_name(path): _imports(path) for path in (SERVICES / package).rglob("*.py")}
    return {
        name: {i for i in imports if i in modules and i != name}
        for name, imports in modules.items()
    }


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of `graph` (empty: none), by depth-first search."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        stack.append(node)
        for follower in sorted(graph[node]):
            if state.get(follower) == 1:
                return [*stack[stack.index(follower) :], follower]
            if follower not in state:
                found = visit(follower)
                if found:
                    return found
        stack.pop()
        state[node] = 2
        return []

    for node in sorted(graph):
        if node not in state:
            found = visit(node)
            if found:
                return found
    return []


def test_the_proxy_has_no_import_cycle() -> None:
    # TYPE_CHECKING imports and imports inside functions count: a cycle dodged
    # by a lazy import is still a cycle.
    assert _cycle(_graph("proxy")) == []


def test_the_cycle_finder_finds_cycles() -> None:
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_no_proxy_class_is_over_600_lines() -> None:
    long = []
    for path in (SERVICES / "proxy").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                length = node.end_lineno - node.lineno + 1
                if length > 600:
                    long.append(f"{path.name}:{node.name} ({length} lines)")
    assert long == []


def test_core_imports_no_service() -> None:
    offenders = [
        f"{path.relative_to(SERVICES)} imports {name}"
        for path in (SERVICES / "core").rglob("*.py")
        for name in _imports(path)
        if name.split(".")[1] in (*SERVICE_PACKAGES, "supervisor", "cli", "check")
    ]
    assert offenders == []


def test_a_service_imports_another_only_through_its_client_surface() -> None:
    # A service's public surface for other services is its `client` module
    # (waygate.resolver.client re-exports the model types others need).
    offenders = []
    for package in SERVICE_PACKAGES:
        for path in (SERVICES / package).rglob("*.py"):
            for name in _imports(path):
                parts = name.split(".")
                other = parts[1] if len(parts) > 1 else ""
                if other in SERVICE_PACKAGES and other != package and parts[2:3] != ["client"]:
                    offenders.append(f"{path.relative_to(SERVICES)} imports {name}")
    assert offenders == []
