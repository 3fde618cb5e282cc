"""The processes Waygate is made of, their commands and default ports.

The port table of docs/architecture.md lives here once; the CLI, `waygate up` and the tests
read it from here. A component is implemented when its app module exists:
that module defines `Settings` (a settings dataclass) and
`async def setup(process, settings)`, which registers servers and tasks on a
`waygate.core.runtime.ServiceProcess`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class Component:
    name: str  # process name in logs and in `waygate up` output
    command: tuple[str, ...]  # the `waygate` subcommand that runs it
    app_module: str
    # Settings field -> default port (docs/architecture.md, "Contracts").
    ports: tuple[tuple[str, int], ...]
    # What each port is for, as shown by `waygate up`.
    port_labels: tuple[tuple[str, str], ...]

    @property
    def implemented(self) -> bool:
        try:
            return importlib.util.find_spec(self.app_module) is not None
        except ModuleNotFoundError:
            return False

    def port(self, field: str) -> int:
        return dict(self.ports)[field]


# In start order for `waygate up`: certs first, since every other process
# takes its certificate from it; the agent last, once the tunnel server is up.
COMPONENTS: tuple[Component, ...] = (
    Component(
        "certs",
        ("certs", "serve"),
        "waygate.certs.app",
        ports=(("grpc_port", 7002), ("admin_port", 9002)),
        port_labels=(("grpc_port", "gRPC waygate.certs.v1.Certs"), ("admin_port", "admin")),
    ),
    Component(
        "resolver",
        ("resolver", "serve"),
        "waygate.resolver.app",
        ports=(("grpc_port", 7001), ("admin_port", 9001)),
        port_labels=(("grpc_port", "gRPC waygate.resolver.v1.Resolver"), ("admin_port", "admin")),
    ),
    Component(
        "tunnel-server",
        ("tunnel", "serve"),
        "waygate.tunnel.server_app",
        ports=(
            ("grpc_port", 7003),
            ("dial_port", 7004),
            ("front_port", 10263),
            ("admin_port", 9003),
        ),
        port_labels=(
            ("grpc_port", "gRPC waygate.tunnel.v1.AgentTunnel (agents)"),
            ("dial_port", "gRPC waygate.tunnel.v1.Tunnel (dialers)"),
            ("front_port", "HTTPS front: NODE:PORT through the tunnel (mTLS)"),
            ("admin_port", "admin"),
        ),
    ),
    Component(
        "proxy",
        ("proxy", "serve"),
        "waygate.proxy.app",
        ports=(("http_port", 8080), ("https_port", 8443), ("admin_port", 9004)),
        port_labels=(("http_port", "HTTP"), ("https_port", "HTTPS"), ("admin_port", "admin")),
    ),
    Component(
        "tunnel-agent",
        ("tunnel", "agent"),
        "waygate.tunnel.agent_app",
        ports=(("admin_port", 9005),),
        port_labels=(("admin_port", "admin"),),
    ),
)


def by_command(command: tuple[str, ...]) -> Component:
    return next(c for c in COMPONENTS if c.command == command)
