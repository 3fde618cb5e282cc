"""Prometheus gauges of the resolver's view, read live from the store at scrape time.

They answer the questions an operator asks when a consumer looks stale: how
many objects, which version, how many watchers, how old the sources' last
sync is, and whether each route source (the routes file, a manifests path,
Kubernetes) is currently rejected or failing, and since when.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from prometheus_client import REGISTRY, Gauge
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

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


class RouteEndpoints(Collector):
    """Ready endpoints behind each route (its backends with a weight above 0), so an
    alert can name a route that answers 503 before any client tries it."""

    def __init__(self) -> None:
        self.store: Store | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        # Also each route's conditions (one family each; both from one pass).
        family = GaugeMetricFamily(
            "waygate_resolver_route_ready_endpoints",
            "Ready endpoints of the services a route sends traffic to (weight above 0).",
            labels=["route"],
        )
        store = self.store
        if store is None:
            yield family
            return
        conditions = GaugeMetricFamily(
            "waygate_resolver_route_condition",
            "1 for each condition a route has now (waygate.resolver.status): its type, "
            "status and reason, e.g. ResolvedRefs False ServiceNotFound.",
            labels=["route", "type", "status", "reason"],
        )
        for route in store.routes():
            ready = sum(
                endpoint.ready
                for backend in route.backends
                if backend.weight > 0
                for endpoint in store.endpoints_of(route.namespace, backend.service)
            )
            name = f"{route.namespace}/{route.name}"
            family.add_metric([name], ready)
            for condition in route.status.conditions if route.status is not None else ():
                conditions.add_metric(
                    [name, condition.type, condition.status, condition.reason], 1.0
                )
        yield family
        yield conditions


ROUTE_ENDPOINTS = RouteEndpoints()
REGISTRY.register(ROUTE_ENDPOINTS)


class SourceStates(Collector):
    """Each route source's own state (the routes file, every manifests path,
    Kubernetes): valid or not, and when its current run of errors began, so an
    alert fires on a rejected edit the resolver otherwise only logs."""

    def __init__(self) -> None:
        self.store: Store | None = None

    def collect(self) -> Iterator[GaugeMetricFamily]:
        valid = GaugeMetricFamily(
            "waygate_resolver_source_valid",
            "1 while a route source's current content is in force, 0 while it is rejected "
            "or failing (the last good state is served).",
            labels=["source"],
        )
        since = GaugeMetricFamily(
            "waygate_resolver_source_last_error_timestamp_seconds",
            "When a route source's current error began (Unix time); 0 while it is valid.",
            labels=["source"],
        )
        for state in self.store.source_states() if self.store is not None else ():
            valid.add_metric([state.source], 1.0 if state.valid else 0.0)
            since.add_metric(
                [state.source], state.error_since.timestamp() if state.error_since else 0.0
            )
        yield valid
        yield since


SOURCE_STATES = SourceStates()
REGISTRY.register(SOURCE_STATES)


def _count(store: Store, kind: Kind) -> float:
    return store.counts()[kind]


def observe(store: Store, file_source: FileSource | None) -> None:
    """Point the gauges at this store (the last call wins: one store per process)."""
    VERSION.set_function(lambda: store.version)
    for kind in Kind:
        OBJECTS.labels(kind.value).set_function(functools.partial(_count, store, kind))
    WATCHERS.set_function(lambda: store.subscriber_count)
    ROUTE_ENDPOINTS.store = store
    SOURCE_STATES.store = store

    def last_sync() -> float:
        when = store.last_sync()[1]
        return when.timestamp() if when is not None else 0.0

    LAST_SYNC.set_function(last_sync)
    if file_source is not None:
        ROUTES_FILE_VALID.set_function(lambda: 1.0 if file_source.last_error is None else 0.0)
