"""Writes the Grafana dashboards beside this file: `python generate.py`.

The JSON files are what ships (the component's ConfigMap); this script is how they
are edited, so every panel has the same datasource variable, grid and units.
tests/monitoring checks that the JSON is what this script writes and that every
metric a panel queries is one the services export.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DATASOURCE = {"type": "prometheus", "uid": "${datasource}"}
POD = '{namespace=~"$namespace"}'


def _panel(kind: str, title: str, targets: list[tuple[str, str]], unit: str, **extra: Any) -> dict:
    return {
        "type": kind,
        "title": title,
        "datasource": DATASOURCE,
        "fieldConfig": {"defaults": {"unit": unit}, "overrides": []},
        "targets": [
            {"refId": chr(ord("A") + i), "expr": expr, "legendFormat": legend}
            for i, (expr, legend) in enumerate(targets)
        ],
        **extra,
    }


def graph(title: str, *targets: tuple[str, str], unit: str = "short") -> dict:
    return _panel("timeseries", title, list(targets), unit)


def stat(title: str, expr: str, unit: str = "short", legend: str = "") -> dict:
    return _panel("stat", title, [(expr, legend)], unit)


def table(title: str, expr: str, unit: str = "short") -> dict:
    panel = _panel("table", title, [(expr, "")], unit)
    panel["targets"][0].update({"format": "table", "instant": True})
    return panel


def dashboard(uid: str, title: str, rows: list[list[dict]]) -> dict:
    """Rows of panels laid out left to right, each row 8 high, widths shared equally."""
    panels = []
    y = 0
    for row in rows:
        width = 24 // len(row)
        for i, panel in enumerate(row):
            panel = {**panel, "id": len(panels) + 1}
            panel["gridPos"] = {"x": i * width, "y": y, "w": width, "h": 8}
            panels.append(panel)
        y += 8
    return {
        "uid": uid,
        "title": title,
        "tags": ["waygate"],
        "timezone": "utc",
        "schemaVersion": 39,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-6h", "to": "now"},
        "templating": {
            "list": [
                {
                    "name": "datasource",
                    "label": "Prometheus",
                    "type": "datasource",
                    "query": "prometheus",
                },
                {
                    "name": "namespace",
                    "label": "Namespace",
                    "type": "query",
                    "datasource": DATASOURCE,
                    "query": "label_values(waygate_grpc_server_handled_total, namespace)",
                    "includeAll": True,
                    "multi": True,
                    "current": {"text": "All", "value": "$__all"},
                },
            ]
        },
        "links": [
            {"title": "Waygate", "type": "dashboards", "tags": ["waygate"], "asDropdown": True}
        ],
        "panels": panels,
    }


def rate(metric: str, by: str, selector: str = "", window: str = "5m") -> str:
    inner = selector[:-1] + ", " + POD[1:] if selector else POD
    return f"sum by ({by}) (rate({metric}{inner}[{window}]))"


def quantile(q: float, metric: str, by: str = "le") -> str:
    return f"histogram_quantile({q}, sum by ({by}) (rate({metric}_bucket{POD}[5m])))"


def grpc_rows(service: str) -> list[dict]:
    selector = f'{{grpc_service=~"waygate.{service}.v1.*"}}'
    return [
        graph(
            "gRPC calls by method and code",
            (
                rate("waygate_grpc_server_handled_total", "grpc_method, grpc_code", selector),
                "{{grpc_method}} {{grpc_code}}",
            ),
            unit="reqps",
        ),
        graph(
            "gRPC call p99 by method",
            (
                f"histogram_quantile(0.99, sum by (le, grpc_method) "
                f"(rate(waygate_grpc_server_handling_seconds_bucket{selector[:-1]}, "
                f"{POD[1:-1]}}}[5m])))",
                "{{grpc_method}}",
            ),
            unit="s",
        ),
    ]


def own_certificate() -> dict:
    return graph(
        "Own certificate: time left",
        (f"waygate_certificate_expiry_timestamp_seconds{POD} - time()", "{{pod}} {{identity}}"),
        unit="s",
    )


def proxy() -> dict:
    return dashboard(
        "waygate-proxy",
        "Waygate / proxy",
        [
            [
                graph(
                    "Requests by route",
                    (rate("waygate_proxy_requests_total", "route"), "{{route}}"),
                    unit="reqps",
                ),
                graph(
                    "Requests by status class",
                    (rate("waygate_proxy_requests_total", "code"), "{{code}}"),
                    unit="reqps",
                ),
            ],
            [
                graph(
                    "5xx ratio by route",
                    (
                        rate("waygate_proxy_requests_total", "route", '{code="5xx"}')
                        + " / "
                        + rate("waygate_proxy_requests_total", "route"),
                        "{{route}}",
                    ),
                    unit="percentunit",
                ),
                graph(
                    "Upstream latency (head sent to head received)",
                    (quantile(0.5, "waygate_proxy_upstream_latency_seconds"), "p50"),
                    (quantile(0.99, "waygate_proxy_upstream_latency_seconds"), "p99"),
                    unit="s",
                ),
            ],
            [
                graph(
                    "Upstream p50 by route",
                    (
                        quantile(0.5, "waygate_proxy_route_upstream_latency_seconds", "le, route"),
                        "{{route}}",
                    ),
                    unit="s",
                ),
                graph(
                    "Upstream p99 by route",
                    (
                        quantile(0.99, "waygate_proxy_route_upstream_latency_seconds", "le, route"),
                        "{{route}}",
                    ),
                    unit="s",
                ),
            ],
            [
                graph(
                    "Local responses by reason (refused, no route, no endpoint, timeouts)",
                    (rate("waygate_proxy_local_responses_total", "reason"), "{{reason}}"),
                    unit="reqps",
                ),
                graph(
                    "Upstream connect errors and TLS failures",
                    (rate("waygate_proxy_upstream_connect_errors_total", "reason"), "{{reason}}"),
                    (
                        rate("waygate_proxy_upstream_tls_failures_total", "route, reason"),
                        "TLS {{route}} {{reason}}",
                    ),
                    unit="ops",
                ),
            ],
            [
                graph(
                    "Connections",
                    (f"sum(waygate_proxy_client_connections{POD})", "client"),
                    (f"sum(waygate_proxy_upstream_connections{POD})", "upstream"),
                ),
                graph(
                    "Passive health: endpoints skipped",
                    (f"waygate_proxy_passive_health_skipped_endpoints{POD}", "{{pod}}"),
                ),
                graph(
                    "Bytes",
                    (f"sum(rate(waygate_proxy_client_received_bytes_total{POD}[5m]))", "in"),
                    (f"sum(rate(waygate_proxy_client_sent_bytes_total{POD}[5m]))", "out"),
                    unit="Bps",
                ),
            ],
            [
                table(
                    "Route certificates: time left",
                    f"waygate_proxy_route_certificate_expiry_timestamp_seconds{POD} - time()",
                    unit="s",
                ),
                graph(
                    "HTTPS connections by outcome",
                    (rate("waygate_proxy_tls_connections_total", "outcome"), "{{outcome}}"),
                    unit="ops",
                ),
                own_certificate(),
            ],
        ],
    )


def resolver() -> dict:
    return dashboard(
        "waygate-resolver",
        "Waygate / resolver",
        [
            [
                stat("Routes file valid (min)", f"min(waygate_resolver_routes_file_valid{POD})"),
                stat("View version (max)", f"max(waygate_resolver_version{POD})"),
                stat("Watchers", f"sum(waygate_resolver_watchers{POD})"),
                stat(
                    "Sources' last sync",
                    f"time() - min(waygate_resolver_last_sync_timestamp_seconds{POD})",
                    unit="s",
                ),
            ],
            [
                graph(
                    "Objects by kind",
                    (f"max by (kind) (waygate_resolver_objects{POD})", "{{kind}}"),
                ),
                table(
                    "Ready endpoints by route",
                    f"max by (route) (waygate_resolver_route_ready_endpoints{POD})",
                ),
            ],
            [
                graph(
                    "Consumers: view staleness",
                    (f"waygate_resolver_client_staleness_seconds{POD}", "{{pod}}"),
                    unit="s",
                ),
                graph(
                    "Consumers: Watch reconnects",
                    (rate("waygate_resolver_client_reconnects_total", "pod"), "{{pod}}"),
                    unit="ops",
                ),
                graph(
                    "Kubernetes relists and watch restarts",
                    (rate("waygate_kube_relists_total", "resource"), "relist {{resource}}"),
                    (
                        rate("waygate_kube_watch_restarts_total", "resource, reason"),
                        "{{resource}} {{reason}}",
                    ),
                    unit="ops",
                ),
            ],
            [*grpc_rows("resolver"), own_certificate()],
        ],
    )


def certs() -> dict:
    return dashboard(
        "waygate-certs",
        "Waygate / certs",
        [
            [
                stat("Leader", f"sum(waygate_certs_leader{POD})"),
                stat("Trust bundle version", f"max(waygate_certs_trust_bundle_version{POD})"),
                stat("Signing backlog", f"sum(waygate_certs_signing_backlog{POD})"),
                stat(
                    "Active CA: time left",
                    'min(waygate_certs_ca_not_after_timestamp_seconds{state="ACTIVE", '
                    'namespace=~"$namespace"}) - time()',
                    unit="s",
                ),
            ],
            [
                graph(
                    "Issued and refused",
                    (f"sum(rate(waygate_certs_issued_total{POD}[5m]))", "issued"),
                    (rate("waygate_certs_refused_total", "reason"), "refused {{reason}}"),
                    unit="ops",
                ),
                graph(
                    "Renewals by outcome (every Waygate process)",
                    (
                        rate("waygate_certificate_renewals_total", "result", window="30m"),
                        "{{result}}",
                    ),
                    unit="ops",
                ),
                graph(
                    "Kubernetes CSR decisions",
                    (
                        rate("waygate_certs_csr_decisions_total", "signer, decision"),
                        "{{signer}} {{decision}}",
                    ),
                    unit="ops",
                ),
            ],
            [
                graph(
                    "CAs in the bundle: time left",
                    (
                        f"waygate_certs_ca_not_after_timestamp_seconds{POD} - time()",
                        "{{state}} {{fingerprint}}",
                    ),
                    unit="s",
                ),
                graph(
                    "Leader transitions",
                    (rate("waygate_certs_leader_transitions_total", "pod", window="1h"), "{{pod}}"),
                    unit="ops",
                ),
            ],
            [
                stat(
                    "CA rotation: consumers holding the next step",
                    f"max(waygate_certs_rotation_waiting_consumers{POD})",
                ),
                graph(
                    "Trust bundle version each consumer applied",
                    (
                        f"max by (identity, instance) (waygate_certs_consumer_bundle_version{POD})",
                        "{{identity}} {{instance}}",
                    ),
                ),
                graph(
                    "Time until trust breaks (every Waygate process)",
                    (f"waygate_trust_expiry_timestamp_seconds{POD} - time()", "{{pod}}"),
                    unit="s",
                ),
            ],
            [*grpc_rows("certs"), own_certificate()],
        ],
    )


def tunnel() -> dict:
    return dashboard(
        "waygate-tunnel",
        "Waygate / tunnel",
        [
            [
                stat("Agents (max per replica)", f"max(waygate_tunnel_server_agents{POD})"),
                graph("Agents by replica", (f"waygate_tunnel_server_agents{POD}", "{{pod}}")),
                graph(
                    "Raw dials by how they are carried (end_to_end: the replica splices)",
                    (rate("waygate_tunnel_server_raw_dials_total", "carried"), "{{carried}}"),
                    unit="ops",
                ),
            ],
            grpc_rows("tunnel"),
            [
                graph(
                    "Refused by fair share",
                    (rate("waygate_grpc_server_refused_total", "pod, limit"), "{{pod}} {{limit}}"),
                    unit="ops",
                ),
                own_certificate(),
            ],
        ],
    )


def overview() -> dict:
    return dashboard(
        "waygate-overview",
        "Waygate / overview",
        [
            [
                stat(
                    "Requests/s",
                    f"sum(rate(waygate_proxy_requests_total{POD}[5m]))",
                    unit="reqps",
                ),
                stat(
                    "5xx ratio",
                    f'sum(rate(waygate_proxy_requests_total{{code="5xx", namespace=~"$namespace"}}[5m]))'
                    f" / sum(rate(waygate_proxy_requests_total{POD}[5m]))",
                    unit="percentunit",
                ),
                stat(
                    "Upstream p99",
                    quantile(0.99, "waygate_proxy_upstream_latency_seconds"),
                    unit="s",
                ),
                stat(
                    "Routes without endpoints",
                    f"count(max by (route) (waygate_resolver_route_ready_endpoints{POD}) == 0) or vector(0)",
                ),
            ],
            [
                stat(
                    "Soonest certificate expiry",
                    f"min(waygate_certificate_expiry_timestamp_seconds{POD}) - time()",
                    unit="s",
                ),
                stat(
                    "Time until trust breaks",
                    f"min(waygate_trust_expiry_timestamp_seconds{POD}) - time()",
                    unit="s",
                ),
                stat(
                    "Oldest resolver view",
                    f"max(waygate_resolver_client_staleness_seconds{POD})",
                    unit="s",
                ),
                stat("Routes file valid", f"min(waygate_resolver_routes_file_valid{POD})"),
                stat("Edge agents (max per replica)", f"max(waygate_tunnel_server_agents{POD})"),
            ],
            [
                graph(
                    "Requests by status class",
                    (rate("waygate_proxy_requests_total", "code"), "{{code}}"),
                    unit="reqps",
                ),
                graph(
                    "gRPC errors by service",
                    (
                        rate(
                            "waygate_grpc_server_handled_total",
                            "grpc_service",
                            '{grpc_code!="OK"}',
                        ),
                        "{{grpc_service}}",
                    ),
                    unit="ops",
                ),
            ],
        ],
    )


DASHBOARDS = {
    "waygate-overview.json": overview,
    "waygate-proxy.json": proxy,
    "waygate-resolver.json": resolver,
    "waygate-certs.json": certs,
    "waygate-tunnel.json": tunnel,
}


def render() -> dict[str, str]:
    return {name: json.dumps(build(), indent=2) + "\n" for name, build in DASHBOARDS.items()}


if __name__ == "__main__":
    for name, text in render().items():
        (HERE / name).write_text(text)
