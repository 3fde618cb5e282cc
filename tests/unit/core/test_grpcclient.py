"""waygate.core.grpcclient: the options every client channel carries."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from waygate.core import grpcclient


def test_every_channel_reconnects_within_seconds_of_its_peer_returning(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """gRPC's default reconnect backoff reaches 120 s; the proxy's long-lived
    resolver channel would stay away that long after the resolver came back."""
    seen: list[dict[str, Any]] = []

    def capture(address: str, options: list[tuple[str, Any]], **kwargs: Any) -> object:
        seen.append(dict(options))
        return object()

    monkeypatch.setattr(grpc.aio, "insecure_channel", capture)
    grpcclient.open_channel("127.0.0.1:1")
    grpcclient.open_channel("127.0.0.1:1", retry=False)
    for options in seen:
        assert options["grpc.max_reconnect_backoff_ms"] <= 10_000
        assert options["grpc.initial_reconnect_backoff_ms"] <= 1_000
