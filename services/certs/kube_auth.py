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
- Only positive results are cached, for `cache_ttl` (default 60 s, far below
  the 10-minute minimum lifetime of a projected token), and the cache is
  bounded; a revoked token stops working within the TTL.
- The review runs in a worker thread; the event loop never waits on it.

`KubeServiceDirectory` reads the Services the policy's per-workload name rule
needs (`GET /api/v1/namespaces/NS/services/NAME`) in a worker thread, each
read bounded by `timeout`, with a short bounded cache (`cache_ttl`, 5 s) so a
renewing workload does not cost one API read per Certify; an annotation
removed from a Service stops granting its name within that TTL.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable

from waygate.certs.auth import MAX_TOKEN_LENGTH, Caller
from waygate.certs.kube_api import JSON, KubeAPI, KubeError
from waygate.certs.policy import SERVING_ACCOUNT_ANNOTATION, ServiceInfo
from waygate.core.errors import FailedPrecondition, Unavailable, excerpt

log = logging.getLogger(__name__)

TOKEN_REVIEWS = "/apis/authentication.k8s.io/v1/tokenreviews"
SERVICE_ACCOUNT_PREFIX = "system:serviceaccount:"
NODE_PREFIX = "system:node:"
NODES_GROUP = "system:nodes"
# Set by the API server for a projected token bound to a pod: the pod's node.
NODE_NAME_EXTRA = "authentication.kubernetes.io/node-name"
#: Longer "tokens" are refused without asking the API server.
MAX_TOKEN_BYTES = MAX_TOKEN_LENGTH


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
        cache_size: int = 4096,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self.audiences = audiences
        self._cache_ttl = cache_ttl
        self._cache_size = cache_size
        self._clock = clock
        self._cache: OrderedDict[bytes, tuple[float, Caller]] = OrderedDict()

    async def authenticate(self, token: str) -> Caller | None:
        token = token.strip()
        if not token or len(token.encode()) > MAX_TOKEN_BYTES:
            return None
        key = hashlib.sha256(token.encode()).digest()
        cached = self._cache.get(key)
        now = self._clock()
        if cached is not None:
            if cached[0] > now:
                return cached[1]
            del self._cache[key]
        review = await asyncio.to_thread(self._review, token)
        caller = self._caller_from(review)
        if caller is not None and self._cache_ttl > 0:
            self._cache[key] = (self._clock() + self._cache_ttl, caller)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
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
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._api = api
        self._timeout = timeout
        self._cache_ttl = cache_ttl
        self._cache_size = cache_size
        self._clock = clock
        self._cache: OrderedDict[tuple[str, str], tuple[float, ServiceInfo | None]] = OrderedDict()

    async def service(self, namespace: str, name: str) -> ServiceInfo | None:
        key = (namespace, name)
        cached = self._cache.get(key)
        if cached is not None:
            if cached[0] > self._clock():
                return cached[1]
            del self._cache[key]
        path = f"/api/v1/namespaces/{namespace}/services/{name}"
        try:
            # The read itself has the client's timeout too; this one bounds the caller's wait.
            obj = await asyncio.wait_for(asyncio.to_thread(self._get, path), self._timeout)
        except TimeoutError:
            raise Unavailable(
                f"cannot read Service {namespace}/{name}: the Kubernetes API did not answer "
                f"within {self._timeout:g}s"
            ) from None
        info = None if obj is None else _service_info(namespace, name, obj)
        if self._cache_ttl > 0:
            self._cache[key] = (self._clock() + self._cache_ttl, info)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
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
