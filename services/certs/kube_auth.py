"""Certify callers in a cluster: projected ServiceAccount tokens checked by TokenReview.

`TokenReviewAuthenticator` posts each bearer token to the API server as an
`authentication.k8s.io/v1` TokenReview with the configured audiences, and maps
the user it names to a `Caller` (`caller_for_user`, also used by the CSR
controller for the user that created a CSR):

    system:serviceaccount:NS:SA              -> Caller(namespace=NS, service_account=SA)
    system:node:NODE, in group system:nodes  -> Caller(node=NODE)
    a pod-bound ServiceAccount token's extra authentication.kubernetes.io/node-name
                                             -> Caller(..., pod_node=NODE)
    anyone else                              -> Caller(name=USER), no names allowed

Invariants:
- A review that does not authenticate the token, or whose audiences do not
  include one we asked for, gives None (UNAUTHENTICATED at the boundary); an
  API failure raises Unavailable (or FailedPrecondition when certs may not
  create TokenReviews), so callers retry instead of giving up; each is logged
  on one line, and the token itself is never logged or kept: the cache is
  keyed by its SHA-256.
- Positive results are cached for `cache_ttl` (default 60 s, far below
  the 10-minute minimum lifetime of a projected token), refusals for
  `refusal_ttl` (5 s: a caller retrying a bad token in a loop costs one review
  per 5 s, not one per call); both caches are bounded (`TTLCache`); a revoked
  token stops working within the TTL.
- The review runs in a thread of its own small pool (`KubeCalls`), never on
  the event loop nor in the default executor; at most `max_in_flight` reviews
  at once, and a Certify finding them all busy gets RESOURCE_EXHAUSTED at once
  instead of queueing behind a slow API server.

`KubeServiceDirectory` reads the Services the policy's per-workload name rule
needs (`GET /api/v1/namespaces/NS/services/NAME`) in its own bounded pool
(`KubeCalls`, RESOURCE_EXHAUSTED when full), each read bounded by `timeout`
(the policy reads one CSR's Services concurrently, so the whole check is too),
with a short bounded cache (`cache_ttl`, 5 s) so a renewing workload does not
cost one API read per Certify; an annotation removed from a Service stops
granting its name within that TTL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import functools
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable
from typing import Any, Generic, TypeVar

from waygate.certs.auth import MAX_TOKEN_LENGTH, Caller
from waygate.certs.kube_api import JSON, KubeAPI, KubeError
from waygate.certs.policy import SERVING_ACCOUNT_ANNOTATION, ServiceInfo
from waygate.core.errors import FailedPrecondition, ResourceExhausted, Unavailable, excerpt

log = logging.getLogger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
NODE_PREFIX = "system:node:"
NODES_GROUP = "system:nodes"
# Set by the API server for a projected token bound to a pod: the pod's node.
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
#: Longer "tokens" are refused without asking the API server.
MAX_TOKEN_BYTES = MAX_TOKEN_LENGTH


_K = TypeVar("_K", bound=Hashable)
_V = TypeVar("_V")
_MISSING: Any = object()


class TTLCache(Generic[_K, _V]):
    """A bounded cache whose entries expire `ttl` after they were put (oldest evicted first)."""

    def __init__(self, ttl: float, size: int, clock: Callable[[], float]) -> None:
        self.ttl = ttl
        self._size = size
        self._clock = clock
        self._entries: OrderedDict[_K, tuple[float, _V]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: _K, default: Any = _MISSING) -> Any:
        """The live value for `key`, else `default` (expired entries are dropped)."""
        entry = self._entries.get(key)
        if entry is None:
            return default
        if entry[0] > self._clock():
            return entry[1]
        del self._entries[key]
        return default

    def put(self, key: _K, value: _V) -> None:
        if self.ttl <= 0:
            return
        self._entries.pop(key, None)
        self._entries[key] = (self._clock() + self.ttl, value)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)


class KubeCalls:
    """Blocking Kubernetes API calls in a pool of their own, at most `limit` at once.

    Used from the event loop only. A call finding every place taken raises
    ResourceExhausted at once: a slow API server must not let Certify calls pile
    up (each holding a unary place) behind it, nor fill the default executor.
    """

    def __init__(self, limit: int, what: str) -> None:
        self.limit = limit
        self.what = what
        self.in_flight = 0
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=limit, thread_name_prefix=f"kube-{what.replace(' ', '-')}"
        )

    async def run(self, function: Callable[..., _V], *args: Any) -> _V:
        if self.in_flight >= self.limit:
            raise ResourceExhausted(
                f"too many {self.what} in flight ({self.limit}); the Kubernetes API is slow "
                "to answer: retry with backoff"
            )
        loop = asyncio.get_running_loop()
        self.in_flight += 1
        call = self._pool.submit(functools.partial(function, *args))
        # The place is given back when the thread is done, not when a caller stops
        # waiting (a timed-out read still occupies its thread).
        call.add_done_callback(lambda _: _call_soon(loop, self._release))
        return await asyncio.wrap_future(call, loop=loop)

    def _release(self) -> None:
        self.in_flight -= 1


def _call_soon(loop: asyncio.AbstractEventLoop, callback: Callable[[], None]) -> None:
    with contextlib.suppress(RuntimeError):  # the loop is closed: nobody counts any more
        loop.call_soon_threadsafe(callback)


def caller_for_user(username: str, groups: Iterable[str] = ()) -> Caller:
    """The Caller a Kubernetes user is, by the conventions of its user name."""
    groups = tuple(groups)
    if username.startswith(SERVICE_ACCOUNT_PREFIX):
        namespace, sep, account = username.removeprefix(SERVICE_ACCOUNT_PREFIX).partition(":")
        if sep and namespace and account and ":" not in account:
            return Caller(
                name=username, namespace=namespace, service_account=account, groups=groups
            )
    if username.startswith(NODE_PREFIX) and NODES_GROUP in groups:
        node = username.removeprefix(NODE_PREFIX)
        if node and ":" not in node:
            return Caller(name=username, node=node, groups=groups)
    return Caller(name=username, groups=groups)


class TokenReviewAuthenticator:
    """An `Authenticator` that asks the Kubernetes API server who a token belongs to."""

    def __init__(
        self,
        api: KubeAPI,
        *,
        audiences: tuple[str, ...],
        cache_ttl: float = 60.0,
        refusal_ttl: float = 5.0,
        cache_size: int = 4096,
        max_in_flight: int = 16,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self.audiences = audiences
        self._cache: TTLCache[bytes, Caller] = TTLCache(cache_ttl, cache_size, clock)
        self._refused: TTLCache[bytes, bool] = TTLCache(refusal_ttl, cache_size, clock)
        self._calls = KubeCalls(max_in_flight, "TokenReviews")

    async def authenticate(self, token: str) -> Caller | None:
        token = token.strip()
        if not token or len(token.encode()) > MAX_TOKEN_BYTES:
            return None
        key = hashlib.sha256(token.encode()).digest()
        cached: Caller | None = self._cache.get(key, None)
        if cached is not None or self._refused.get(key, False):
            return cached
        review = await self._calls.run(self._review, token)
        caller = self._caller_from(review)
        if caller is None:
            self._refused.put(key, True)
        else:
            self._cache.put(key, caller)
        return caller

    def _review(self, token: str) -> JSON:
        body: JSON = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        }
        if self.audiences:
            body["spec"]["audiences"] = list(self.audiences)
        try:
            return self._api.create(TOKEN_REVIEWS, body)
        except KubeError as exc:
            log.warning("TokenReview failed: %s", exc.message)
            if exc.status in (401, 403):
                raise FailedPrecondition(
                    f"certs may not create TokenReviews ({exc.message}); "
                    "check the certs ClusterRole"
                ) from None
            raise Unavailable(
                f"cannot check the token: the Kubernetes TokenReview failed: {exc.message}"
            ) from None

    def _caller_from(self, review: JSON) -> Caller | None:
        status = review.get("status") or {}
        if status.get("authenticated") is not True:
            log.info(
                "token not authenticated by TokenReview: %s",
                excerpt(str(status.get("error") or "no reason given"), 200),
            )
            return None
        user = status.get("user") or {}
        username = user.get("username")
        if not isinstance(username, str) or not username:
            log.warning("TokenReview authenticated a token but named no user; refusing it")
            return None
        if self.audiences:
            # The API server says which of our audiences the token is valid for;
            # none in common means a token minted for some other service.
            granted = set(status.get("audiences") or ())
            if not granted.intersection(self.audiences):
                log.info(
                    "token of %s is not for audience %s (it is for %s)",
                    username,
                    ", ".join(self.audiences),
                    ", ".join(sorted(granted)) or "no audience reported",
                )
                return None
        groups = [g for g in user.get("groups") or () if isinstance(g, str)]
        caller = caller_for_user(username, groups)
        node_names = (user.get("extra") or {}).get(NODE_NAME_EXTRA) or ()
        if caller.service_account is not None and isinstance(node_names, list):
            names = [n for n in node_names if isinstance(n, str) and n and ":" not in n]
            if len(names) == 1:
                caller = dataclasses.replace(caller, pod_node=names[0])
        return caller


class KubeServiceDirectory:
    """The policy's `ServiceDirectory` over the Kubernetes API (needs `get` on services)."""

    def __init__(
        self,
        api: KubeAPI,
        *,
        timeout: float = 5.0,
        cache_ttl: float = 5.0,
        cache_size: int = 1024,
        max_in_flight: int = 32,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._timeout = timeout
        self._cache: TTLCache[tuple[str, str], ServiceInfo | None] = TTLCache(
            cache_ttl, cache_size, clock
        )
        self._calls = KubeCalls(max_in_flight, "Service reads")

    async def service(self, namespace: str, name: str) -> ServiceInfo | None:
        key = (namespace, name)
        cached = self._cache.get(key)
        if cached is not _MISSING:
            return cached  # type: ignore[no-any-return]
        path = f"/api/v1/namespaces/{namespace}/services/{name}"
        try:
            # The read itself has the client's timeout too; this one bounds the caller's wait.
            obj = await asyncio.wait_for(self._calls.run(self._get, path), self._timeout)
        except TimeoutError:
            raise Unavailable(
                f"cannot read Service {namespace}/{name}: the Kubernetes API did not answer "
                f"within {self._timeout:g}s"
            ) from None
        info = None if obj is None else _service_info(namespace, name, obj)
        self._cache.put(key, info)
        return info

    def _get(self, path: str) -> JSON | None:
        try:
            return self._api.get(path)
        except KubeError as exc:
            if exc.not_found:
                return None
            log.warning("reading a Service failed: %s", exc.message)
            if exc.status in (401, 403):
                raise FailedPrecondition(
                    f"certs may not read Services ({exc.message}); check the certs ClusterRole"
                ) from None
            raise Unavailable(f"cannot read a Service from Kubernetes: {exc.message}") from None


def _service_info(namespace: str, name: str, obj: JSON) -> ServiceInfo:
    annotations = (obj.get("metadata") or {}).get("annotations") or {}
    account = annotations.get(SERVING_ACCOUNT_ANNOTATION) if isinstance(annotations, dict) else None
    return ServiceInfo(
        namespace=namespace,
        name=name,
        serving_account=account if isinstance(account, str) else None,
    )
