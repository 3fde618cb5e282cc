"""`waygate proxy serve`: settings and wiring of the HTTP proxy process.

The process watches the resolver (`waygate.resolver.client.ResolverWatch`,
one stream, no RPC per request), builds every table of a view at once
(`waygate.proxy.view.ProxyView`) inside the watch's `on_view` callback and
swaps it whole (so a change applies to the next request), and
serves HTTP/1.1 on `http_port` through `waygate.proxy.server`. It is ready
once the first complete resolver snapshot has been applied; while the
resolver is away it keeps serving the last table. SIGTERM drains: the
listener stops accepting, in-flight exchanges get `shutdown_grace`, idle
keep-alive connections close at once (`waygate.core.runtime.Listener`).

`https_port` serves TLS routes (`waygate.proxy.tls`: the certificate by SNI
among the routes' own, else the proxy's default certificate, from certs or
`--default-certificate/--default-key`, else one generated at start); it is
bound whenever the proxy runs. Reencrypt routes go through
`waygate.proxy.upstream_tls`. Both ports serve HTTP/2 beside HTTP/1.1
(`waygate.proxy.http2`: ALPN h2 on HTTPS, h2c with prior knowledge on HTTP),
and routes whose backends speak HTTP/2 or gRPC are forwarded over HTTP/2
(`waygate.proxy.h2upstream`).
`--workers N` runs N processes on the same port (SO_REUSEPORT),
each with its own resolver watch; the parent keeps the admin port and shows
every worker's metrics on its /metrics, labelled `worker` (`waygate.core.workers`,
the group every service's `--workers` uses).
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import os
import secrets
import socket
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import REGISTRY

from waygate.core.errors import FailedPrecondition, Unavailable
from waygate.core.runtime import ServiceProcess
from waygate.core.settings import (
    ProcessSettings,
    parse_duration,
    port_number,
    positive,
    setting,
)
from waygate.proxy import access, backendcerts
from waygate.proxy.bodybuffer import BufferLimits
from waygate.proxy.http2 import H2Collector, H2Limits
from waygate.proxy.metrics import ProxyCollector, ProxyMetrics
from waygate.proxy.routing import Defaults
from waygate.proxy.server import Limits, ProxyServer
from waygate.proxy.upstream import Dialer
from waygate.proxy.view import ProxyView, ViewSettings

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

    from waygate.core.grpctls import RotatingChannel
    from waygate.resolver.client import ResolverWatch

log = logging.getLogger(__name__)


def _at_least_one(value: int) -> str | None:
    return None if value >= 1 else f"must be at least 1, not {value}"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Settings(ProcessSettings):
    """Flags of `waygate proxy serve` (each also WAYGATE_<NAME> or a YAML key).

    Per-route overrides of the timeouts come from the route's `timeouts`
    (connect, client, server, httpRequest, keepAlive, tunnel); these flags are
    the defaults. The X-Forwarded-*/Forwarded mode is the route's own
    `forwardedHeaders` (append unless the route says otherwise).
    """

    http_port: int = setting(8080, help="HTTP listen port", check=port_number)
    https_port: int = setting(
        8443,
        help="HTTPS listen port for TLS routes, h2 and http/1.1 by ALPN (always bound; "
        "without a default certificate, names no route has get a generated one)",
        check=port_number,
    )
    default_certificate: Path | None = setting(
        None,
        help="PEM certificate chain served on HTTPS when no route certificate matches the "
        "SNI (re-read when it changes); unset: the proxy's certificate from certs",
    )
    default_key: Path | None = setting(
        None, help="PEM private key of --default-certificate (a 0600 file)"
    )
    gateway: str = setting(
        "",
        help="serve only this Gateway's listeners (NS/NAME); empty: every Gateway of "
        "Waygate's GatewayClasses, merged by port and hostname, and every Ingress",
    )
    listener_ports: str = setting(
        "",
        help="Gateway listener port -> local port, comma-separated (80=8080,443=8443); a "
        "local port must be this proxy's HTTP or HTTPS port. Empty: 80 -> the HTTP port, "
        "443 -> the HTTPS port",
    )
    remote_extra_fields: str = setting(
        "",
        help="client-certificate fields auth-proxy routes pass on as X-Remote-Extra-<Field>: "
        "a comma list of ou, email, dns, uri, serial",
    )
    admin_port: int = setting(
        9004, help="admin HTTP port (/metrics /healthz /readyz)", check=port_number
    )
    resolver_address: tuple[str, ...] = setting(
        ("127.0.0.1:7001",),
        help="host:port of the resolver whose routes this proxy serves; several replicas "
        "comma-separated: the Watch takes the next one after each lost stream, and "
        "Gateway listener reports go to each",
        check=lambda addresses: None if addresses else "give at least one address",
    )
    resolver_server_name: str | None = setting(
        None, help="name to verify in the resolver's certificate when it differs from the host"
    )
    workers: int = setting(
        1, help="processes serving the HTTP port together (SO_REUSEPORT)", check=_at_least_one
    )
    worker: bool = setting(
        False,
        help="internal: run as one worker of a --workers group (SO_REUSEPORT listener, "
        "metrics reported to the parent on stdout)",
    )
    max_connections: int = setting(
        10000, help="client connections open at once per worker; more are closed", check=positive
    )
    digest_nonces: int = setting(
        16384,
        help="ingress-nginx auth-type digest: nonces (and client addresses counted for "
        "evasion) kept per worker, about 250 bytes each; when full the expired, then "
        "the oldest are forgotten first",
        check=positive,
    )
    connect_timeout: float = setting(
        5.0, help="upstream connect timeout", parse=parse_duration, check=positive
    )
    client_timeout: float = setting(
        30.0,
        help="client inactivity while sending a request body",
        parse=parse_duration,
        check=positive,
    )
    server_timeout: float = setting(
        30.0,
        help="upstream inactivity before and during a response (504 before it starts)",
        parse=parse_duration,
        check=positive,
    )
    http_request_timeout: float = setting(
        10.0,
        help="time to receive a whole request head (408)",
        parse=parse_duration,
        check=positive,
    )
    keep_alive_timeout: float = setting(
        300.0,
        help="idle client keep-alive connections are closed after this",
        parse=parse_duration,
        check=positive,
    )
    tunnel_timeout: float = setting(
        3600.0,
        help="inactivity of an upgraded (WebSocket, SPDY), passthrough or TCP service connection",
        parse=parse_duration,
        check=positive,
    )
    tcp_services_max_connections: int = setting(
        1000,
        help="connections open at once per TCP service port (ingress-nginx's "
        "--tcp-services-configmap entries); more are closed on accept",
        check=positive,
    )
    tcp_services_drain: float = setting(
        30.0,
        help="a TCP service port gone from the view stops accepting; its connections "
        "are closed after this",
        parse=parse_duration,
        check=positive,
    )
    tcp_proxy_protocol_version: int = setting(
        1,
        help="PROXY protocol version sent to TCP service backends whose entry asks for it "
        "(1, as nginx sends, or 2); from clients both are read",
        check=lambda v: None if v in (1, 2) else f"must be 1 or 2, not {v}",
    )
    proxy_protocol: bool = setting(
        False,
        help="every connection to the HTTP and HTTPS ports (and Gateway listener ports) "
        "starts with a PROXY protocol header (v1 or v2) from the load balancer in front, "
        "and the client address is the header's (ingress-nginx's use-proxy-protocol); "
        "a connection without one is closed",
    )
    proxy_protocol_timeout: float = setting(
        5.0,
        help="with --proxy-protocol, a connection whose header is not whole after this "
        "is closed (ingress-nginx's proxy-protocol-header-timeout)",
        parse=parse_duration,
        check=positive,
    )
    upstream_max_idle: int = setting(
        64, help="idle keep-alive connections kept per endpoint", check=positive
    )
    upstream_idle_timeout: float = setting(
        15.0,
        help="idle upstream connections are closed after this",
        parse=parse_duration,
        check=positive,
    )
    tunnel_pool_size: int = setting(
        4,
        help="warm connections kept open to each tunnel-server replica's data listener, "
        "TLS done, so a tunnelled connection costs a round trip instead of a handshake; "
        "0: one new connection per dial",
        check=lambda v: None if 0 <= v <= 256 else f"must lie between 0 and 256, not {v}",
    )
    tunnel_pool_idle: float = setting(
        30.0,
        help="how long a warm tunnel connection waits unused before it is closed (and how "
        "long after the last dial the pool is kept full)",
        parse=parse_duration,
        check=positive,
    )
    tunnel_end_to_end: bool = setting(
        False,
        help="TLS from the proxy to the tunnel agent, the tunnel server copying ciphertext: "
        "the cheapest path for bulk transfers, a handshake more per new upstream "
        "connection (and no request sent with the dial); relayed where it cannot be had",
    )
    access_log_rate: int = setting(
        100,
        help="JSON access-log lines per second at most (the rest are counted in one "
        "summary line per second); 0: none",
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    unavailable_page: Path | None = setting(
        None,
        help="HTML file served with 503 when no route matches or no endpoint is ready; "
        "{reason} in it is replaced by the reason",
    )
    max_connections_per_source: int = setting(
        1000,
        help="client connections from one address at once (at the cap its oldest idle "
        "keep-alive connection is closed; with none idle, 503)",
        check=positive,
    )
    max_small_chunks: int = setting(
        1024,
        help="chunks a chunked request body may have beyond one per 256 bytes of payload "
        "(more: 400; tiny chunks cost CPU each)",
        check=positive,
    )
    max_connections_per_endpoint: int = setting(
        1024,
        help="upstream connections to one endpoint at once, HTTP/1.1 (busy and idle) and "
        "HTTP/2 (0: no bound)",
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    endpoint_queue: int = setting(
        1024,
        help="requests that may wait for a connection to an endpoint at its bound (more: 503; "
        "a wait ends at the server timeout)",
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    min_request_body_rate: int = setting(
        1024,
        help="bytes/s a request body must average while the upstream takes it, checked "
        "after --request-body-grace (slower: 408); 0: no minimum",
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    request_body_grace: float = setting(
        10.0,
        help="time a request body has before the minimum rate applies",
        parse=parse_duration,
        check=positive,
    )
    request_buffer_memory: int = setting(
        64 * 1024,
        help="request body bytes held in memory per request while it is taken in before an "
        "upstream is used (request buffering, a route's requestBuffering); more goes to a "
        "temporary file",
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    request_buffer_memory_total: int = setting(
        64 * 1024 * 1024,
        help="request body bytes held in memory for every buffered request of the process "
        "together; past it bodies go to temporary files",
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    request_buffer_max: int = setting(
        64 * 1024 * 1024,
        help="the largest request body buffered (memory and file; larger: 413, or turn the "
        "route's requestBuffering off to stream it)",
        check=positive,
    )
    request_buffer_files_total: int = setting(
        1024 * 1024 * 1024,
        help="request body bytes in the temporary files of every buffered request of the "
        "process together (past it: 503; keep it under the directory's room)",
        check=positive,
    )
    request_buffer_dir: Path | None = setting(
        None,
        help="directory of the buffered bodies' temporary files (mode 0600, unlinked at "
        "once); unset: the system's temporary directory",
    )
    max_informational: int = setting(
        16,
        help="informational (1xx) responses an upstream may send before its final one, per "
        "request (more: 502)",
        check=positive,
    )
    max_informational_bytes: int = setting(
        65536,
        help="bytes of informational (1xx) response heads per request (more: 502)",
        check=positive,
    )
    sticky_key_file: Path | None = setting(
        None,
        help="file with the secret that keys sticky-cookie values (shared by replicas so "
        "a cookie survives a restart); unset: a random key per process group",
    )
    # HTTP/2 (h2 on the HTTPS port by ALPN, h2c with prior knowledge on the HTTP
    # port, and to backends that ask for it): waygate.proxy.http2.H2Limits.
    h2_max_concurrent_streams: int = setting(
        100, help="HTTP/2 streams open at once per connection (either side)", check=positive
    )
    h2_stream_window: int = setting(
        256 * 1024,
        help="HTTP/2 receive window per stream, bytes (what a peer may send ahead)",
        check=lambda v: None if 65535 <= v < 2**31 else f"must be 65535..2^31-1, not {v}",
    )
    h2_connection_window: int = setting(
        1024 * 1024,
        help="HTTP/2 receive window per connection, bytes",
        check=lambda v: None if 65535 <= v < 2**31 else f"must be 65535..2^31-1, not {v}",
    )
    h2_max_header_list_size: int = setting(
        32 * 1024,
        help="HTTP/2 decoded header list size, bytes (larger blocks end the connection)",
        check=positive,
    )
    h2_control_frames: int = setting(
        200,
        help="HTTP/2 control frames (PING, SETTINGS, PRIORITY, WINDOW_UPDATE, RST_STREAM, "
        "empty DATA not ending its stream) allowed beyond twice the useful frames, counted "
        "frame by frame, then GOAWAY ENHANCE_YOUR_CALM",
        check=positive,
    )
    h2_control_frame_rate: int = setting(
        100,
        help="HTTP/2 control frames allowed per second of a connection's life beyond "
        "--h2-control-frames (keep-alive PINGs)",
        check=lambda v: None if v >= 0 else f"must be 0 or more, not {v}",
    )
    h2_premature_resets: int = setting(
        100,
        help="HTTP/2 streams a client may reset before their answer (once past half the "
        "streams it opened), then GOAWAY ENHANCE_YOUR_CALM (rapid reset)",
        check=positive,
    )
    h2_stream_buffer: int = setting(
        256 * 1024,
        help="HTTP/2 response bytes held per stream while the client's window is shut; "
        "past it the backend is paused",
        check=positive,
    )
    h2_connection_buffer: int = setting(
        1024 * 1024,
        help="HTTP/2 response bytes held for all of one connection's streams (its windows "
        "shut or its socket backed up); past it every stream's backend is paused",
        check=positive,
    )
    h2_held_total: int = setting(
        64 * 1024 * 1024,
        help="HTTP/2 response bytes held for all clients of the process together; a stream "
        "that would pass it is reset (ENHANCE_YOUR_CALM)",
        check=positive,
    )
    h2_min_data_payload: int = setting(
        256,
        help="HTTP/2 DATA frames with some payload below this (not ending their stream) are "
        "small: charged to their connection's read rate (--h2-small-data-rate)",
        check=lambda v: None if 0 <= v <= 16384 else f"must be 0..16384, not {v}",
    )
    h2_small_data_rate: int = setting(
        5000,
        help="HTTP/2 small DATA frames a client connection may send a second; faster, its "
        "reads pause until its bucket refills (slowed, not ended)",
        check=positive,
    )
    h2_small_data_burst: int = setting(
        5000,
        help="HTTP/2 small DATA frames a client connection may send at once beyond "
        "--h2-small-data-rate (its bucket's size; a new connection's is full)",
        check=positive,
    )

    def limits(self) -> Limits:
        """The data plane's bounds (waygate.proxy.server.Limits) from these settings."""
        return Limits(
            max_connections_per_source=self.max_connections_per_source,
            max_small_chunks=self.max_small_chunks,
            max_connections_per_endpoint=self.max_connections_per_endpoint,
            endpoint_queue=self.endpoint_queue,
            min_request_body_rate=self.min_request_body_rate,
            request_body_grace=self.request_body_grace,
            max_informational=self.max_informational,
            max_informational_bytes=self.max_informational_bytes,
            request_buffer=BufferLimits(
                memory_per_request=self.request_buffer_memory,
                memory_total=self.request_buffer_memory_total,
                max_body=self.request_buffer_max,
                directory=str(self.request_buffer_dir or ""),
                files_total=self.request_buffer_files_total,
            ),
        )

    def validate(self) -> str | None:
        problem = super().validate()
        if problem:
            return problem
        if self.unavailable_page is not None and not self.unavailable_page.is_file():
            return (
                f"invalid setting unavailable_page: {self.unavailable_page} is not a readable file"
            )
        if self.request_buffer_dir is not None and not self.request_buffer_dir.is_dir():
            return (
                f"invalid setting request_buffer_dir: {self.request_buffer_dir} is not a directory"
            )
        if self.sticky_key_file is not None and not self.sticky_key_file.is_file():
            return f"invalid setting sticky_key_file: {self.sticky_key_file} is not a readable file"
        if (self.default_certificate is None) != (self.default_key is None):
            return (
                "invalid setting default_certificate: set both default_certificate and default_key"
            )
        from waygate.proxy.tls import EXTRA_FIELDS

        unknown = set(self.extra_fields()) - set(EXTRA_FIELDS)
        if unknown:
            return (
                f"invalid setting remote_extra_fields: {', '.join(sorted(unknown))} "
                f"(known: {', '.join(EXTRA_FIELDS)})"
            )
        for name in ("default_certificate", "default_key"):
            path = getattr(self, name)
            if path is not None and not path.is_file():
                return f"invalid setting {name}: {path} is not a readable file"
        parts = self.gateway.split("/")
        if self.gateway and (len(parts) != 2 or not all(parts)):
            return f"invalid setting gateway: {self.gateway!r} is not NS/NAME"
        try:
            self.listener_sides()
        except ValueError as exc:
            return f"invalid setting listener_ports: {exc}"
        return None

    def listener_sides(self) -> dict[int, bool]:
        """Gateway listener port -> the side serving it (True: the HTTPS port)."""
        if not self.listener_ports.strip():
            return {80: False, 443: True}
        sides: dict[int, bool] = {}
        for item in self.listener_ports.split(","):
            listener, sep, local = item.strip().partition("=")
            if not sep or not listener.isdigit() or not local.isdigit():
                raise ValueError(f"{item.strip()!r} is not LISTENER=LOCAL (80=8080)")
            if not 0 < int(listener) < 65536:
                raise ValueError(f"listener port {listener} is outside 1..65535")
            if int(local) == self.http_port:
                sides[int(listener)] = False
            elif int(local) == self.https_port:
                sides[int(listener)] = True
            else:
                raise ValueError(
                    f"local port {local} is neither the HTTP port ({self.http_port}) nor "
                    f"the HTTPS port ({self.https_port}); other ports are not bound"
                )
        return sides

    def extra_fields(self) -> tuple[str, ...]:
        return tuple(f.strip().lower() for f in self.remote_extra_fields.split(",") if f.strip())

    def h2_limits(self) -> H2Limits:
        return H2Limits(
            max_concurrent_streams=self.h2_max_concurrent_streams,
            stream_window=self.h2_stream_window,
            connection_window=self.h2_connection_window,
            max_header_list_size=self.h2_max_header_list_size,
            control_frames=self.h2_control_frames,
            control_frame_rate=self.h2_control_frame_rate,
            premature_resets=self.h2_premature_resets,
            stream_buffer=self.h2_stream_buffer,
            connection_buffer=self.h2_connection_buffer,
            held_total=self.h2_held_total,
            min_data_payload=self.h2_min_data_payload,
            small_data_rate=self.h2_small_data_rate,
            small_data_burst=self.h2_small_data_burst,
        )

    def defaults(self) -> Defaults:
        return Defaults(
            connect_timeout=self.connect_timeout,
            client_timeout=self.client_timeout,
            server_timeout=self.server_timeout,
            http_request_timeout=self.http_request_timeout,
            keep_alive_timeout=self.keep_alive_timeout,
            tunnel_timeout=self.tunnel_timeout,
        )


