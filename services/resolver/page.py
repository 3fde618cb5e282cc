"""The resolver's sections of the status page (`waygate.core.statuspage`).

The route sources' own state (a rejected routes-file or manifests edit, or a
failing Kubernetes watch, first: it is what makes a route misbehave silently), every route with its conditions
(`waygate.resolver.status`) and its backends' ready endpoints, the view's
freshness, and which tunnel-server replicas hold which edge node. Read from the
store at request time.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from waygate.core.statuspage import Section, cell, duration_text
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
                        _ago(state.loaded_at, now),
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
    age = f"{duration_text(time.time() - synced.timestamp())} ago" if synced else "never"
    found.append(
        Section(
            "View",
            ["version", "watchers", "oldest source", "last confirmed"],
            [[store.version, store.subscriber_count, source or "(none)", age]],
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


def provider(store: Store) -> Callable[[], list[Section]]:
    return lambda: sections(store)
