"""The resolver's sections of the status page (`waygate.core.statuspage`).

The route sources' own state (a rejected routes-file or manifests edit, or a
failing Kubernetes watch, first: it is what makes a route misbehave silently),
the Gateway API and Ingress objects with their conditions, every route with its conditions
(`waygate.resolver.status`) and its backends' ready endpoints, the view's
freshness, and which tunnel-server replicas hold which edge node. Read from the
store at request time.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from waygate.core.statuspage import Section, cell, duration_text, time_cell
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.model import Kind, Route
from waygate.resolver.store import Store


def _ago(when: datetime | None, now: datetime) -> str:
    return duration_text((now - when).total_seconds()) + " ago" if when is not None else ""


def _status_cell(route: Route, now: datetime) -> dict[str, Any]:
    status = route.status
    if status is None:
        return cell("not computed", "warn")
    problem = status.problem()
    changed = max(
        (c.last_transition for c in status.conditions if c.last_transition is not None),
        default=None,
    )
    title = "; ".join(f"{c.type}={c.status} ({c.reason})" for c in status.conditions)
    since = f" (since {_ago(changed, now)})" if changed is not None else ""
    if problem is not None:
        return cell(problem + since, "bad", title=title)
    return cell("admitted, refs resolved" + since, "ok", title=title)


def _route_row(store: Store, route: Route, now: datetime) -> list[Any]:
    ready = sum(
        endpoint.ready
        for backend in route.backends
        if backend.weight > 0
        for endpoint in store.endpoints_of(route.namespace, backend.service)
    )
    return [
        f"{route.namespace}/{route.name}",
        f"{route.host}{route.path}",
        ", ".join(b.service for b in route.backends),
        route.tls.termination.value if route.tls is not None else "",
        cell(ready, "ok" if ready else "bad"),
        _status_cell(route, now),
    ]


def sections(store: Store) -> list[Section]:
    now = datetime.now(UTC)
    states = store.source_states()
    found = []
    if states:
        found.append(
            Section(
                "Route sources",
                ["source", "state", "loaded", "detail"],
                [
                    [
                        state.source,
                        cell("valid", "ok") if state.valid else cell("rejected", "bad"),
                        time_cell(state.loaded_at, empty="never"),
                        "in force"
                        if state.valid
                        else f"{state.error} (failing since {_ago(state.error_since, now)}; "
                        "the last good state is kept)",
                    ]
                    for state in states
                ],
                state="ok" if all(s.valid for s in states) else "bad",
            )
        )
    routes = [_route_row(store, route, now) for route in store.routes()]
    found.append(
        Section(
            "Routes",
            ["route", "host/path", "backends", "tls", "ready endpoints", "status"],
            routes,
            state="bad" if any(row[5]["state"] == "bad" for row in routes) else "ok",
            empty="no route",
        )
    )
    source, synced = store.last_sync()
    found.append(
        Section(
            "View",
            ["version", "watchers", "oldest source", "last confirmed"],
            [
                [
                    store.version,
                    store.subscriber_count,
                    source or "(none)",
                    time_cell(synced, empty="never"),
                ]
            ],
        )
    )
    found.append(
        Section(
            "Tunnel presence",
            ["node", "held by tunnel replicas"],
            [
                [p.node, ", ".join(s.id for s in p.servers) or cell("none", "bad")]
                for p in store.snapshot([Kind.TUNNELS]).tunnels
            ],
            empty="no edge node is connected",
        )
    )
    return found


# Conditions whose healthy status is False (the others are healthy when True).
_HEALTHY_FALSE = {"Conflicted"}


def _conditions_cell(conditions: list[dict[str, Any]]) -> Any:
    """Healthy conditions by type; an unhealthy one as Type=Status (Reason: message)."""
    parts, bad = [], False
    for c in conditions:
        kind, status = str(c.get("type", "")), str(c.get("status", ""))
        healthy = status == ("False" if kind in _HEALTHY_FALSE else "True")
        if healthy:
            if kind not in _HEALTHY_FALSE:
                parts.append(kind)
            continue
        bad = bad or status == ("True" if kind in _HEALTHY_FALSE else "False")
        detail = f"{c.get('reason', '')}: {c['message']}" if c.get("message") else c.get("reason")
        parts.append(f"{kind}={status} ({detail})")
    return cell("; ".join(parts) or "-", "bad" if bad else "ok" if parts else "")


def gateway_section(board: StatusBoard) -> Section:
    """Gateway API and Ingress objects with their conditions (what `waygate gateways`
    shows): a route's per parent Gateway, a Gateway's own and its listeners'."""
    rows: list[list[Any]] = []
    for item in board.items():
        name = f"{item.kind} {item.namespace + '/' if item.namespace else ''}{item.name}"
        status = item.status or {}
        places: list[tuple[str, list[dict[str, Any]]]] = []
        if status.get("conditions"):
            places.append(("", status["conditions"]))
        for parent in status.get("parents") or ():
            ref = parent.get("parentRef") or parent.get("ancestorRef") or {}
            where = f"{ref.get('namespace', item.namespace)}/{ref.get('name', '')}"
            if ref.get("sectionName"):
                where += f"/{ref['sectionName']}"
            places.append((f"on {where}", parent.get("conditions") or []))
        for listener in status.get("listeners") or ():
            routes = listener.get("attachedRoutes", 0)
            places.append(
                (
                    f"listener {listener.get('name')} ({routes} routes)",
                    listener.get("conditions") or [],
                )
            )
        if not places:
            addresses = (status.get("loadBalancer") or {}).get("ingress") or []
            shown = ", ".join(a.get("ip") or a.get("hostname", "") for a in addresses)
            places.append((f"address {shown}" if shown else "", []))
        for where, conditions in places:
            rows.append([name, where, _conditions_cell(conditions)])
    return Section(
        "Gateway API objects",
        ["object", "where", "conditions"],
        rows,
        note="Gateway API and Ingress objects Waygate serves (`waygate gateways`)",
        state="bad" if any(row[2]["state"] == "bad" for row in rows) else "ok",
        empty="no Gateway API or Ingress object",
    )


def provider(store: Store, board: StatusBoard | None = None) -> Callable[[], list[Section]]:
    if board is None:
        return lambda: sections(store)
    return lambda: [*sections(store), gateway_section(board)]