class HttpListener:
    """The proxy's HTTP port as a runtime Listener (started after setup, drained on SIGTERM)."""

    def __init__(self, server: ProxyServer, host: str, port: int, reuse_port: bool) -> None:
        self.server = server
        self.host = host
        self.port = port
        self.reuse_port = reuse_port
        self.bound_port = 0

    async def start(self) -> None:
        self.bound_port = await self.server.start(self.host, self.port, reuse_port=self.reuse_port)
        log.info("proxy listening", extra={"http_port": self.bound_port})

    def stop_accepting(self) -> None:
        self.server.stop_accepting()

    async def drain(self, grace: float) -> None:
        await self.server.drain(grace)


def resolver_watch(
    channels: Sequence[RotatingChannel], on_view: Callable[[Any], None]
) -> ResolverWatch:
    """The proxy's one Watch stream, on the process's rotating channel to a resolver
    replica (several: each attempt takes the next, `in_turn`).

    Each stream borrows the channel with `lend()`, which holds it: a certificate
    renewal gives new calls a new channel, and the watch moves its stream there
    (make-before-break, resuming from the view held; `ResolverWatch`'s handover),
    so the Watch is neither re-synced at every renewal nor left on the retired
    channel. The watch closes what it was lent, which lets go of the hold; the
    process closes the channel itself when it stops."""
    from waygate.resolver.client import ResolverWatch, in_turn

    return ResolverWatch(in_turn([c.lend for c in channels]), on_view=on_view)


