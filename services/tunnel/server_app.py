"""`waygate tunnel serve`: settings and wiring of a tunnel-server replica.

Two mTLS gRPC listeners: agents on `grpc_port` (7003; node name from the
client certificate), dialers on `dial_port` (7004; identities in `dialers`),
and the data listener on `data_port` (7005; `waygate.tunnel.datapath`):
agents' data connections and raw dials, one TCP connection each.
With `resolver_address` the replica reports the nodes it holds to each
resolver replica listed there, one stream each (`waygate.tunnel.presence`). SIGTERM: the hub stops taking dials,
tells every agent to move (Drain with the grace), and the listeners give open
connections `shutdown_grace` before they are cut.

The replica set agents are told about is this replica plus `replicas`
(ids, e.g. the StatefulSet's pod names); agents hold one stream per id. The
set is static (read at start): every replica must be given the same set, or
agents told different sets by different replicas keep joining and leaving.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import socket
from typing import TYPE_CHECKING

from waygate.core.grpcserver import GrpcServer, ServiceRegistration
from waygate.core.identity import patterns_problem
from waygate.core.runtime import ServiceProcess
from waygate.core.settings import GrpcServerSettings, parse_duration, port_number, positive, setting
from waygate.tunnel import metrics, mux
from waygate.tunnel.front import FrontSettings, start_front
from waygate.tunnel.server import AgentTunnelServicer, Hub, TunnelServicer
from waygate.tunnel.v1 import tunnel_pb2_grpc

if TYPE_CHECKING:
    from waygate.components import UpContext
    from waygate.core.grpctls import RotatingChannel

log = logging.getLogger(__name__)


def _host_port(value: str) -> str | None:
    host, _, port = value.rpartition(":")
    if not host.strip("[]") or not port.isdigit() or not 1 <= int(port) <= 65535:
        return f"{value!r} is not host:port"
    return None


def _window_check(value: int) -> str | None:
    low, high = 4 * mux.MAX_CHUNK, 64 * 1024 * 1024
    return None if low <= value <= high else f"must lie between {low} and {high} bytes, not {value}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings(FrontSettings, GrpcServerSettings):  # front_*: the HTTPS front (front.py)
    grpc_port: int = setting(7003, help="agents' gRPC port (AgentTunnel)", check=port_number)
    dial_port: int = setting(7004, help="dialers' gRPC port (Tunnel)", check=port_number)
    admin_port: int = setting(
        9003, help="admin HTTP port (/metrics /healthz /readyz)", check=port_number
    )
    # Every Dial is a stream for the life of its TCP connection, and one agent
    # stream carries all of a node's: connections are never aged out (the grace
    # would cut them) and a dialer (the proxy, one identity) may hold many.
    max_connection_age: float = setting(
        0.0,
        help="close every connection after this long (GOAWAY); 0: never, since the "
        "grace would cut tunnelled connections",
        parse=parse_duration,
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    max_streams: int = setting(
        100_000, help="streams (tunnelled connections and agents) at once", check=positive
    )
    max_streams_per_peer: int = setting(
        50_000, help="streams at once per client identity (a dialer, an agent)", check=positive
    )
    max_concurrent_streams: int = setting(
        10_000,
        help="HTTP/2 MAX_CONCURRENT_STREAMS: tunnelled connections at once on one dialer "
        "connection (more wait client-side)",
        check=positive,
    )
    max_concurrent_rpcs: int = setting(
        110_000, help="outer bound on calls in flight (grpc core)", check=positive
    )
    server_id: str = setting("", help="this replica's id (e.g. the pod name); empty: the host name")
    replicas: tuple[str, ...] = setting(
        (),
        help="ids of the other replicas agents must also connect to, comma-separated; "
        "every replica must list the same set (its own id aside), as the StatefulSet does; "
        "read at start; empty: this replica is the only one",
    )
    advertise_address: str = setting(
        "", help="dialer-facing host:port reported to the resolver; empty: HOST:DIAL_PORT"
    )
    dialers: tuple[str, ...] = setting(
        (),
        help="client identities allowed to dial, comma-separated: SPIFFE IDs (trailing * "
        "matches any rest) or DNS names; empty: nobody (with mTLS)",
        check=patterns_problem,
    )
    dial_timeout: float = setting(
        10.0, help="longest time a dial may take", parse=parse_duration, check=positive
    )
    window: int = setting(
        mux.DEFAULT_WINDOW,
        help="per-connection flow-control window in bytes, each direction",
        check=_window_check,
    )
    data_port: int = setting(
        7005,
        help="data listener: agents' data connections and raw dials, one TCP connection "
        "per tunnelled connection (mTLS as the gRPC ports)",
        check=port_number,
    )
    data_path: bool = setting(
        True,
        help="run the data listener; off: every tunnelled byte rides the agents' Connect "
        "streams and the Dial streams (the fallback path)",
    )
    data_advertise_address: str = setting(
        "",
        help="host:port agents and dialers reach the data listener at; empty: the data port "
        "on the host they reached this server by (a balancer must forward it to the same "
        "replica pods as the gRPC ports)",
    )
    data_idle_timeout: float = setting(
        300.0,
        help="how long an agent's pooled data connection may wait for its dial (agents "
        "replace theirs sooner: their pool idle time)",
        parse=parse_duration,
        check=positive,
    )
    resolver_address: tuple[str, ...] = setting(
        (),
        help="host:port of every resolver replica to report presence to, comma-separated "
        "(each replica knows only the presence reported to it); empty: no reports",
    )
    resolver_replicas_service: str | None = setting(
        None,
        help="host:port of a headless Service whose every address is a resolver replica: "
        "presence to each, followed as replicas come and go (looked up every third of "
        "the presence lease); instead of, or besides, resolver_address",
        check=_host_port,
    )
    resolver_server_name: str | None = setting(
        None,
        help="name to verify in the resolvers' certificate when it differs from the host "
        "(with resolver_replicas_service: the name the replicas' certificate carries)",
    )
    presence_lease: float = setting(
        15.0,
        help="lease asked for on presence reports (a dead replica's presence ends within it)",
        parse=parse_duration,
        check=positive,
    )

    @property
    def replica_id(self) -> str:
        return self.server_id or socket.gethostname().lower()


async def setup(process: ServiceProcess, settings: Settings) -> None:
    hub = Hub(
        settings.replica_id,
        replicas=settings.replicas,
        window=settings.window,
        dial_timeout=settings.dial_timeout,
    )
    metrics.observe(hub)
    process.status.add("tunnel-server", metrics.status_provider(hub))
    authenticated = settings.certs_address is not None or settings.tls_client_ca_file is not None
    if not authenticated:
        log.warning(
            "no client certificates on this tunnel server: agents name their node in "
            "metadata and every dialer is allowed (development only)"
        )
    process.add_grpc_server(
        GrpcServer.from_settings(
            settings,
            [
                ServiceRegistration(
                    "waygate.tunnel.v1.AgentTunnel",
                    tunnel_pb2_grpc.add_AgentTunnelServicer_to_server,
                    AgentTunnelServicer(hub, require_certificate=authenticated),
                )
            ],
            # One credentials object per listener: gRPC refuses to share a dynamic one.
            credentials=await process.server_credentials(client_auth=True),
        )
    )
    dial_server = process.add_grpc_server(
        GrpcServer.from_settings(
            settings,
            [
                ServiceRegistration(
                    "waygate.tunnel.v1.Tunnel",
                    tunnel_pb2_grpc.add_TunnelServicer_to_server,
                    TunnelServicer(hub, dialers=settings.dialers, check_dialers=authenticated),
                )
            ],
            credentials=await process.server_credentials(client_auth=True),
            port=settings.dial_port,
        )
    )
    process.on_drain(lambda: hub.drain(settings.shutdown_grace))
    if settings.data_path:
        from waygate.tunnel.datapath import DataListener

        data = DataListener(
            hub,
            await process.server_ssl_context(client_auth=True),
            dialers=settings.dialers,
            check_dialers=authenticated,
            idle_timeout=settings.data_idle_timeout,
        )
        data_port = await data.start(settings.host, settings.data_port)
        process.on_stop(data.stop)
        hub.data_address = settings.data_advertise_address or f":{data_port}"
        log.info("tunnel data listener", extra={"data_port": data_port})

    host = settings.host if settings.host not in ("0.0.0.0", "::") else socket.gethostname()
    # One report stream per resolver replica: a replica knows only the presence
    # reported to it, so a report to one of several (through a Service) would
    # leave the others routing this replica's nodes nowhere.

    async def advertised() -> str:
        # The dial port is known once the listener is bound (port 0 in tests).
        while not dial_server.port:
            await asyncio.sleep(0.05)
        return settings.advertise_address or (
            f"[{host}]:{dial_server.port}" if ":" in host else f"{host}:{dial_server.port}"
        )

    for resolver_address in dict.fromkeys(settings.resolver_address):
        from waygate.tunnel.presence import PresenceReporter

        channel = await process.client_channel(
            resolver_address, server_name=settings.resolver_server_name
        )

        async def report(channel: RotatingChannel = channel) -> None:
            await PresenceReporter(
                hub, channel, address=await advertised(), lease=settings.presence_lease
            ).run()

        process.spawn(report(), f"tunnel-presence {resolver_address}")
    if settings.resolver_replicas_service is not None:
        from waygate.tunnel.presence import EveryReplica

        service = settings.resolver_replicas_service
        name = settings.resolver_server_name or service.rpartition(":")[0].strip("[]")

        async def report_to_every_replica() -> None:
            await EveryReplica(
                hub,
                lambda target: process.client_channel(target, server_name=name),
                service,
                address=await advertised(),
                lease=settings.presence_lease,
            ).run()

        process.spawn(report_to_every_replica(), f"tunnel-presence {service}")
    # The HTTPS front (yurttunnel parity): requests to NODE-ADDRESS:PORT through the hub.
    await start_front(process, settings, hub)
    await process.mark_ready()


def up_arguments(context: UpContext) -> list[str]:
    """Under `up`: report to the local resolver; the proxy and the local user may dial."""
    from waygate.components import USER, spiffe_id

    return [
        "--server-id",
        "tunnel-server-0",
        "--resolver-address",
        context.address("resolver"),
        "--dialers",
        ",".join((spiffe_id("proxy"), spiffe_id(USER))),
    ]
