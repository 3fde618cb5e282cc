"""Prometheus gauges of the resolver's view, read live from the store at scrape time.

They answer the questions an operator asks when a consumer looks stale: how
many objects, which version, how many watchers, how old the sources' last
sync is, and whether the routes file is currently rejected.
"""

from __future__ import annotations

import functools

from prometheus_client import Gauge

from waygate.resolver.filesource import FileSource
from waygate.resolver.model import Kind
from waygate.resolver.store import Store

VERSION = Gauge("waygate_resolver_version", "Current version of the resolver's view.")
OBJECTS = Gauge("waygate_resolver_objects", "Objects in the resolver's view, by kind.", ["kind"])
WATCHERS = Gauge("waygate_resolver_watchers", "Open Watch subscriptions.")
LAST_SYNC = Gauge(
    "waygate_resolver_last_sync_timestamp_seconds",
    "When the sources last confirmed their data (oldest source; 0 before the first sync).",
)
ROUTES_FILE_VALID = Gauge(
    "waygate_resolver_routes_file_valid",
    "1 while the routes file's current content is in force, 0 while an edit is rejected.",
)


def _count(store: Store, kind: Kind) -> float:
    return store.counts()[kind]


def observe(store: Store, file_source: FileSource | None) -> None:
    """Point the gauges at this store (the last call wins: one store per process)."""
    VERSION.set_function(lambda: store.version)
    for kind in Kind:
        OBJECTS.labels(kind.value).set_function(functools.partial(_count, store, kind))
    WATCHERS.set_function(lambda: store.subscriber_count)

    def last_sync() -> float:
        when = store.last_sync()[1]
        return when.timestamp() if when is not None else 0.0

    LAST_SYNC.set_function(last_sync)
    if file_source is not None:
        ROUTES_FILE_VALID.set_function(lambda: 1.0 if file_source.last_error is None else 0.0)