def _unregister(metrics: ProxyMetrics) -> Any:
    async def run() -> None:
        for collector in list(REGISTRY._collector_to_names):
            if isinstance(collector, ProxyCollector | H2Collector):
                REGISTRY.unregister(collector)

    return run


def _sticky_key(settings: Settings) -> bytes:
    if settings.sticky_key_file is not None:
        key = settings.sticky_key_file.read_bytes().strip()
        if len(key) < 16:
            raise FailedPrecondition("sticky_key_file must hold at least 16 bytes of secret")
        return key[:64]
    return secrets.token_bytes(32)


async def _tls_setup(process: ServiceProcess, settings: Settings, server: ProxyServer) -> Any:
    """The HTTPS listener (always) and the reencrypt step; returns the TLS front."""
    from waygate.proxy.passthrough import TlsFront
    from waygate.proxy.tls import DefaultCertificate, EdgeCertificates
    from waygate.proxy.upstream_tls import UpstreamTLS

    certificates = await process.certificates()
    default = None
    if settings.default_certificate is not None and settings.default_key is not None:
        default = DefaultCertificate.from_files(settings.default_certificate, settings.default_key)
    elif certificates is not None:
        default = DefaultCertificate.from_rotator(certificates.rotator)
        process.on_stop(_closer(default.close))

    def trust_pem() -> bytes | None:
        return certificates.trust.current.pem if certificates is not None else None

    def client_pem() -> tuple[bytes, bytes] | None:
        if certificates is None:
            return None
        held = certificates.rotator.current
        return held.chain_pem(), held.key_pem()

    upstream_tls = UpstreamTLS(
        trust_pem, client_pem, server.dialer.connect, on_untrusted=server.health.failed
    )
    if certificates is not None:
        process.on_stop(_closer(certificates.rotator.subscribe(upstream_tls.invalidate)))
        process.on_stop(_closer(certificates.trust.subscribe(upstream_tls.invalidate)))
    server.upstream_tls = upstream_tls
    if default is None:
        # The HTTPS port is served all the same: edge routes may carry their own
        # certificates, and a name no route has gets a generated certificate.
        log.info(
            "no default certificate (no certs, no --default-certificate): a generated "
            "self-signed one answers names no route has"
        )
        default = DefaultCertificate.self_signed()
    default.start(process.spawn)
    edge = EdgeCertificates(default, extra_fields=settings.extra_fields())
    front = TlsFront(server, edge, settings.host, settings.https_port, reuse_port=settings.worker)
    process.add_listener(front)
    return front


