"""A STAND-IN Kubernetes API server for tests (no real API server can run here).

Real HTTP/1.1 on 127.0.0.1, port 0, served by `http.server` threads, so the
official `kubernetes` client talks to it exactly as it would to a cluster. It
keeps arbitrary objects as JSON dicts and implements the parts of the API
machinery that clients depend on. Nothing in it is specific to a Waygate
service.

What it still lacks (tests must not rely on these): admission, defaulting,
validation beyond what is listed, discovery, set-based label selectors
(`in`, `notin`), consistent paging (later pages of a `limit`ed list read the
current objects, not a snapshot at the first page's version, and a continue
token never expires), server-side apply, protobuf, RBAC (every authenticated
request may do everything), Lease-specific validation (a Lease is a plain
object; its `resourceVersion` conflicts are the generic ones), and finalizers.

HTTP side (what a client can call):
- Paths: `/api/v1/...` (core) and `/apis/GROUP/VERSION/...`; namespaced
  (`.../namespaces/NS/PLURAL[/NAME[/SUBRESOURCE]]`) and cluster-wide
  (`.../PLURAL[/NAME]`; for a namespaced kind that lists every namespace).
- GET collection: a list `{"kind": KIND+"List", "metadata": {"resourceVersion"},
  "items": [...]}`, items without kind/apiVersion like the real server.
  `limit=N` pages it: at most N items and `metadata.continue` while more remain;
  `continue=TOKEN` returns the next page (400 for a token it did not issue).
- GET collection with `watch=true` (also `True`, `1`): a chunked stream of watch
  events, one JSON object per line. `resourceVersion` absent or "0": synthetic
  ADDED events for the current objects first. `resourceVersion=N`: every event
  after N, replayed from a bounded history, then live ones. N older than the
  history: one ERROR event carrying a Status with code 410 ("Expired"), then the
  stream ends (like the real server); with `gone_as_http = True` a plain HTTP
  410 response instead. `timeoutSeconds` ends the stream cleanly (default
  `default_watch_timeout`). `allowWatchBookmarks=true` lets `bookmark()`
  reach that watch.
- `labelSelector`: equality only (`a=b`, `a==b`, `a!=b`, `a`, `!a`).
  `fieldSelector`: `=`, `==`, `!=` on any dotted field path (`metadata.name`,
  `metadata.namespace`, `spec.signerName`, ...). A watcher whose selector stops
  (or starts) matching a modified object gets DELETED (or ADDED), as in the
  real server.
- POST (create, 201; 409 AlreadyExists; `metadata.generateName` honoured), GET
  one (404 NotFound), PUT (replace; 409 Conflict when the body's
  metadata.resourceVersion is set and stale), PATCH (`application/merge-patch+json`
  and `application/strategic-merge-patch+json` both as JSON merge patch;
  `application/json-patch+json` with add/replace/remove/test), DELETE (200, the
  deleted object's last state, as the real server answers for objects without finalizers).
  A write that changes nothing bumps nothing and emits nothing.
- Subresources `/status` (PUT/PATCH change only `.status`) and `/approval`
  (PUT/PATCH change only `.status.conditions`).
- POST `/apis/authentication.k8s.io/v1/tokenreviews`: calls `token_reviewer(token,
  audiences)`, a function the test sets, returning None (not authenticated) or a
  dict `{"username", "uid", "groups", "extra"}`; the answer is a TokenReview
  with `.status` filled in. Without a reviewer every token is refused.
- `bearer_token`: when set, requests without `Authorization: Bearer <it>` get 401.
- `unavailable`: while true, every request gets 503 ServiceUnavailable (an API
  server that is down or overloaded); open watches are not touched.
- `write_delay`: seconds every write (POST, PUT, PATCH, DELETE) waits before it
  is applied and answered (a slow etcd); reads are not delayed.
- `partitioned`: bearer tokens cut off from the server, as by a network
  partition: a request carrying one has its connection closed unanswered, and
  `partition(token)` also cuts that token's open watches. Give each client its
  own token (see `kubeconfig()`) to partition one of several.
- Leases (`coordination.k8s.io/v1`, namespaced) are stored like any object, so
  a PUT with a stale `metadata.resourceVersion` gets 409: what leader election
  relies on.
- Every write bumps one global resourceVersion counter (as etcd does); every
  object's `metadata.resourceVersion` is the version of its last write; `uid`,
  `creationTimestamp` and `generation` are set on create.

Test side (plain method calls from any thread; objects are dicts):
    api = KubeAPI(history=1000)        # history = events kept for watch resume
    api.start(); ...; api.stop()       # or `with KubeAPI() as api:`
    api.url, api.configuration()       # kubernetes.client.Configuration for it
    api.register("waygate.io/v1", "Route", "routes", namespaced=True)
    api.create(obj) / api.replace(obj) / api.apply(obj)  -> stored copy
        (kind/apiVersion/metadata.name/namespace taken from obj; apply = create
        or replace; each emits the watch event a client write would)
    api.delete(api_version, kind, name, namespace=None) -> last state
    api.get(api_version, kind, name, namespace=None), api.list(api_version, kind, namespace=None)
    api.resource_version               # the current global version (int)
    api.expire_history()               # forget history: resumes from older versions get 410
    api.drop_watches()                 # cut every open watch connection mid-stream
    api.stall_watches()                # open watches go silent but stay open (dead peer)
    api.bookmark()                     # a BOOKMARK to every watch that allowed them
    api.watchers(kind=None)            # number of open watch streams
    await api.wait_watchers(n, kind=None, timeout=5.0)   # async poll until >= n
    api.requests                       # list of Request(method, path, query, watch)
    api.token_reviewer = fn; api.bearer_token = "t"; api.gone_as_http = True
    api.unavailable = True             # 503 for every request until set back
    api.write_delay = 5.0              # every write answered 5 s late
    api.partition(token) / api.heal(token)   # cut one client off, and back
    api.kubeconfig(path, token)        # write a kubeconfig for this server and token

Kinds used without `register` are accepted: a collection path of an unknown
resource is namespaced if the path says so, its kind is the plural without the
final "s", capitalised. The common built-in kinds are pre-registered. With
`KubeAPI(auto_register=False)` an unregistered resource path answers 404, as a
real server does for a custom resource whose CRD is not installed; `register`
it later to "install" it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import copy
import dataclasses
import datetime
import http.server
import json
import logging
import queue
import select
import socket
import threading
import time
import urllib.parse
import uuid
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

logger = logging.getLogger(__name__)

JSON = dict[str, Any]

#: Socket timeout for idle keep-alive connections and stalled writes.
CONNECTION_TIMEOUT = 30.0
#: How often an idle watch checks whether its client has gone away.
IDLE_CHECK = 0.2


@dataclasses.dataclass(frozen=True)
class ResourceType:
    group: str  # "" for the core group
    version: str
    plural: str
    kind: str
    namespaced: bool

    @property
    def api_version(self) -> str:
        return f"{self.group}/{self.version}" if self.group else self.version


@dataclasses.dataclass(frozen=True)
class Request:
    method: str
    path: str
    query: dict[str, str]
    watch: bool


_BUILTIN = [
    ("v1", "Service", "services", True),
    ("v1", "Endpoints", "endpoints", True),
    ("v1", "Pod", "pods", True),
    ("v1", "Secret", "secrets", True),
    ("v1", "ConfigMap", "configmaps", True),
    ("v1", "ServiceAccount", "serviceaccounts", True),
    ("v1", "Event", "events", True),
    ("v1", "Node", "nodes", False),
    ("v1", "Namespace", "namespaces", False),
    ("discovery.k8s.io/v1", "EndpointSlice", "endpointslices", True),
    ("certificates.k8s.io/v1", "CertificateSigningRequest", "certificatesigningrequests", False),
    ("coordination.k8s.io/v1", "Lease", "leases", True),
    ("apiextensions.k8s.io/v1", "CustomResourceDefinition", "customresourcedefinitions", False),
]


class ApiError(Exception):
    """An HTTP error answered as a Kubernetes Status object."""

    def __init__(self, code: int, reason: str, message: str) -> None:
        super().__init__(message)
        self.code, self.reason, self.message = code, reason, message

    def status(self) -> JSON:
        return _status(self.code, self.reason, self.message)


def _status(code: int, reason: str, message: str) -> JSON:
    return {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }


@dataclasses.dataclass
class _Event:
    rv: int
    rtype: ResourceType
    type: str  # ADDED, MODIFIED, DELETED
    old: JSON | None
    new: JSON | None


_CLOSE = object()  # sentinel: end the watch cleanly
_DROP = object()  # sentinel: cut the connection without a final chunk
_STALL = object()  # sentinel: send nothing more, keep the connection open


@dataclasses.dataclass(eq=False)
class _Watcher:
    rtype: ResourceType
    namespace: str | None
    labels: list[tuple[str, str, str | None]]
    fields: list[tuple[str, str, str]]
    bookmarks: bool
    connection: socket.socket
    token: str = ""
    queue: queue.SimpleQueue[Any] = dataclasses.field(default_factory=queue.SimpleQueue)

    def matches(self, obj: JSON | None) -> bool:
        if obj is None:
            return False
        meta = obj.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return _labels_match(meta.get("labels") or {}, self.labels) and _fields_match(
            obj, self.fields
        )

    def translate(self, event: _Event) -> JSON | None:
        """The event this watcher sees, given its selectors (None: nothing)."""
        was, now = self.matches(event.old), self.matches(event.new)
        if event.type == "DELETED":
            return {"type": "DELETED", "object": event.old} if was else None
        if now and was:
            return {"type": "MODIFIED", "object": event.new}
        if now:
            return {"type": "ADDED", "object": event.new}
        if was:
            return {"type": "DELETED", "object": event.new}
        return None


def _parse_labels(selector: str) -> list[tuple[str, str, str | None]]:
    terms: list[tuple[str, str, str | None]] = []
    for raw in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in raw:
            key, value = raw.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "==" in raw or "=" in raw:
            key, value = raw.split("==", 1) if "==" in raw else raw.split("=", 1)
            terms.append((key.strip(), "=", value.strip()))
        elif raw.startswith("!"):
            terms.append((raw[1:].strip(), "!exists", None))
        elif " " in raw or "(" in raw:
            raise ApiError(400, "BadRequest", f"set-based label selectors unsupported: {raw}")
        else:
            terms.append((raw, "exists", None))
    return terms


def _labels_match(labels: dict[str, str], terms: list[tuple[str, str, str | None]]) -> bool:
    for key, op, value in terms:
        if op == "=" and labels.get(key) != value:
            return False
        if op == "!=" and labels.get(key) == value:
            return False
        if op == "exists" and key not in labels:
            return False
        if op == "!exists" and key in labels:
            return False
    return True


def _parse_fields(selector: str) -> list[tuple[str, str, str]]:
    terms = []
    for raw in filter(None, (t.strip() for t in selector.split(","))):
        if "!=" in raw:
            key, value = raw.split("!=", 1)
            terms.append((key.strip(), "!=", value.strip()))
        elif "=" in raw:
            key, value = raw.split("==", 1) if "==" in raw else raw.split("=", 1)
            terms.append((key.strip(), "=", value.strip()))
        else:
            raise ApiError(400, "BadRequest", f"invalid field selector: {raw}")
    return terms


def _field(obj: JSON, path: str) -> str:
    value: Any = obj
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _fields_match(obj: JSON, terms: list[tuple[str, str, str]]) -> bool:
    return all((_field(obj, key) == value) == (op == "=") for key, op, value in terms)


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch (also used for strategic merge: lists replace)."""
    if not isinstance(patch, dict):
        return copy.deepcopy(patch)
    result = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def json_patch(target: JSON, operations: list[JSON]) -> JSON:
    """RFC 6902 JSON patch: add, replace, remove, test."""
    doc = copy.deepcopy(target)
    for op in operations:
        parts = [
            p.replace("~1", "/").replace("~0", "~") for p in str(op.get("path", "")).split("/")[1:]
        ]
        if not parts:
            raise ApiError(422, "Invalid", "json patch on the whole document is unsupported")
        parent: Any = doc
        for part in parts[:-1]:
            parent = parent[int(part)] if isinstance(parent, list) else parent.get(part)
            if parent is None:
                raise ApiError(422, "Invalid", f"json patch path not found: {op.get('path')}")
        last = parts[-1]
        kind = op.get("op")
        try:
            if isinstance(parent, list):
                index = len(parent) if last == "-" else int(last)
                if kind == "add":
                    parent.insert(index, op["value"])
                elif kind == "replace":
                    parent[index] = op["value"]
                elif kind == "remove":
                    del parent[index]
                elif kind == "test" and parent[index] != op["value"]:
                    raise ApiError(422, "Invalid", f"json patch test failed at {op['path']}")
            elif kind in ("add", "replace"):
                if kind == "replace" and last not in parent:
                    raise ApiError(422, "Invalid", f"json patch path not found: {op['path']}")
                parent[last] = op["value"]
            elif kind == "remove":
                del parent[last]
            elif kind == "test" and parent.get(last) != op["value"]:
                raise ApiError(422, "Invalid", f"json patch test failed at {op['path']}")
            elif kind not in ("add", "replace", "remove", "test"):
                raise ApiError(422, "Invalid", f"unsupported json patch op {kind!r}")
        except (IndexError, KeyError, ValueError) as exc:
            raise ApiError(422, "Invalid", f"json patch failed at {op.get('path')}: {exc}") from exc
    return doc


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _without_rv(obj: JSON) -> JSON:
    stripped = copy.deepcopy(obj)
    stripped.get("metadata", {}).pop("resourceVersion", None)
    return stripped


