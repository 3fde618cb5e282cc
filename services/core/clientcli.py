"""What every client command (`waygate resolve`, `waygate cert bundle`, ...) shares.

Connection settings come from flags > WAYGATE_* env > --config, like a
service's. The state directory that `waygate up` writes is found as git finds
`.git`: `--state-dir` or WAYGATE_STATE_DIR when given (explicit wins, as
GIT_DIR does), else `.waygate` in this directory or the nearest parent that
has one, else the user's default `~/.local/state/waygate` when it exists.
There, `up.json` says where that `up` serves (so a copy started with
`--port-offset` needs no `--addr`), `ca.pem` turns TLS on and
`client/cert.pem` + `client/key.pem` are presented when present, so commands
work near a `waygate up` without flags. With no state directory and no
`--addr`, a command says so and how to point at one instead of dialling a
default address. RPC failures become one line on stderr and a non-zero exit,
never a traceback.

Listings print `-o table` (default), `wide` (more columns), `json` or `yaml`
(the whole document, for scripts), through `render`.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
from collections.abc import Callable, Coroutine, Sequence
from pathlib import Path
from typing import Any, ClassVar

import grpc

from waygate.core.grpcclient import ClientTLS, open_channel
from waygate.core.logs import configure_logging
from waygate.core.settings import (
    LOG_LEVELS,
    SettingsError,
    add_settings_arguments,
    parse_duration,
    positive,
    setting,
    settings_from_args,
)
from waygate.core.tracing import configure_tracing, shutdown_tracing

# Exit codes shared by client commands.
EXIT_OK, EXIT_FAILED, EXIT_USAGE_OR_UNREACHABLE = 0, 1, 2

#: The state directory's name, looked for in this directory and its parents.
STATE_DIR_NAME = ".waygate"
#: Written by `waygate up` into its state directory: where it serves.
UP_RECORD = "up.json"
OUTPUT_FORMATS = ("table", "wide", "json", "yaml")


def user_state_dir() -> Path:
    """The user's default state directory (used when it exists)."""
    return Path.home() / ".local" / "state" / "waygate"


def find_state_dir(start: Path | None = None) -> Path | None:
    """`.waygate` in `start` (default: the working directory) or the nearest parent
    that has one, else the user's default when it exists; None when there is none."""
    here = (start or Path.cwd()).absolute()
    for directory in (here, *here.parents):
        candidate = directory / STATE_DIR_NAME
        if candidate.is_dir():
            return candidate
    default = user_state_dir()
    return default if default.is_dir() else None


@dataclasses.dataclass(frozen=True)
class UpRecord:
    """What `waygate up` wrote about where it serves (`up.json`)."""

    host: str
    port_offset: int
    pid: int
    # Component name -> {port field -> "host:port"}.
    addresses: dict[str, dict[str, str]]

    def address(self, default_port: int) -> str:
        return f"{self.host}:{default_port + self.port_offset}"

    @classmethod
    def read(cls, state_dir: Path) -> UpRecord | None:
        try:
            data = json.loads((state_dir / UP_RECORD).read_text())
            return cls(
                str(data["host"]),
                int(data["port_offset"]),
                int(data.get("pid", 0)),
                {str(k): dict(v) for k, v in dict(data.get("addresses", {})).items()},
            )
        except (OSError, ValueError, KeyError, TypeError):
            return None

    def write(self, state_dir: Path) -> None:
        from waygate.core.files import write_file_atomically

        text = json.dumps(dataclasses.asdict(self), indent=2, sort_keys=True) + "\n"
        write_file_atomically(state_dir / UP_RECORD, text.encode(), 0o644)


class NoStateDirectory(Exception):
    """No --addr and no state directory to take addresses and TLS from."""

    def __init__(self) -> None:
        super().__init__(
            "no waygate state directory found (looked for .waygate here and in every parent, "
            f"WAYGATE_STATE_DIR, {user_state_dir()}); run `waygate up` in this directory or a "
            "parent, point at one with --state-dir DIR or WAYGATE_STATE_DIR, or give --addr "
            "HOST:PORT (with --ca-file, --cert-file/--key-file for TLS, or --plaintext)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientSettings:
    CONFIG_ENV: ClassVar[str] = "WAYGATE_CLIENT_CONFIG"

    state_dir: Path | None = setting(
        None,
        help="state directory written by `waygate up` (addresses, trust bundle, client "
        "certificate); unset: .waygate here or in the nearest parent, else "
        "~/.local/state/waygate",
    )
    ca_file: Path | None = setting(None, help="PEM CA bundle to verify the server with")
    cert_file: Path | None = setting(None, help="PEM client certificate (mTLS)")
    key_file: Path | None = setting(None, help="PEM client key (mTLS)")
    server_name: str | None = setting(None, help="name to verify in the server certificate")
    plaintext: bool = setting(False, help="no TLS, even when the state directory has a CA")
    timeout: float = setting(
        10.0, help="deadline of each call", parse=parse_duration, check=positive
    )
    log_level: str = setting("warning", help="log level", choices=LOG_LEVELS)
    otlp_endpoint: str | None = setting(
        None,
        help="OTLP/gRPC endpoint for traces",
        env=("WAYGATE_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT"),
    )

    def __post_init__(self) -> None:
        if (self.cert_file is None) != (self.key_file is None):
            raise SettingsError("invalid setting cert_file/key_file: give both or neither")

    def found_state_dir(self) -> Path | None:
        """The state directory in use: the one given, else the one found."""
        return self.state_dir if self.state_dir is not None else find_state_dir()

    @property
    def explicit_connection(self) -> bool:
        """TLS or plaintext was said explicitly (no state directory needed)."""
        return self.plaintext or self.ca_file is not None or self.cert_file is not None

    def tls(self) -> ClientTLS | None:
        if self.plaintext:
            return None
        if self.ca_file is not None or self.cert_file is not None:
            # An explicit CA or client certificate: exactly that (system roots when no CA).
            return ClientTLS(self.ca_file, self.cert_file, self.key_file, self.server_name)
        state_dir = self.found_state_dir()
        if state_dir is None:
            return None
        bundle = state_dir / "ca.pem"
        if not bundle.is_file():
            return None
        cert, key = state_dir / "client" / "cert.pem", state_dir / "client" / "key.pem"
        if cert.is_file() and key.is_file():
            return ClientTLS(bundle, cert, key, self.server_name)
        return ClientTLS(bundle, None, None, self.server_name)


def add_client_arguments(parser: argparse.ArgumentParser, default_port: int | None) -> None:
    """Connection flags; `--addr` too unless default_port is None (address given otherwise).

    Without --addr the address is the state directory's `up` address for the
    service whose default port is `default_port`."""
    if default_port is not None:
        parser.add_argument(
            "--addr",
            default=None,
            help="server address host:port [where the state directory's `waygate up` "
            f"serves it; 127.0.0.1:{default_port} with explicit TLS flags]",
        )
        parser.set_defaults(default_port=default_port)
    add_settings_arguments(parser, ClientSettings)


def add_output_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "-o",
        "--output",
        choices=OUTPUT_FORMATS,
        default="table",
        help="table (default), wide (more columns), json or yaml (everything, for scripts)",
    )


