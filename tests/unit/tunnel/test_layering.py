"""gRPC stays in the tunnel's boundary modules (issue 19 item 5).

The agent's packet pump, the shared stream design, the allow-list, the peer
identity rule, presence reporting and the byte relay import no grpc: they are
driven through `agent.PacketStream` (gRPC: `agent_grpc`), the resolver's client
surface (`waygate.resolver.client`) and the boundary modules (`server`,
`client`, `agent_grpc`). Checked on the source, so a transitive
import through a shared helper (tracing pulls in the OTLP exporter) does not hide
a direct one.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import waygate.tunnel

TUNNEL = Path(waygate.tunnel.__file__).parent
GRPC_FREE = (
    "agent.py",
    "mux.py",
    "allow.py",
    "peers.py",
    "presence.py",
    "relay.py",
    "selection.py",
    "warmpool.py",
    "wire.py",
)


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


@pytest.mark.parametrize("module", GRPC_FREE)
def test_the_module_imports_no_grpc(module: str) -> None:
    imported = imported_modules(TUNNEL / module)
    assert not {
        name
        for name in imported
        if name == "grpc" or name.startswith("grpc.") or name.endswith("_pb2_grpc")
    }


def test_the_check_sees_an_import() -> None:
    assert "grpc" in imported_modules(TUNNEL / "agent_grpc.py")


def private_names_of_other_modules(path: Path) -> set[str]:
    """`from waygate.tunnel.X import _name`, and `X._name` where X is a tunnel module
    imported by name: another module's private names used here."""
    tree = ast.parse(path.read_text())
    modules: set[str] = set()  # local names bound to waygate.tunnel modules
    used: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("waygate."):
            for alias in node.names:
                if alias.name.startswith("_"):
                    used.add(f"{node.module}.{alias.name}")
                elif node.module == "waygate.tunnel":
                    modules.add(alias.asname or alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.startswith("waygate.") and alias.asname:
                    modules.add(alias.asname)
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and isinstance(node.value, ast.Name)
            and node.value.id in modules
        ):
            used.add(f"{node.value.id}.{node.attr}")
    return used


@pytest.mark.parametrize("module", sorted(p.name for p in TUNNEL.glob("*.py")))
def test_no_module_uses_another_modules_private_names(module: str) -> None:
    """Issue 28 item 7: what one module shares with another is public (datapath used
    server's private queue markers; they are `server.EOF`, `CLOSED`, `LOST` now)."""
    assert private_names_of_other_modules(TUNNEL / module) == set()


def test_the_private_name_check_sees_a_use(tmp_path: Path) -> None:
    source = tmp_path / "user.py"
    source.write_text(
        "from waygate.tunnel.server import _EOF\n"
        "from waygate.tunnel import server as tunnel_server\n"
        "x = tunnel_server._CLOSED\n"
    )
    assert private_names_of_other_modules(source) == {
        "waygate.tunnel.server._EOF",
        "tunnel_server._CLOSED",
    }
