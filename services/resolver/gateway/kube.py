"""Gateway API and Ingress in Kubernetes mode: the objects by list + watch, and their status.

The kinds below are listed and watched by `waygate.resolver.kube.KubernetesSource`
through the shared reflector (`waygate.core.kube.Reflector`), one per kind,
like Services and EndpointSlices; each event updates `GatewayObjects`, which
runs the one translation (`translate.translate`, the same as the manifests
source's) once per loop turn after changes, then replaces the store's routes
of source "kubernetes-gateway" and the status board. A Service change runs it
too (a backend appearing or going resolves or breaks references).

Kinds: GatewayClass, Gateway, HTTPRoute, GRPCRoute (gateway.networking.k8s.io/v1),
TLSRoute (v1, as the v1.5+ channels ship it), ReferenceGrant (v1beta1),
Ingress and IngressClass (networking.k8s.io/v1), Namespaces (their labels, for
allowedRoutes selectors), Secrets (kubernetes.io/tls ones are kept, for certificateRefs; with --ingress-nginx
Opaque ones too, for auth-secret), BackendTLSPolicy (v1) and ConfigMaps (its CA certificates). A kind whose CRD is not installed (404) counts as none.

Status: `StatusWriter.run` writes only while `is_leader()` (the resolver's
Lease elector, shared with the Route status writer): it
writes what changed on the board through each object's `/status`
subresource, reading the object first and writing with its resourceVersion
(409: read and write again on the next round). A route's `status.parents`
entries of other controllers are kept; only Waygate's are replaced. When a
replica becomes leader it writes every status once, so nothing a former
leader missed stays stale.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from waygate.core.kube import KubeAPI, KubeError
from waygate.resolver.gateway.spec import CONTROLLER_NAME, JSON
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.gateway.translate import STATUS_KINDS, Objects, ObjectStatus, translate
from waygate.resolver.ingress_nginx.config import IngressNginx, keeps_secret
from waygate.resolver.model import Service
from waygate.resolver.store import Store

log = logging.getLogger(__name__)

SOURCE = "kubernetes-gateway"

#: kind -> (API prefix, plural, namespaced)
KINDS: Mapping[str, tuple[str, str, bool]] = {
    "GatewayClass": ("/apis/gateway.networking.k8s.io/v1", "gatewayclasses", False),
    "Gateway": ("/apis/gateway.networking.k8s.io/v1", "gateways", True),
    "HTTPRoute": ("/apis/gateway.networking.k8s.io/v1", "httproutes", True),
    "GRPCRoute": ("/apis/gateway.networking.k8s.io/v1", "grpcroutes", True),
    "TLSRoute": ("/apis/gateway.networking.k8s.io/v1", "tlsroutes", True),
    "ReferenceGrant": ("/apis/gateway.networking.k8s.io/v1beta1", "referencegrants", True),
    "IngressClass": ("/apis/networking.k8s.io/v1", "ingressclasses", False),
    "Ingress": ("/apis/networking.k8s.io/v1", "ingresses", True),
    "BackendTLSPolicy": ("/apis/gateway.networking.k8s.io/v1", "backendtlspolicies", True),
    "Namespace": ("/api/v1", "namespaces", False),
    "Secret": ("/api/v1", "secrets", True),
    "ConfigMap": ("/api/v1", "configmaps", True),
}
# Kinds written by the status writer: translate.STATUS_KINDS (the others have no
# status of ours).


def collection(kind: str, namespace: str | None) -> str:
    prefix, plural, namespaced = KINDS[kind]
    if namespaced and namespace:
        return f"{prefix}/namespaces/{namespace}/{plural}"
    return f"{prefix}/{plural}"


def object_path(kind: str, namespace: str, name: str) -> str:
    prefix, plural, namespaced = KINDS[kind]
    if namespaced:
        return f"{prefix}/namespaces/{namespace}/{plural}/{name}"
    return f"{prefix}/{plural}/{name}"


def _key(obj: JSON) -> tuple[str, str]:
    metadata = obj.get("metadata") or {}
    return str(metadata.get("namespace") or ""), str(metadata.get("name") or "")


class _StoreServices(Mapping[tuple[str, str], Service]):
    """The store's services as the translation reads them (by key)."""

    def __init__(self, store: Store) -> None:
        self._store = store

    def __getitem__(self, key: tuple[str, str]) -> Service:
        service = self._store.get_service(*key)
        if service is None:
            raise KeyError(key)
        return service

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(())

    def __len__(self) -> int:
        return 0


