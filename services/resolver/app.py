"""`waygate resolver serve`: settings and wiring of the resolver process.

The process holds one Store, fed by the routes file (when given) and by
tunnel-server reports, and serves waygate.resolver.v1.Resolver on it. It is
ready once its sources have loaded successfully: a resolver that would answer
from an empty view while a file is merely invalid must not take traffic.
"""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import logging
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from waygate.core.files import write_file_atomically
from waygate.core.grpcclient import CLIENT_RECEIVE_BYTES
from waygate.core.grpcserver import GrpcServer
from waygate.core.identity import patterns_problem
from waygate.core.runtime import ServiceProcess
from waygate.core.settings import GrpcServerSettings, parse_duration, port_number, positive, setting
from waygate.resolver import metrics
from waygate.resolver.access import WriteAccess
from waygate.resolver.events import DEFAULT_CHUNK_BYTES
from waygate.resolver.filesource import EXAMPLE_ROUTES, FILE_MODE, FileSource
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.ingress_nginx.config import DNS_NAME, IngressNginx
from waygate.resolver.manifests import ManifestsSource
from waygate.resolver.schema import DEFAULT_MAX_ROUTES_PER_SOURCE
from waygate.resolver.server import ResolverServicer
from waygate.resolver.store import DEFAULT_HISTORY_LIMIT, DEFAULT_MAX_PENDING, Store
from waygate.resolver.tunnels import TunnelRegistry