async def _start_workers(process: ServiceProcess, settings: Settings) -> None:
    """The parent of a --workers group (`waygate.core.workers`): it keeps the admin
    port and runs no listener. It reserves the HTTP port (and `--https-port 0`), so
    port 0 gives every worker the same one, and writes one sticky-cookie key (0600)
    so a cookie means the same endpoint in every worker."""
    import sys
    import tempfile

    from waygate.core.files import write_file_atomically
    from waygate.core.workers import WorkerGroup, reserve_port

    reservations = [reserve_port(settings.host, settings.http_port)]
    port = reservations[0].getsockname()[1]
    https_port = settings.https_port
    if https_port == 0:
        # A fixed HTTPS port is not reserved: workers bind it only with a certificate.
        reservations.append(reserve_port(settings.host, 0))
        https_port = reservations[1].getsockname()[1]
    key_dir: tempfile.TemporaryDirectory[str] | None = None
    key_file = settings.sticky_key_file
    if key_file is None:
        key_dir = tempfile.TemporaryDirectory(prefix="waygate-proxy-")
        key_file = Path(key_dir.name) / "sticky.key"
        write_file_atomically(key_file, secrets.token_hex(32).encode(), 0o600)

    async def release() -> None:
        for reservation in reservations:
            reservation.close()
        if key_dir is not None:
            key_dir.cleanup()

    process.on_stop(release)
    argv = [
        *sys.argv[1:],
        "--worker",
        "--workers",
        "1",
        "--http-port",
        str(port),
        "--https-port",
        str(https_port),
        "--admin-port",
        "0",
        "--sticky-key-file",
        str(key_file),
    ]
    group = WorkerGroup(
        process,
        name="proxy",
        count=settings.workers,
        argv=lambda index: argv,
        shutdown_grace=settings.shutdown_grace,
    )
    await group.start()
    log.info("proxy listening", extra={"http_port": port, "workers": settings.workers})


