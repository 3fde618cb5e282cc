"""The CA kept in a Kubernetes Secret (cluster mode's `CAStore`).

The authority's file set (name -> bytes: PEM keys and certificates, rotation
state as JSON) becomes the `data` of one Secret of type Opaque, one key per
file. See `waygate.certs.store` for the contract.

Invariants:
- `load` returns None when the Secret does not exist or holds no data (a
  Secret created empty ahead of time, e.g. by kustomize, is filled on first
  start); any other failure is an error, never None, so the CA is never
  silently replaced by a new one because a read failed.
- `save` replaces the whole set with optimistic concurrency: it creates the
  Secret only when the last load found none, and otherwise replaces it with
  the resourceVersion that load (or the previous save) saw. If another writer
  changed or created it in between (a second certs replica, a person), the
  save fails with FailedPrecondition and nothing is overwritten.
- Labels and annotations that others put on the Secret are kept.
- The calls block (with the API client's timeouts); the authority loads at
  start and saves on CA changes, which are rare.
"""

from __future__ import annotations

import base64
import binascii
import logging
import re
from typing import Any

from waygate.certs.kube_api import JSON, KubeAPI, KubeError
from waygate.core.errors import FailedPrecondition, Unavailable

log = logging.getLogger(__name__)

#: What Kubernetes accepts as a key of Secret data.
_DATA_KEY = re.compile(r"[-._a-zA-Z0-9]+")
#: Kubernetes refuses Secrets above 1 MiB; leave room for metadata.
MAX_DATA_BYTES = 900 * 1024
LABELS = {"app.kubernetes.io/name": "waygate", "app.kubernetes.io/component": "certs"}


def parse_secret_reference(text: str) -> tuple[str, str]:
    """ "NAMESPACE/NAME" -> (namespace, name); ValueError with a reason otherwise."""
    namespace, sep, name = text.strip().partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"not a Secret reference: {text!r} (use NAMESPACE/NAME)")
    return namespace, name


class SecretCAStore:
    """A CA file set in one Opaque Secret, written with resourceVersion preconditions."""

    def __init__(self, api: KubeAPI, namespace: str, name: str) -> None:
        self._api = api
        self.namespace = namespace
        self.name = name
        self.description = f"secret {namespace}/{name}"
        self._collection = f"/api/v1/namespaces/{namespace}/secrets"
        self._path = f"{self._collection}/{name}"
        # The Secret as last read or written; None: absent at the last load.
        self._seen: JSON | None = None

    def load(self) -> dict[str, bytes] | None:
        try:
            secret = self._api.get(self._path)
        except KubeError as exc:
            if exc.not_found:
                self._seen = None
                return None
            raise self._error("read", exc) from None
        if secret.get("type", "Opaque") != "Opaque":
            raise FailedPrecondition(
                f"CA store {self.description} has type {secret.get('type')!r}, not Opaque; "
                "it is not a Waygate CA Secret"
            )
        files: dict[str, bytes] = {}
        for key, value in (secret.get("data") or {}).items():
            try:
                files[key] = base64.b64decode(value or "", validate=True)
            except (binascii.Error, TypeError):
                raise FailedPrecondition(
                    f"CA store {self.description}: data key {key!r} is not base64"
                ) from None
        self._seen = secret
        return files or None

    def save(self, files: dict[str, bytes]) -> None:
        for key in files:
            if not _DATA_KEY.fullmatch(key):
                raise ValueError(f"not a Secret data key: {key!r}")
        size = sum(len(v) for v in files.values())
        if size > MAX_DATA_BYTES:
            raise FailedPrecondition(
                f"CA store {self.description}: {size} bytes do not fit in a Secret "
                f"(limit {MAX_DATA_BYTES})"
            )
        body = self._body(files)
        try:
            if self._seen is None:
                written = self._api.create(self._collection, body)
            else:
                written = self._api.replace(self._path, body)
        except KubeError as exc:
            if exc.conflict:
                action = "created" if self._seen is None else "changed"
                raise FailedPrecondition(
                    f"CA store {self.description} was {action} by another writer since this "
                    "process read it (another certs replica?); not overwriting it. Restart "
                    "certs to load the stored CA."
                ) from None
            raise self._error("write", exc) from None
        self._seen = written
        log.debug("CA store saved", extra={"store": self.description, "files": len(files)})

    def _body(self, files: dict[str, bytes]) -> JSON:
        metadata: dict[str, Any] = {"name": self.name, "namespace": self.namespace}
        if self._seen is not None:
            seen = self._seen.get("metadata") or {}
            for field in ("labels", "annotations", "ownerReferences", "finalizers"):
                if seen.get(field):
                    metadata[field] = seen[field]
            metadata["resourceVersion"] = seen.get("resourceVersion", "")
        metadata["labels"] = {**(metadata.get("labels") or {}), **LABELS}
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": metadata,
            "type": "Opaque",
            "data": {k: base64.b64encode(v).decode("ascii") for k, v in sorted(files.items())},
        }

    def _error(self, action: str, exc: KubeError) -> Exception:
        if exc.status in (401, 403):
            return FailedPrecondition(
                f"certs may not {action} its CA {self.description}: {exc.message} "
                "(check the certs Role: secrets get/create/update)"
            )
        if exc.status == 0 or exc.status >= 500 or exc.status == 429:
            return Unavailable(f"cannot {action} CA {self.description}: {exc.message}")
        return FailedPrecondition(f"cannot {action} CA {self.description}: {exc.message}")
