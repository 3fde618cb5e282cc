"""Publishes the trust bundle to a ConfigMap, so pods can mount the CA they must trust.

Every Waygate pod that takes a certificate from certs needs the trust bundle
first, to verify certs itself (the same bootstrap Kubernetes solves with the
`kube-root-ca.crt` ConfigMap). This keeps ConfigMap NS/NAME's `ca.pem` equal to
the bundle: at start and on every change (a CA rotation stages, switches and
retires CAs, and each stage changes the bundle).

Invariants:
- Only the newest bundle is ever written; bundles that change faster than the
  API accepts them are skipped, never queued.
- A write happens only when the ConfigMap's content differs (idempotent across
  restarts and replicas); a conflict re-reads and tries again. Keys, labels
  and annotations that others put on the ConfigMap are kept.
- API calls run in a worker thread; a failure is logged and retried with
  backoff and never stops certs, which keeps serving the bundle over gRPC.
- With replicas only the leader runs it (`waygate.certs.leader.while_leading`).
"""

from __future__ import annotations

import asyncio
import logging

from waygate.certs.kube_api import JSON, KubeAPI, KubeError
from waygate.core.backoff import Backoff

log = logging.getLogger(__name__)

BUNDLE_KEY = "ca.pem"
LABELS = {"app.kubernetes.io/part-of": "waygate", "app.kubernetes.io/component": "certs"}


class BundlePublisher:
    def __init__(
        self, api: KubeAPI, namespace: str, name: str, *, backoff: Backoff | None = None
    ) -> None:
        self._api = api
        self.namespace, self.name = namespace, name
        self._collection = f"/api/v1/namespaces/{namespace}/configmaps"
        self._path = f"{self._collection}/{name}"
        self._backoff = backoff or Backoff(initial=0.5, maximum=30.0)
        self._wanted: str | None = None
        self._changed = asyncio.Event()
        self.published: str | None = None

    def publish(self, pem: str) -> None:
        """Ask for `pem` to be published; returns at once (call from the event loop)."""
        self._wanted = pem
        self._changed.set()

    async def run(self) -> None:
        # (Re)started, e.g. by a replica that became the leader: compare with what
        # the ConfigMap holds now, whatever was published before.
        self.published = None
        if self._wanted is not None:
            self._changed.set()
        while True:
            await self._changed.wait()
            self._changed.clear()
            pem = self._wanted
            if pem is None or pem == self.published:
                continue
            try:
                await asyncio.to_thread(self._write, pem)
            except KubeError as exc:
                delay = self._backoff.next_delay()
                log.warning(
                    "cannot publish the trust bundle to configmap %s/%s: %s; retrying in %.1fs",
                    self.namespace,
                    self.name,
                    exc.message,
                    delay,
                )
                await asyncio.sleep(delay)
                self._changed.set()
                continue
            self._backoff.reset()
            self.published = pem
            log.info("trust bundle published", extra={"configmap": f"{self.namespace}/{self.name}"})

    def _body(self, pem: str, current: JSON | None) -> JSON:
        """The ConfigMap to write: `current` with our key and labels set, anything else kept."""
        metadata: JSON = {"name": self.name, "namespace": self.namespace}
        data: JSON = {}
        if current is not None:
            kept = current.get("metadata") or {}
            metadata.update(
                {k: kept[k] for k in ("labels", "annotations", "resourceVersion") if k in kept}
            )
            data.update(current.get("data") or {})
        metadata["labels"] = {**(metadata.get("labels") or {}), **LABELS}
        data[BUNDLE_KEY] = pem
        return {"apiVersion": "v1", "kind": "ConfigMap", "metadata": metadata, "data": data}

    def _write(self, pem: str) -> None:
        for _ in range(3):
            try:
                current: JSON | None = self._api.get(self._path)
            except KubeError as exc:
                if not exc.not_found:
                    raise
                current = None
            if current is not None and (current.get("data") or {}).get(BUNDLE_KEY) == pem:
                return
            try:
                if current is None:
                    self._api.create(self._collection, self._body(pem, None))
                else:
                    self._api.replace(self._path, self._body(pem, current))
                return
            except KubeError as exc:
                if not exc.conflict:
                    raise
        raise KubeError(409, "the configmap kept changing under three attempts to write it")
