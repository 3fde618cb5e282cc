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
    "warmpool.py",
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
