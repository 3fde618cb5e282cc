"""The one Kubernetes layer: a JSON client and a reflector, shared by every service.

`KubeAPI` makes plain JSON requests (get, create, replace, list, watch) through
the official `kubernetes` client's REST layer, which keeps its authentication,
TLS and proxy handling; objects stay plain dicts, so a replace sends back every
field the server sent. `Reflector` keeps one resource in step with the API
server by list + watch, as client-go's reflector (and linkerd2's shared
controller/k8s) does:

    list (pages of `page_size`, `limit`/`continue`) -> on_list(items)
    watch from the list's resourceVersion -> on_event(type, object) per event
    watch ends (server timeout)  -> watch again from the last resourceVersion
    connection lost / read timed out -> back off with jitter, watch again from
                                        the last resourceVersion (nothing missed)
    410 Gone, as an HTTP status or as an ERROR event -> list again
    404 on an optional resource (a CRD not installed) -> on_missing(), retry later

Invariants:
- Every blocking call (the kubernetes client, stream reads) runs on the
  reflector's own two threads, never on the event loop and never in the loop's
  default executor (a watch read blocks for minutes and would starve it);
  results cross back to the loop, where the callbacks run.
- Every call has a connect and a read timeout; a watch carries
  `timeoutSeconds` (drawn from [t, 2t) like client-go, so replicas do not
  reconnect together) and a read timeout of that plus `watch_read_margin`, so
  a dead connection (no FIN ever comes) is noticed.
- Every failure is a `KubeError` carrying the HTTP status (0 when no response
  came) and the server's own message: callers branch on `status`, never on
  urllib3's exception types.
- Retries back off with `waygate.core.backoff` (jitter); a watch that ends at
  once without events backs off too, so a misbehaving server never gets a
  busy loop. A callback that raises is logged and the watch goes on.
- Metrics: `waygate_kube_relists_total{resource}` and
  `waygate_kube_watch_restarts_total{resource,reason}`
  (reason: expired, gone, error, missing).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import logging
import random
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException
from prometheus_client import Counter

from waygate.core.backoff import Backoff
from waygate.core.errors import FailedPrecondition

log = logging.getLogger(__name__)

JSON = dict[str, Any]

#: Extra read time a watch gets beyond its server-side timeoutSeconds, so a
#: healthy stream always ends by the server closing it, and a dead connection
#: (no FIN ever arrives) ends by the read timeout.
WATCH_READ_MARGIN = 30.0

RELISTS = Counter(
    "waygate_kube_relists_total",
    "Complete lists of a Kubernetes resource by a reflector (the first one included).",
    ["resource"],
)
WATCH_RESTARTS = Counter(
    "waygate_kube_watch_restarts_total",
    "Watches of a Kubernetes resource opened again, by why the previous one ended "
    "(expired: server timeout; gone: 410; error: connection or API error; missing: 404).",
    ["resource", "reason"],
)


class KubeError(Exception):
    """A Kubernetes API request failed; `status` is the HTTP status, 0 if none came."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def conflict(self) -> bool:
        """409: the object changed since it was read, or it already exists."""
        return self.status == 409

    @property
    def gone(self) -> bool:
        """410: the resourceVersion is too old to resume from; list again."""
        return self.status == 410


def load_configuration(kubeconfig: Path | str | None, *, context: str | None = None) -> Any:
    """A client Configuration from `kubeconfig`, or the pod's ServiceAccount when unset.

    Raises FailedPrecondition with a one-line reason when neither works.
    """
    configuration = client.Configuration()
    try:
        if kubeconfig:
            config.load_kube_config(
                config_file=str(kubeconfig),
                context=context or None,
                client_configuration=configuration,
                persist_config=False,
            )
        else:
            config.load_incluster_config(client_configuration=configuration)
    except (ConfigException, OSError, ValueError, TypeError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster ServiceAccount"
        hint = "" if kubeconfig else " (outside a cluster, set kubeconfig)"
        raise FailedPrecondition(
            f"cannot configure the Kubernetes client: cannot load {where}: {exc}{hint}"
        ) from None
    return configuration


def load_api_client(kubeconfig: Path | None, *, context: str | None = None) -> client.ApiClient:
    """An ApiClient from `kubeconfig`, or from the pod's ServiceAccount when None."""
    return client.ApiClient(configuration=load_configuration(kubeconfig, context=context))


def _server_message(status: int, body: bytes | str | None, fallback: str) -> str:
    """The `message` of a Kubernetes Status body, else a short fallback."""
    if isinstance(body, bytes):
        body = body.decode("utf-8", "replace")
    if body:
        try:
            parsed = json.loads(body)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict) and isinstance(parsed.get("message"), str):
            return f"{status} {parsed['message']}"
        return f"{status} {body.strip()[:200]}"
    return f"{status} {fallback}"