class GatewayObjects:
    """The watched objects; translates them into the store and the board after changes."""

    def __init__(
        self,
        store: Store,
        board: StatusBoard,
        *,
        addresses: tuple[str, ...] = (),
        sharing: str = "share",
        ingress_nginx: IngressNginx | None = None,
    ) -> None:
        self.store = store
        self.board = board
        self.ingress_nginx = ingress_nginx
        # Host ownership is decided in the store; objects that lose a host say so.
        board.follow(store)
        self.addresses = addresses
        self.sharing = sharing
        self.objects = Objects(services=_StoreServices(store))
        self._namespaces: dict[tuple[str, str], JSON] = {}
        self._scheduled = False
        self._rejected: set[str] = set()
        self.translations = 0

    def replace(self, kind: str, items: list[JSON]) -> None:
        table = self._table(kind)
        table.clear()
        for obj in items:
            self.put(kind, obj, schedule=False)
        self.changed()

    def put(self, kind: str, obj: JSON, *, schedule: bool = True) -> None:
        key = _key(obj)
        table = self._table(kind)
        if kind == "Secret" and not keeps_secret(obj, self.ingress_nginx):
            table.pop(key, None)
        else:
            table[key] = obj
        if schedule:
            self.changed()

    def delete(self, kind: str, obj: JSON) -> None:
        self._table(kind).pop(_key(obj), None)
        self.changed()

    def _table(self, kind: str) -> dict[tuple[str, str], JSON]:
        if kind == "Namespace":
            return self._namespaces
        if kind == "Secret":
            return self.objects.secrets
        return self.objects.of(kind)

    def changed(self) -> None:
        """Translate once, on the next loop turn, whatever else changes in this one."""
        if self._scheduled:
            return
        self._scheduled = True
        asyncio.get_running_loop().call_soon(self._translate)

    def _translate(self) -> None:
        self._scheduled = False
        # Namespaces by name, as the translation reads them.
        self.objects.namespaces = {key[1]: obj for key, obj in self._namespaces.items()}
        translation = translate(
            self.objects,
            addresses=self.addresses,
            sharing=self.sharing,
            ingress_nginx=self.ingress_nginx,
        )
        self.translations += 1
        for rejected in translation.rejected:
            line = f"{rejected.kind} {rejected.namespace}/{rejected.name}: {rejected.error}"
            if line not in self._rejected:
                self._rejected.add(line)
                log.warning("Gateway API object not served (its status says why): %s", line)
        self.store.replace_source(SOURCE, routes=translation.routes, claims=translation.claims)
        self.board.replace(translation.statuses, translation.ignored)


def merged_status(kind: str, current: JSON, ours: JSON) -> JSON:
    """The status to write: ours, keeping other controllers' route parents and
    policy ancestors."""
    if kind in ("HTTPRoute", "GRPCRoute", "TLSRoute"):
        field = "parents"
    elif kind == "BackendTLSPolicy":
        field = "ancestors"
    elif kind == "Ingress":
        # IngressStatus has no conditions: a host conflict shows in `waygate gateways`.
        return {k: v for k, v in ours.items() if k != "conditions"}
    else:
        return ours
    theirs = [
        entry
        for entry in (current.get("status") or {}).get(field) or []
        if entry.get("controllerName") != CONTROLLER_NAME
    ]
    return {**ours, field: theirs + list(ours.get(field) or [])}


class StatusWriter:
    """The leader's duty: write changed statuses through the /status subresource."""

    def __init__(
        self,
        api: KubeAPI,
        board: StatusBoard,
        *,
        is_leader: Callable[[], bool],
        interval: float = 1.0,
        call: Callable[..., Any] = asyncio.to_thread,
        synced: Callable[[], bool] = lambda: True,
    ) -> None:
        self.api = api
        self.board = board
        self.is_leader = is_leader
        # Nothing is written before the source's first full list: a status computed
        # from half a view (a Gateway listed before its routes) would say 0 attached.
        self.synced = synced
        self.interval = interval
        self._call = call
        self.writes = 0
        self.conflicts = 0

    async def run(self) -> None:
        leading = False
        while True:
            if not self.is_leader():
                leading = False
            elif self.synced():
                if not leading:
                    # A new leader writes everything once: a former one may have missed some.
                    leading = True
                    self.board.mark_all_changed()
                for item in self.board.take_changed():
                    if not self.is_leader():
                        self.board.mark_changed(item.key)
                        continue
                    await self.write(item)
            await asyncio.sleep(self.interval)

    async def write(self, item: ObjectStatus) -> None:
        if item.kind not in STATUS_KINDS:
            return
        path = object_path(item.kind, item.namespace, item.name)
        try:
            current: JSON = await self._call(self.api.get, path)
            body = {
                "apiVersion": current.get("apiVersion"),
                "kind": current.get("kind"),
                "metadata": {
                    "name": item.name,
                    **({"namespace": item.namespace} if item.namespace else {}),
                    "resourceVersion": (current.get("metadata") or {}).get("resourceVersion"),
                },
                "status": merged_status(item.kind, current, item.status),
            }
            await self._call(self.api.replace, path + "/status", body)
            self.writes += 1
        except KubeError as exc:
            if exc.not_found:
                return  # deleted meanwhile: its next translation drops it
            if exc.conflict:
                self.conflicts += 1
            else:
                log.warning("cannot write the status of %s %s: %s", item.kind, path, exc)
            self.board.mark_changed(item.key)