if TYPE_CHECKING:
    from waygate.components import UpContext

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings(GrpcServerSettings):
    grpc_port: int = setting(7001, help="gRPC listen port", check=port_number)
    admin_port: int = setting(
        9001, help="admin HTTP port (/metrics /healthz /readyz)", check=port_number
    )
    routes_file: Path | None = setting(
        None,
        help="YAML file of services, endpoints and routes (reloaded on change); "
        "unset: start empty, routes read-only",
    )
    routes_poll_interval: float = setting(
        1.0,
        help="how often the routes file is checked for changes",
        parse=parse_duration,
        check=positive,
    )
    watch_history: int = setting(
        DEFAULT_HISTORY_LIMIT,
        help="changes kept for Watch resumes; an older resume version gets a full snapshot",
        check=positive,
    )
    watch_max_pending: int = setting(
        DEFAULT_MAX_PENDING,
        help="keys a slow Watch client may fall behind by before it gets a fresh snapshot",
        check=positive,
    )
    tunnel_lease: float = setting(
        30.0,
        help="lease of a ReportTunnels report that does not ask for one",
        parse=parse_duration,
        check=positive,
    )
    tunnel_lease_min: float = setting(
        5.0, help="shortest lease a tunnel server may ask for", parse=parse_duration, check=positive
    )
    tunnel_lease_max: float = setting(
        300.0,
        help="longest lease a tunnel server may ask for",
        parse=parse_duration,
        check=positive,
    )

    watch_heartbeat: float = setting(
        30.0,
        help="on a quiet Watch stream, send an empty Changes this often, carrying the "
        "current last-sync time (0: never). Keep it at most about 30s: waygate's own "
        "clients take a stream silent for 75s as lost and reconnect",
        parse=parse_duration,
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    tunnel_reporters: tuple[str, ...] = setting(
        (),
        help="client identities allowed to call ReportTunnels, comma-separated: SPIFFE IDs "
        "(a trailing * matches any rest) or DNS names; empty: nobody (with mTLS)",
        check=patterns_problem,
    )
    route_admins: tuple[str, ...] = setting(
        (),
        help="client identities allowed to call ApplyRoute and DeleteRoute, comma-separated: "
        "SPIFFE IDs (a trailing * matches any rest) or DNS names; empty: nobody (with mTLS)",
        check=patterns_problem,
    )
    route_readers: tuple[str, ...] = setting(
        (),
        help="client identities that receive route private keys (tls.key) over Watch, "
        "comma-separated, same forms as --route-admins (the proxy's); everyone else and "
        "every client without a certificate gets them redacted",
        check=patterns_problem,
    )
    max_routes_per_source: int = setting(
        DEFAULT_MAX_ROUTES_PER_SOURCE,
        help="routes one source may produce (the routes file, a manifests file or "
        "directory, the cluster's Route objects): a file with more is refused at the "
        "object that makes the first route past it, naming its line; "
        "Route objects past it (the youngest) are not served and their status says why",
        check=positive,
    )
    route_host_sharing: bool = setting(
        False,
        help="let routes of different namespaces share a host (each host and path still "
        "goes to its oldest route); default: a host belongs to the namespace of its oldest "
        "claim, whatever its kind (Route, Ingress, HTTPRoute, a Gateway listener's "
        "hostname), and other namespaces' claims on it are Conflicted, as in OpenShift",
    )
    manifests: Path | None = setting(
        None,
        help="Kubernetes manifests, a file or a directory of YAML as `kubectl apply -f` takes "
        "(Namespace, Service, EndpointSlice, TLS Secret, Route, the Gateway API kinds, "
        "Ingress, IngressClass), served without a cluster and reloaded on change",
    )
    gateway_addresses: tuple[str, ...] = setting(
        (),
        help="addresses (IPs or host names, comma-separated) reported as Gateways' "
        "status.addresses and Ingresses' status.loadBalancer",
    )
    gateway_listener_sharing: str = setting(
        "share",
        help="listeners of different Gateways on one port, which a proxy serving every "
        "Gateway merges: share (default: they share it, their routes merged by the spec's "
        "precedence; a protocol clash, or one HTTPS hostname with two certificates, is "
        "Conflicted), exclusive (also the same hostname is Conflicted: the older Gateway "
        "keeps it), separate (each proxy serves one Gateway, --gateway: no conflicts "
        "across Gateways)",
        choices=("share", "exclusive", "separate"),
    )
    kubernetes: bool = setting(
        False,
        help="watch Services, EndpointSlices and waygate.io Route objects in Kubernetes "
        "(in-cluster credentials unless --kubeconfig); routes are then read-only",
    )
    gateway_api: bool = setting(
        False,
        help="with --kubernetes: also watch the Gateway API and Ingress kinds and write their "
        "status (deploy/kustomize/components/gateway-api grants the RBAC)",
    )
    ingress_nginx: bool = setting(
        False,
        help="also serve the Ingresses ingress-nginx would (IngressClass controller "
        "k8s.io/ingress-nginx, or --ingress-nginx-class), their nginx.ingress.kubernetes.io "
        "annotations honoured, reported or refused (fail closed); with --kubernetes or "
        "--manifests",
    )
    ingress_nginx_class: str = setting(
        "nginx",
        help="with --ingress-nginx: the class served when no IngressClass of that name "
        "exists (spec.ingressClassName or kubernetes.io/ingress.class)",
        check=lambda v: None if DNS_NAME.fullmatch(v) else f"{v!r} is not a class name",
    )
    annotations_prefix: str = setting(
        "nginx.ingress.kubernetes.io",
        help="with --ingress-nginx: the annotation prefix, as ingress-nginx's flag",
        check=lambda v: None if DNS_NAME.fullmatch(v) else f"{v!r} is not a DNS name",
    )
    ingress_nginx_configmap: str = setting(
        "",
        help="with --ingress-nginx: NS/NAME of the controller ConfigMap (annotation "
        "defaults, snippets policy, HSTS); read live",
    )
    tcp_services_configmap: str = setting(
        "",
        help="with --ingress-nginx: NS/NAME of ingress-nginx's TCP services ConfigMap "
        '("PORT": "NS/SVC:PORT[:PROXY][:PROXY]"): each entry a port the proxies bind and '
        "relay to the Service's endpoints; read live",
    )
    default_ssl_certificate: str = setting(
        "",
        help="with --ingress-nginx: NS/NAME of the TLS Secret for Ingress TLS hosts "
        "without a secretName",
    )
    admission_webhook_port: int = setting(
        0,
        help="with --ingress-nginx --kubernetes: HTTPS port of the ValidatingAdmissionWebhook "
        "for Ingress (POST /validate, the process's certificate); 0: off",
        check=port_number,
    )
    kubeconfig: str = setting("", help="kubeconfig file for --kubernetes; empty: in-cluster")
    kube_context: str = setting("", help="kubeconfig context; empty: the current one")
    kube_namespace: str = setting("", help="only this namespace; empty: every namespace")
    kube_edge_nodes: str = setting(
        "",
        help="nodes (comma-separated) whose endpoints are reachable only through a tunnel",
    )
    status_lease: str = setting(
        "",
        help="NS/NAME of the coordination.k8s.io Lease that elects the replica writing "
        "Route objects' status (their conditions) with --kubernetes; empty: not written",
    )

    def validate(self) -> str | None:
        problem = super().validate()
        if problem:
            return problem
        if self.kubernetes and self.routes_file is not None:
            return (
                "invalid setting routes_file: with --kubernetes, services and routes come "
                "from the cluster; give one source, not both"
            )
        if self.status_lease and (not self.kubernetes or "/" not in self.status_lease):
            return "invalid setting status_lease: NS/NAME, and only with --kubernetes"
        if not self.kubernetes and (self.kubeconfig or self.kube_namespace or self.kube_edge_nodes):
            return "invalid setting kubeconfig/kube_*: these need --kubernetes"
        if self.kubernetes and self.manifests is not None:
            return (
                "invalid setting manifests: with --kubernetes, objects come from the "
                "cluster; give one source, not both"
            )
        problem = self.ingress_nginx_problem()
        if problem:
            return problem
        if self.manifests is not None and not self.manifests.exists():
            return f"invalid setting manifests: {self.manifests} does not exist"
        if self.routes_file is not None and not self.routes_file.is_file():
            return f"invalid setting routes_file: {self.routes_file} is not a readable file"
        if not self.tunnel_lease_min <= self.tunnel_lease <= self.tunnel_lease_max:
            return (
                "invalid setting tunnel_lease: must lie between tunnel_lease_min "
                f"({self.tunnel_lease_min}s) and tunnel_lease_max ({self.tunnel_lease_max}s)"
            )
        return None

    def ingress_nginx_problem(self) -> str | None:
        try:
            self.ingress_nginx_settings()
        except ValueError as exc:
            return f"invalid setting {exc}"
        return None

    def ingress_nginx_settings(self) -> IngressNginx | None:
        """The --ingress-nginx flags, checked (ValueError naming the flag)."""
        return IngressNginx.from_settings(self)


def watch_bounds(max_message_bytes: int) -> tuple[int, int]:
    """(snapshot chunk, Changes event) bounds for a server whose message limit
    is `max_message_bytes`.

    Capped at what clients receive (gRPC's default 4 MiB): a larger server limit
    must not produce events no client can read. Chunks stay well under the cap; a
    Changes event may use most of it (what is larger becomes a chunked snapshot).
    """
    limit = min(max_message_bytes, CLIENT_RECEIVE_BYTES)
    return min(DEFAULT_CHUNK_BYTES, limit // 4), limit - limit // 8


async def setup(process: ServiceProcess, settings: Settings) -> None:
    store = Store(history_limit=settings.watch_history, share_hosts=settings.route_host_sharing)
    tunnels = TunnelRegistry(
        store,
        default_lease=settings.tunnel_lease,
        min_lease=settings.tunnel_lease_min,
        max_lease=settings.tunnel_lease_max,
    )
    file_source = None
    if settings.routes_file is not None:
        file_source = FileSource(
            store,
            settings.routes_file,
            poll_interval=settings.routes_poll_interval,
            max_routes=settings.max_routes_per_source,
        )
    board = StatusBoard()
    manifests_source = None
    if settings.manifests is not None:
        manifests_source = ManifestsSource(
            store,
            board,
            settings.manifests,
            poll_interval=settings.routes_poll_interval,
            addresses=settings.gateway_addresses,
            sharing=settings.gateway_listener_sharing,
            ingress_nginx=settings.ingress_nginx_settings(),
            max_routes=settings.max_routes_per_source,
        )
    kube_source = None
    if settings.kubernetes:
        # Imported only in Kubernetes mode: the client library is heavy to load.
        from waygate.resolver.gateway.kube import GatewayObjects
        from waygate.resolver.kube import KubernetesSource, kube_configuration, parse_node_list

        configuration = kube_configuration(settings.kubeconfig, settings.kube_context)
        gateway_objects = (
            GatewayObjects(
                store,
                board,
                addresses=settings.gateway_addresses,
                sharing=settings.gateway_listener_sharing,
                ingress_nginx=settings.ingress_nginx_settings(),
            )
            if settings.gateway_api or settings.ingress_nginx
            else None
        )
        kube_source = KubernetesSource(
            store,
            configuration,
            namespace=settings.kube_namespace or None,
            edge_nodes=parse_node_list(settings.kube_edge_nodes),
            max_routes=settings.max_routes_per_source,
            gateway=gateway_objects,
        )
        if settings.admission_webhook_port and gateway_objects is not None:
            from waygate.resolver.ingress_nginx.webhook import start_webhook

            await start_webhook(process, settings, gateway_objects.objects.of)
    metrics.observe(store, file_source)
    from waygate.resolver import page

    process.status.add("resolver", page.provider(store, board))
    access = WriteAccess(
        tunnel_reporters=settings.tunnel_reporters,
        route_admins=settings.route_admins,
        route_readers=settings.route_readers,
        # Client certificates are asked for exactly in these two cases
        # (ServiceProcess.server_credentials); otherwise there is no identity.
        authenticated=settings.certs_address is not None or settings.tls_client_ca_file is not None,
    )
    if access.unauthenticated_warning:
        log.warning(access.unauthenticated_warning)
    else:
        for name, allowed in (
            ("tunnel_reporters", access.tunnel_reporters),
            ("route_admins", access.route_admins),
        ):
            if not allowed:
                log.warning("%s is empty: its write RPCs are refused to every client", name)
        if not access.route_readers:
            log.warning(
                "route_readers is empty: no Watch client receives route private keys, "
                "so the proxy cannot serve routes' own certificates"
            )
    chunk_bytes, event_bytes = watch_bounds(settings.max_message_bytes)
    servicer = ResolverServicer(
        store,
        routes=file_source,
        gateways=board,
        tunnels=tunnels,
        access=access,
        watch_max_pending=settings.watch_max_pending,
        watch_heartbeat=settings.watch_heartbeat,
        watch_chunk_bytes=chunk_bytes,
        max_event_bytes=event_bytes,
    )
    process.add_grpc_server(
        GrpcServer.from_settings(
            settings,
            [servicer.registration()],
            credentials=await process.server_credentials(client_auth=True),
        )
    )

    async def release_tunnels() -> None:
        tunnels.close_all()

    process.on_stop(release_tunnels)

    async def become_ready() -> None:
        if file_source is not None:
            if not await file_source.reload():
                process.readiness.set_not_ready(f"routes file: {file_source.last_error}")
            while not file_source.loaded:
                await asyncio.sleep(file_source.poll_interval)
                await file_source.poll_async()
            process.spawn(file_source.run(), "routes-file")
        if manifests_source is not None:
            if not await manifests_source.reload():
                process.readiness.set_not_ready(f"manifests: {manifests_source.last_error}")
            while not manifests_source.loaded:
                await asyncio.sleep(manifests_source.poll_interval)
                await manifests_source.reload()
            process.spawn(manifests_source.run(), "manifests")
        if kube_source is not None:
            process.readiness.set_not_ready("waiting for the first list from Kubernetes")
            await kube_source.wait_synced()
        await process.mark_ready()
        # The loaded view is long-lived and acyclic: keep it out of the cyclic
        # collector's full passes, which otherwise stall the loop for tens of
        # milliseconds with a large store (visible as Watch latency spikes).
        gc.freeze()

    def end_streams() -> None:
        # Watch and ReportTunnels streams never finish by themselves: end them
        # with UNAVAILABLE when draining starts, so consumers reconnect
        # (elsewhere) and resume, and the stop need not wait out its grace.
        ended = store.end_subscriptions()
        tunnels.end_streams()
        log.info(
            "draining: ended watch streams",
            extra={"watches": ended, "tunnel_reports": tunnels.open_streams},
        )

    process.on_drain(end_streams)
    if kube_source is not None:
        process.spawn(kube_source.run(), "kubernetes-source")
        if settings.status_lease:
            _spawn_status_writer(
                process,
                settings,
                store,
                board if settings.gateway_api or settings.ingress_nginx else None,
                kube_source.invalid_routes,
                kube_source.synced.is_set,
            )
    process.spawn(become_ready(), "become-ready")


EXAMPLE_MANIFESTS = Path(__file__).parent / "examples" / "gateway.yaml"


def up_arguments(context: UpContext) -> list[str]:
    """`waygate up`: serve a copy of the example routes file kept in the state directory.

    The copy (not the packaged file) is what ApplyRoute writes to, and it
    survives restarts of `up`; delete it to start over from the example.
    Only the tunnel server may report tunnels, only the local user (the
    client certificate `up` makes) may change routes, and only the proxy
    receives route private keys.
    """
    from waygate.components import COMPONENTS, DEMO_PORT, USER, spiffe_id

    routes = context.state_dir / "routes.yaml"
    if not routes.exists():
        context.state_dir.mkdir(parents=True, exist_ok=True)
        # The demo backend moves with --port-offset; so do the example's endpoints on it.
        example = EXAMPLE_ROUTES.read_text().replace(
            f"targetPort: {DEMO_PORT}", f"targetPort: {context.demo_port}"
        )
        # So does the resolver's own gRPC port (the waygate/resolver-* routes).
        resolver = next(c for c in COMPONENTS if c.name == "resolver").port("grpc_port")
        example = example.replace(
            f"targetPort: {resolver}", f"targetPort: {context.port('resolver', 'grpc_port')}"
        )
        # 0600 from the start: ApplyRoute writes route TLS private keys into it.
        write_file_atomically(routes, example.encode(), FILE_MODE)
    # Beside it, Kubernetes manifests with a Gateway and an HTTPRoute to the demo
    # backend (gateway.localtest.me), also a copy the user may edit.
    manifests = context.state_dir / "gateway.yaml"
    if not manifests.exists():
        example = (
            EXAMPLE_MANIFESTS.read_text()
            .replace(f"targetPort: {DEMO_PORT}", f"targetPort: {context.demo_port}")
            .replace(f"port: {DEMO_PORT}}}", f"port: {context.demo_port}}}")
        )
        write_file_atomically(manifests, example.encode(), FILE_MODE)
    return [
        "--routes-file",
        str(routes),
        "--manifests",
        str(manifests),
        "--gateway-addresses",
        "127.0.0.1",
        "--tunnel-reporters",
        spiffe_id("tunnel-server"),
        "--route-admins",
        spiffe_id(USER),
        "--route-readers",
        spiffe_id("proxy"),
    ]


def _spawn_status_writer(
    process: ServiceProcess,
    settings: Settings,
    store: Store,
    board: StatusBoard | None,
    invalid_routes: Any,
    synced: Callable[[], bool],
) -> None:
    """The Route and Gateway API status writers and the Lease electing the one replica
    that runs them."""
    import kubernetes.client as k8s

    from waygate.core.kube import KubeAPI
    from waygate.core.leader import LeaderElector, default_identity
    from waygate.resolver.kube import SOURCE, kube_configuration
    from waygate.resolver.kube_status import LEADER, LEADER_TRANSITIONS, RouteStatusWriter

    namespace, _, name = settings.status_lease.partition("/")
    api = KubeAPI(k8s.ApiClient(kube_configuration(settings.kubeconfig, settings.kube_context)))
    elector = LeaderElector(
        api,
        namespace,
        name,
        identity=default_identity(),
        component="resolver",
        leader_gauge=LEADER,
        transitions=LEADER_TRANSITIONS,
    )
    writer = RouteStatusWriter(
        store,
        api,
        source=SOURCE,
        is_leader=elector.is_leader,
        invalid=invalid_routes,
        synced=synced,
    )
    process.spawn(elector.run(), "route-status-election")
    process.spawn(writer.run(), "route-status-writer")
    if board is not None:
        from waygate.resolver.gateway.kube import StatusWriter

        gateway_writer = StatusWriter(api, board, is_leader=elector.is_leader, synced=synced)
        process.spawn(gateway_writer.run(), "gateway-status-writer")
    if settings.ingress_nginx:
        from waygate.resolver.ingress_nginx.events import IngressEventWriter

        events = IngressEventWriter(store, api, is_leader=elector.is_leader, synced=synced)
        process.spawn(events.run(), "ingress-nginx-events")
    process.on_stop(_closing(api))


def _closing(api: Any) -> Any:
    async def close() -> None:
        api.close()

    return close
