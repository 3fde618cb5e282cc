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
  start and saves on CA changes, which are rare, never on the event loop (see
  below for the one save that can be asked for there).

Replicas (`writer` given, see `waygate.certs.leader`): only the leader writes.
A save is one of three kinds, told apart by comparing it with what is stored:
a new CA (a rotation, or the first CA), a raised leaf-expiry bound, or only
state transitions (a staged CA starting to sign, a retired CA leaving) — these
follow from the stored state and the clock, so every replica computes the same.
- On a follower, a new CA or a raised bound raises Unavailable naming the
  leader (RotateCA answers UNAVAILABLE; the leader keeps the bound far enough
  ahead that Certify never needs it); a transition stays in memory only: the
  leader stores the same one.
- On the leader, a transition is written by a background thread (whoever
  applied it, Certify included, never waits for the API); a new CA or a raised
  bound is written in the caller's thread, which is never the loop's.
- `follow()` watches the Secret (the shared reflector, by field selector) and
  hands every version another writer stored to a callback, in a worker thread:
  how a rotation by the leader reaches every replica within seconds.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import json
import logging
import re
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from waygate.certs.castate import STATE_FILE
from waygate.core.backoff import Backoff
from waygate.core.errors import FailedPrecondition, Unavailable
from waygate.core.kube import JSON, KubeAPI, KubeError, Reflector

log = logging.getLogger(__name__)

#: What Kubernetes accepts as a key of Secret data.
_DATA_KEY = re.compile(r"[-._a-zA-Z0-9]+")
#: Kubernetes refuses Secrets above 1 MiB; leave room for metadata.
MAX_DATA_BYTES = 900 * 1024
LABELS = {"app.kubernetes.io/name": "waygate", "app.kubernetes.io/component": "certs"}


#: Annotation naming the replica that wrote the Secret last (for people and tests).
WRITTEN_BY = "waygate.io/written-by"


class Writer(Protocol):
    """Who may write: the leader elector (`waygate.certs.leader.LeaderElector`)."""

    identity: str

    def is_leader(self) -> bool: ...

    def leader_description(self) -> str: ...


def _bounds(files: dict[str, bytes] | None) -> dict[str, str]:
    """CA name -> its leaf bound (ISO text), from a file set's state."""
    if not files or STATE_FILE not in files:
        return {}
    try:
        state = json.loads(files[STATE_FILE])
        return {str(e["name"]): str(e.get("leaf_bound") or "") for e in state["authorities"]}
    except (ValueError, KeyError, TypeError):
        return {}


def save_kind(stored: dict[str, bytes] | None, files: dict[str, bytes]) -> str:
    """ "new-ca", "bound" or "transition": what a save changes, against what is stored."""
    before, after = _bounds(stored), _bounds(files)
    if stored is None or set(after) - set(before):
        return "new-ca"
    if any(after[name] > before.get(name, "") for name in after if after[name]):
        return "bound"
    return "transition"


def _newer(version: str, than: str) -> bool:
    try:
        return int(version) > int(than)
    except ValueError:
        return version != than


def parse_secret_reference(text: str) -> tuple[str, str]:
    """ "NAMESPACE/NAME" -> (namespace, name); ValueError with a reason otherwise."""
    namespace, sep, name = text.strip().partition("/")
    if not sep or not namespace or not name or "/" in name:
        raise ValueError(f"not a Secret reference: {text!r} (use NAMESPACE/NAME)")
    return namespace, name


#: An upstream authority given in the Secret (cert-manager's CA Secret keys): the
#: intermediate certs signs with, its key, and the organisation's root above it. certs
#: reads them at start (as --ca-cert, --ca-key, --trust-anchor) and never writes them:
#: every save keeps what the Secret holds under these keys.
UPSTREAM_KEYS = ("tls.crt", "tls.key", "ca.crt")


