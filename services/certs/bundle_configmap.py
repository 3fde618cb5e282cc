"""Publish the trust bundle to a Kubernetes ConfigMap, so pods can mount it as ca.pem.

Cluster mode's counterpart of `--bundle-file`: `data["ca.pem"]` of ConfigMap
NAMESPACE/NAME follows the trust bundle, first at start and then after every
change (CA rotation stages).

Invariants:
- only the `ca.pem` key is written: other keys, labels and annotations that
  others put on the ConfigMap are kept; a replace carries the resourceVersion
  just read, so a concurrent writer is never overwritten blindly (on 409 the
  next attempt reads again);
- the API calls block, so they run in a worker thread; a failure is logged
  and retried with backoff, and only the newest bundle is ever sent (older
  pending ones are skipped, never published after a newer one).
"""

from __future__ import annotations

import asyncio
import logging

from waygate.certs.authority import TrustBundleView
from waygate.certs.kube_api import JSON, KubeAPI, KubeError
from waygate.core.backoff import Backoff

log = logging.getLogger(__name__)

KEY = "ca.pem"
LABELS = {"app.kubernetes.io/name": "waygate", "app.kubernetes.io/component": "certs"}


class ConfigMapBundlePublisher:
    def __init__(
        self, api: KubeAPI, namespace: str, name: str, *, backoff: Backoff | None = None
    ) -> None:
        self._api = api
        self.namespace = namespace
        self.name = name
        self._collection = f"/api/v1/namespaces/{namespace}/configmaps"
        self._path = f"{self._collection}/{name}"
        self._backoff = backoff or Backoff(initial=1.0, maximum=60.0)
        self._pending: str | None = None
        self._wake = asyncio.Event()
        self.published: str | None = None  # the PEM last written

    def changed(self, bundle: TrustBundleView) -> None:
        """Queue `bundle` for publishing (an authority listener)."""
        self._pending = bundle.pem
        self._wake.set()

    def publish(self, pem: str) -> None:
        """Make the ConfigMap's ca.pem equal `pem` (blocking; raises KubeError)."""
        try:
            current = self._api.get(self._path)
        except KubeError as exc:
            if not exc.not_found:
                raise
            body: JSON = {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": self.name, "namespace": self.namespace, "labels": LABELS},
                "data": {KEY: pem},
            }
            self._api.create(self._collection, body)
            return
        data = dict(current.get("data") or {})
        if data.get(KEY) == pem:
            return
        data[KEY] = pem
        current["data"] = data
        self._api.replace(self._path, current)

    async def run(self) -> None:
        """Publish every queued bundle until cancelled."""
        while True:
            await self._wake.wait()
            self._wake.clear()
            pem = self._pending
            if pem is None or pem == self.published:
                continue
            try:
                await asyncio.to_thread(self.publish, pem)
            except KubeError as exc:
                delay = self._backoff.next_delay()
                log.warning(
                    "cannot publish the trust bundle to ConfigMap %s/%s (retrying in %.0fs): %s",
                    self.namespace,
                    self.name,
                    delay,
                    exc.message,
                )
                await asyncio.sleep(delay)
                self._wake.set()
                continue
            self._backoff.reset()
            self.published = pem
            log.info(
                "trust bundle published",
                extra={
                    "configmap": f"{self.namespace}/{self.name}",
                    "certificates": pem.count("BEGIN"),
                },
            )
