"""The proxy's sections of the status page (`waygate.core.statuspage`).

Read at request time from what the proxy already holds: its route table (routes,
their endpoints, passive-health skips), its request counters and per-route
latency buckets, and the resolver view it serves from. Nothing here runs on the
request path.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

from waygate.core.statuspage import Section, Traffic, cell, duration_text, expiry_cell
from waygate.proxy.metrics import ProxyMetrics, quantile
from waygate.proxy.server import ProxyServer

#: The route label of requests no route took (the Routes section's "unrouted" row).
UNROUTED = ""
#: A route whose share of 5xx answers is above this is shown as failing.
ERROR_SHARE_BAD = 0.05
#: A view older than this (no event, no heartbeat) is shown as stale: a little
#: over two of the resolver's 30 s heartbeats (the client's own default).
STALE_AFTER = 75.0


def _traffic(metrics: ProxyMetrics) -> dict[str, tuple[int, int]]:
    """route -> (requests, 5xx answers)."""
    totals: dict[str, tuple[int, int]] = {}
    for (route, _method, hundreds), count in metrics.requests.items():
        requests, errors = totals.get(route, (0, 0))
        totals[route] = (requests + count, errors + (count if hundreds == 5 else 0))
    return totals


def traffic(server: ProxyServer) -> Traffic:
    """The status document's summary line: every request, 5xx, unrouted."""
    totals = _traffic(server.metrics)
    return Traffic(
        requests=sum(requests for requests, _ in totals.values()),
        errors_5xx=sum(errors for _, errors in totals.values()),
        unrouted=totals.get(UNROUTED, (0, 0))[0],
    )


def _ms(seconds: float | None) -> str:
    return "" if seconds is None else f"{seconds * 1000:.1f} ms"


def route_sections(server: ProxyServer) -> list[Section]:
    traffic = _traffic(server.metrics)
    routes: list[list[Any]] = []
    endpoints: list[list[Any]] = []
    for entry in sorted(server.table.entries(), key=lambda e: e.options.name):
        name = entry.options.name
        route = entry.route
        targets = [(b, t) for b in entry.backends for t in b.picker.targets]
        skipped = sum(server.health.skipped(t) for _, t in targets)
        usable = len(targets) - skipped
        ready = cell(
            f"{usable}/{len(targets)}",
            "bad" if not usable else "warn" if skipped else "ok",
            title="endpoints taking traffic / endpoints",
        )
        requests, errors = traffic.get(name, (0, 0))
        share = errors / requests if requests else 0.0
        counts = server.metrics.route_latency.get(name)
        routes.append(
            [
                name,
                f"{route.host}{route.path}",
                ", ".join(b.service for b in entry.backends) or "(no backend)",
                ready,
                requests,
                cell(errors, "bad" if share > ERROR_SHARE_BAD else ""),
                _ms(quantile(counts, 0.5) if counts else None),
                _ms(quantile(counts, 0.99) if counts else None),
            ]
        )
        for backend, target in targets:
            where = f"{target.address}:{target.port}"
            if target.tunnel:
                where += f" via tunnel to {target.node}"
            state = (
                cell("skipped (connects failing)", "bad")
                if server.health.skipped(target)
                else cell("ok", "ok")
            )
            endpoints.append([name, backend.service, where, state])
    failing = any(row[3]["state"] == "bad" for row in routes)
    # Requests no route took are counted under route "" (the metrics' contract).
    unrouted, unrouted_errors = traffic.get(UNROUTED, (0, 0))
    routes.append(
        [
            cell("unrouted", "warn" if unrouted else ""),
            "no route took these (unknown host or path)",
            "",
            "",
            unrouted,
            unrouted_errors,
            "",
            "",
        ]
    )
    return [
        Section(
            "Routes",
            ["route", "host/path", "backends", "endpoints", "requests", "5xx", "p50", "p99"],
            routes,
            note="served by this proxy; p50/p99: upstream response-head latency",
            state="bad" if failing else "ok",
            empty="no route: the resolver has sent none yet",
        ),
        Section(
            "Endpoints",
            ["route", "service", "address", "passive health"],
            endpoints,
            note=f"{server.metrics.passive_health_skipped} skipped after failed connects",
        ),
    ]


def view_sections(watch: Any) -> list[Section]:
    """The resolver view the proxy serves from: freshness and tunnel presence."""
    view = watch.view
    staleness = watch.staleness()
    if view is None:
        note, state = "no view from the resolver yet", "bad"
    elif not watch.connected or staleness > STALE_AFTER:
        age = "never" if math.isinf(staleness) else duration_text(staleness) + " ago"
        note, state = f"stale: last confirmed {age}; serving the last view", "bad"
    else:
        note, state = f"fresh: confirmed {duration_text(staleness)} ago", "ok"
    rows: list[list[Any]] = []
    if view is not None:
        rows.append(["version", view.version])
        rows.append(["routes", len(view.routes)])
        rows.append(["services", len(view.services)])
    tunnels = [
        [presence.node, ", ".join(s.id for s in presence.servers) or cell("none", "bad")]
        for presence in (view.tunnels.values() if view is not None else ())
    ]
    return [
        Section("Resolver view", ["", ""], rows, note=note, state=state),
        Section(
            "Tunnel presence",
            ["node", "held by tunnel replicas"],
            sorted(tunnels, key=lambda row: str(row[0])),
            empty="no edge node is connected",
        ),
    ]


REFUSED_SECTION = "Route certificates refused"


def certificate_sections(front: Any) -> list[Section]:
    """The routes' own certificates the HTTPS listener serves (nothing renews them)."""
    if front is None:
        return []
    rows = [
        [
            host,
            served.leaf.subject.rfc4514_string(),
            expiry_cell(served.not_after, served.not_before),
        ]
        for host, served in sorted(front.certificates.served(), key=lambda pair: pair[0])
    ]
    found = [
        Section(
            "Route certificates",
            ["host", "subject", "expires in"],
            rows,
            note="routes' own certificates, served by SNI (others get the proxy's)",
            empty="no route brings its own certificate",
        )
    ]
    if front.certificates.refusals:
        # `waygate check` lists these rows (section title and columns are its contract).
        found.append(
            Section(
                REFUSED_SECTION,
                ["route", "host", "reason"],
                [[r, h, cell(why, "bad")] for r, h, why in front.certificates.refusals],
                note="the proxy's default certificate is served for these hosts",
                state="bad",
            )
        )
    return found


PROXY_PROTOCOL_SECTION = "PROXY protocol not read"


def proxy_protocol_sections(server: ProxyServer) -> list[Section]:
    """Routes whose clients come behind a PROXY protocol header (ingress-nginx's
    use-proxy-protocol) on a proxy started without --proxy-protocol: the two settings
    disagree (`waygate check` lists these rows; title and columns are its contract)."""
    if server.proxy_protocol_timeout:
        return []
    names = sorted(
        {
            entry.options.name
            for entry in server.table.entries()
            if entry.route.client_proxy_protocol
        }
    )
    if not names:
        return []
    why = cell("use-proxy-protocol is on; this proxy runs without --proxy-protocol", "bad")
    return [
        Section(
            PROXY_PROTOCOL_SECTION,
            ["route", "reason"],
            [[name, why] for name in names],
            note="served with the peer's address as the client's; a load balancer's "
            "PROXY header is answered 400",
            state="bad",
        )
    ]


def provider(server: ProxyServer, watch: Any, front: Any) -> Callable[[], list[Section]]:
    return lambda: (
        route_sections(server)
        + proxy_protocol_sections(server)
        + certificate_sections(front)
        + view_sections(watch)
    )
