"""The lifecycle of one service process.

    configure logging and tracing -> admin HTTP up (/readyz 503 "starting")
    -> the service's setup registers gRPC servers and background tasks
    -> servers start, health NOT_SERVING -> the service calls mark_ready()
    -> SIGTERM/SIGINT: /readyz 503 "draining", health NOT_SERVING, new calls
       refused, in-flight calls get `shutdown_grace` to finish, background
       tasks cancelled, cleanups run, traces flushed -> exit 0.

Listeners other than gRPC (the proxy's HTTP port) register a `Listener`:
started after setup like the gRPC servers; on SIGTERM they stop accepting at
once, then `drain(grace)` lets in-flight requests finish within the grace
period and closes idle keep-alive connections, alongside the gRPC drain.

A background task that dies with an exception stops the process with exit
code 1: a supervisor (`waygate up`, Kubernetes) restarts it, rather than the
process limping on without part of its job.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import ssl
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import grpc

from waygate.core.admin import AdminServer, Readiness
from waygate.core.errors import FailedPrecondition
from waygate.core.grpcserver import GrpcServer
from waygate.core.logs import configure_logging
from waygate.core.memory import MemoryTrimmer
from waygate.core.settings import ProcessSettings
from waygate.core.statuspage import Section, StatusPage, expiry_cell
from waygate.core.tracing import configure_tracing, shutdown_tracing

if TYPE_CHECKING:
    from waygate.core.grpctls import ProcessCertificates, RotatingChannel

log = logging.getLogger(__name__)

Cleanup = Callable[[], Awaitable[None]]
# Starts a process's certificates from its settings (`waygate.certs.client.
# start_process_certificates`, given by the CLI: core knows no service).
CertificateSource = Callable[
    [ProcessSettings, Callable[[Coroutine[Any, Any, Any], str], Any]],
    Awaitable["ProcessCertificates"],
]


class Listener(Protocol):
    """A non-gRPC listener the process starts and drains (e.g. the proxy's HTTP port)."""

    async def start(self) -> None:
        """Bind and accept; called after setup, before the process is marked ready."""

    def stop_accepting(self) -> None:
        """Close the listening sockets; connections already accepted carry on."""

    async def drain(self, grace: float) -> None:
        """Let in-flight requests finish within `grace` seconds, close idle
        keep-alive connections now, then close whatever is left."""


def _async(function: Callable[[], None]) -> Cleanup:
    async def run() -> None:
        function()

    return run


class ServiceProcess:
    def __init__(
        self,
        service: str,
        settings: ProcessSettings,
        *,
        certificate_source: CertificateSource | None = None,
    ) -> None:
        configure_logging(service, settings.log_level, settings.log_format)
        configure_tracing(service, settings.otlp_endpoint)
        self.service = service
        self.settings = settings
        self.readiness = Readiness()
        # The admin port's status page; services add their sections in setup.
        self.status = StatusPage(service, lambda: (self.readiness.ready, self.readiness.reason))
        self.status.add("certificates", self._certificate_sections)
        self.admin = AdminServer.from_settings(self.readiness, settings, self.status)
        self.grpc_servers: list[GrpcServer] = []
        self.listeners: list[Listener] = []
        self._started_listeners: list[Listener] = []
        self._started: list[GrpcServer] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._cleanups: list[Cleanup] = []
        self._drain_callbacks: list[Callable[[], None]] = []
        self._stop = asyncio.Event()
        self._exit_code = 0
        # Certificates from the certs service, started by the first listener or
        # client that needs them (see `certificates`).
        self._certificates: ProcessCertificates | None = None
        self._certificate_source = certificate_source
        self._certificates_lock = asyncio.Lock()

    # -------------------------------------------------------- used by setup

    def add_grpc_server(self, server: GrpcServer) -> GrpcServer:
        self.grpc_servers.append(server)
        return server

    def add_listener(self, listener: Listener) -> Listener:
        self.listeners.append(listener)
        return listener

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run background work for the life of the process; a crash stops the process."""
        task = asyncio.get_running_loop().create_task(coro, name=name)
        self._tasks.add(task)
        task.add_done_callback(self._task_done)
        return task

    def on_drain(self, callback: Callable[[], None]) -> None:
        """Call `callback` the moment draining starts, before the servers stop.

        Long-lived streams (watches, reports) never finish by themselves; ending
        them here lets their clients reconnect elsewhere at once instead of the
        stop waiting out its whole grace period.
        """
        self._drain_callbacks.append(callback)

    def on_stop(self, cleanup: Cleanup) -> None:
        """Run `cleanup` while stopping, after the servers; last registered runs first."""
        self._cleanups.append(cleanup)

    def _certificate_sections(self) -> list[Section]:
        """This process's own certificate and the CAs it trusts, with time left."""
        held = self._certificates
        if held is None or not held.rotator.has_certificate:
            return []
        current = held.rotator.current
        rows: list[list[Any]] = [
            [
                "own",
                current.identity,
                current.serial[:16],
                expiry_cell(current.not_after, current.not_before),
            ]
        ]
        for ca in held.trust.current.certificates:
            rows.append(
                [
                    "trusted CA",
                    ca.subject.rfc4514_string(),
                    format(ca.serial_number, "x")[:16],
                    expiry_cell(ca.not_valid_after_utc, ca.not_valid_before_utc),
                ]
            )
        return [Section("Certificates", ["kind", "identity", "serial", "expires in"], rows)]

    async def certificates(self) -> ProcessCertificates | None:
        """This process's certificate from certs (None without `certs_address`).

        The first call obtains it (start-up fails with certs' message if it is
        refused) and spawns its renewal and trust-bundle watch; later calls share it.
        """
        if self.settings.certs_address is None:
            return None
        async with self._certificates_lock:
            if self._certificates is None:
                if self._certificate_source is None:
                    raise FailedPrecondition(
                        f"{self.service}: certs_address is set but this process was "
                        "started without a certs client"
                    )
                self._certificates = await self._certificate_source(self.settings, self.spawn)
        return self._certificates

    async def server_credentials(self, *, client_auth: bool) -> grpc.ServerCredentials | None:
        """TLS credentials for this process's gRPC listeners, from its settings.

        None means plaintext (allowed only on loopback or with --insecure, which
        the settings already enforce). With `certs_address`, the certificate
        comes from certs and is swapped in place on every renewal; with
        `client_auth`, clients must present a certificate chaining to certs'
        current trust bundle. With static tls_* files and `client_auth`, clients
        must present a certificate that chains to the configured client CA.
        """
        settings = self.settings
        certificates = await self.certificates()
        if certificates is not None:
            return certificates.server_credentials(client_auth=client_auth)
        if settings.tls_cert_file is None or settings.tls_key_file is None:
            return None
        client_ca = self._static_client_ca(client_auth)
        return grpc.ssl_server_credentials(
            [(settings.tls_key_file.read_bytes(), settings.tls_cert_file.read_bytes())],
            root_certificates=client_ca.read_bytes() if client_ca is not None else None,
            require_client_auth=client_auth,
        )

    async def server_ssl_context(
        self, *, client_auth: bool = False, alpn_protocols: tuple[str, ...] = ()
    ) -> ssl.SSLContext | None:
        """An SSLContext for this process's HTTPS/TLS listeners (asyncio), TLS 1.2+.

        With `certs_address` it always serves the current certificate (its SNI
        callback switches each new connection to the newest one) and, with
        `client_auth`, requires a client certificate chaining to the current
        trust bundle. With static tls_* files it serves those. None: plaintext.
        """
        certificates = await self.certificates()
        if certificates is not None:
            contexts = certificates.ssl_contexts(
                client_auth=client_auth, alpn_protocols=alpn_protocols
            )
            self.on_stop(_async(contexts.close))
            return contexts.context
        settings = self.settings
        if settings.tls_cert_file is None or settings.tls_key_file is None:
            return None
        from waygate.core.tls import server_context

        client_ca = self._static_client_ca(client_auth)
        return server_context(
            chain_pem=settings.tls_cert_file.read_bytes(),
            key_pem=settings.tls_key_file.read_bytes(),
            client_ca_pem=client_ca.read_bytes() if client_auth and client_ca else None,
            client_auth=client_auth,
            alpn_protocols=alpn_protocols,
        )

    def _static_client_ca(self, client_auth: bool) -> Path | None:
        """tls_client_ca_file; with `client_auth` it must be set (gRPC and HTTPS alike):
        never silently serve without the client authentication this service requires."""
        client_ca = self.settings.tls_client_ca_file
        if client_auth and client_ca is None:
            raise FailedPrecondition(
                f"{self.service} requires client certificates: set tls_client_ca_file "
                "to the CA that signs its clients' certificates"
            )
        return client_ca

    async def client_channel(
        self, address: str, *, server_name: str | None = None
    ) -> RotatingChannel:
        """A channel to another Waygate service; call its `channel()` for every call or stream.

        With `certs_address` it is mTLS with this process's current certificate
        (a new channel after each renewal); with static tls_* files it presents
        tls_cert_file and verifies the server against tls_client_ca_file (the
        system roots when unset); otherwise plaintext. Closed when the process stops.
        """
        from waygate.core.grpcclient import ClientTLS
        from waygate.core.grpctls import static_client_channel

        certificates = await self.certificates()
        if certificates is not None:
            channel = certificates.client_channel(address, server_name=server_name)
        elif self.settings.tls_cert_file is not None:
            tls = ClientTLS(
                self.settings.tls_client_ca_file,
                self.settings.tls_cert_file,
                self.settings.tls_key_file,
                server_name,
            )
            channel = static_client_channel(address, tls.credentials(), server_name)
        else:
            channel = static_client_channel(address, None, server_name)
        self.on_stop(channel.close)
        return channel

    async def mark_ready(self) -> None:
        """Health SERVING and /readyz 200; call once the service can answer correctly."""
        if self._stop.is_set():
            return
        self.readiness.set_ready()
        for server in self._started:
            await server.set_serving()
        log.info("ready")

    def request_stop(self, exit_code: int = 0) -> None:
        self._exit_code = max(self._exit_code, exit_code)
        self._stop.set()

    # -------------------------------------------------------- internals

    def _task_done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled() or self._stop.is_set():
            return
        exc = task.exception()
        if exc is not None:
            log.error("background task %s failed; stopping", task.get_name(), exc_info=exc)
            self.request_stop(exit_code=1)

    async def run(self, setup: Callable[[ServiceProcess], Awaitable[None]]) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)
        try:
            admin_port = await self.admin.start(self.settings.host, self.settings.admin_port)
            # A stop requested while setup still runs (it may wait for certs) wins.
            setting_up = asyncio.ensure_future(setup(self))
            stopped = asyncio.ensure_future(self._stop.wait())
            await asyncio.wait({setting_up, stopped}, return_when=asyncio.FIRST_COMPLETED)
            stopped.cancel()
            if not setting_up.done():
                setting_up.cancel()
                await asyncio.gather(setting_up, return_exceptions=True)
                return self._exit_code
            setting_up.result()
            for server in self.grpc_servers:
                await server.start()
                self._started.append(server)
                if self.readiness.ready:
                    await server.set_serving()
            for listener in self.listeners:
                await listener.start()
                self._started_listeners.append(listener)
            log.info(
                "listening",
                extra={"grpc_ports": [s.port for s in self._started], "admin_port": admin_port},
            )
            # Freed native memory (gRPC core, OpenSSL) back to the OS after bursts.
            self.spawn(MemoryTrimmer().run(), "memory-trim")
            await self._stop.wait()
        finally:
            await self._shutdown()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        return self._exit_code

    async def _shutdown(self) -> None:
        grace = self.settings.shutdown_grace
        self.readiness.set_not_ready("draining")
        log.info("draining", extra={"grace_seconds": grace})
        for callback in self._drain_callbacks:
            try:
                callback()
            except Exception:
                log.exception("drain callback failed")
        for listener in self._started_listeners:
            listener.stop_accepting()
        await asyncio.gather(
            *(server.stop(grace) for server in self._started),
            *(listener.drain(grace) for listener in self._started_listeners),
            return_exceptions=True,
        )
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for cleanup in reversed(self._cleanups):
            try:
                await cleanup()
            except Exception:
                log.exception("cleanup failed")
        await self.admin.stop()
        with contextlib.suppress(Exception):
            shutdown_tracing()
        log.info("stopped")
