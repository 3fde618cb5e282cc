"""`waygate tunnel agent`: settings and wiring of an edge agent.

The agent dials out to `server_address` (one address for every replica: a
LoadBalancer, a node port, HAProxy) and holds a stream to each replica the
servers report (`waygate.tunnel.agent`). Its node name is the DNS name its
certificate is issued for (`cert_identity`, e.g. `edge-1`; under Kubernetes
certs issues `dns:NODE` only for the node named by the pod's ServiceAccount
token), or `node` with static certificates. It dials only what `allow`
permits. Ready (/readyz) while it holds a stream to at least one replica.
"""

from __future__ import annotations

import dataclasses
import logging
import ssl
from collections.abc import Callable
from typing import TYPE_CHECKING

import grpc

from waygate.core.grpcclient import ClientTLS
from waygate.core.runtime import ServiceProcess
from waygate.core.settings import ProcessSettings, parse_duration, port_number, positive, setting
from waygate.tunnel import mux
from waygate.tunnel.agent import Agent
from waygate.tunnel.agent_grpc import GrpcConnector
from waygate.tunnel.allow import DEFAULT_ALLOW, AllowList, entries_problem
from waygate.tunnel.relay import client_context, rotating_client_context

if TYPE_CHECKING:
    from waygate.components import UpContext

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    # The agent role: certs issues the agent a clientAuth-only certificate, the only
    # kind the tunnel server registers as an agent (`waygate.tunnel.peers`).
    client_certificate_only = True

    admin_port: int = setting(
        9005, help="admin HTTP port (/metrics /healthz /readyz)", check=port_number
    )
    server_address: str = setting(
        help="host:port through which every tunnel-server replica is reached (agents' port)"
    )
    server_name: str | None = setting(
        None, help="name to verify in the servers' certificates when it differs from the host"
    )
    node: str = setting(
        "", help="node name (static certificates only; with certs it is the cert identity)"
    )
    allow: tuple[str, ...] = setting(
        DEFAULT_ALLOW,
        help="destinations the agent may dial, comma-separated NET:PORTS (NET: CIDR, address "
        "or 'node' for this host's addresses; PORTS: port, PORT+PORT or *)",
        check=entries_problem,
    )
    window: int = setting(
        mux.DEFAULT_WINDOW,
        help="per-connection flow-control window in bytes",
        check=lambda v: (
            None
            if 4 * mux.MAX_CHUNK <= v <= 64 * 1024 * 1024
            else f"must lie between {4 * mux.MAX_CHUNK} and {64 * 1024 * 1024}, not {v}"
        ),
    )
    dial_timeout: float = setting(
        10.0,
        help="longest connect when the server sets none",
        parse=parse_duration,
        check=positive,
    )
    data_connections: bool = setting(
        True,
        help="carry tunnelled connections on their own data connections when the server "
        "has a data listener; off: on the Connect stream only",
    )
    pool_size: int = setting(
        4,
        help="idle data connections kept open per server replica (a dial then needs no "
        "TLS handshake); 0: open one per dial",
        check=lambda v: None if 0 <= v <= 256 else f"must lie between 0 and 256, not {v}",
    )
    pool_idle: float = setting(
        60.0,
        help="how long an idle data connection is kept before it is replaced (below the "
        "servers' data_idle_timeout)",
        parse=parse_duration,
        check=positive,
    )
    reconnect_max: float = setting(
        10.0,
        help="longest pause between connection attempts (exponential backoff with jitter)",
        parse=parse_duration,
        check=positive,
    )

    @property
    def node_name(self) -> str:
        if self.cert_identity and "://" not in self.cert_identity:
            return self.cert_identity.lower()
        return self.node

    def validate(self) -> str | None:
        problem = super().validate()
        if problem:
            return problem
        if not self.node_name:
            return (
                "invalid setting node: give the node name (or a DNS cert_identity, which "
                "names the node)"
            )
        if self.node and self.certs_address is not None and self.node != self.node_name:
            return "invalid setting node: with certs the node is the cert identity"
        return None


async def setup(process: ServiceProcess, settings: Settings) -> None:
    from waygate.core.backoff import Backoff

    certificates = await process.certificates()
    ssl_context: Callable[[], ssl.SSLContext | None]
    if certificates is not None:
        from waygate.core.grpctls import client_credentials

        def credentials() -> grpc.ChannelCredentials | None:
            # Read at every connection attempt: a renewed certificate is used for new
            # streams while the open ones keep theirs.
            return client_credentials(certificates.rotator, certificates.trust)

        ssl_context = rotating_client_context(certificates.rotator, certificates.trust)

    elif settings.tls_cert_file is not None:
        static = ClientTLS(
            settings.tls_client_ca_file, settings.tls_cert_file, settings.tls_key_file
        ).credentials()
        static_context = client_context(
            settings.tls_client_ca_file.read_bytes() if settings.tls_client_ca_file else None,
            settings.tls_cert_file.read_bytes(),
            settings.tls_key_file.read_bytes() if settings.tls_key_file else None,
        )

        def credentials() -> grpc.ChannelCredentials | None:
            return static

        def ssl_context() -> ssl.SSLContext | None:
            return static_context

    else:
        log.warning("no TLS: the agent connects in plaintext and names its node in metadata")

        def credentials() -> grpc.ChannelCredentials | None:
            return None

        def ssl_context() -> ssl.SSLContext | None:
            return None

    agent = Agent(
        node=settings.node_name,
        server_address=settings.server_address,
        connector=GrpcConnector(
            settings.server_address, credentials, server_name=settings.server_name
        ),
        allow=AllowList(settings.allow),
        server_name=settings.server_name,
        window=settings.window,
        dial_timeout=settings.dial_timeout,
        backoff=Backoff(initial=0.2, maximum=settings.reconnect_max),
        ssl_context=ssl_context,
        data_connections=settings.data_connections,
        pool_size=settings.pool_size,
        pool_idle=settings.pool_idle,
    )

    def readiness(held: int) -> None:
        # Ready while at least one server replica can reach this node.
        if held:
            process.readiness.set_ready()
        else:
            process.readiness.set_not_ready("no stream to any tunnel server replica")

    agent.on_streams = readiness
    from waygate.tunnel import metrics

    process.status.add("tunnel-agent", metrics.agent_status_provider(agent))
    process.spawn(agent.run(), "tunnel-agent")

    async def become_ready() -> None:
        await agent.connected.wait()
        await process.mark_ready()

    process.spawn(become_ready(), "tunnel-agent-ready")


def up_arguments(context: UpContext) -> list[str]:
    """Under `up`: the local tunnel server, and the demo backend allowed beside the kubelet port."""
    return [
        "--server-address",
        context.address("tunnel-server"),
        "--allow",
        ",".join(context.agent_allow or (*DEFAULT_ALLOW, f"{context.host}:{context.demo_port}")),
    ]
