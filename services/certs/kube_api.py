"""A thin JSON layer over the official `kubernetes` client, for certs' Kubernetes parts.

Job: build an `ApiClient` from a kubeconfig file or the pod's ServiceAccount, and
make plain JSON requests (get, create, replace, list, watch) through the client's
REST layer, which keeps its authentication, TLS and proxy handling. Objects stay
plain dicts, so a replace sends back every field the server sent, including ones
this client version has no model for.

Invariants:
- Every call blocks and has a timeout; async callers run calls in a worker
  thread (`asyncio.to_thread`), so the event loop never waits on the network.
- Every failure is a `KubeError` carrying the HTTP status (0 when no response
  came) and the server's own message: callers branch on `status`, never on
  urllib3's exception types.
- A watch stream can be closed from another thread, which unblocks its reader
  at once; a stream never outlives its server-side timeout plus a margin.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException
from kubernetes.config.config_exception import ConfigException

from waygate.core.errors import FailedPrecondition

log = logging.getLogger(__name__)

JSON = dict[str, Any]

#: Extra read time a watch gets beyond its server-side timeoutSeconds, so a
#: healthy stream always ends by the server closing it, and a dead connection
#: (no FIN ever arrives) ends by the read timeout.
WATCH_READ_MARGIN = 30.0


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


def load_api_client(kubeconfig: Path | None, *, context: str | None = None) -> client.ApiClient:
    """An ApiClient from `kubeconfig`, or from the pod's ServiceAccount when None.

    Raises FailedPrecondition with a one-line reason when neither works.
    """
    configuration = client.Configuration()
    try:
        if kubeconfig is not None:
            config.load_kube_config(
                config_file=str(kubeconfig),
                context=context,
                client_configuration=configuration,
                persist_config=False,
            )
        else:
            config.load_incluster_config(client_configuration=configuration)
    except (ConfigException, OSError, ValueError) as exc:
        where = f"kubeconfig {kubeconfig}" if kubeconfig else "the in-cluster ServiceAccount"
        hint = "" if kubeconfig else " (outside a cluster, set kubeconfig)"
        raise FailedPrecondition(
            f"cannot configure the Kubernetes client from {where}: {exc}{hint}"
        ) from None
    return client.ApiClient(configuration=configuration)


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

    def __init__(self, api_client: client.ApiClient, *, timeout: float = 10.0) -> None:
        self.api_client = api_client
        self.timeout = timeout

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
        timeout = (self.timeout, read_timeout if read_timeout is not None else self.timeout)
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

    def list(self, path: str, *, limit: int = 500) -> tuple[list[JSON], str]:
        """Every object at `path` (pages followed) and the list's resourceVersion."""
        items: list[JSON] = []
        token: str | None = None
        while True:
            query: list[tuple[str, Any]] = [("limit", limit)]
            if token:
                query.append(("continue", token))
            page = self.request("GET", path, query=query)
            items.extend(i for i in page.get("items") or () if isinstance(i, dict))
            metadata = page.get("metadata") or {}
            token = metadata.get("continue")
            if not token:
                return items, str(metadata.get("resourceVersion") or "")

    def watch(self, path: str, resource_version: str, *, timeout_seconds: int) -> WatchStream:
        """Open a watch from `resource_version`; the server ends it after `timeout_seconds`."""
        query: list[tuple[str, Any]] = [
            ("watch", "true"),
            ("allowWatchBookmarks", "true"),
            ("timeoutSeconds", timeout_seconds),
        ]
        if resource_version:
            query.append(("resourceVersion", resource_version))
        response = self._send(
            "GET", path, query=query, read_timeout=timeout_seconds + WATCH_READ_MARGIN
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
