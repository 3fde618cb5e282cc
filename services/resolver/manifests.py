"""Kubernetes manifests as a source: what `kubectl apply -f PATH` takes, without a cluster.

`waygate resolver serve --manifests PATH` reads a YAML (or JSON) file, or
every `*.yaml`, `*.yml` and `*.json` file directly in a directory (in name
order, as kubectl does without -R), each holding any number of `---`
separated documents (a `kind: List` is expanded). Kinds read:
Namespace, Service, EndpointSlice (discovery.k8s.io/v1), Secret (type
kubernetes.io/tls; with --ingress-nginx also Opaque, for auth-secret; other
types are skipped), ConfigMap (BackendTLSPolicy's
CA certificates), the waygate.io Route, and the
Gateway API and Ingress kinds of `waygate.resolver.gateway`. Any other kind
(a real manifest directory has Deployments in it) is skipped with one log
line per object and load, not refused.

Invariants (the routes file's rules, `filesource.py`):
- All or nothing: the store holds exactly the last content that parsed,
  converted and passed the schema checks as a whole (one version); any error
  rejects the whole edit with `path:line: reason` (logged, kept in
  `last_error`) and the last good state stays, routes and statuses alike.
  Except with --ingress-nginx: an Ingress refused for its annotations or paths
  is refused alone (its routes Admitted False), as in a cluster.
- Services, endpoints and Route CRD objects go through `kube_convert` and
  Gateway API / Ingress objects through `gateway.translate`, exactly as in
  Kubernetes mode: one conversion per kind, whatever the source.
- Reading and parsing run in a worker thread; changes are noticed by polling
  (name, size, mtime) of every file and confirmed by content hash.
- The source publishes its own state (valid with the version and time of its
  last load, or its last error with `path:line` and since when) in the store,
  so ListRoutes, Watch, ListGateways, `check`, the status page and the
  metrics show a rejected edit, not only the log.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from waygate.core.errors import InvalidArgument
from waygate.resolver import kube_convert
from waygate.resolver.gateway.spec import FieldPath, SpecError, dotted
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.gateway.translate import (
    Objects,
    Translation,
    is_gateway_object,
    translate,
)
from waygate.resolver.ingress_nginx.config import IngressNginx, keeps_secret
from waygate.resolver.model import Endpoint, Route, Service
from waygate.resolver.schema import DEFAULT_MAX_ROUTES_PER_SOURCE
from waygate.resolver.status import SourceHealth
from waygate.resolver.store import Store
from waygate.resolver.yamlload import (
    MAX_YAML_BYTES,
    FileError,
    YAMLDocuments,
    read_bounded,
    too_large,
)

log = logging.getLogger(__name__)

_SUFFIXES = (".yaml", ".yml", ".json")
# The Kubernetes kinds read besides the Gateway API ones: (apiVersion, kind).
_CORE = {
    ("v1", "Namespace"),
    ("v1", "Service"),
    ("v1", "Secret"),
    ("v1", "ConfigMap"),
    ("discovery.k8s.io/v1", "EndpointSlice"),
    ("waygate.io/v1", "Route"),
}
_CLUSTER_SCOPED = {"Namespace", "GatewayClass", "IngressClass"}


@dataclass
class _Document:
    path: Path
    node: yaml.Node
    obj: dict[str, Any]

    def line(self, where: FieldPath = ()) -> int:
        """The line of `where` inside the document (its deepest part that exists)."""
        node = self.node
        for part in where:
            child = None
            if isinstance(part, str) and isinstance(node, yaml.MappingNode):
                child = next((v for k, v in node.value if k.value == part), None)
            elif isinstance(part, int) and isinstance(node, yaml.SequenceNode):
                child = node.value[part] if part < len(node.value) else None
            if child is None:
                break
            node = child
        return int(node.start_mark.line) + 1

    def error(self, reason: str, where: FieldPath = ()) -> FileError:
        return FileError(self.path, self.line(where), reason)


@dataclass
class ManifestsContent:
    services: list[Service] = field(default_factory=list)
    endpoints: list[Endpoint] = field(default_factory=list)
    routes: list[Route] = field(default_factory=list)
    translation: Translation = field(default_factory=Translation)
    skipped: list[str] = field(default_factory=list)


def _files(root: Path) -> list[Path]:
    if root.is_dir():
        return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _SUFFIXES)
    return [root]


def _documents(path: Path, text: str) -> list[_Document]:
    out = []
    with YAMLDocuments(path, text) as loader:
        for node in loader.documents():
            obj = loader.construct_document(node)
            if obj is None:
                continue
            document = _Document(path, node, obj)
            if not isinstance(obj, dict):
                raise document.error("a manifest document must be a mapping (a Kubernetes object)")
            if obj.get("kind") == "List":
                items = obj.get("items") or []
                items_node = next((v for k, v in node.value if k.value == "items"), None)
                for index, item in enumerate(items):
                    item_node = items_node.value[index] if items_node is not None else node
                    if not isinstance(item, dict):
                        raise _Document(path, item_node, {}).error("a List item must be a mapping")
                    out.append(_Document(path, item_node, item))
                continue
            out.append(document)
    return out


def parse_manifests(
    files: list[tuple[Path, str]],
    *,
    addresses: tuple[str, ...] = (),
    sharing: str = "share",
    ingress_nginx: IngressNginx | None = None,
    max_routes: int = DEFAULT_MAX_ROUTES_PER_SOURCE,
) -> ManifestsContent:
    """Every object of the files -> the store's content and the statuses; FileError
    names the first line that is wrong."""
    documents = [doc for path, text in files for doc in _documents(path, text)]
    content = ManifestsContent()
    services: dict[tuple[str, str], Service] = {}
    objects = Objects(services=services)
    where_is: dict[tuple[str, str, str], _Document] = {}
    slices: dict[tuple[str, str], list[list[Endpoint]]] = {}
    for doc in documents:
        obj = doc.obj
        kind, api_version = obj.get("kind"), obj.get("apiVersion")
        if not isinstance(kind, str) or not isinstance(api_version, str) or not kind:
            raise doc.error("apiVersion and kind are required")
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict) or not isinstance(metadata.get("name"), str):
            raise doc.error("metadata.name is required", ("metadata",))
        name = metadata["name"]
        if kind in _CLUSTER_SCOPED:
            namespace = ""
        else:
            namespace = metadata.get("namespace") or "default"
            metadata["namespace"] = namespace
        known = (api_version, kind) in _CORE or is_gateway_object(kind, api_version)
        if not known:
            content.skipped.append(f"{api_version} {kind} {namespace}/{name}".replace(" /", " "))
            continue
        if kind == "Secret" and not keeps_secret(obj, ingress_nginx):
            content.skipped.append(f"v1 Secret {namespace}/{name} (type {obj.get('type')})")
            continue
        identity = (kind, namespace, name)
        if identity in where_is:
            first = where_is[identity]
            raise doc.error(
                f"{kind} {namespace + '/' if namespace else ''}{name} is defined twice "
                f"(first at {first.path}:{first.line()})"
            )
        where_is[identity] = doc
        try:
            if kind == "Namespace":
                objects.namespaces[name] = obj
            elif kind == "Service":
                service = kube_convert.service_from(obj)
                services[service.key] = service
                content.services.append(service)
            elif kind == "EndpointSlice":
                owner = kube_convert.slice_service(obj)
                if owner is None:
                    raise doc.error(
                        f"an EndpointSlice needs the label {kube_convert.SERVICE_NAME_LABEL}",
                        ("metadata",),
                    )
                slices.setdefault(owner, []).append(kube_convert.endpoints_from_slice(obj))
            elif kind == "Secret":
                objects.secrets[(namespace, name)] = obj
            elif kind == "Route":
                content.routes.append(kube_convert.route_from(obj))
            else:
                objects.of(kind)[(namespace, name)] = obj
        except InvalidArgument as exc:
            # A Route's field (waygate.resolver.schema) names its own line.
            raise doc.error(str(exc), getattr(exc, "at", ())) from None
    for groups in slices.values():
        content.endpoints.extend(kube_convert.merge_endpoints(groups))
    translation = translate(
        objects, addresses=addresses, sharing=sharing, ingress_nginx=ingress_nginx
    )
    if translation.rejected:
        rejected = translation.rejected[0]
        doc = where_is[(rejected.kind, rejected.namespace, rejected.name)]
        what = f"{rejected.kind} {rejected.namespace + '/' if rejected.namespace else ''}"
        raise doc.error(
            f"{what}{rejected.name}: {dotted(rejected.error.where)}: {rejected.error.reason}",
            rejected.error.where,
        )
    content.translation = translation
    content.routes.extend(translation.routes)
    if len(content.routes) > max_routes:
        # The object that made the first route past the source's budget.
        past = content.routes[max_routes]
        kind, _, ref = past.origin.partition(" ")
        namespace, _, name = ref.partition("/")
        identity = (kind, namespace, name) if past.origin else ("Route", *past.key)
        raise where_is.get(identity, documents[0]).error(
            f"{len(content.routes)} routes; a source may produce at most {max_routes} "
            "(--max-routes-per-source)"
        )
    return content


@dataclass
class _Read:
    stat: tuple[Any, ...] | None
    digest: bytes | None
    content: ManifestsContent | None
    error: FileError | None


class ManifestsSource:
    """Feeds the store and the status board from a manifests file or directory."""

    def __init__(
        self,
        store: Store,
        board: StatusBoard,
        path: Path,
        *,
        poll_interval: float = 1.0,
        addresses: tuple[str, ...] = (),
        sharing: str = "share",
        ingress_nginx: IngressNginx | None = None,
        max_routes: int = DEFAULT_MAX_ROUTES_PER_SOURCE,
    ) -> None:
        self.max_routes = max_routes
        self.store = store
        self.ingress_nginx = ingress_nginx
        self.board = board
        board.follow(store)  # host conflicts onto the objects' statuses
        self.path = path.absolute()
        self.source = f"manifests:{self.path}"
        self.poll_interval = poll_interval
        self.addresses = addresses
        self.sharing = sharing
        self.health = SourceHealth(self.source)
        self._stat: tuple[Any, ...] | None = None
        self._digest: bytes | None = None
        self._lock = asyncio.Lock()
        self.on_loaded: Callable[[ManifestsContent], None] | None = None

    def _stat_key(self) -> tuple[Any, ...] | None:
        try:
            files = _files(self.path)
            return tuple((p.name, p.stat().st_mtime_ns, p.stat().st_size) for p in files)
        except OSError:
            return None

    def _read(self, known: bytes | None) -> _Read:
        stat = self._stat_key()
        if stat is None:
            return _Read(None, None, None, FileError(self.path, None, "is missing"))
        texts: list[tuple[Path, str]] = []
        digest = hashlib.sha256()
        total = 0
        for path in _files(self.path):
            try:
                data = read_bounded(path, MAX_YAML_BYTES - total)
            except OSError as exc:
                error = FileError(path, None, f"cannot read: {exc.strerror or exc}")
                return _Read(stat, None, None, error)
            except FileError:
                return _Read(stat, None, None, FileError(self.path, None, too_large()))
            total += len(data)
            digest.update(str(path).encode() + b"\0" + data + b"\0")
            try:
                texts.append((path, data.decode("utf-8")))
            except UnicodeDecodeError as exc:
                return _Read(stat, None, None, FileError(path, None, f"not UTF-8 ({exc.reason})"))
        value = digest.digest()
        if value == known:
            return _Read(stat, value, None, None)
        try:
            return _Read(
                stat,
                value,
                parse_manifests(
                    texts,
                    addresses=self.addresses,
                    sharing=self.sharing,
                    ingress_nginx=self.ingress_nginx,
                    max_routes=self.max_routes,
                ),
                None,
            )
        except FileError as exc:
            return _Read(stat, value, None, exc)

    def _apply(self, read: _Read) -> bool:
        self._stat = read.stat
        if read.error is None and read.content is None:
            if self.last_error is None:
                self.store.mark_synced(self.source)
            return self.last_error is None
        self._digest = read.digest
        if read.error is not None:
            message = str(read.error)
            if self.health.failed(message):
                log.error("manifests rejected; keeping the last good state: %s", message)
            self.store.set_source_state(self.health.state())
            return False
        content = read.content
        assert content is not None
        for skipped in content.skipped:
            log.info("manifests: skipped %s (not a kind the resolver reads)", skipped)
        self.store.replace_source(
            self.source,
            services=content.services,
            endpoints=content.endpoints,
            routes=content.routes,
            claims=content.translation.claims,
        )
        self.store.mark_synced(self.source)
        self.board.replace(content.translation.statuses, content.translation.ignored)
        if self.last_error is not None:
            log.info("manifests are valid again", extra={"path": str(self.path)})
        self.health.loaded(self.store.version)
        self.store.set_source_state(self.health.state())
        log.info(
            "manifests loaded",
            extra={
                "path": str(self.path),
                "services": len(content.services),
                "routes": len(content.routes),
                "statuses": len(content.translation.statuses),
                "version": self.store.version,
            },
        )
        if self.on_loaded is not None:
            self.on_loaded(content)
        return True

    @property
    def last_error(self) -> str | None:
        return self.health.error

    @property
    def loaded(self) -> bool:
        return self.health.loaded_at is not None

    def load(self) -> bool:
        """Read and apply synchronously (start-up and tests)."""
        return self._apply(self._read(self._digest))

    async def reload(self) -> bool:
        async with self._lock:
            return self._apply(await asyncio.to_thread(self._read, self._digest))

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval)
            if self._stat_key() != self._stat:
                await self.reload()
            elif self.last_error is None and self.loaded:
                self.store.mark_synced(self.source)


__all__ = ["ManifestsContent", "ManifestsSource", "SpecError", "parse_manifests"]
