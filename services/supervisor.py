"""`waygate up`: every implemented service on 127.0.0.1, each in its own process.

The topology (ports, identities, the demo's names, `UpContext`) is
`waygate.components`'s: services read it there and never import this module.

Children start in `COMPONENTS` order, each waited for until its /readyz says
ready (or a timeout passes), so certs is up before the processes that take
their certificates from it. A child that exits on its own is restarted with
exponential backoff (reset once it has run for a minute). SIGINT or SIGTERM
stops every child with SIGTERM, then SIGKILL after the grace period; children
also get SIGKILL from the kernel if `up` itself dies (PR_SET_PDEATHSIG), so no
orphan outlives it.

A component's app module may define `up_arguments(context) -> list[str]` for
the extra flags it needs under `up` (its state directory, an example file).
Every component whose settings have `resolver_address` (the proxy, the tunnel
server) is pointed at the local resolver, unless its `up_arguments` says
otherwise; with certs running, that connection is mTLS like every other.

Beside the services, `up` runs the demo backend (`python -m waygate.demo`,
waygate.demo.echo) on 127.0.0.1:8090 plus the offset: the endpoint of the
example route demo/echo, answering every request with what it received. It is
supervised like the services (restarted when it exits, stopped with them).

TLS everywhere (docs/architecture.md, "Security between services"): before any child
starts, `up` writes `<state>/tokens.yaml` (0600) for certs, with one random
bootstrap token per process and one for the local user, and each token alone
in `<state>/tokens/<name>.token` (0600), which is what that child is given
(a file, never a flag: command lines are world-readable in /proc). Every child
but certs gets `--certs-address`, `--certs-token-file`, `--certs-ca-file` and
its identity `spiffe://waygate.local/ns/local/sa/<name>` with SANs
`dns:<name>.waygate.local,ip:127.0.0.1`; it then makes its own key and takes
its certificate from certs. Once certs is ready, `up` does the same for the
local user (a key made here, identity .../sa/user) and keeps
`<state>/client/{key.pem (0600),cert.pem}` renewed while it runs; certs itself
keeps `<state>/ca.pem` equal to its trust bundle. Client commands find both
there, so they work without flags.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import dataclasses
import importlib
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import ClassVar

import yaml

from waygate.components import (
    CERTS,
    COMPONENTS,
    DEMO,
    DEMO_PORT,
    HOST,
    RESOLVER,
    USER,
    Component,
    UpContext,
    process_identity,
    spiffe_id,
)
from waygate.core.backoff import Backoff
from waygate.core.clientcli import EXIT_USAGE_OR_UNREACHABLE, UpRecord, fail
from waygate.core.errors import WaygateError
from waygate.core.files import write_file_atomically
from waygate.core.logs import configure_logging, resolved_format
from waygate.core.settings import (
    LOG_FORMATS,
    LOG_LEVELS,
    SettingsError,
    parse_duration,
    positive,
    setting,
    settings_from_args,
)

log = logging.getLogger(__name__)

STABLE_AFTER = 60.0  # a child that ran this long restarts with the initial backoff again


@dataclasses.dataclass(frozen=True)
class Bootstrap:
    """Who may ask certs for what under `up`: one random token per process and the user."""

    state_dir: Path
    names: tuple[str, ...]  # every process that takes a certificate from certs, and USER

    @property
    def tokens_file(self) -> Path:
        return self.state_dir / "tokens.yaml"

    def token_file(self, name: str) -> Path:
        return self.state_dir / "tokens" / f"{name}.token"

    def allowed(self, name: str) -> list[str]:
        if name == USER:
            return [f"uri:{spiffe_id(name)}"]
        identity, sans = process_identity(name)
        kind = "uri" if identity.startswith("spiffe://") else "dns"
        return [f"{kind}:{identity}", *sans]

    def write(self) -> None:
        """Fresh tokens on every `up`: a token from an earlier run is worth nothing."""
        tokens = {name: secrets.token_urlsafe(32) for name in self.names}
        # The local user's token is an admin's (RotateCA, ListIssued): `waygate cert
        # status` and `cert rotate-ca` work next to `up` as its other commands do.
        entries = [
            {"token": tokens[name], "name": name, "allowed": self.allowed(name)}
            | ({"admin": True} if name == USER else {})
            for name in self.names
        ]
        (self.state_dir / "tokens").mkdir(mode=0o700, parents=True, exist_ok=True)
        for name, token in tokens.items():
            write_file_atomically(self.token_file(name), f"{token}\n".encode(), 0o600)
        text = "# written by `waygate up`; certs reads it at start. Secret: keep 0600.\n"
        write_file_atomically(
            self.tokens_file, (text + yaml.safe_dump({"tokens": entries})).encode(), 0o600
        )

    def arguments(self, name: str, certs_address: str) -> list[str]:
        identity, sans = process_identity(name)
        return [
            "--certs-address",
            certs_address,
            "--certs-token-file",
            str(self.token_file(name)),
            "--certs-ca-file",
            str(self.state_dir / "ca.pem"),
            "--cert-identity",
            identity,
            "--cert-sans",
            ",".join(sans),
        ]


@dataclasses.dataclass(frozen=True, kw_only=True)
class UpSettings:
    CONFIG_ENV: ClassVar[str] = "WAYGATE_UP_CONFIG"

    state_dir: Path = setting(Path(".waygate"), help="where certificates, keys and state are kept")
    port_offset: int = setting(
        0, help="added to every default port (to run two copies side by side)"
    )
    ready_timeout: float = setting(
        30.0,
        help="how long to wait for each service's /readyz",
        parse=parse_duration,
        check=positive,
    )
    stop_grace: float = setting(
        15.0,
        help="how long children may take to stop before SIGKILL",
        parse=parse_duration,
        check=positive,
    )
    log_level: str = setting("info", help="log level of up itself", choices=LOG_LEVELS)
    log_format: str = setting(
        "auto",
        help="log format of up and every child: json, text, or auto (text when up's stderr "
        "is a terminal; children get what up decided, their stderr being a pipe)",
        choices=LOG_FORMATS,
    )

    def __post_init__(self) -> None:
        top = max(DEMO_PORT, *(port for c in COMPONENTS for _, port in c.ports))
        top += self.port_offset
        if self.port_offset < 0 or top > 65535:
            raise SettingsError(
                f"invalid setting port_offset: {self.port_offset} puts ports outside 1..65535"
            )


# Looked up once, here: between fork and exec (where `_die_with_parent` runs, in
# a process that has threads) only the bare call is safe, not a library load.
_prctl: Callable[..., int] | None
try:
    _prctl = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not glibc Linux: children rely on the clean stop only
    _prctl = None
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> Callable[[], None]:
    """For the child, before exec: get SIGKILL when the supervisor dies."""

    def arrange() -> None:
        if _prctl is not None:
            _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != parent:  # the supervisor died before prctl took effect
                os.kill(os.getpid(), signal.SIGKILL)

    return arrange


class Child:
    """One supervised process: a service component, or the demo backend."""

    def __init__(self, name: str, argv: list[str], ready_port: int) -> None:
        self.name = name
        self.argv = argv
        self.ready_port = ready_port  # GET /readyz there answers 200 once it serves
        self.process: asyncio.subprocess.Process | None = None
        self.started_at = 0.0
        self.backoff = Backoff(initial=0.5, maximum=30.0)
        self.restarts = 0

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv, preexec_fn=_die_with_parent(os.getpid())
        )
        self.started_at = time.monotonic()
        log.info("started %s", self.name, extra={"pid": self.process.pid})

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


async def _ready(port: int, timeout: float) -> bool:
    """Poll http://127.0.0.1:PORT/readyz until it answers 200 or the timeout passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with contextlib.suppress(OSError, asyncio.TimeoutError):
            reader, writer = await asyncio.wait_for(asyncio.open_connection(HOST, port), 1.0)
            try:
                writer.write(b"GET /readyz HTTP/1.1\r\nHost: up\r\n\r\n")
                status = await asyncio.wait_for(reader.readline(), 1.0)
            finally:
                writer.close()
            if status.startswith(b"HTTP/1.1 200"):
                return True
        await asyncio.sleep(0.1)
    return False


