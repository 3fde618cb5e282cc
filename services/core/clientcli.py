"""What every client command (`waygate resolve`, `waygate cert bundle`, ...) shares.

Connection settings come from flags > WAYGATE_* env > --config, like a
service's. Without explicit TLS flags a client looks in the state directory
that `waygate up` writes (`./.waygate` unless WAYGATE_STATE_DIR says
otherwise): with a `ca.pem` there it speaks TLS, presenting
`client/cert.pem` + `client/key.pem` when present, so commands work next to
`waygate up` without flags. RPC failures become one line on stderr and a
non-zero exit, never a traceback.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from collections.abc import Callable, Coroutine
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


@dataclasses.dataclass(frozen=True, kw_only=True)
class ClientSettings:
    CONFIG_ENV: ClassVar[str] = "WAYGATE_CLIENT_CONFIG"

    state_dir: Path = setting(Path(".waygate"), help="state directory written by `waygate up`")
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

    def tls(self) -> ClientTLS | None:
        if self.plaintext:
            return None
        if self.ca_file is not None or self.cert_file is not None:
            # An explicit CA or client certificate: exactly that (system roots when no CA).
            return ClientTLS(self.ca_file, self.cert_file, self.key_file, self.server_name)
        bundle = self.state_dir / "ca.pem"
        if not bundle.is_file():
            return None
        cert, key = self.state_dir / "client" / "cert.pem", self.state_dir / "client" / "key.pem"
        if cert.is_file() and key.is_file():
            return ClientTLS(bundle, cert, key, self.server_name)
        return ClientTLS(bundle, None, None, self.server_name)


def add_client_arguments(parser: argparse.ArgumentParser, default_port: int | None) -> None:
    """Connection flags; `--addr` too unless default_port is None (address given otherwise)."""
    if default_port is not None:
        parser.add_argument(
            "--addr",
            default=f"127.0.0.1:{default_port}",
            help="server address host:port [%(default)s]",
        )
    add_settings_arguments(parser, ClientSettings)


def client_settings(args: argparse.Namespace) -> ClientSettings:
    settings = settings_from_args(ClientSettings, args)
    configure_logging("cli", settings.log_level)
    configure_tracing("cli", settings.otlp_endpoint)
    return settings


def channel_for(
    args: argparse.Namespace, settings: ClientSettings, address: str | None = None
) -> grpc.aio.Channel:
    return open_channel(address or args.addr, tls=settings.tls())


def fail(message: str, code: int = EXIT_FAILED) -> int:
    print(f"waygate: {message}", file=sys.stderr)
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
