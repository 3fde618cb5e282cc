"""The proxy's Prometheus metrics, counted in plain dicts and exported at scrape time.

The request path only bumps integers in dicts (no prometheus_client child
lookups or locks per request); a custom collector turns them into metric
families when /metrics is scraped. With `--workers`, each worker reports its
whole registry to the parent (`waygate.core.workers`), labelled `worker`.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
)
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
STATUS_CLASSES = ("1xx", "2xx", "3xx", "4xx", "5xx")
_METHODS = {
    m: m.decode()
    for m in (b"GET", b"HEAD", b"POST", b"PUT", b"DELETE", b"PATCH", b"OPTIONS", b"TRACE")
}


def method_label(method: bytes) -> str:
    return _METHODS.get(method, "OTHER")


class ProxyMetrics:
    def __init__(self) -> None:
        # (route, method as sent, status // 100) -> count; labelled when exported
        # (snapshot), so a request costs one tuple and one dict update.
        self.requests: dict[tuple[str, bytes, int], int] = {}
        self.connect_errors: dict[str, int] = {}
        self.refused: dict[str, int] = {}  # local 4xx/5xx answers by reason kind
        self.latency_counts = [0] * (len(LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0
        # The same buckets per route (the status page's p50/p99, the dashboards').
        self.route_latency: dict[str, list[int]] = {}
        self.route_latency_sum: dict[str, float] = {}
        self.client_connections = 0
        self.upstream_connections = 0
        self.upstream_opened = 0
        self.pool_reused = 0
        self.bytes_in = 0  # from clients
        self.bytes_out = 0  # to clients
        self.passive_health_skipped = 0
        self.redispatches = 0
        self.evicted_idle = 0  # idle keep-alive connections closed to make room

    def request(self, route: str, method: bytes, status: int) -> None:
        key = (route, method, status // 100)
        self.requests[key] = self.requests.get(key, 0) + 1

    def latency(self, seconds: float, route: str = "") -> None:
        index = bisect.bisect_left(LATENCY_BUCKETS, seconds)
        self.latency_counts[index] += 1
        self.latency_sum += seconds
        if route:
            counts = self.route_latency.get(route)
            if counts is None:
                counts = self.route_latency[route] = [0] * (len(LATENCY_BUCKETS) + 1)
            counts[index] += 1
            self.route_latency_sum[route] = self.route_latency_sum.get(route, 0.0) + seconds

    def connect_error(self, kind: str) -> None:
        self.connect_errors[kind] = self.connect_errors.get(kind, 0) + 1

    def _labelled_requests(self) -> list[list[Any]]:
        """[route, method label, status class, count] rows (unknown methods merged)."""
        merged: dict[tuple[str, str, str], int] = {}
        for (route, method, hundreds), count in self.requests.items():
            key = (
                route,
                _METHODS.get(method, "OTHER"),
                STATUS_CLASSES[min(max(hundreds, 1), 5) - 1],
            )
            merged[key] = merged.get(key, 0) + count
        return [[*key, count] for key, count in merged.items()]

    def snapshot(self) -> dict[str, Any]:
        return {
            "requests": self._labelled_requests(),
            "connect_errors": dict(self.connect_errors),
            "refused": dict(self.refused),
            "latency_counts": list(self.latency_counts),
            "latency_sum": self.latency_sum,
            "route_latency": {route: list(c) for route, c in self.route_latency.items()},
            "route_latency_sum": dict(self.route_latency_sum),
            "client_connections": self.client_connections,
            "upstream_connections": self.upstream_connections,
            "upstream_opened": self.upstream_opened,
            "pool_reused": self.pool_reused,
            "bytes_in": self.bytes_in,
            "bytes_out": self.bytes_out,
            "passive_health_skipped": self.passive_health_skipped,
            "redispatches": self.redispatches,
            "evicted_idle": self.evicted_idle,
        }


def _cumulative(counts: list[int]) -> list[tuple[str, float]]:
    """Per-bucket counts -> Prometheus's cumulative (le, count) pairs."""
    buckets = []
    running = 0
    for bound, count in zip([*map(str, LATENCY_BUCKETS), "+Inf"], counts, strict=True):
        running += count
        buckets.append((bound, float(running)))
    return buckets


