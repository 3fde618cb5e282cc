"""Kubernetes Events on ingress-nginx Ingresses: why one is not served, what is not honoured.

ingress-nginx's users watch `kubectl describe ingress` and `kubectl get events`;
the resolver's leader (the replica that writes statuses) posts one core/v1 Event
per Ingress and verdict: Warning with the refusal's reason (UnsupportedAnnotation,
InvalidAnnotation, InvalidPath, SnippetsNotAllowed, UnsupportedConfiguration) when
the Ingress is not served; Warning AnnotationNotHonoured when it is served with
annotations not honoured; Normal AnnotationsHonoured when it is served with
every annotation honoured, some with a named difference (an Ingress honoured
exactly has nothing to report).

Invariants: the verdict is read from the store's routes (the fields
`annotations.shape` set), so Events say exactly what the proxy does; an Event
is posted again only when an Ingress's verdict changes (and once per leader
term), never on every pass; a failed post is retried on the next pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from waygate.core.kube import KubeAPI, KubeError
from waygate.resolver.store import Store

log = logging.getLogger(__name__)

COMPONENT = "waygate-resolver"
MAX_MESSAGE = 1024

# (namespace, name) of an Ingress -> (type, reason, message)
Verdict = tuple[str, str, str]


def ingress_verdicts(store: Store) -> dict[tuple[str, str], Verdict]:
    """Each ingress-nginx Ingress's verdict, from the routes made of it."""
    out: dict[tuple[str, str], Verdict] = {}
    for route in store.routes():
        if not route.origin.startswith("Ingress ") or (
            route.ingress_refusal is None and not route.ingress_verdicts
        ):
            continue
        namespace, _, name = route.origin.removeprefix("Ingress ").partition("/")
        key = (namespace, name)
        if route.ingress_refusal is not None:
            out[key] = ("Warning", route.ingress_refusal[0], route.ingress_refusal[1])
        elif key not in out:
            lacking = [line for line in route.ingress_verdicts if ": not-honoured" in line]
            if lacking:
                out[key] = ("Warning", "AnnotationNotHonoured", "; ".join(lacking))
            else:
                out[key] = ("Normal", "AnnotationsHonoured", "; ".join(route.ingress_verdicts))
    return out


class IngressEventWriter:
    """Posts an Event when an Ingress's verdict changes (leader only)."""

    def __init__(
        self,
        store: Store,
        api: KubeAPI,
        *,
        is_leader: Callable[[], bool],
        synced: Callable[[], bool] = lambda: True,
        interval: float = 2.0,
    ) -> None:
        self._store = store
        self._api = api
        self._is_leader = is_leader
        self._synced = synced
        self._interval = interval
        self._posted: dict[tuple[str, str], Verdict] = {}

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self._interval)
            if not self._is_leader():
                self._posted.clear()
            elif self._synced():
                await self.write_pass()

    async def write_pass(self) -> int:
        """Post the changed verdicts once; how many Events were posted."""
        current = ingress_verdicts(self._store)
        for key in list(self._posted):
            if key not in current:
                del self._posted[key]
        posted = 0
        for key, verdict in sorted(current.items()):
            if self._posted.get(key) == verdict:
                continue
            try:
                await asyncio.to_thread(
                    self._api.create, f"/api/v1/namespaces/{key[0]}/events", event(key, verdict)
                )
            except KubeError as exc:
                log.info(
                    "Ingress event not posted; retrying on the next pass",
                    extra={"ingress": f"{key[0]}/{key[1]}", "error": str(exc)},
                )
                continue
            self._posted[key] = verdict
            posted += 1
        return posted


def event(key: tuple[str, str], verdict: Verdict, now: datetime | None = None) -> dict[str, Any]:
    """A core/v1 Event about one Ingress."""
    kind, reason, message = verdict
    stamp = (now or datetime.now(UTC)).strftime("%Y-%m-%dT%H:%M:%SZ")
    if len(message) > MAX_MESSAGE:
        message = message[: MAX_MESSAGE - 3] + "..."
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"generateName": f"{key[1]}.", "namespace": key[0]},
        "involvedObject": {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "Ingress",
            "namespace": key[0],
            "name": key[1],
        },
        "type": kind,
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT},
        "reportingComponent": COMPONENT,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }
