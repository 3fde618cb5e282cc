"""`waygate up`: every implemented service on 127.0.0.1, each in its own process.

The topology (ports, identities, the demo's names, `UpContext`) is
`waygate.components`'s: services read it there and never import this module.

Children start in `COMPONENTS` order, each waited for until its /readyz says
ready (or a timeout passes), so certs is up before the processes that take
their certificates from it. `up` never reports what it did not see:
- a state directory belongs to one running `up`: `<state>/up.lock`, locked
  (flock) before anything in the directory is written and held for `up`'s
  life, makes a second `up` on the same directory stop at once, naming the
  running one and printing a command for a copy beside it (its own
  --state-dir and a free --port-offset), so a second copy can never rewrite
  the first one's tokens, certificates or up.json;
- every port it will use is checked before anything starts; a taken one stops
  `up` at once naming the port, the process holding it (when /proc tells) and
  a command with a --port-offset that is free (and its own --state-dir);
- a child counts as ready only when its /readyz answers 200 from a socket the
  child (or its own descendant) holds, not whatever else answers on the port;
- a child that exits on its own is restarted with exponential backoff (reset
  once it has run for a minute); one that exits `max_restarts` times in a row
  stops `up` with exit 1 and its last error line (children's stderr passes
  through `up`, which keeps the last lines of each, bounded);
- a child whose /healthz stops answering `liveness_failures` times in a row
  (hung, or SIGSTOPped) is killed and so restarted.
SIGINT or SIGTERM
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
import fcntl
import importlib
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections import deque
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar, TextIO

import yaml

from waygate.components import (
    CERTS,
    COMPONENTS,
    DEMO,
    DEMO_PORT,
    HOST,
    RESOLVER,
    TUNNEL_AGENT,
    USER,
    Component,
    UpContext,
    process_identity,
    spiffe_id,
)
from waygate.core.admin import AdminServer, Readiness
from waygate.core.backoff import Backoff
from waygate.core.clientcli import (
    EXIT_FAILED,
    EXIT_USAGE_OR_UNREACHABLE,
    UpRecord,
    fail,
    http_status,
)
from waygate.core.errors import WaygateError
from waygate.core.files import write_file_atomically
from waygate.core.logs import configure_logging, resolved_format
from waygate.core.portholder import descends_from, listeners, port_free
from waygate.core.settings import (
    LOG_FORMATS,
    LOG_LEVELS,
    SettingsError,
    fraction,
    parse_duration,
    port_number,
    positive,
    setting,
    settings_from_args,
)
from waygate.core.statuspage import GatheredStatus, Section, cell, time_cell

log = logging.getLogger(__name__)

STABLE_AFTER = 60.0  # a child that ran this long restarts with the initial backoff again
#: Lines of each child's stderr kept to report why it crashed.
KEPT_LINES = 20
#: A child's stderr line longer than this is passed on in pieces (bounded memory).
MAX_LINE = 64 * 1024
# In the state directory: locked by the `up` that uses it, for its life; holds its pid.
STATE_LOCK = "up.lock"
STATUS_PORT = 9000  # plus the port offset; the page gathering every service's status


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
    max_restarts: int = setting(
        5,
        help="a child that exits this many times in a row (each within a minute of its "
        "start) stops `up` with exit 1 and its last error",
        check=positive,
    )
    liveness_interval: float = setting(
        5.0,
        help="how often each ready child's /healthz is asked whether it still answers",
        parse=parse_duration,
        check=positive,
    )
    liveness_failures: int = setting(
        3,
        help="a child that does not answer /healthz this many times in a row (hung, or "
        "stopped) is killed and restarted",
        check=positive,
    )
    agent_allow: tuple[str, ...] = setting(
        (),
        help="what the demo tunnel agent may dial, comma-separated HOST:PORT (as "
        "`tunnel agent --allow`); empty: the kubelet port and the demo backend",
    )
    log_level: str = setting("info", help="log level of up itself", choices=LOG_LEVELS)
    log_format: str = setting(
        "auto",
        help="log format of up and every child: json, text, or auto (text when up's stderr "
        "is a terminal; children get what up decided, their stderr being a pipe)",
        choices=LOG_FORMATS,
    )

    status_port: int = setting(
        STATUS_PORT,
        help="port of the status page gathering every service's (moves with --port-offset)",
        check=port_number,
    )
    otlp_endpoint: str | None = setting(
        None,
        help="OTLP/gRPC endpoint every child exports traces to (e.g. 127.0.0.1:4317, "
        "Jaeger's); unset: no export",
        env=("WAYGATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    )
    trace_sample_ratio: float = setting(
        1.0,
        help="with --otlp-endpoint: share of untraced requests the proxy starts a trace "
        "for (0..1); requests with trace context follow their parent",
        check=fraction,
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
        # Exits in a row, each within STABLE_AFTER of its start.
        self.crashes = 0
        self.ready = False
        self.lines: deque[str] = deque(maxlen=KEPT_LINES)
        self._relay: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.process = await asyncio.create_subprocess_exec(
            *self.argv,
            stderr=asyncio.subprocess.PIPE,
            limit=MAX_LINE,
            preexec_fn=_die_with_parent(os.getpid()),
        )
        self.started_at = time.monotonic()
        self.ready = False
        assert self.process.stderr is not None
        self._relay = asyncio.create_task(self._pass_on(self.process.stderr))
        log.info("started %s", self.name, extra={"pid": self.process.pid})

    async def _pass_on(self, stream: asyncio.StreamReader) -> None:
        """The child's stderr to ours, line by line, keeping the last lines."""
        out = sys.stderr.buffer
        while True:
            try:
                line = await stream.readline()
            except ValueError:  # longer than MAX_LINE: pass on what is there
                line = await stream.read(MAX_LINE)
            if not line:
                return
            out.write(line)
            out.flush()
            self.lines.append(line.decode("utf-8", "replace").rstrip("\n"))

    async def finished(self) -> None:
        """Wait (bounded) until the stderr relay has passed on what the child wrote."""
        if self._relay is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(asyncio.shield(self._relay), 5.0)

    def last_error(self) -> str:
        """The child's last error line (its message, for JSON logs), else its last line."""
        for line in reversed(self.lines):
            message = _error_message(line)
            if message:
                return message
        return self.lines[-1] if self.lines else "(it wrote nothing to stderr)"

    def signal(self, sig: int) -> None:
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


def _error_message(line: str) -> str | None:
    if line.startswith("{"):
        with contextlib.suppress(ValueError, AttributeError):
            record = json.loads(line)
            if str(record.get("level", "")).lower() in ("error", "critical"):
                return str(record.get("msg") or record.get("message") or line)
            return None
    lowered = line.lower()
    if "error" in lowered or "traceback" in lowered or line.startswith("waygate:"):
        return line
    return None


async def _http_status(port: int, path: str, timeout: float) -> int | None:
    return await http_status(f"{HOST}:{port}", path, timeout)


def _held_by(child: Child) -> bool:
    """The child's ready port is held by the child (or its own descendant); True when
    /proc cannot tell (no holder found), so non-Linux hosts still start."""
    if child.process is None:
        return False
    holders = listeners(child.ready_port)
    return not holders or any(descends_from(h.pid, child.process.pid) for h in holders)


async def _ready(child: Child, timeout: float) -> bool:
    """Poll the child's /readyz until it answers 200 from the child itself, or the timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await _http_status(child.ready_port, "/readyz", 1.0) == 200 and _held_by(child):
            return True
        await asyncio.sleep(0.1)
    return False


class Supervisor:
    def __init__(self, settings: UpSettings) -> None:
        self.settings = settings
        self.context = UpContext(
            settings.state_dir.resolve(),
            settings.port_offset,
            agent_allow=settings.agent_allow,
            sticky_key_file=settings.state_dir.resolve() / "sticky.key",
        )
        self.children: list[Child] = []
        self._stopping = asyncio.Event()
        # Why `up` gave up (a crash-looping child), for its exit status and last word.
        self._failure: str | None = None
        self.bootstrap: Bootstrap | None = None
        self._client_renewal: asyncio.Task[None] | None = None
        # The state directory's lock (an open, flock-ed file), held until exit.
        self._state_lock: TextIO | None = None

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
        key_file = self.context.sticky_key_file
        if "sticky_key_file" in fields and key_file is not None and "--sticky-key-file" not in argv:
            argv += ["--sticky-key-file", str(key_file)]
        if self.bootstrap is not None and component.name != CERTS and "certs_address" in fields:
            argv += self.bootstrap.arguments(component.name, self.context.address(CERTS))
        if self.settings.otlp_endpoint:
            argv += ["--otlp-endpoint", self.settings.otlp_endpoint]
            argv += ["--trace-sample-ratio", str(self.settings.trace_sample_ratio)]
        return argv

    async def _serve_status(self, implemented: list[Component]) -> AdminServer:
        """The status page gathering every child's (their admin ports' /status.json)."""
        readiness = Readiness()
        readiness.set_ready()
        # Traffic first (the proxy's routes), the CA last: the order people look in.
        order = ["proxy", RESOLVER, "tunnel-server", TUNNEL_AGENT, CERTS]
        shown = sorted(implemented, key=lambda c: order.index(c.name) if c.name in order else 99)
        gathered = GatheredStatus(
            "Waygate (waygate up)",
            [(c.name, HOST, self.context.port(c.name, "admin_port")) for c in shown],
            sections=self._process_sections,
        )
        server = AdminServer(readiness, status=gathered)
        await server.start(HOST, self.settings.status_port + self.context.port_offset)
        return server

    def _process_sections(self) -> list[Section]:
        """`up`'s own part of its page: one row per child, with its restarts."""
        rows: list[list[Any]] = []
        for child in self.children:
            process = child.process
            running = process is not None and process.returncode is None
            state = (
                cell("ready", "ok")
                if running and child.ready
                else cell("starting", "warn")
                if running
                else cell("exited; restarting", "bad")
            )
            started = time.time() - (time.monotonic() - child.started_at)
            rows.append(
                [
                    child.name,
                    process.pid if process is not None else "",
                    state,
                    cell(child.restarts, "warn" if child.restarts else ""),
                    time_cell(datetime.fromtimestamp(started, UTC) if child.started_at else None),
                ]
            )
        overall = "ok"
        if any(child.restarts for child in self.children):
            overall = "warn"
        if any(row[2]["state"] == "bad" for row in rows):
            overall = "bad"
        return [
            Section(
                "Processes",
                ["process", "pid", "state", "restarts", "started"],
                rows,
                note="the processes `waygate up` runs and restarts",
                state=overall,
                empty="none started yet",
            )
        ]

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
        """Get the local user's client certificate (key made here) and keep it renewed;
        `up` follows the trust bundle it reaches certs with and acknowledges it
        (ReportTrust, as every trust consumer does), so a CA rotation waits for it too."""
        from waygate.certs.client import GrpcIssuer, TrustBundleWatcher, TrustReporter
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
        address, token_file = self.context.address(CERTS), self.bootstrap.token_file(USER)

        async def keep() -> None:
            await asyncio.gather(
                rotator.run(),
                TrustBundleWatcher(address, trust).run(),
                TrustReporter(address, token_file, trust, spiffe_id(USER)).run(),
            )

        self._client_renewal = asyncio.create_task(keep(), name="client-certificate")
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
        in_use = self._lock_state_dir(implemented)
        if in_use is not None:
            return fail(f"up: {in_use}", EXIT_USAGE_OR_UNREACHABLE)
        taken = self._taken_port(implemented)
        if taken is not None:
            return fail(f"up: {taken}", EXIT_USAGE_OR_UNREACHABLE)
        self._sticky_key()
        if any(c.name == CERTS for c in implemented):
            self.bootstrap = Bootstrap(
                self.context.state_dir,
                (*(c.name for c in implemented if c.name != CERTS), USER),
            )
            self.bootstrap.write()
        self._record(implemented)
        status_server = await self._serve_status(implemented)
        self.print_addresses(implemented, missing)
        print(
            f"  {'status page':<14} http://{HOST}:{status_server.port}/  (every service's, live)",
            flush=True,
        )
        children = [
            Child(c.name, self._argv(c), self.context.port(c.name, "admin_port"))
            for c in implemented
        ]
        # The demo backend last: it depends on nothing, and nothing waits for it.
        children.append(Child(DEMO, self._demo_argv(), self.context.demo_port))
        watchers = []
        not_ready: list[str] = []
        try:
            for child in children:
                self.children.append(child)
                await child.start()
                watchers.append(asyncio.create_task(self._watch(child)))
                watchers.append(asyncio.create_task(self._liveness(child)))
                ready = asyncio.create_task(_ready(child, self.settings.ready_timeout))
                stop = asyncio.create_task(self._stopping.wait())
                await asyncio.wait({ready, stop}, return_when=asyncio.FIRST_COMPLETED)
                stop.cancel()
                ready.cancel()
                if self._stopping.is_set():
                    break
                child.ready = ready.result()
                if not child.ready:
                    not_ready.append(child.name)
                    log.warning(
                        "%s is not ready after %.0fs; going on",
                        child.name,
                        self.settings.ready_timeout,
                    )
                elif child.name == CERTS and self.bootstrap is not None:
                    await self._client_certificate()
            if not self._stopping.is_set():
                if not_ready:
                    print(
                        "waygate up: started, but NOT ready: "
                        + ", ".join(not_ready)
                        + " (see their log lines above); Ctrl-C stops everything",
                        flush=True,
                    )
                else:
                    print("waygate up: all services started; Ctrl-C stops them", flush=True)
            await self._stopping.wait()
        finally:
            if self._client_renewal is not None:
                self._client_renewal.cancel()
                await asyncio.gather(self._client_renewal, return_exceptions=True)
            await self._stop_all()
            await status_server.stop()
            for watcher in watchers:
                watcher.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            for child in self.children:
                await child.finished()
        if self._failure is not None:
            print(f"waygate up: stopped: {self._failure}", file=sys.stderr, flush=True)
            return EXIT_FAILED
        print("waygate up: stopped", flush=True)
        return 0

    def _ports(self, implemented: list[Component]) -> list[tuple[int, str]]:
        ports = [
            (self.context.port(c.name, field), f"{c.name} {label}")
            for c in implemented
            for field, label in c.port_labels
        ]
        status = (self.settings.status_port + self.context.port_offset, "status page")
        return [*ports, (self.context.demo_port, f"{DEMO} HTTP"), status]

    def _taken_port(self, implemented: list[Component]) -> str | None:
        """What is wrong when a port `up` needs is taken (None: all free)."""
        for port, what in self._ports(implemented):
            if port_free(HOST, port):
                continue
            holders = listeners(port)
            by = f"by {holders[0]}" if holders else "by another process (not visible here)"
            return f"port {port} ({what}) on {HOST} is already taken {by}; " + self._beside_hint(
                implemented
            )
        return None

    def _beside_hint(self, implemented: list[Component]) -> str:
        """How to run a second copy beside the running one: its own state directory
        (never the first one's) and a port offset that is free now."""
        offset = self._free_offset(implemented)
        state = self._free_state_dir(offset or 100)
        command = f"waygate up --state-dir {state} --port-offset {offset or 'N'}"
        if offset is None:
            return f"stop it, or run a copy beside it: {command} (no free offset found)"
        return f"stop it, or run a copy beside it: {command}"

    def _free_state_dir(self, offset: int) -> str:
        """A state directory beside this one that no `up` holds (printed relative to
        the working directory when it is below it, so the hint reads as typed)."""
        state = self.context.state_dir
        for n in range(offset, offset + 100_000, 100):
            candidate = state.with_name(f"{state.name}-{n}")
            if not candidate.exists() or _state_dir_lock_holder(candidate) is None:
                break
        with contextlib.suppress(ValueError):
            return str(candidate.relative_to(Path.cwd()))
        return str(candidate)

    def _lock_state_dir(self, implemented: list[Component]) -> str | None:
        """Lock the state directory for this process's life (None), or say who holds it."""
        path = self.context.state_dir / STATE_LOCK
        handle = open(path, "a+")  # noqa: SIM115 - held (locked) until the process ends
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.close()
            holder = _state_dir_lock_holder(self.context.state_dir)
            record = UpRecord.read(self.context.state_dir)
            running = f"pid {holder}" if holder else "another process"
            if record is not None and record.pid == holder:
                running += f", port offset {record.port_offset}"
            return (
                f"state directory {self.context.state_dir} is in use by a running "
                f"`waygate up` ({running}); {self._beside_hint(implemented)}"
            )
        handle.seek(0)
        handle.truncate()
        handle.write(f"{os.getpid()}\n")
        handle.flush()
        self._state_lock = handle
        return None

    def _free_offset(self, implemented: list[Component]) -> int | None:
        base = self.context.port_offset
        defaults = [port - base for port, _ in self._ports(implemented)]
        for offset in range(base + 100, base + 2001, 100):
            if max(defaults) + offset > 65535:
                return None
            if all(port_free(HOST, port + offset) for port in defaults):
                return offset
        return None

    def _sticky_key(self) -> None:
        """The proxy's sticky-cookie key, kept in the state directory (0600) across
        runs, so a browser's cookie still picks its endpoint after a restart."""
        key_file = self.context.sticky_key_file
        if key_file is not None and not key_file.is_file():
            write_file_atomically(key_file, secrets.token_hex(32).encode() + b"\n", 0o600)

    async def _liveness(self, child: Child) -> None:
        """Kill a ready child whose /healthz stops answering (hung, or SIGSTOPped): its
        watcher then restarts it. A child that exits is the watcher's business."""
        interval = self.settings.liveness_interval
        misses = 0
        while not self._stopping.is_set():
            await asyncio.sleep(interval)
            process = child.process
            if process is None or process.returncode is not None or not child.ready:
                misses = 0
                if process is not None and process.returncode is None and not child.ready:
                    # Restarted (or late): ready again once its /readyz says so.
                    child.ready = await _http_status(child.ready_port, "/readyz", 1.0) == 200
                continue
            if await _http_status(child.ready_port, "/healthz", min(interval, 2.0)) is not None:
                misses = 0
                continue
            misses += 1
            if misses >= self.settings.liveness_failures:
                log.error(
                    "%s did not answer /healthz %d times in a row (hung or stopped); "
                    "killing it so it restarts",
                    child.name,
                    misses,
                    extra={"pid": process.pid},
                )
                child.signal(signal.SIGKILL)
                misses = 0

    async def _watch(self, child: Child) -> None:
        while True:
            code = None if child.process is None else await child.process.wait()
            if self._stopping.is_set():
                return
            child.ready = False
            if time.monotonic() - child.started_at > STABLE_AFTER:
                child.backoff.reset()
                child.crashes = 0
            child.crashes += 1
            if child.crashes > self.settings.max_restarts:
                await child.finished()
                self._failure = (
                    f"{child.name} keeps crashing: it exited {child.crashes} times in a row "
                    f"(last exit code {code}); its last error: {child.last_error()}"
                )
                log.error("%s", self._failure)
                self._stopping.set()
                return
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


def _state_dir_lock_holder(state_dir: Path) -> int | None:
    """The pid of the `up` that holds `state_dir`'s lock now; None when nobody does."""
    try:
        with open(state_dir / STATE_LOCK) as handle:
            try:
                fcntl.flock(handle, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                text = handle.read().strip()
                return int(text) if text.isdigit() else 0
            return None
    except OSError:
        return None


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