def quantile(counts: list[int], q: float) -> float | None:
    """The q-quantile of per-bucket counts, interpolated within its bucket as
    Prometheus's histogram_quantile does (None: no observation; the last finite
    bound when it falls in +Inf)."""
    total = sum(counts)
    if not total:
        return None
    rank = q * total
    running = 0
    for index, count in enumerate(counts):
        if running + count >= rank and count:
            if index == len(LATENCY_BUCKETS):
                return LATENCY_BUCKETS[-1]
            lower = LATENCY_BUCKETS[index - 1] if index else 0.0
            upper = LATENCY_BUCKETS[index]
            return lower + (upper - lower) * (rank - running) / count
        running += count
    return LATENCY_BUCKETS[-1]


class ProxyCollector(Collector):
    """Exports snapshots from `source()` (this process, or every worker merged)."""

    def __init__(self, source: Any) -> None:
        self._source = source

    def collect(self) -> Iterator[Any]:
        snap = self._source()
        requests = CounterMetricFamily(
            "waygate_proxy_requests",
            "HTTP requests answered, by route (the matched route whatever the answer; "
            'route="" for requests no route took), method and status class',
            labels=["route", "method", "code"],
        )
        for route, method, cls, count in snap["requests"]:
            requests.add_metric([route, method, cls], count)
        yield requests
        errors = CounterMetricFamily(
            "waygate_proxy_upstream_connect_errors",
            "failed upstream connects, by reason",
            labels=["reason"],
        )
        for reason, count in snap["connect_errors"].items():
            errors.add_metric([reason], count)
        yield errors
        refused = CounterMetricFamily(
            "waygate_proxy_local_responses",
            "requests the proxy answered itself (refused, no route, no endpoint, timeouts)",
            labels=["reason"],
        )
        for reason, count in snap["refused"].items():
            refused.add_metric([reason], count)
        yield refused
        histogram = HistogramMetricFamily(
            "waygate_proxy_upstream_latency_seconds",
            "time from the request head sent upstream to the response head received",
            buckets=_cumulative(snap["latency_counts"]),
            sum_value=snap["latency_sum"],
        )
        yield histogram
        by_route = HistogramMetricFamily(
            "waygate_proxy_route_upstream_latency_seconds",
            "upstream_latency_seconds by route",
            labels=["route"],
        )
        for route, counts in snap["route_latency"].items():
            by_route.add_metric(
                [route], _cumulative(counts), sum_value=snap["route_latency_sum"][route]
            )
        yield by_route
        for name, help_text, field in (
            ("waygate_proxy_client_connections", "open client connections", "client_connections"),
            (
                "waygate_proxy_upstream_connections",
                "open upstream connections (busy and idle)",
                "upstream_connections",
            ),
            (
                "waygate_proxy_passive_health_skipped_endpoints",
                "endpoints skipped for now because their connects kept failing",
                "passive_health_skipped",
            ),
        ):
            yield GaugeMetricFamily(name, help_text, value=snap[field])
        for name, help_text, field in (
            ("waygate_proxy_upstream_connections_opened", "upstream connects", "upstream_opened"),
            (
                "waygate_proxy_pool_reused",
                "requests sent on a pooled keep-alive connection",
                "pool_reused",
            ),
            ("waygate_proxy_client_received_bytes", "bytes received from clients", "bytes_in"),
            ("waygate_proxy_client_sent_bytes", "bytes sent to clients", "bytes_out"),
            (
                "waygate_proxy_redispatches",
                "requests sent to another endpoint after a failed connect",
                "redispatches",
            ),
            (
                "waygate_proxy_idle_connections_evicted",
                "idle client keep-alive connections closed to make room for new ones",
                "evicted_idle",
            ),
        ):
            yield CounterMetricFamily(name, help_text, value=snap.get(field, 0))