def _network_reason(exc: BaseException) -> str:
    """The innermost cause of a urllib3 failure, without its pool and URL preamble."""
    if isinstance(exc, urllib3.exceptions.MaxRetryError) and exc.reason is not None:
        exc = exc.reason
    text = str(exc)
    if isinstance(exc, urllib3.exceptions.NewConnectionError):
        text = text.rpartition("): ")[2] or text
    return text


class WatchStream:
    """One open watch response: `events()` yields parsed events until the server ends it.

    `close()` may be called from any thread; a reader blocked in `events()`
    then returns promptly.
    """

    def __init__(self, response: urllib3.BaseHTTPResponse, description: str) -> None:
        self._response = response
        self._description = description
        self._closed = False

    def events(self) -> Iterator[JSON]:
        buffer = b""
        try:
            for chunk in self._response.stream(amt=None, decode_content=True):
                buffer += chunk
                *lines, buffer = buffer.split(b"\n")
                for line in lines:
                    if line.strip():
                        yield _parse_event(line, self._description)
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            if self._closed:
                return
            raise KubeError(0, f"watch of {self._description} broke: {exc}") from None
        if buffer.strip() and not self._closed:
            yield _parse_event(buffer, self._description)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        # Unblocks a reader in another thread; close() alone may wait for it.
        with contextlib.suppress(AttributeError, ValueError, RuntimeError, OSError):
            self._response.shutdown()  # type: ignore[attr-defined]
        self._response.close()
        self._response.release_conn()


def _parse_event(line: bytes, description: str) -> JSON:
    try:
        event = json.loads(line)
    except ValueError:
        raise KubeError(0, f"watch of {description} sent a line that is not JSON") from None
    if not isinstance(event, dict) or not isinstance(event.get("object"), dict):
        raise KubeError(0, f"watch of {description} sent an event without an object")
    if event.get("type") == "ERROR":
        status = event["object"]
        code = status.get("code") if isinstance(status.get("code"), int) else 500
        raise KubeError(code, f"watch of {description}: {code} {status.get('message', '')}")
    return event


class KubeAPI:
    """Blocking JSON requests with timeouts; run them off the event loop."""

    def __init__(
        self,
        api_client: client.ApiClient,
        *,
        timeout: float = 10.0,
        connect_timeout: float | None = None,
        watch_read_margin: float = WATCH_READ_MARGIN,
    ) -> None:
        self.api_client = api_client
        #: Read timeout of every request but a watch's.
        self.timeout = timeout
        self.connect_timeout = timeout if connect_timeout is None else connect_timeout
        self.watch_read_margin = watch_read_margin

    def close(self) -> None:
        self.api_client.close()

    @property
    def host(self) -> str:
        return str(self.api_client.configuration.host)

    def _send(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, Any]] | None = None,
        body: JSON | None = None,
        read_timeout: float | None = None,
    ) -> Any:
        headers = {"Accept": "application/json"}
        if body is not None:
            headers["Content-Type"] = "application/json"
        request = self.api_client.param_serialize(
            method=method,
            resource_path=path,
            query_params=query or [],
            header_params=headers,
            body=body,
            auth_settings=["BearerToken"],
        )
        timeout = (
            self.connect_timeout,
            read_timeout if read_timeout is not None else self.timeout,
        )
        try:
            return self.api_client.call_api(*request, _request_timeout=timeout)
        except ApiException as exc:
            raise KubeError(
                exc.status or 0, _server_message(exc.status or 0, exc.body, str(exc.reason))
            ) from None
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(
                0, f"cannot reach the Kubernetes API at {self.host}: {_network_reason(exc)}"
            ) from None

    def request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, Any]] | None = None,
        body: JSON | None = None,
    ) -> JSON:
        response = self._send(method, path, query=query, body=body)
        try:
            data = response.read()
        except (urllib3.exceptions.HTTPError, OSError) as exc:
            raise KubeError(0, f"{method} {path}: the response broke off: {exc}") from None
        finally:
            response.response.release_conn()
        if not 200 <= response.status <= 299:
            raise KubeError(
                response.status, _server_message(response.status, data, response.reason)
            )
        try:
            parsed = json.loads(data)
        except ValueError:
            raise KubeError(response.status, f"{method} {path}: the response is not JSON") from None
        if not isinstance(parsed, dict):
            raise KubeError(response.status, f"{method} {path}: the response is not an object")
        return parsed

    def get(self, path: str) -> JSON:
        return self.request("GET", path)

    def create(self, path: str, body: JSON) -> JSON:
        return self.request("POST", path, body=body)

    def replace(self, path: str, body: JSON) -> JSON:
        return self.request("PUT", path, body=body)

    def list(
        self, path: str, *, limit: int = 500, selectors: Sequence[tuple[str, str]] | None = None
    ) -> tuple[list[JSON], str]:
        """Every object at `path` (pages followed) and the list's resourceVersion.

        `selectors`: ("labelSelector"|"fieldSelector", expression) pairs.
        """
        items: list[JSON] = []
        token: str | None = None
        while True:
            query: list[tuple[str, Any]] = [("limit", limit), *(selectors or ())]
            if token:
                query.append(("continue", token))
            page = self.request("GET", path, query=query)
            items.extend(i for i in page.get("items") or () if isinstance(i, dict))
            metadata = page.get("metadata") or {}
            token = metadata.get("continue")
            if not token:
                return items, str(metadata.get("resourceVersion") or "")

    def watch(
        self,
        path: str,
        resource_version: str,
        *,
        timeout_seconds: int,
        selectors: Sequence[tuple[str, str]] | None = None,
    ) -> WatchStream:
        """Open a watch from `resource_version`; the server ends it after `timeout_seconds`."""
        query: list[tuple[str, Any]] = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", timeout_seconds),
            *(selectors or ()),
        ]
        if resource_version:
            query.append(("resourceVersion", resource_version))
        response = self._send(
            "GET", path, query=query, read_timeout=timeout_seconds + self.watch_read_margin
        )
        raw = response.response
        if not 200 <= response.status <= 299:
            try:
                data = response.read()
            except (urllib3.exceptions.HTTPError, OSError):
                data = b""
            raw.release_conn()
            raise KubeError(
                response.status, _server_message(response.status, data, response.reason)
            )
        return WatchStream(raw, path)