def render(document: Any, output: str, table_text: Callable[[bool], str]) -> str:
    """`document` as JSON or YAML, or `table_text(wide)` for table and wide."""
    if output == "json":
        return json.dumps(document, indent=2, sort_keys=False)
    if output == "yaml":
        import yaml

        return str(yaml.safe_dump(document, sort_keys=False, default_flow_style=False)).rstrip()
    return table_text(output == "wide")


def printable(value: object) -> str:
    """`value` as text a terminal shows as it is: every character that is not
    printable (C0/C1 controls, escape sequences, newlines, bidi overrides, line
    separators) written as a Python escape (`\\x1b`, `\\n`, `\\u202e`).

    Route, Gateway and Ingress fields come from whoever wrote them; a newline
    in one would forge a row of a table, an escape sequence rewrite the screen.
    Every human-facing line of a client command that carries such a field goes
    through here (`table` does it per cell)."""
    text = str(value)
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """Columns padded to their widest cell, two spaces apart (kubectl's look); every
    cell made `printable`, so no field can forge a row."""
    cells = [[printable(cell) for cell in row] for row in (header, *rows)]
    widths = [max(len(cell) for cell in column) for column in zip(*cells, strict=False)]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in cells
    )


def resolve_address(args: argparse.Namespace, settings: ClientSettings) -> str:
    """--addr, else where the state directory's `up` serves this command's service;
    NoStateDirectory when neither is known (unless TLS was given explicitly)."""
    if getattr(args, "addr", None):
        return str(args.addr)
    default_port = getattr(args, "default_port", None)
    state_dir = settings.found_state_dir()
    if state_dir is not None and default_port is not None:
        record = UpRecord.read(state_dir)
        if record is not None:
            return record.address(default_port)
        return f"127.0.0.1:{default_port}"
    if settings.explicit_connection and default_port is not None:
        return f"127.0.0.1:{default_port}"
    raise NoStateDirectory()


def client_settings(args: argparse.Namespace) -> ClientSettings:
    settings = settings_from_args(ClientSettings, args)
    configure_logging("cli", settings.log_level)
    configure_tracing("cli", settings.otlp_endpoint)
    return settings


def channel_for(
    args: argparse.Namespace, settings: ClientSettings, address: str | None = None
) -> grpc.aio.Channel:
    if address is None:
        address = args.addr = resolve_address(args, settings)
    return open_channel(address, tls=settings.tls())


def fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"waygate: {printable(message)}", file=sys.stderr)
    return code


def run_client(
    args: argparse.Namespace, body: Callable[[ClientSettings], Coroutine[Any, Any, int]]
) -> int:
    """Run one client command: settings, tracing, the call, errors as one line."""
    try:
        settings = client_settings(args)
    except SettingsError as exc:
        return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
    try:
        return asyncio.run(body(settings))
    except NoStateDirectory as exc:
        return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
    except grpc.aio.AioRpcError as exc:
        code = exc.code()
        if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return fail(
                f"cannot reach {args.addr}: {code.name}: {exc.details()}", EXIT_USAGE_OR_UNREACHABLE
            )
        return fail(f"{code.name}: {exc.details()}")
    except OSError as exc:
        return fail(f"{exc.strerror or exc}: {getattr(exc, 'filename', '') or ''}".rstrip(": "))
    finally:
        shutdown_tracing()


async def http_status(address: str, path: str, timeout: float) -> int | None:
    """The status code of `GET http://ADDRESS/PATH` (an admin port's /readyz or
    /healthz), or None when nothing answers within `timeout`."""
    host, _, port = address.rpartition(":")
    try:
        async with asyncio.timeout(timeout):
            reader, writer = await asyncio.open_connection(host, int(port))
            try:
                # Host: the address connected to, as kubelet's probes send it (admin
                # ports refuse names they were not given: waygate.core.admin).
                peer = writer.get_extra_info("peername")
                ip = str(peer[0]) if isinstance(peer, tuple) else "127.0.0.1"
                authority = f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"
                writer.write(f"GET {path} HTTP/1.1\r\nHost: {authority}\r\n\r\n".encode())
                line = await reader.readline()
            finally:
                writer.close()
    except (OSError, TimeoutError, ValueError):
        return None
    parts = line.split()
    return int(parts[1]) if len(parts) >= 2 and parts[1].isdigit() else None