class KubeAPI:
    """The stand-in server. See the module docstring for its whole API."""

    def __init__(
        self, history: int = 1000, default_watch_timeout: float = 300.0, auto_register: bool = True
    ) -> None:
        self._lock = threading.RLock()
        self._types: dict[tuple[str, str, str], ResourceType] = {}
        self._kinds: dict[tuple[str, str], ResourceType] = {}
        self._objects: dict[ResourceType, dict[tuple[str, str], JSON]] = {}
        self._history: deque[_Event] = deque()
        self._history_size = history
        # Watches may resume from any version >= this; older ones get 410.
        self._oldest_resumable = 0
        self._rv = 1
        self._watchers: list[_Watcher] = []
        self._connections: set[socket.socket] = set()
        self.default_watch_timeout = default_watch_timeout
        self.auto_register = auto_register
        self.requests: list[Request] = []
        self.token_reviewer: Callable[[str, list[str]], JSON | None] | None = None
        self.bearer_token: str | None = None
        self.gone_as_http = False
        self.unavailable = False
        self.write_delay = 0.0
        self.partitioned: set[str] = set()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        for api_version, kind, plural, namespaced in _BUILTIN:
            self.register(api_version, kind, plural, namespaced=namespaced)

    # ------------------------------------------------------------ lifecycle

    def start(self) -> KubeAPI:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.api = self
        self._thread = threading.Thread(
            target=self._server.serve_forever,
            kwargs={"poll_interval": 0.05},
            name="kubeapi-stand-in",
            daemon=True,
        )
        self._thread.start()
        return self

    def stop(self) -> None:
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        with self._lock:
            for watcher in self._watchers:
                watcher.queue.put(_DROP)
            for conn in list(self._connections):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = None

    def __enter__(self) -> KubeAPI:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def port(self) -> int:
        assert self._server is not None, "start() the stand-in first"
        return int(self._server.server_address[1])

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def configuration(self) -> Any:
        """A `kubernetes.client.Configuration` pointing at this server."""
        from kubernetes import client

        config = client.Configuration()
        config.host = self.url
        if self.bearer_token:
            config.api_key = {"authorization": self.bearer_token}
            config.api_key_prefix = {"authorization": "Bearer"}
        return config

    # ------------------------------------------------------------ test-side API

    def register(
        self, api_version: str, kind: str, plural: str, *, namespaced: bool = True
    ) -> None:
        group, _, version = api_version.rpartition("/")
        rtype = ResourceType(group, version, plural, kind, namespaced)
        with self._lock:
            self._types[(group, version, plural)] = rtype
            self._kinds[(api_version, kind)] = rtype
            self._objects.setdefault(rtype, {})

    @property
    def resource_version(self) -> int:
        with self._lock:
            return self._rv

    def create(self, obj: JSON) -> JSON:
        rtype, namespace, _ = self._locate(obj)
        return self._create(rtype, namespace, obj)

    def replace(self, obj: JSON) -> JSON:
        rtype, namespace, name = self._locate(obj)
        return self._replace(rtype, namespace, name, obj, check_rv=False)

    def apply(self, obj: JSON) -> JSON:
        rtype, namespace, name = self._locate(obj)
        with self._lock:
            if (namespace, name) in self._objects[rtype]:
                return self._replace(rtype, namespace, name, obj, check_rv=False)
            return self._create(rtype, namespace, obj)

    def delete(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> JSON:
        return self._delete(self._kind(api_version, kind), namespace or "", name)

    def get(self, api_version: str, kind: str, name: str, namespace: str | None = None) -> JSON:
        return self._get(self._kind(api_version, kind), namespace or "", name)

    def list(self, api_version: str, kind: str, namespace: str | None = None) -> list[JSON]:
        rtype = self._kind(api_version, kind)
        with self._lock:
            return [
                copy.deepcopy(obj)
                for (ns, _), obj in sorted(self._objects[rtype].items())
                if namespace is None or ns == namespace
            ]

    def partition(self, token: str) -> None:
        """Cut the client using `token` off: its requests and open watches fail."""
        with self._lock:
            self.partitioned.add(token)
            for watcher in [w for w in self._watchers if w.token == token]:
                self._watchers.remove(watcher)
                watcher.queue.put(_DROP)
                with contextlib.suppress(OSError):
                    watcher.connection.shutdown(socket.SHUT_RDWR)

    def heal(self, token: str) -> None:
        with self._lock:
            self.partitioned.discard(token)

    def kubeconfig(self, path: Any, token: str) -> Any:
        """Write a kubeconfig for this server with bearer `token` to `path`; returns path."""
        from pathlib import Path

        target = Path(path)
        target.write_text(
            "apiVersion: v1\nkind: Config\n"
            f'clusters: [{{name: stand-in, cluster: {{server: "{self.url}"}}}}]\n'
            f"users: [{{name: user, user: {{token: {token}}}}}]\n"
            "contexts: [{name: c, context: {cluster: stand-in, user: user}}]\n"
            "current-context: c\n"
        )
        target.chmod(0o600)
        return target

    def expire_history(self) -> None:
        """Forget every past event: a watch resuming from an older version gets 410."""
        with self._lock:
            self._history.clear()
            self._oldest_resumable = self._rv

    def drop_watches(self) -> None:
        """Cut every open watch connection without a clean end of stream."""
        with self._lock:
            watchers, self._watchers = self._watchers, []
            for watcher in watchers:
                watcher.queue.put(_DROP)
                with contextlib.suppress(OSError):
                    watcher.connection.shutdown(socket.SHUT_RDWR)

    def stall_watches(self) -> None:
        """Make every open watch go silent without closing (a dead connection)."""
        with self._lock:
            watchers, self._watchers = self._watchers, []
            for watcher in watchers:
                watcher.queue.put(_STALL)

    def bookmark(self) -> None:
        """Send a BOOKMARK at the current version to every watch that allowed them."""
        with self._lock:
            for watcher in self._watchers:
                if watcher.bookmarks:
                    watcher.queue.put(
                        {
                            "type": "BOOKMARK",
                            "object": {
                                "kind": watcher.rtype.kind,
                                "apiVersion": watcher.rtype.api_version,
                                "metadata": {"resourceVersion": str(self._rv)},
                            },
                        }
                    )

    def watchers(self, kind: str | None = None) -> int:
        with self._lock:
            return sum(1 for w in self._watchers if kind is None or w.rtype.kind == kind)

    async def wait_watchers(
        self, count: int, kind: str | None = None, timeout: float = 5.0
    ) -> None:
        """Poll until at least `count` watches (of `kind`) are open; TimeoutError otherwise."""
        async with asyncio.timeout(timeout):
            while self.watchers(kind) < count:
                await asyncio.sleep(0.01)

    # ------------------------------------------------------------ object machinery

    def _kind(self, api_version: str, kind: str) -> ResourceType:
        with self._lock:
            rtype = self._kinds.get((api_version, kind))
            if rtype is None:
                self.register(api_version, kind, kind.lower() + "s", namespaced=True)
                rtype = self._kinds[(api_version, kind)]
            return rtype

    def _locate(self, obj: JSON) -> tuple[ResourceType, str, str]:
        rtype = self._kind(obj["apiVersion"], obj["kind"])
        meta = obj.get("metadata") or {}
        namespace = meta.get("namespace", "") if rtype.namespaced else ""
        if rtype.namespaced and not namespace:
            raise ValueError(f"{rtype.kind} objects need metadata.namespace")
        return rtype, namespace, meta.get("name", "")

    def _type_for_path(
        self, group: str, version: str, plural: str, namespaced: bool
    ) -> ResourceType:
        with self._lock:
            rtype = self._types.get((group, version, plural))
            if rtype is None and not self.auto_register:
                raise ApiError(404, "NotFound", "the server could not find the requested resource")
            if rtype is None:
                kind = plural[:-1] if plural.endswith("s") else plural
                self.register(
                    f"{group}/{version}" if group else version,
                    kind[:1].upper() + kind[1:],
                    plural,
                    namespaced=namespaced,
                )
                rtype = self._types[(group, version, plural)]
            return rtype

    def _emit(self, rtype: ResourceType, type_: str, old: JSON | None, new: JSON | None) -> None:
        event = _Event(self._rv, rtype, type_, old, new)
        self._history.append(event)
        while len(self._history) > self._history_size:
            self._oldest_resumable = self._history.popleft().rv
        for watcher in self._watchers:
            if watcher.rtype == rtype:
                seen = watcher.translate(event)
                if seen is not None:
                    watcher.queue.put(copy.deepcopy(seen))

    def _create(self, rtype: ResourceType, namespace: str, body: JSON) -> JSON:
        obj = copy.deepcopy(body)
        obj["apiVersion"], obj["kind"] = rtype.api_version, rtype.kind
        meta = obj.setdefault("metadata", {})
        if not meta.get("name"):
            if not meta.get("generateName"):
                raise ApiError(422, "Invalid", "metadata.name or metadata.generateName is required")
            meta["name"] = meta["generateName"] + uuid.uuid4().hex[:5]
        if rtype.namespaced:
            if meta.get("namespace", namespace) != namespace:
                raise ApiError(
                    400, "BadRequest", "the namespace of the object does not match the path"
                )
            meta["namespace"] = namespace
        else:
            meta.pop("namespace", None)
        with self._lock:
            key = (namespace, meta["name"])
            if key in self._objects[rtype]:
                raise ApiError(
                    409, "AlreadyExists", f'{rtype.plural} "{meta["name"]}" already exists'
                )
            self._rv += 1
            meta.update(
                uid=str(uuid.uuid4()),
                creationTimestamp=_now(),
                resourceVersion=str(self._rv),
                generation=1,
            )
            self._objects[rtype][key] = obj
            self._emit(rtype, "ADDED", None, copy.deepcopy(obj))
            return copy.deepcopy(obj)

    def _get(self, rtype: ResourceType, namespace: str, name: str) -> JSON:
        with self._lock:
            obj = self._objects[rtype].get((namespace, name))
            if obj is None:
                raise ApiError(404, "NotFound", f'{rtype.plural} "{name}" not found')
            return copy.deepcopy(obj)

    def _store(self, rtype: ResourceType, namespace: str, name: str, new: JSON) -> JSON:
        """Write `new` over the existing object, keeping server-owned metadata."""
        with self._lock:
            old = self._objects[rtype].get((namespace, name))
            if old is None:
                raise ApiError(404, "NotFound", f'{rtype.plural} "{name}" not found')
            new = copy.deepcopy(new)
            new["apiVersion"], new["kind"] = rtype.api_version, rtype.kind
            meta = new.setdefault("metadata", {})
            old_meta = old["metadata"]
            for key in ("name", "uid", "creationTimestamp", "generation", "resourceVersion"):
                meta[key] = old_meta[key]
            if rtype.namespaced:
                meta["namespace"] = namespace
            if _without_rv(new) == _without_rv(old):
                return copy.deepcopy(old)
            if new.get("spec") != old.get("spec"):
                meta["generation"] = old_meta.get("generation", 1) + 1
            self._rv += 1
            meta["resourceVersion"] = str(self._rv)
            self._objects[rtype][(namespace, name)] = new
            self._emit(rtype, "MODIFIED", copy.deepcopy(old), copy.deepcopy(new))
            return copy.deepcopy(new)

    def _replace(
        self, rtype: ResourceType, namespace: str, name: str, body: JSON, *, check_rv: bool
    ) -> JSON:
        with self._lock:
            current = self._get(rtype, namespace, name)
            sent_rv = (body.get("metadata") or {}).get("resourceVersion")
            if check_rv and sent_rv and sent_rv != current["metadata"]["resourceVersion"]:
                raise ApiError(
                    409,
                    "Conflict",
                    f'Operation cannot be fulfilled on {rtype.plural} "{name}": the object has '
                    "been modified; please apply your changes to the latest version and try again",
                )
            return self._store(rtype, namespace, name, body)

    def _delete(self, rtype: ResourceType, namespace: str, name: str) -> JSON:
        with self._lock:
            obj = self._objects[rtype].pop((namespace, name), None)
            if obj is None:
                raise ApiError(404, "NotFound", f'{rtype.plural} "{name}" not found')
            self._rv += 1
            obj["metadata"]["resourceVersion"] = str(self._rv)
            self._emit(rtype, "DELETED", copy.deepcopy(obj), None)
            return obj

    # ------------------------------------------------------------ HTTP handling

    def _handle(self, handler: _Handler, method: str) -> None:
        parsed = urllib.parse.urlsplit(handler.path)
        query = dict(urllib.parse.parse_qsl(parsed.query, keep_blank_values=True))
        watch = query.get("watch", "").lower() in ("true", "1")
        with self._lock:
            self.requests.append(Request(method, parsed.path, query, watch))
        auth = handler.headers.get("Authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        if token and token in self.partitioned:
            # A partition: the request never gets an answer.
            handler.close_connection = True
            with contextlib.suppress(OSError):
                handler.connection.shutdown(socket.SHUT_RDWR)
            return
        if method != "GET" and self.write_delay > 0:
            time.sleep(self.write_delay)
        try:
            if self.unavailable:
                raise ApiError(
                    503,
                    "ServiceUnavailable",
                    "the server is currently unable to handle the request",
                )
            if self.bearer_token is not None and auth != f"Bearer {self.bearer_token}":
                raise ApiError(401, "Unauthorized", "Unauthorized")
            body = self._read_body(handler)
            self._route(handler, method, parsed.path, query, watch, body)
        except ApiError as err:
            _send_json(handler, err.code, err.status())
        except (ValueError, KeyError, TypeError) as err:
            _send_json(handler, 400, _status(400, "BadRequest", f"bad request: {err}"))

    @staticmethod
    def _read_body(handler: _Handler) -> Any:
        length = int(handler.headers.get("Content-Length") or 0)
        if not length:
            return None
        raw = handler.rfile.read(length)
        try:
            return json.loads(raw)
        except ValueError as err:
            raise ApiError(400, "BadRequest", f"request body is not JSON: {err}") from err

    def _route(
        self,
        handler: _Handler,
        method: str,
        path: str,
        query: dict[str, str],
        watch: bool,
        body: Any,
    ) -> None:
        parts = [p for p in path.split("/") if p]
        if parts[:2] == ["api", "v1"]:
            group, version, rest = "", "v1", parts[2:]
        elif len(parts) >= 3 and parts[0] == "apis":
            group, version, rest = parts[1], parts[2], parts[3:]
        else:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({path})"
            )
        if (group, version, rest) == ("authentication.k8s.io", "v1", ["tokenreviews"]):
            if method != "POST":
                raise ApiError(405, "MethodNotAllowed", "tokenreviews only accept POST")
            _send_json(handler, 201, self._token_review(body))
            return
        namespace = ""
        if len(rest) >= 3 and rest[0] == "namespaces":
            namespace, rest = rest[1], rest[2:]
            namespaced_path = True
        else:
            namespaced_path = False
        if not rest or len(rest) > 3:
            raise ApiError(
                404, "NotFound", f"the server could not find the requested resource ({path})"
            )
        rtype = self._type_for_path(group, version, rest[0], namespaced_path)
        name = rest[1] if len(rest) > 1 else None
        subresource = rest[2] if len(rest) > 2 else None
        if name is None:
            if method == "GET" and watch:
                self._watch(handler, rtype, namespace if namespaced_path else None, query)
            elif method == "GET":
                _send_json(
                    handler, 200, self._list(rtype, namespace if namespaced_path else None, query)
                )
            elif method == "POST":
                _send_json(handler, 201, self._create(rtype, namespace, _require_object(body)))
            else:
                raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed on a collection")
            return
        if subresource not in (None, "status", "approval"):
            raise ApiError(404, "NotFound", f"unknown subresource {subresource!r}")
        if method == "GET":
            _send_json(handler, 200, self._get(rtype, namespace, name))
        elif method == "PUT":
            body = _require_object(body)
            with self._lock:
                if subresource is not None:
                    body = _only_status(self._get(rtype, namespace, name), body, subresource)
                replaced = self._replace(rtype, namespace, name, body, check_rv=True)
            _send_json(handler, 200, replaced)
        elif method == "PATCH":
            content_type = (handler.headers.get("Content-Type") or "").split(";")[0].strip()
            with self._lock:
                current = self._get(rtype, namespace, name)
                if content_type == "application/json-patch+json":
                    if not isinstance(body, list):
                        raise ApiError(400, "BadRequest", "a json patch is a list of operations")
                    patched = json_patch(current, body)
                elif content_type in (
                    "application/merge-patch+json",
                    "application/strategic-merge-patch+json",
                ):
                    patched = merge_patch(current, _require_object(body))
                else:
                    raise ApiError(
                        415, "UnsupportedMediaType", f"unsupported patch type {content_type!r}"
                    )
                if subresource is not None:
                    patched = _only_status(current, patched, subresource)
                replaced = self._replace(rtype, namespace, name, patched, check_rv=True)
            _send_json(handler, 200, replaced)
        elif method == "DELETE":
            # The real server answers with the deleted object's last state.
            _send_json(handler, 200, self._delete(rtype, namespace, name))
        else:
            raise ApiError(405, "MethodNotAllowed", f"{method} is not allowed")

    def _list(self, rtype: ResourceType, namespace: str | None, query: dict[str, str]) -> JSON:
        labels = _parse_labels(query.get("labelSelector", ""))
        fields = _parse_fields(query.get("fieldSelector", ""))
        with self._lock:
            items = []
            for (ns, _), obj in sorted(self._objects[rtype].items()):
                if namespace is not None and ns != namespace:
                    continue
                if not _labels_match(obj["metadata"].get("labels") or {}, labels):
                    continue
                if not _fields_match(obj, fields):
                    continue
                item = copy.deepcopy(obj)
                item.pop("apiVersion", None)
                item.pop("kind", None)
                items.append(item)
            metadata: JSON = {"resourceVersion": str(self._rv)}
            token = query.get("continue", "")
            if token:
                try:
                    state = json.loads(base64.urlsafe_b64decode(token.encode()))
                    list_rv, after = str(state["rv"]), tuple(state["after"])
                except (ValueError, KeyError, TypeError) as err:
                    raise ApiError(400, "BadRequest", f"invalid continue token {token!r}") from err
                metadata["resourceVersion"] = list_rv
                items = [
                    i
                    for i in items
                    if (i["metadata"].get("namespace", ""), i["metadata"]["name"]) > after
                ]
            limit = int(query.get("limit") or 0)
            if limit > 0 and len(items) > limit:
                items = items[:limit]
                last = items[-1]["metadata"]
                metadata["continue"] = base64.urlsafe_b64encode(
                    json.dumps(
                        {
                            "rv": metadata["resourceVersion"],
                            "after": [last.get("namespace", ""), last["name"]],
                        }
                    ).encode()
                ).decode()
            return {
                "kind": rtype.kind + "List",
                "apiVersion": rtype.api_version,
                "metadata": metadata,
                "items": items,
            }

    def _token_review(self, body: Any) -> JSON:
        review = _require_object(body)
        spec = review.get("spec") or {}
        token, audiences = spec.get("token", ""), list(spec.get("audiences") or [])
        user = self.token_reviewer(token, audiences) if self.token_reviewer and token else None
        status: JSON = {"authenticated": user is not None}
        if user is not None:
            status["user"] = user
            status["audiences"] = audiences
        else:
            status["error"] = "invalid bearer token"
        return {
            "kind": "TokenReview",
            "apiVersion": "authentication.k8s.io/v1",
            "metadata": {"creationTimestamp": None},
            "spec": spec,
            "status": status,
        }

    def _watch(
        self,
        handler: _Handler,
        rtype: ResourceType,
        namespace: str | None,
        query: dict[str, str],
    ) -> None:
        auth = handler.headers.get("Authorization", "")
        token = auth[len("Bearer ") :] if auth.startswith("Bearer ") else ""
        timeout = float(query.get("timeoutSeconds") or self.default_watch_timeout)
        watcher = _Watcher(
            rtype=rtype,
            namespace=namespace,
            labels=_parse_labels(query.get("labelSelector", "")),
            fields=_parse_fields(query.get("fieldSelector", "")),
            bookmarks=query.get("allowWatchBookmarks", "").lower() in ("true", "1"),
            connection=handler.connection,
            token=token,
        )
        since = query.get("resourceVersion", "")
        with self._lock:
            if since in ("", "0"):
                for obj in sorted(
                    self._objects[rtype].values(),
                    key=lambda o: (o["metadata"].get("namespace", ""), o["metadata"]["name"]),
                ):
                    if watcher.matches(obj):
                        watcher.queue.put({"type": "ADDED", "object": copy.deepcopy(obj)})
            else:
                try:
                    since_rv = int(since)
                except ValueError as err:
                    raise ApiError(400, "BadRequest", f"invalid resourceVersion {since!r}") from err
                if since_rv < self._oldest_resumable:
                    message = f"too old resource version: {since_rv} ({self._oldest_resumable})"
                    if self.gone_as_http:
                        raise ApiError(410, "Expired", message)
                    watcher.queue.put({"type": "ERROR", "object": _status(410, "Expired", message)})
                    watcher.queue.put(_CLOSE)
                else:
                    for event in self._history:
                        if event.rv > since_rv and event.rtype == rtype:
                            seen = watcher.translate(event)
                            if seen is not None:
                                watcher.queue.put(copy.deepcopy(seen))
            self._watchers.append(watcher)
        try:
            self._stream(handler, watcher, time.monotonic() + timeout)
        finally:
            with self._lock:
                if watcher in self._watchers:
                    self._watchers.remove(watcher)

    @staticmethod
    def _stream(handler: _Handler, watcher: _Watcher, deadline: float) -> None:
        handler.close_connection = True
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Transfer-Encoding", "chunked")
        handler.send_header("Connection", "close")
        handler.end_headers()
        handler.wfile.flush()
        try:
            while True:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    item = watcher.queue.get(timeout=min(remaining, IDLE_CHECK))
                except queue.Empty:
                    if _client_gone(handler.connection):
                        return
                    continue
                if item is _CLOSE:
                    break
                if item is _DROP:
                    with contextlib.suppress(OSError):
                        handler.connection.shutdown(socket.SHUT_RDWR)
                    return
                if item is _STALL:
                    # A dead peer: silent, never ending, until the client gives up.
                    while not _client_gone(handler.connection):
                        time.sleep(IDLE_CHECK)
                    return
                data = json.dumps(item).encode() + b"\n"
                handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                handler.wfile.flush()
            handler.wfile.write(b"0\r\n\r\n")
            handler.wfile.flush()
        except OSError:
            # The client went away; nothing to clean up beyond the watcher entry.
            return


def _client_gone(connection: socket.socket) -> bool:
    """True when the client closed its end (readable with nothing to read)."""
    try:
        readable, _, _ = select.select([connection], [], [], 0)
        return bool(readable) and connection.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except (OSError, ValueError):
        return True


def _require_object(body: Any) -> JSON:
    if not isinstance(body, dict):
        raise ApiError(400, "BadRequest", "the request body must be a JSON object")
    return body


def _only_status(current: JSON, body: JSON, subresource: str) -> JSON:
    """A subresource write changes the status (or only its conditions), nothing else."""
    updated = copy.deepcopy(current)
    new_status = body.get("status") or {}
    if subresource == "approval":
        updated.setdefault("status", {})["conditions"] = new_status.get("conditions") or []
    else:
        updated["status"] = new_status
    sent_rv = (body.get("metadata") or {}).get("resourceVersion")
    if sent_rv:
        updated["metadata"]["resourceVersion"] = sent_rv
    return updated


def _send_json(handler: _Handler, code: int, obj: JSON) -> None:
    data = json.dumps(obj).encode()
    handler.send_response(code)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    api: KubeAPI

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.api._lock:
            self.api._connections.add(request)
        super().process_request(request, client_address)

    def shutdown_request(self, request: Any) -> None:
        with self.api._lock:
            self.api._connections.discard(request)
        super().shutdown_request(request)


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = CONNECTION_TIMEOUT
    server: _Server

    def do_GET(self) -> None:
        self.server.api._handle(self, "GET")

    def do_POST(self) -> None:
        self.server.api._handle(self, "POST")

    def do_PUT(self) -> None:
        self.server.api._handle(self, "PUT")

    def do_PATCH(self) -> None:
        self.server.api._handle(self, "PATCH")

    def do_DELETE(self) -> None:
        self.server.api._handle(self, "DELETE")

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("kubeapi stand-in: " + format, *args)


def secret_data(values: dict[str, bytes]) -> dict[str, str]:
    """Base64-encode values for a Secret's `data`, as the API expects."""
    return {key: base64.b64encode(value).decode() for key, value in values.items()}


def iter_lines(stream: Iterator[bytes]) -> Iterator[JSON]:
    """Decode a watch stream read with `_preload_content=False` into events (test helper)."""
    buffer = b""
    for chunk in stream:
        buffer += chunk
        while b"\n" in buffer:
            line, buffer = buffer.split(b"\n", 1)
            if line.strip():
                yield json.loads(line)
