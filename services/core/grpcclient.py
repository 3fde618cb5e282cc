"""gRPC channels for Waygate clients: services calling services, and the CLI.

Every channel carries the tracing interceptors (CLIENT span + W3C context in
the metadata), keepalive pings that detect dead peers behind NAT or a load
balancer, and a retry policy for UNAVAILABLE on every method (the call never
reached a handler, so a retry is safe). TLS is optional: server verification
against a CA bundle, plus a client certificate for mTLS.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc

from waygate.core import tracing

RETRY_SERVICE_CONFIG = json.dumps(
    {
        "methodConfig": [
            {
                "name": [{}],
                "retryPolicy": {
                    "maxAttempts": 4,
                    "initialBackoff": "0.1s",
                    "maxBackoff": "2s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        ]
    }
)

#: The most a client channel receives in one message (gRPC's default, which these
#: channels keep): servers size what they stream to clients under it.
CLIENT_RECEIVE_BYTES = 4 * 1024 * 1024

KEEPALIVE_OPTIONS: tuple[tuple[str, Any], ...] = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
    # gRPC's own reconnect backoff grows to 120 s: a long-lived channel (the
    # proxy's resolver Watch, a service's certs client) would stay away for
    # minutes after its peer came back. Capped at 10 s, starting at 0.5 s.
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 10_000),
)


@dataclass(frozen=True)
class ClientTLS:
    """Where a client finds its trust anchors and (for mTLS) its own certificate."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    # Name to verify in the server certificate when it differs from the address host.
    server_name: str | None = None

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes() if self.ca_file else None,
            private_key=self.key_file.read_bytes() if self.key_file else None,
            certificate_chain=self.cert_file.read_bytes() if self.cert_file else None,
        )


def open_channel(
    address: str,
    *,
    tls: ClientTLS | None = None,
    credentials: grpc.ChannelCredentials | None = None,
    server_name: str | None = None,
    retry: bool = True,
    options: Sequence[tuple[str, Any]] = (),
    traced: bool = True,
) -> grpc.aio.Channel:
    """An aio channel to `address` (host:port). Plaintext unless tls or credentials are given.

    `traced=False`: no tracing interceptors. For a channel opened per stream and
    closed when the stream ends (the tunnel agent's Connect attempts): a call
    through the interceptors keeps its TCP connection open well after the
    channel's `close()` (measured: about 13 connections left per tunnel-server
    restart in each agent, released only later), and such a stream makes its own
    spans anyway."""
    opts: list[tuple[str, Any]] = [*KEEPALIVE_OPTIONS, *options]
    if retry:
        opts += [("grpc.enable_retries", 1), ("grpc.service_config", RETRY_SERVICE_CONFIG)]
    else:
        opts.append(("grpc.enable_retries", 0))
    name = server_name or (tls.server_name if tls else None)
    if name:
        opts.append(("grpc.ssl_target_name_override", name))
    if tls is not None and credentials is None:
        credentials = tls.credentials()
    interceptors = tracing.client_interceptors() if traced else None
    if credentials is None:
        return grpc.aio.insecure_channel(address, options=opts, interceptors=interceptors)
    return grpc.aio.secure_channel(address, credentials, options=opts, interceptors=interceptors)