def _closer(close: Any) -> Any:
    async def run() -> None:
        close()

    return run


class ViewFanOut:
    """One resolver view into the one `view.ProxyView` the proxy serves from.

    `on_view` (the resolver watch's callback, on the loop): the Gateway
    listeners' own ports bound or closed for the view (`listeners.py`), then
    every table (HTTP routing, passthrough per front, certificates by SNI,
    listener sides, reencrypt routes) built once from the view and that
    listener set (`ProxyView.build`) and swapped whole (`ProxyServer.set_view`).
    `on_healed`: a listener port that could not be bound before now is: the
    last view is built again on the new listener set.
    """

    def __init__(self, server: ProxyServer, listeners: Any, settings: ViewSettings) -> None:
        self.server = server
        self.listeners = listeners  # listeners.GatewayListeners
        self.settings = settings
        self.last: Any = None

    def on_view(self, view: Any) -> None:
        self.last = view
        self._build(view)

    def on_healed(self) -> None:
        if self.last is not None:
            self._build(self.last)

    def _build(self, view: Any) -> None:
        # First: the own ports this view's Gateway listeners need, bound or closed.
        sides = self.listeners.sides(view.routes.values())
        settings = self.settings._replace(
            listener_ports=sides, own_tls_ports=frozenset(self.listeners.fronts())
        )
        server = self.server
        server.set_view(ProxyView.build(view, server.view, settings))


