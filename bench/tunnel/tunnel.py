"""The tunnel's part of the benchmark: server and agent processes, and the dial client."""

from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path

from tests.support.pki import IdentityFiles, LocalCA


@dataclasses.dataclass
class TunnelReport:
    bulk_seconds: float | None
    lines: list[str]


async def measure(
    directory: Path,
    ca: LocalCA,
    server_files: IdentityFiles,
    client_files: IdentityFiles,
    bulk_port: int,
    http_port: int,
    total: int,
    dial_seconds: float,
) -> TunnelReport:
    if importlib.util.find_spec("waygate.tunnel.server_app") is None:
        return TunnelReport(None, ["Tunnel not measured: `waygate tunnel serve` is not there yet."])
    return TunnelReport(None, ["Tunnel not measured yet."])
