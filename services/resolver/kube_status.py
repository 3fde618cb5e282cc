"""Route objects' status subresource, written from the resolver's route conditions.

In Kubernetes mode every resolver replica computes the same conditions
(waygate.resolver.status) from the same cluster state; only the leader
(`is_leader`) writes them, so `kubectl get routes -o yaml` shows why a route
is not served. Invariants:
- Only routes the Kubernetes source owns are written (never the routes file's),
  and the Route objects it could not parse (`invalid`): Admitted False,
  reason InvalidSpec, the validation error as the message.
- A write happens when the conditions differ from what the object's status
  says, ignoring lastTransitionTime (so a new leader with its own times does
  not rewrite every route); the write is a GET then a PUT of `/status` with
  the resourceVersion read: a concurrent change answers 409 and the route is
  tried again on the next pass.
- Kubernetes calls run in a worker thread, never on the event loop; every
  pass is bounded by the client's request timeout, and one failing route
  never stops the others.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from prometheus_client import Counter, Gauge

from waygate.core.kube import JSON, KubeAPI, KubeError
from waygate.resolver.model import ADMITTED, FALSE, Route, RouteCondition, RouteKey, RouteStatus
from waygate.resolver.store import Store

#: The status writers' Lease election (`waygate.core.leader`); only the leader writes.
LEADER = Gauge("waygate_resolver_leader", "1 while this resolver replica writes Route status.")
LEADER_TRANSITIONS = Counter(
    "waygate_resolver_leader_transitions_total",
    "Times this resolver replica started or stopped writing Route status.",
    ["change"],
)

log = logging.getLogger(__name__)

ROUTES_PATH = "/apis/waygate.io/v1/namespaces/{namespace}/routes/{name}"


def status_document(status: RouteStatus, generation: int) -> JSON:
    """The `status` of a Route object, as metav1.Conditions."""
    return {
        "conditions": [
            {
                "type": c.type,
                "status": c.status,
                "reason": c.reason,
                "message": c.message,
                "lastTransitionTime": c.last_transition.strftime("%Y-%m-%dT%H:%M:%SZ")
                if c.last_transition is not None
                else None,
                "observedGeneration": c.observed_generation or generation,
            }
            for c in status.conditions
        ]
    }


def _comparable(status: Any) -> list[tuple[Any, ...]]:
    if not isinstance(status, dict):
        return []
    return sorted(
        (c.get("type"), c.get("status"), c.get("reason"), c.get("message"))
        for c in status.get("conditions") or []
        if isinstance(c, dict)
    )


class RouteStatusWriter:
    """Keeps Route objects' status equal to the resolver's conditions (leader only)."""

    def __init__(
        self,
        store: Store,
        api: KubeAPI,
        *,
        source: str,
        is_leader: Callable[[], bool],
        interval: float = 2.0,
        invalid: Callable[[], dict[RouteKey, str]] = dict,
        synced: Callable[[], bool] = lambda: True,
    ) -> None:
        self._store = store
        self._api = api
        self._source = source
        self._is_leader = is_leader
        self._interval = interval
        self._invalid = invalid
        # Not before the source's first full list (a route's backends may be unlisted).
        self._synced = synced
        self._clock = lambda: datetime.now(UTC)
        # What was last written (or found) per route: conditions without times.
        self._written: dict[RouteKey, list[tuple[Any, ...]]] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if self._is_leader():
                if self._synced():
                    await self.write_pass()
            else:
                self._written.clear()  # a future leader term starts from the objects

    async def write_pass(self) -> int:
        """Write every changed status once; how many were written."""
        pending: list[Route] = []
        invalid = self._invalid()
        for (namespace, name), why in sorted(invalid.items()):
            condition = RouteCondition(ADMITTED, FALSE, "InvalidSpec", why, self._clock())
            pending.append(Route(namespace, name, "", status=RouteStatus((condition,))))
        for route in self._store.routes():
            if route.status is None or self._store.route_owner(*route.key) != self._source:
                continue
            wanted = _comparable(status_document(route.status, 0))
            if self._written.get(route.key) != wanted:
                pending.append(route)
        live = {r.key for r in self._store.routes()} | set(invalid)
        for key in list(self._written):
            if key not in live:
                del self._written[key]
        written = 0
        for route in pending:
            try:
                if await asyncio.to_thread(self._write, route):
                    written += 1
            except KubeError as exc:
                log.info(
                    "route status not written; retrying on the next pass",
                    extra={"route": f"{route.namespace}/{route.name}", "error": str(exc)},
                )
        return written

    def _write(self, route: Route) -> bool:
        """GET the object, PUT its status when it differs; True when written."""
        assert route.status is not None
        path = ROUTES_PATH.format(namespace=route.namespace, name=route.name)
        current = self._api.get(path)
        generation = int((current.get("metadata") or {}).get("generation") or 0)
        document = status_document(route.status, generation)
        wanted = _comparable(document)
        if _comparable(current.get("status")) == wanted:
            self._written[route.key] = wanted
            return False
        current["status"] = document
        self._api.replace(path + "/status", current)
        self._written[route.key] = wanted
        return True