async def setup(process: ServiceProcess, settings: Settings) -> None:
    if settings.workers > 1 and not settings.worker:
        await _start_workers(process, settings)
        return
    metrics = ProxyMetrics()
    access.configure_digest(settings.digest_nonces)
    page = settings.unavailable_page.read_bytes() if settings.unavailable_page else b""
    cookie_key = _sticky_key(settings)
    defaults = settings.defaults()
    server = ProxyServer(
        defaults=defaults,
        dialer=Dialer(),
        metrics=metrics,
        cookie_key=cookie_key,
        max_connections=settings.max_connections,
        max_idle_per_endpoint=settings.upstream_max_idle,
        pool_idle_timeout=settings.upstream_idle_timeout,
        unavailable_page=page,
        listen_port=settings.http_port,
        access_log_rate=settings.access_log_rate,
        limits=settings.limits(),
        # HTTP/2: the listeners' limits, and the connections to HTTP/2 backends.
        h2_limits=settings.h2_limits(),
        trace_ratio=settings.trace_sample_ratio,
        proxy_protocol_timeout=settings.proxy_protocol_timeout if settings.proxy_protocol else 0.0,
    )
    process.on_stop(_closer(server.h2_upstreams.close))
    view_settings = ViewSettings(
        defaults, cookie_key, settings.trace_sample_ratio, gateway=settings.gateway
    )
    REGISTRY.register(ProxyCollector(metrics.snapshot))
    REGISTRY.register(H2Collector())
    process.on_stop(_unregister(metrics))
    if settings.worker:
        from waygate.core.workers import report_forever

        process.spawn(report_forever(lambda: process.readiness.ready), "proxy-metrics-report")

    front = await _tls_setup(process, settings, server)
    from waygate.proxy.listeners import GatewayListeners, ListenerReporter

    # Gateway listeners on ports --listener-ports does not map are bound as is, and
    # what cannot be served is reported to the resolver (waygate.proxy.listeners).
    gateway_listeners = GatewayListeners(
        server,
        settings.host,
        settings.listener_sides(),
        lambda: (server.listen_port, front.bound_port if front is not None else 0),
        gateway=settings.gateway,
        reuse_port=settings.worker,
        certificates=front.certificates if front is not None else None,
    )
    process.on_stop(_closer(gateway_listeners.close))
    view_settings = view_settings._replace(edge=front.certificates if front is not None else None)
    fan_out = ViewFanOut(server, gateway_listeners, view_settings)
    from waygate.proxy.tcpservices import TcpServices

    tcp_services = TcpServices(
        server,
        settings.host,
        defaults=defaults,
        cookie_key=cookie_key,
        max_connections=settings.tcp_services_max_connections,
        drain=settings.tcp_services_drain,
        proxy_protocol_version=settings.tcp_proxy_protocol_version,
        reuse_port=settings.worker,
        serve=not settings.gateway,
    )
    process.on_stop(lambda: tcp_services.close(settings.shutdown_grace))
    process.status.add("tcp-services", tcp_services.sections)

    def on_view(view: Any) -> None:
        fan_out.on_view(view)
        tcp_services.on_view(view)  # ports of their own (waygate.proxy.tcpservices)

    on_healed = fan_out.on_healed

    channels = [
        await process.client_channel(address, server_name=settings.resolver_server_name)
        for address in dict.fromkeys(settings.resolver_address)
    ]
    watch = resolver_watch(channels, on_view)
    # Endpoints marked `tunnel` are dialled through a tunnel-server replica that
    # holds their node (presence from this same watch).
    from waygate.proxy.upstream import ConnectError
    from waygate.tunnel.client import (
        ViewPresence,
        early_transport_dialer,
        process_client,
        transport_dialer,
    )

    tunnel_client = await process_client(
        process,
        ViewPresence(watch),
        pool_size=settings.tunnel_pool_size,
        pool_idle=settings.tunnel_pool_idle,
        end_to_end=settings.tunnel_end_to_end,
    )
    # Every upstream step (HTTP/1.1, HTTP/2, reencrypt, passthrough, mirrors) takes
    # the tunnel's data connection as its transport: no socketpair in between.
    server.dialer.tunnel = transport_dialer(tunnel_client, ConnectError)
    server.dialer.tunnel_early = early_transport_dialer(tunnel_client, ConnectError)
    process.spawn(watch.run(), "resolver-watch")
    # To every replica: whichever one leads status writing hears this proxy.
    for channel in channels:
        reporter = ListenerReporter(
            gateway_listeners, channel.hold, f"{socket.gethostname()}/{os.getpid()}"
        )
        process.spawn(reporter.run(), f"gateway-listener-report {channel.address}")
    process.spawn(gateway_listeners.run(on_healed), "gateway-listener-retry")
    from waygate.proxy import status

    process.status.add("proxy", status.provider(server, watch, front))
    process.status.set_traffic(lambda: status.traffic(server))
    process.status.add("backend-certificates", lambda: backendcerts.sections(server))
    if server.upstream_tls is not None:
        process.spawn(server.upstream_tls.probe_forever(), "backend-certificate-probes")
        # Backend certificates needing attention go to every replica (route status).
        from waygate.proxy.backendreport import BackendCertificateReporter

        for channel in channels:
            certificate_reporter = BackendCertificateReporter(
                server.upstream_tls.certificates,
                channel.hold,
                f"{socket.gethostname()}/{os.getpid()}",
            )
            process.spawn(
                certificate_reporter.run(), f"backend-certificate-report {channel.address}"
            )
    process.add_listener(
        HttpListener(server, settings.host, settings.http_port, reuse_port=settings.worker)
    )

    async def ready_when_synced() -> None:
        while True:
            try:
                await watch.wait_synced(30.0)
                break
            except Unavailable:
                log.warning(
                    "still waiting for the resolver at %s", ",".join(settings.resolver_address)
                )
        await process.mark_ready()
        # Everything made while starting (modules, gRPC, TLS contexts, the first
        # table) leaves the collector's generations: collecting the per-request
        # garbage no longer walks it.
        gc.freeze()

    process.spawn(ready_when_synced(), "proxy-ready")
