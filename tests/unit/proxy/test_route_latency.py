"""Per-route upstream latency: the buckets behind the status page's p50/p99 and
the route-labelled histogram, with quantiles interpolated as Prometheus does."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from waygate.proxy.metrics import LATENCY_BUCKETS, ProxyCollector, ProxyMetrics, quantile


def test_latency_is_counted_per_route_and_overall():
    metrics = ProxyMetrics()
    for seconds in (0.002, 0.002, 0.004, 0.2):
        metrics.latency(seconds, "demo/echo")
    metrics.latency(0.5)  # no route: counted overall only
    assert sum(metrics.latency_counts) == 5
    assert sum(metrics.route_latency["demo/echo"]) == 4
    registry = CollectorRegistry()
    registry.register(ProxyCollector(metrics.snapshot))
    text = generate_latest(registry).decode()
    assert (
        'waygate_proxy_route_upstream_latency_seconds_bucket{le="0.0025",route="demo/echo"} 2.0'
        in text
    )
    assert 'waygate_proxy_route_upstream_latency_seconds_count{route="demo/echo"} 4.0' in text


def test_quantiles_interpolate_within_the_bucket():
    counts = [0] * (len(LATENCY_BUCKETS) + 1)
    assert quantile(counts, 0.5) is None
    counts[LATENCY_BUCKETS.index(0.005)] = 10  # ten answers in (0.0025, 0.005]
    assert quantile(counts, 0.5) == 0.0025 + (0.005 - 0.0025) * 0.5
    assert quantile(counts, 1.0) == 0.005
    counts[-1] = 90  # most slower than the last bound: the last bound is all we know
    assert quantile(counts, 0.99) == LATENCY_BUCKETS[-1]
