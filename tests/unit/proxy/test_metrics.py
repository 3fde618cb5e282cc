"""The proxy's request counters: raw keys on the request path, labels at export."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from waygate.proxy.metrics import ProxyCollector, ProxyMetrics


def test_requests_are_labelled_by_method_and_status_class_when_exported() -> None:
    metrics = ProxyMetrics()
    for method, status in ((b"GET", 200), (b"GET", 204), (b"BREW", 418), (b"PURGE", 404)):
        metrics.request("demo/echo", method, status)
    metrics.request("", b"POST", 503)
    rows = sorted(tuple(row) for row in metrics.snapshot()["requests"])
    assert rows == [
        ("", "POST", "5xx", 1),
        ("demo/echo", "GET", "2xx", 2),
        ("demo/echo", "OTHER", "4xx", 2),  # unknown methods merge under OTHER
    ]
    registry = CollectorRegistry()
    registry.register(ProxyCollector(metrics.snapshot))
    text = generate_latest(registry).decode()
    assert 'waygate_proxy_requests_total{code="2xx",method="GET",route="demo/echo"} 2.0' in text