class SecretCAStore:
    """A CA file set in one Opaque Secret, written with resourceVersion preconditions."""

    def __init__(
        self, api: KubeAPI, namespace: str, name: str, *, writer: Writer | None = None
    ) -> None:
        self._api = api
        self._writer = writer
        # Serialises writes (callers' threads and the write-behind thread).
        self._write_lock = threading.RLock()
        self._behind: dict[str, bytes] | None = None
        self._stored: dict[str, bytes] | None = None
        self.namespace = namespace
        self.name = name
        self.description = f"secret {namespace}/{name}"
        self._collection = f"/api/v1/namespaces/{namespace}/secrets"
        self._path = f"{self._collection}/{name}"
        # The Secret as last read or written; None: absent at the last load.
        self._seen: JSON | None = None
        #: The upstream authority's keys (UPSTREAM_KEYS) the Secret held at the last
        #: load, apart from certs' own files (which `load` returns without them).
        self.upstream: dict[str, bytes] = {}

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
        self.upstream = {k: files.pop(k) for k in UPSTREAM_KEYS if k in files}
        with self._write_lock:
            self._seen = secret
            self._stored = files or None
        return files or None

    @property
    def version(self) -> str:
        """resourceVersion of the Secret as last read or written; "" when absent."""
        seen = self._seen
        return str((seen.get("metadata") or {}).get("resourceVersion") or "") if seen else ""

    def refusal(self, what: str) -> str | None:
        """Why this replica may not write `what` (it is not the leader); None when it may."""
        if self._writer is None or self._writer.is_leader():
            return None
        return (
            f"this certs replica ({self._writer.identity}) is not the leader, and only "
            f"the leader writes {what}; the leader is {self._writer.leader_description()}"
        )

    def save(self, files: dict[str, bytes]) -> None:
        if self._writer is None:
            self._write(files)
            return
        kind = save_kind(self._stored, files)
        if not self._writer.is_leader():
            if kind == "transition":
                return  # in memory only; the leader stores the same transition
            refusal = self.refusal("a new CA" if kind == "new-ca" else "the leaf-expiry bound")
            raise Unavailable(refusal or "not the leader")
        if kind == "transition":
            # Follows from the stored state and the clock, so it need not hold up
            # the caller (GetTrustBundle on the loop, Certify or the timer under the
            # authority's lock): a background thread stores it, and should that
            # fail, the next write (the bound keeper's, within seconds) carries it.
            self._write_behind(files)
            return
        with self._write_lock:
            self._write(files)
            # This set is the authority's state after any transition still waiting to
            # be written behind (both are made under its lock, in order): the older
            # one must not land after it and undo it (a new CA, a raised bound). Kept
            # if this write failed: then it is still the newest stored state to come.
            self._behind = None

    def save_based_on(self, files: dict[str, bytes], version: str) -> str | None:
        """Write `files` only if the Secret is still at `version` (as this process
        last saw it); the new version, or None when it moved on (nothing written)."""
        with self._write_lock:
            if self.version != version:
                return None
            if self._writer is not None and not self._writer.is_leader():
                return None
            self._write(files)
            return self.version

    def _write_behind(self, files: dict[str, bytes]) -> None:
        with self._write_lock:
            start = self._behind is None
            self._behind = files
        if start:
            threading.Thread(target=self._flush_behind, name="ca-write-behind", daemon=True).start()

    def _flush_behind(self) -> None:
        """Store the newest transition; retried with backoff while this replica
        leads (a leader that stops leaves it to the next, which stores its own)."""
        backoff = Backoff(0.5, 10.0)
        while True:
            with self._write_lock:
                files, self._behind = self._behind, None
                if files is None:
                    return
                if self._writer is not None and not self._writer.is_leader():
                    continue
                try:
                    self._write(files)
                    backoff.reset()
                    continue
                except FailedPrecondition as exc:
                    # Someone else stored a newer state (a previous leader's late
                    # write): the watch brings it, and applying it again from there
                    # makes a new transition to store. Never overwrite it.
                    log.warning("CA state transition not stored: %s", exc)
                    continue
                except Exception as exc:
                    failure = exc
                    if self._behind is None:
                        self._behind = files  # nothing newer came meanwhile: retry this
            delay = backoff.next_delay()
            log.warning("CA state transition not stored, retrying in %.1fs: %s", delay, failure)
            time.sleep(delay)

    def _write(self, files: dict[str, bytes]) -> None:
        for key in files:
            if not _DATA_KEY.fullmatch(key):
                raise ValueError(f"not a Secret data key: {key!r}")
        size = sum(len(v) for v in files.values())
        if size > MAX_DATA_BYTES:
            raise FailedPrecondition(
                f"CA store {self.description}: {size} bytes do not fit in a Secret "
                f"(limit {MAX_DATA_BYTES})"
            )
        with self._write_lock:
            self._write_locked(files)

    def _write_locked(self, files: dict[str, bytes]) -> None:
        body = self._body(files)
        try:
            if self._seen is None:
                written = self._api.create(self._collection, body)
            else:
                written = self._api.replace(self._path, body)
        except KubeError as exc:
            if exc.conflict:
                action = "created" if self._seen is None else "changed"
                then = (
                    "this replica takes the stored CA from its watch of the Secret"
                    if self._writer is not None
                    else "restart certs to load the stored CA"
                )
                raise FailedPrecondition(
                    f"CA store {self.description} was {action} by another writer since this "
                    f"process read it (another certs replica?); not overwriting it: {then}"
                ) from None
            raise self._error("write", exc) from None
        self._seen = written
        self._stored = dict(files)
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
        if self._writer is not None:
            metadata["annotations"] = {
                **(metadata.get("annotations") or {}),
                WRITTEN_BY: self._writer.identity,
            }
        data = {k: base64.b64encode(v).decode("ascii") for k, v in files.items()}
        if self._seen is not None:
            # The upstream authority's three belong to whoever put them there.
            kept = self._seen.get("data") or {}
            data.update({k: kept[k] for k in UPSTREAM_KEYS if k in kept and k not in files})
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "metadata": metadata,
            "type": "Opaque",
            "data": dict(sorted(data.items())),
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

    # ------------------------------------------------------------ replicas

    def adopt_object(self, secret: JSON) -> dict[str, bytes] | None:
        """Take a Secret seen by the watch as the stored state (blocking, a worker
        thread); its files when another writer stored them, None when it is this
        process's own write or older than what this process has seen."""
        version = str((secret.get("metadata") or {}).get("resourceVersion") or "")
        with self._write_lock:
            if not version or not _newer(version, self.version):
                return None
            files: dict[str, bytes] = {}
            for key, value in (secret.get("data") or {}).items():
                try:
                    files[key] = base64.b64decode(value or "", validate=True)
                except (binascii.Error, TypeError):
                    log.warning("CA store %s: data key %r is not base64", self.description, key)
                    return None
            for key in UPSTREAM_KEYS:  # read at start only, never certs' own state
                files.pop(key, None)
            self._seen = secret
            self._stored = files or None
            return files or None

    async def follow(self, adopt: Callable[[dict[str, bytes]], object]) -> None:
        """Watch the Secret until cancelled; `adopt(files)` runs in a worker thread for
        every version another writer stored (newest only, never queued)."""
        latest: list[JSON] = []
        arrived = asyncio.Event()

        def seen(secret: JSON) -> None:
            latest[:] = [secret]
            arrived.set()

        def listed(items: list[JSON]) -> None:
            for item in items[-1:]:
                seen(item)

        reflector = Reflector(
            self._api,
            self._collection,
            name="ca-secret",
            field_selector=f"metadata.name={self.name}",
            on_list=listed,
            on_event=lambda kind, obj: seen(obj) if kind != "DELETED" else None,
        )
        watching = asyncio.ensure_future(reflector.run())
        try:
            while True:
                await arrived.wait()
                arrived.clear()
                secret = latest[0]
                try:
                    files = await asyncio.to_thread(self.adopt_object, secret)
                    if files is not None:
                        await asyncio.to_thread(adopt, files)
                except Exception as exc:
                    log.warning("cannot take the CA state from %s: %s", self.description, exc)
        finally:
            watching.cancel()
            await asyncio.gather(watching, return_exceptions=True)