# ---------------------------------------------------------------- the reflector

_END = object()  # the watch stream ended cleanly (server-side timeout)


class Reflector:
    """Keeps one resource in step with the API server by list + watch, until cancelled.

    `on_list(items)` gets the complete current set after every (re)list; the
    callee replaces what it held, so nothing deleted while disconnected
    survives. `on_event(type, object)` gets ADDED, MODIFIED and DELETED;
    `on_bookmark()` a bookmark (the view is current as of now). `on_missing()`:
    when set, a 404 on the list means "the resource is not served" (a CRD not
    installed): it is called, counted as synced, and the list retried with backoff.
    `on_error(message)`: a list or watch failed (it is retried with backoff), so
    the owner can publish its state, not only log it.
    """

    def __init__(
        self,
        api: KubeAPI,
        path: str,
        *,
        name: str,
        on_list: Callable[[list[JSON]], None],
        on_event: Callable[[str, JSON], None],
        on_bookmark: Callable[[], None] | None = None,
        on_missing: Callable[[], None] | None = None,
        on_error: Callable[[str], None] | None = None,
        label_selector: str = "",
        field_selector: str = "",
        watch_timeout: float = 300.0,
        page_size: int = 500,
        backoff: Callable[[], Backoff] = lambda: Backoff(0.5, 30.0),
        rng: random.Random | None = None,
    ) -> None:
        self.api = api
        self.path = path
        self.name = name
        self._on_list = on_list
        self._on_event = on_event
        self._on_bookmark = on_bookmark
        self._on_missing = on_missing
        self._on_error = on_error
        self._selectors = [
            (key, value)
            for key, value in (("labelSelector", label_selector), ("fieldSelector", field_selector))
            if value
        ]
        self._watch_timeout = watch_timeout
        self._page_size = page_size
        self._backoff = backoff
        self._rng = rng or random.Random()
        #: resourceVersion to resume from; empty: list first.
        self.version = ""
        #: Set after the first complete list (or a 404 with on_missing).
        self.synced = asyncio.Event()
        self._executor: concurrent.futures.ThreadPoolExecutor | None = None

    async def run(self) -> None:
        # Two threads: the list/watch request, and the reader of the open stream.
        self._executor = concurrent.futures.ThreadPoolExecutor(
            max_workers=2, thread_name_prefix=f"kube-{self.name}"
        )
        try:
            await self._loop()
        finally:
            self._executor.shutdown(wait=False, cancel_futures=True)

    async def _call(self, function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._executor, lambda: function(*args, **kwargs))

    async def _loop(self) -> None:
        backoff = self._backoff()
        loop = asyncio.get_running_loop()
        while True:
            delay: float | None = None
            events = -1
            try:
                if not self.version:
                    await self._list()
                    backoff.reset()
                started = loop.time()
                events = 0
                events = await self._watch()
                WATCH_RESTARTS.labels(self.name, "expired").inc()
                # A watch the server ends at once, without a single event (not even
                # a bookmark), must not become a busy loop.
                if events or loop.time() - started > 1.0:
                    backoff.reset()
                else:
                    delay = backoff.next_delay()
            except KubeError as exc:
                if exc.gone:
                    WATCH_RESTARTS.labels(self.name, "gone").inc()
                    log.info(
                        "%s: resourceVersion %s expired (410); listing again",
                        self.name,
                        self.version,
                    )
                    self.version = ""
                    # After progress, relist at once; 410 right after a list, not in a tight loop.
                    delay = None if events > 0 else backoff.next_delay()
                elif exc.not_found and self._on_missing is not None:
                    WATCH_RESTARTS.labels(self.name, "missing").inc()
                    log.warning(
                        "%s: not served by the API server (is the CRD installed?); "
                        "treating as none and retrying",
                        self.name,
                    )
                    self.version = ""
                    self._on_missing()
                    self.synced.set()
                    delay = backoff.next_delay()
                else:
                    WATCH_RESTARTS.labels(self.name, "error").inc()
                    delay = backoff.next_delay()
                    log.warning(
                        "%s: list/watch failed; retrying in %.1fs: %s",
                        self.name,
                        delay,
                        exc.message,
                        extra={"status": exc.status},
                    )
                    if self._on_error is not None:
                        self._on_error(exc.message)
            except Exception:
                # Unexpected, so with a traceback; the reflector must outlive it all the same.
                WATCH_RESTARTS.labels(self.name, "error").inc()
                delay = backoff.next_delay()
                log.warning("%s: list/watch failed unexpectedly", self.name, exc_info=True)
                if self._on_error is not None:
                    self._on_error("list/watch failed unexpectedly (see the log)")
            if delay is not None:
                await asyncio.sleep(delay)

    async def _list(self) -> None:
        items, version = await self._call(
            self.api.list, self.path, limit=self._page_size, selectors=self._selectors
        )
        RELISTS.labels(self.name).inc()
        self._on_list(items)
        self.version = version
        self.synced.set()

    async def _watch(self) -> int:
        """Follow one watch stream from `version` to its end; returns the event count.

        `version` follows every event, so a stream that breaks resumes after
        the last event handled.
        """
        loop = asyncio.get_running_loop()
        # Like client-go: a random timeout in [t, 2t).
        timeout = max(1, int(self._watch_timeout * self._rng.uniform(1.0, 2.0)))
        opening = asyncio.ensure_future(
            self._call(
                self.api.watch,
                self.path,
                self.version,
                timeout_seconds=timeout,
                selectors=self._selectors,
            )
        )
        try:
            # Shielded: cancelling the await must not drop a stream the thread is
            # about to return, with its connection left open.
            stream = await asyncio.shield(opening)
        except asyncio.CancelledError:
            opening.add_done_callback(_close_opened_stream)
            raise
        queue: asyncio.Queue[Any] = asyncio.Queue()
        assert self._executor is not None
        reader = loop.run_in_executor(self._executor, _read_stream, stream, loop, queue)
        count = 0
        try:
            while True:
                item = await queue.get()
                if item is _END:
                    return count
                if isinstance(item, BaseException):
                    raise item
                count += 1
                self._deliver(item)
        finally:
            # Also on cancellation: unblocks the reader thread, then waits for it briefly.
            stream.close()
            await asyncio.wait([reader], timeout=self.api.connect_timeout)

    def _deliver(self, event: JSON) -> None:
        kind = str(event.get("type"))
        obj = event["object"]
        self.version = str((obj.get("metadata") or {}).get("resourceVersion") or self.version)
        try:
            if kind == "BOOKMARK":
                if self._on_bookmark is not None:
                    self._on_bookmark()
            elif kind in ("ADDED", "MODIFIED", "DELETED"):
                self._on_event(kind, obj)
            else:
                log.warning("%s: ignoring watch event of type %r", self.name, kind)
        except Exception:
            log.exception("%s: handling a %s event failed", self.name, kind)


def _close_opened_stream(opening: asyncio.Future[Any]) -> None:
    if not opening.cancelled() and opening.exception() is None:
        opening.result().close()


def _read_stream(
    stream: WatchStream, loop: asyncio.AbstractEventLoop, queue: asyncio.Queue[Any]
) -> None:
    """Runs on a reflector thread: decode events and hand them to the loop.

    The queue is bounded only by what one watch connection carries before the
    loop applies it; the loop applies an event in microseconds.
    """

    def deliver(item: Any) -> None:
        # A closed loop raises RuntimeError: nobody is waiting any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(queue.put_nowait, item)

    try:
        for event in stream.events():
            deliver(event)
        deliver(_END)
    except Exception as exc:
        deliver(exc)
