"""The processes Waygate is made of, their commands, default ports and, under
`waygate up`, their identities and the context their `up_arguments` get.

The port table of docs/architecture.md lives here once; the CLI, `waygate up` and the tests
read it from here. A component is implemented when its app module exists:
that module defines `Settings` (a settings dataclass) and
`async def setup(process, settings)`, which registers servers and tasks on a
`waygate.core.runtime.ServiceProcess`.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path


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
            ("data_port", 7005),
            ("front_port", 10263),
            ("admin_port", 9003),
        ),
        port_labels=(
            ("grpc_port", "gRPC waygate.tunnel.v1.AgentTunnel (agents)"),
            ("dial_port", "gRPC waygate.tunnel.v1.Tunnel (dialers)"),
            ("data_port", "tunnelled connections' data (agents, mTLS)"),
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


# ---------------------------------------------------------------- under `waygate up`

HOST = "127.0.0.1"
CERTS = "certs"  # the component every other one takes its certificate from
TRUST_DOMAIN = "waygate.local"
USER = "user"  # the local user's client certificate: .../sa/user
RESOLVER = "resolver"  # the component other processes watch routes and endpoints from
DEMO = "demo-backend"  # the demo echo backend's name in `up` output and logs
DEMO_PORT = 8090  # plus the port offset; the example route demo/echo points here
TUNNEL_AGENT = "tunnel-agent"  # its certificate names the edge node it serves, nothing else
EDGE_NODE = "edge-local"  # the node of the example route demo/hello's endpoint


def spiffe_id(name: str) -> str:
    return f"spiffe://{TRUST_DOMAIN}/ns/local/sa/{name}"


# The proxy's default certificate serves the example routes' TLS hosts on HTTPS
# (by name: certs' policy never issues a wildcard certificate, even to a token
# allowed every name under it).
EXAMPLE_TLS_HOSTS = ("echo-tls.localtest.me", "hello-tls.localtest.me", "resolver.localtest.me")


def process_sans(name: str) -> tuple[str, ...]:
    """SANs of a process under `up`: clients connect to 127.0.0.1, so the IP is one.

    Never a "localhost" DNS name: pkilint rejects it, and it names every machine.
    The proxy's also cover the example routes' hosts (its default HTTPS certificate).
    """
    if name == "proxy":
        return (
            f"dns:{name}.{TRUST_DOMAIN}",
            f"ip:{HOST}",
            *(f"dns:{host}" for host in EXAMPLE_TLS_HOSTS),
        )
    return (f"dns:{name}.{TRUST_DOMAIN}", f"ip:{HOST}")


def process_identity(name: str) -> tuple[str, tuple[str, ...]]:
    """The identity and extra SANs a process asks certs for under `up`.

    The tunnel agent's identity is its node's name and nothing else: the tunnel
    server takes the node from the certificate's one DNS name.
    """
    if name == TUNNEL_AGENT:
        return EDGE_NODE, ()
    return spiffe_id(name), process_sans(name)


@dataclass(frozen=True)
class UpContext:
    """What a component's `up_arguments` may use."""

    state_dir: Path
    port_offset: int
    host: str = HOST
    # What the demo tunnel agent may dial (`up --agent-allow`); empty: its default.
    agent_allow: tuple[str, ...] = ()
    # The proxy's sticky-cookie key, kept in the state directory; None: the proxy's own.
    sticky_key_file: Path | None = None

    def port(self, component_name: str, field: str) -> int:
        component = next(c for c in COMPONENTS if c.name == component_name)
        return component.port(field) + self.port_offset

    def address(self, component_name: str, field: str = "grpc_port") -> str:
        return f"{self.host}:{self.port(component_name, field)}"

    @property
    def demo_port(self) -> int:
        """The demo backend's HTTP port (the example route demo/echo's endpoint)."""
        return DEMO_PORT + self.port_offset