class Supervisor:
    def __init__(self, settings: UpSettings) -> None:
        self.settings = settings
        self.context = UpContext(settings.state_dir.resolve(), settings.port_offset)
        self.children: list[Child] = []
        self._stopping = asyncio.Event()
        self.bootstrap: Bootstrap | None = None
        self._client_renewal: asyncio.Task[None] | None = None

    def _argv(self, component: Component) -> list[str]:
        argv = [sys.executable, "-m", "waygate", *component.command, "--host", HOST]
        argv += ["--log-format", resolved_format(self.settings.log_format)]
        for field, _ in component.ports:
            argv += [f"--{field.replace('_', '-')}", str(self.context.port(component.name, field))]
        app = importlib.import_module(component.app_module)
        extra = getattr(app, "up_arguments", None)
        if extra is not None:
            argv += extra(self.context)
        fields = {f.name for f in dataclasses.fields(app.Settings)}
        if (
            "resolver_address" in fields
            and component.name != RESOLVER
            and "--resolver-address" not in argv
        ):
            argv += ["--resolver-address", self.context.address(RESOLVER)]
        if self.bootstrap is not None and component.name != CERTS and "certs_address" in fields:
            argv += self.bootstrap.arguments(component.name, self.context.address(CERTS))
        return argv

    def _demo_argv(self) -> list[str]:
        return [
            sys.executable,
            "-m",
            "waygate.demo",
            "--host",
            HOST,
            "--http-port",
            str(self.context.demo_port),
            "--log-format",
            resolved_format(self.settings.log_format),
        ]

    async def _client_certificate(self) -> None:
        """Get the local user's client certificate (key made here) and keep it renewed."""
        from waygate.certs.client import GrpcIssuer
        from waygate.core.rotation import (
            CertificateRotator,
            TrustBundle,
            TrustStore,
            save_certificate,
        )

        assert self.bootstrap is not None
        state = self.context.state_dir
        try:
            trust = TrustStore(TrustBundle.from_pem((state / "ca.pem").read_bytes()))
            rotator = CertificateRotator(
                GrpcIssuer(self.context.address(CERTS), self.bootstrap.token_file(USER), trust),
                spiffe_id(USER),
            )
            (state / "client").mkdir(mode=0o700, exist_ok=True)
            rotator.subscribe(
                lambda held: save_certificate(
                    held, state / "client" / "key.pem", state / "client" / "cert.pem"
                )
            )
            await rotator.obtain(timeout=self.settings.ready_timeout)
        except (OSError, WaygateError) as exc:
            log.error(
                "no client certificate for the local user; client commands need TLS flags: %s",
                exc,
            )
            return
        self._client_renewal = asyncio.create_task(rotator.run(), name="client-certificate")
        print(
            f"waygate up: TLS everywhere; trust bundle {state / 'ca.pem'}, "
            f"your client certificate ({spiffe_id(USER)}) in {state / 'client'}",
            flush=True,
        )

    def _record(self, implemented: list[Component]) -> None:
        """`up.json` in the state directory: where this `up` serves, so client commands
        run here (or below) find it without --addr, whatever the port offset."""
        addresses = {
            c.name: {f: f"{self.context.host}:{self.context.port(c.name, f)}" for f, _ in c.ports}
            for c in implemented
        }
        addresses[DEMO] = {"http_port": f"{self.context.host}:{self.context.demo_port}"}
        UpRecord(self.context.host, self.context.port_offset, os.getpid(), addresses).write(
            self.context.state_dir
        )

    def print_addresses(self, implemented: list[Component], missing: list[Component]) -> None:
        lines = ["waygate up: state in " + str(self.context.state_dir)]
        for component in implemented:
            for field, label in component.port_labels:
                lines.append(
                    f"  {component.name:<14} {self.context.host}:{self.context.port(component.name, field):<6} {label}"
                )
        lines.append(
            f"  {DEMO:<14} {self.context.host}:{self.context.demo_port:<6} "
            "HTTP demo backend (echoes requests; route demo/echo)"
        )
        if missing:
            lines.append("  not implemented yet: " + ", ".join(c.name for c in missing))
        print("\n".join(lines), flush=True)

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._stopping.set)
        implemented = [c for c in COMPONENTS if c.implemented]
        missing = [c for c in COMPONENTS if not c.implemented]
        if not implemented:
            return fail("no service is implemented yet; nothing to run", EXIT_USAGE_OR_UNREACHABLE)
        self.context.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        if any(c.name == CERTS for c in implemented):
            self.bootstrap = Bootstrap(
                self.context.state_dir,
                (*(c.name for c in implemented if c.name != CERTS), USER),
            )
            self.bootstrap.write()
        self._record(implemented)
        self.print_addresses(implemented, missing)
        children = [
            Child(c.name, self._argv(c), self.context.port(c.name, "admin_port"))
            for c in implemented
        ]
        # The demo backend last: it depends on nothing, and nothing waits for it.
        children.append(Child(DEMO, self._demo_argv(), self.context.demo_port))
        watchers = []
        try:
            for child in children:
                self.children.append(child)
                await child.start()
                watchers.append(asyncio.create_task(self._watch(child)))
                ready = asyncio.create_task(_ready(child.ready_port, self.settings.ready_timeout))
                stop = asyncio.create_task(self._stopping.wait())
                await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                ready.cancel()
                if self._stopping.is_set():
                    break
                if not ready.result():
                    log.warning(
                        "%s is not ready after %.0fs; going on",
                        child.name,
                        self.settings.ready_timeout,
                    )
                elif child.name == CERTS and self.bootstrap is not None:
                    await self._client_certificate()
            if not self._stopping.is_set():
                print("waygate up: all services started; Ctrl-C stops them", flush=True)
            await self._stopping.wait()
        finally:
            if self._client_renewal is not None:
                self._client_renewal.cancel()
                await asyncio.gather(self._client_renewal, return_exceptions=True)
            await self._stop_all()
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
        print("waygate up: stopped", flush=True)
        return 0

    async def _watch(self, child: Child) -> None:
        while True:
            code = None if child.process is None else await child.process.wait()
            if self._stopping.is_set():
                return
            if time.monotonic() - child.started_at > STABLE_AFTER:
                child.backoff.reset()
            delay = child.backoff.next_delay()
            child.restarts += 1
            log.warning(
                "%s exited with code %s; restarting in %.1fs",
                child.name,
                code,
                delay,
                extra={"restarts": child.restarts},
            )
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), delay)
            if self._stopping.is_set():
                return
            try:
                await child.start()
            except OSError as exc:
                # Could not even start it (fork failed, interpreter gone): keep trying.
                log.error("cannot restart %s: %s", child.name, exc)
                child.started_at = time.monotonic()
                child.process = None

    async def _stop_all(self) -> None:
        self._stopping.set()
        for child in reversed(self.children):
            child.signal(signal.SIGTERM)
        running = [c.process.wait() for c in self.children if c.process is not None]
        try:
            await asyncio.wait_for(asyncio.gather(*running), self.settings.stop_grace)
        except TimeoutError:
            for child in self.children:
                if child.process is not None and child.process.returncode is None:
                    log.warning(
                        "%s did not stop within %.0fs; killing it",
                        child.name,
                        self.settings.stop_grace,
                    )
                    child.signal(signal.SIGKILL)
            await asyncio.gather(
                *(c.process.wait() for c in self.children if c.process is not None)
            )


def run_up(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(UpSettings, args)
    except SettingsError as exc:
        return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
    configure_logging("up", settings.log_level, settings.log_format)
    try:
        return asyncio.run(Supervisor(settings).run())
    except OSError as exc:
        where = f": {exc.filename}" if exc.filename else ""
        return fail(f"up: {exc.strerror or exc}{where}")
    except WaygateError as exc:
        return fail(f"up: {exc}")
