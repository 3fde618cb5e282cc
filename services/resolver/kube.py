"""The Kubernetes source: Services, EndpointSlices and Route custom resources,
by list + watch, into the resolver's store.

Each of the three kinds runs one loop:
    list -> replace_source (the kind becomes exactly what the API holds now)
    watch from the list's resourceVersion -> apply each event
    watch ends (server timeout) -> watch again from the last resourceVersion
    connection lost -> back off with jitter, then watch again from the last
                       resourceVersion (no relist: nothing was missed)
    410 Gone (HTTP 410, or an ERROR event with code 410) -> relist at once
Watches ask for bookmarks, so the resourceVersion keeps moving on a quiet
cluster and a resume rarely meets 410.

Invariants:
- Never a stale endpoint after a reconnect: a resume replays every event
  after the last version applied, and when the API can no longer do that
  (410) the relist goes through `Store.replace_source`, which deletes whatever
  this source contributed before and is absent now (endpoints deleted while
  disconnected included).
- The store is only touched from the event loop; the `kubernetes` client's
  blocking calls and the watch stream reads run on this source's own threads
  (never the loop's default executor), and their results cross back as queued
  items, so the loop never blocks on the network.
- A dead connection is noticed: every watch carries `timeoutSeconds`
  (`watch_timeout`, with jitter so replicas do not reconnect together) and a
  client-side read timeout a little longer than that.
- Freshness is per kind: a list, a bookmark or any event confirms that kind
  up to that moment, and the store's last-sync time for "kubernetes" is the
  OLDEST of the kinds' confirmations, so a failing EndpointSlice watch is not
  hidden by fresh Service bookmarks. `synced` is set once every kind has
  listed (readiness).
- Bad objects never stop the watch: an object that fails validation is
  logged with the reason and left out (a modified object that became invalid
  is removed, so the store never keeps a state the API no longer has).
- A missing Route CRD (404) counts as "no routes" and is retried with backoff,
  so a cluster without the CRD still gets services and endpoints.

Edge endpoints: an endpoint is marked `tunnel=True` (reachable only through a
tunnel to its node) when its EndpointSlice carries the label
`waygate.io/tunnel: "true"` — the EndpointSlice controller copies a Service's
labels onto its slices, so label the Service — or when its `nodeName` is in the
configured `edge_nodes`. See `kube_convert` for the object mapping.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import json
import logging
import random
from collections.abc import Callable, Iterable
from datetime import UTC, datetime
from typing import Any

import urllib3
from kubernetes import client as k8s

from waygate.core.backoff import Backoff
from waygate.core.errors import InvalidArgument
from waygate.core.settings import SettingsError
from waygate.resolver import kube_convert as convert
from waygate.resolver.model import Endpoint
from waygate.resolver.store import Store

log = logging.getLogger(__name__)

SOURCE = "kubernetes"
ROUTE_GROUP, ROUTE_VERSION, ROUTE_PLURAL = "waygate.io", "v1", "routes"

JSON = dict[str, Any]
_END = object()  # the watch stream ended cleanly (server-side timeout)


class _Gone(Exception):
    """The resourceVersion is too old for the API server: relist."""

    #: Whether the watch that met it had applied events first (then relist at once).
    progressed = False


class _WatchFailed(Exception):
    """The watch answered with an ERROR event other than 410."""


def kube_configuration(kubeconfig: str = "", context: str = "") -> k8s.Configuration:
    """Client configuration from a kubeconfig file, or the in-cluster service account."""
    from kubernetes import config

    configuration = k8s.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(
                config_file=kubeconfig,
                context=context or None,
                client_configuration=configuration,
            )
        else:
            config.load_incluster_config(client_configuration=configuration)
    except (config.ConfigException, OSError, ValueError, TypeError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster configuration"
        raise SettingsError(f"kubernetes: cannot load {where}: {exc}") from None
    return configuration


def parse_node_list(text: str) -> frozenset[str]:
    """'edge-1, edge-2' (commas and/or spaces) -> {"edge-1", "edge-2"}."""
    return frozenset(name for name in text.replace(",", " ").split() if name)


# ---------------------------------------------------------------- per-kind handlers


class _Handler:
    """How one kind is listed, watched and written to the store."""

    name = ""
    optional = False  # a 404 on the list means "none" rather than an error

    def __init__(self, store: Store) -> None:
        self.store = store

    def call(self, api: k8s.ApiClient, namespace: str | None) -> Callable[..., Any]:
        raise NotImplementedError

    def relist(self, items: list[JSON]) -> None:
        raise NotImplementedError

    def apply(self, event_type: str, obj: JSON) -> None:
        raise NotImplementedError


class _Services(_Handler):
    name = "services"

    def call(self, api: k8s.ApiClient, namespace: str | None) -> Callable[..., Any]:
        core = k8s.CoreV1Api(api)
        if namespace:
            return functools.partial(core.list_namespaced_service, namespace)
        return core.list_service_for_all_namespaces

    def relist(self, items: list[JSON]) -> None:
        self.store.replace_source(SOURCE, services=_valid(convert.service_from, items))

    def apply(self, event_type: str, obj: JSON) -> None:
        _upsert_or_delete(
            event_type, obj, "Service", convert.service_from,
            self.store.upsert_service, self.store.delete_service,
        )  # fmt: skip


def _upsert_or_delete(
    event_type: str,
    obj: JSON,
    kind: str,
    convert_object: Callable[[JSON], Any],
    upsert: Callable[..., None],
    delete: Callable[..., None],
) -> None:
    """Apply one watch event for a keyed kind. An object that became invalid is
    removed, so the store never keeps a state the API no longer has."""
    namespace, name = convert.object_key(obj)
    if event_type != "DELETED":
        try:
            upsert(convert_object(obj), source=SOURCE)
            return
        except InvalidArgument as exc:
            log.warning("skipping invalid %s: %s", kind, exc)
    delete(namespace, name, source=SOURCE)


class _Routes(_Handler):
    name = "routes"
    optional = True

    def call(self, api: k8s.ApiClient, namespace: str | None) -> Callable[..., Any]:
        custom = k8s.CustomObjectsApi(api)
        if namespace:
            return functools.partial(
                custom.list_namespaced_custom_object,
                ROUTE_GROUP,
                ROUTE_VERSION,
                namespace,
                ROUTE_PLURAL,
            )
        return functools.partial(
            custom.list_cluster_custom_object, ROUTE_GROUP, ROUTE_VERSION, ROUTE_PLURAL
        )

    def relist(self, items: list[JSON]) -> None:
        self.store.replace_source(SOURCE, routes=_valid(convert.route_from, items))

    def apply(self, event_type: str, obj: JSON) -> None:
        _upsert_or_delete(
            event_type, obj, "Route", convert.route_from,
            self.store.upsert_route, self.store.delete_route,
        )  # fmt: skip


class _EndpointSlices(_Handler):
    """Keeps every slice's endpoints, so a service's set is the merge of its slices."""

    name = "endpointslices"

    def __init__(self, store: Store, edge_nodes: frozenset[str]) -> None:
        super().__init__(store)
        self._edge_nodes = edge_nodes
        # service (namespace, name) -> slice name -> that slice's endpoints
        self._by_service: dict[tuple[str, str], dict[str, list[Endpoint]]] = {}
        # slice (namespace, name) -> the service it belonged to when last seen
        self._owner: dict[tuple[str, str], tuple[str, str]] = {}

    def call(self, api: k8s.ApiClient, namespace: str | None) -> Callable[..., Any]:
        discovery = k8s.DiscoveryV1Api(api)
        if namespace:
            return functools.partial(discovery.list_namespaced_endpoint_slice, namespace)
        return discovery.list_endpoint_slice_for_all_namespaces

    def _endpoints(self, obj: JSON) -> list[Endpoint]:
        problems: list[str] = []
        try:
            endpoints = convert.endpoints_from_slice(obj, self._edge_nodes, problems)
        except InvalidArgument as exc:
            log.warning("skipping invalid EndpointSlice: %s", exc)
            return []
        for problem in problems:
            log.warning("skipping invalid endpoint: %s", problem)
        return endpoints

    def _merged(self, service: tuple[str, str]) -> list[Endpoint]:
        return convert.merge_endpoints(list(self._by_service.get(service, {}).values()))

    def relist(self, items: list[JSON]) -> None:
        self._by_service.clear()
        self._owner.clear()
        for obj in items:
            self._remember(obj)
        endpoints = [ep for service in self._by_service for ep in self._merged(service)]
        self.store.replace_source(SOURCE, endpoints=endpoints)

    def _remember(self, obj: JSON) -> tuple[str, str] | None:
        owner = convert.slice_service(obj)
        if owner is None:
            return None
        key = convert.object_key(obj)
        self._owner[key] = owner
        self._by_service.setdefault(owner, {})[key[1]] = self._endpoints(obj)
        return owner

    def _forget(self, key: tuple[str, str]) -> tuple[str, str] | None:
        owner = self._owner.pop(key, None)
        if owner is not None:
            slices = self._by_service.get(owner, {})
            slices.pop(key[1], None)
            if not slices:
                self._by_service.pop(owner, None)
        return owner

    def apply(self, event_type: str, obj: JSON) -> None:
        affected = {self._forget(convert.object_key(obj))}
        if event_type != "DELETED":
            affected.add(self._remember(obj))
        for service in affected:
            if service is not None:
                self.store.set_endpoints(*service, self._merged(service), source=SOURCE)


def _valid(parse: Callable[[JSON], Any], items: Iterable[JSON]) -> list[Any]:
    valid = []
    for obj in items:
        try:
            valid.append(parse(obj))
        except InvalidArgument as exc:
            log.warning("skipping invalid object: %s", exc)
    return valid


# ---------------------------------------------------------------- the source


@dataclasses.dataclass(frozen=True)
class Timeouts:
    #: Server-side watch duration (timeoutSeconds); each watch adds up to 50% jitter.
    watch: float = 300.0
    #: TCP connect to the API server.
    connect: float = 10.0
    #: A whole list call; also the read timeout's margin over a watch's duration.
    request: float = 60.0


class KubernetesSource:
    """List + watch Services, EndpointSlices and Routes into `store` until cancelled."""

    def __init__(
        self,
        store: Store,
        configuration: k8s.Configuration,
        *,
        namespace: str | None = None,
        edge_nodes: Iterable[str] = (),
        timeouts: Timeouts = Timeouts(),
        backoff_initial: float = 0.5,
        backoff_maximum: float = 30.0,
        rng: random.Random | None = None,
    ) -> None:
        self._store = store
        self._configuration = configuration
        self._namespace = namespace or None
        self._timeouts = timeouts
        self._rng = rng or random.Random()
        self._backoff = (backoff_initial, backoff_maximum)
        self._handlers: list[_Handler] = [
            _Services(store),
            _EndpointSlices(store, frozenset(edge_nodes)),
            _Routes(store),
        ]
        self._listed: set[str] = set()
        #: When each kind last proved its view current (list, bookmark or event).
        self._confirmed: dict[str, datetime] = {}
        #: Set once every kind has been listed (the resolver's readiness).
        self.synced = asyncio.Event()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    async def wait_synced(self) -> None:
        await self.synced.wait()

    async def run(self) -> None:
        # Two threads per kind: its list/watch call and its stream reader.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=2 * len(self._handlers), thread_name_prefix="kube"
        )
        api = k8s.ApiClient(self._configuration)
        try:
            async with asyncio.TaskGroup() as group:
                for handler in self._handlers:
                    group.create_task(self._run_kind(api, handler), name=f"kube-{handler.name}")
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)
            api.close()

    # ------------------------------------------------------------ one kind

    async def _run_kind(self, api: k8s.ApiClient, handler: _Handler) -> None:
        backoff = Backoff(*self._backoff, rng=self._rng)
        call = handler.call(api, self._namespace)
        version: str | None = None
        while True:
            try:
                if version is None:
                    version = await self._list(call, handler)
                    backoff.reset()
                version, progressed = await self._watch(call, handler, version)
                if progressed:
                    backoff.reset()
                    continue
                # A watch that ended without a single event (not even a bookmark)
                # is either an idle cluster or a server that ends watches at once;
                # the backoff keeps the second from becoming a busy loop.
            except (_Gone, k8s.ApiException) as exc:
                if isinstance(exc, _Gone) or exc.status == 410:
                    log.info("%s: resourceVersion %s expired; relisting", handler.name, version)
                    version = None
                    if isinstance(exc, _Gone) and exc.progressed:
                        continue
                    # 410 right after a list: relist, but not in a tight loop.
                    await asyncio.sleep(backoff.next_delay())
                    continue
                if exc.status == 404 and handler.optional:
                    log.warning(
                        "%s: not served by the API server (is the CRD installed?); "
                        "treating as none and retrying",
                        handler.name,
                    )
                    handler.relist([])
                    self._note_listed(handler)
                    version = None
                else:
                    log.warning("%s: API error %s: %s", handler.name, exc.status, exc.reason)
            except (_WatchFailed, urllib3.exceptions.HTTPError, OSError, ValueError) as exc:
                # A cut or timed-out connection, or a garbled stream: reconnect.
                log.warning("%s: watch failed: %s", handler.name, exc)
            except Exception:
                # Unexpected, so with a traceback; the watch must outlive it all the same.
                log.warning("%s: watch failed unexpectedly", handler.name, exc_info=True)
            await asyncio.sleep(backoff.next_delay())

    async def _list(self, call: Callable[..., Any], handler: _Handler) -> str:
        loop = asyncio.get_running_loop()
        body = await loop.run_in_executor(
            self._executor,
            functools.partial(self._list_blocking, call),
        )
        handler.relist(body.get("items") or [])
        self._note_listed(handler)
        return str((body.get("metadata") or {}).get("resourceVersion") or "")

    def _list_blocking(self, call: Callable[..., Any]) -> JSON:
        response = call(
            _preload_content=False,
            _request_timeout=(self._timeouts.connect, self._timeouts.request),
        )
        try:
            return json.loads(response.data)
        finally:
            response.release_conn()

    def _note_listed(self, handler: _Handler) -> None:
        self._listed.add(handler.name)
        self._confirm(handler)
        if len(self._listed) == len(self._handlers):
            self.synced.set()

    def _confirm(self, handler: _Handler) -> None:
        """`handler`'s kind is current as of now; the source as of its stalest kind."""
        self._confirmed[handler.name] = datetime.now(UTC)
        if len(self._confirmed) == len(self._handlers):
            self._store.mark_synced(SOURCE, min(self._confirmed.values()))

    async def _watch(
        self, call: Callable[..., Any], handler: _Handler, version: str
    ) -> tuple[str, bool]:
        """Watch from `version` until the stream ends; (last version, any event seen)."""
        loop = asyncio.get_running_loop()
        duration = int(self._timeouts.watch * (1 + self._rng.random() / 2))
        opening = loop.run_in_executor(
            self._executor,
            functools.partial(
                call,
                watch=True,
                resource_version=version,
                timeout_seconds=duration,
                allow_watch_bookmarks=True,
                _preload_content=False,
                _request_timeout=(self._timeouts.connect, duration + self._timeouts.request),
            ),
        )
        try:
            # Shielded: cancelling the await must not drop a response the
            # thread is about to return, with its connection left open.
            response = await asyncio.shield(opening)
        except asyncio.CancelledError:
            # Stopped while connecting: close the response once it is open.
            opening.add_done_callback(_close_opened_response)
            raise
        events: asyncio.Queue[Any] = asyncio.Queue()
        reader = loop.run_in_executor(self._executor, _read_stream, response, loop, events)
        progressed = False
        try:
            while True:
                item = await events.get()
                if item is _END:
                    return version, progressed
                if isinstance(item, BaseException):
                    raise item
                try:
                    version = self._apply(handler, item, version)
                except _Gone as gone:
                    gone.progressed = progressed
                    raise
                progressed = True
        finally:
            # Unblock the reader thread (it may sit in a socket read), let it finish,
            # then close the connection: a watch connection is never reused.
            with contextlib.suppress(OSError, ValueError, RuntimeError):
                response.shutdown()
            await asyncio.wait([reader], timeout=self._timeouts.connect)
            response.close()
            response.release_conn()

    def _apply(self, handler: _Handler, event: JSON, version: str) -> str:
        event_type = event.get("type")
        obj = event.get("object") or {}
        if event_type == "ERROR":
            if obj.get("code") == 410:
                raise _Gone()
            raise _WatchFailed(f"{obj.get('code')} {obj.get('reason')}: {obj.get('message')}")
        new_version = str((obj.get("metadata") or {}).get("resourceVersion") or version)
        if event_type == "BOOKMARK":
            self._confirm(handler)
            return new_version
        if event_type in ("ADDED", "MODIFIED", "DELETED"):
            handler.apply(event_type, obj)
            self._confirm(handler)
        else:
            log.warning("%s: ignoring watch event of type %r", handler.name, event_type)
        return new_version


def _close_opened_response(opening: asyncio.Future[Any]) -> None:
    if opening.cancelled() or opening.exception() is not None:
        return
    response = opening.result()
    with contextlib.suppress(OSError, ValueError, RuntimeError):
        response.close()
        response.release_conn()


def _read_stream(
    response: Any, loop: asyncio.AbstractEventLoop, events: asyncio.Queue[Any]
) -> None:
    """Runs on a source thread: decode watch lines and hand them to the loop.

    The queue is unbounded, but only by what one watch connection can carry
    before the loop applies it; the loop applies an event in microseconds.
    """

    def deliver(item: Any) -> None:
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(events.put_nowait, item)

    buffer = b""
    try:
        for chunk in response.stream(decode_content=False):
            buffer += chunk
            while b"\n" in buffer:
                line, buffer = buffer.split(b"\n", 1)
                if line.strip():
                    deliver(json.loads(line))
        if buffer.strip():
            deliver(json.loads(buffer))
        deliver(_END)
    except Exception as exc:
        deliver(exc)
