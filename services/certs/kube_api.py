"""certs' name for the shared Kubernetes layer (`waygate.core.kube`).

certs' Kubernetes parts (the Secret store, the bundle ConfigMap, the CSR
controller, TokenReview, the leader Lease) all use the one client and
reflector in `waygate.core.kube`; this module only keeps the names they and
their tests import.
"""

from __future__ import annotations

from waygate.core.kube import (
    JSON,
    WATCH_READ_MARGIN,
    KubeAPI,
    KubeError,
    Reflector,
    WatchStream,
    _server_message,
    load_api_client,
)

__all__ = [
    "JSON",
    "WATCH_READ_MARGIN",
    "KubeAPI",
    "KubeError",
    "Reflector",
    "WatchStream",
    "_server_message",
    "load_api_client",
]
