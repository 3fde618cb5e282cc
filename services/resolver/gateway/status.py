"""The status every Gateway API and Ingress object should carry, as last translated.

One board per resolver. A source (manifests or Kubernetes) replaces its
whole content after each translation; the board stamps each condition's
`lastTransitionTime`, keeping the previous stamp while the condition's
status stays the same (metav1.Condition's rule), and remembers which
objects changed since the Kubernetes status writer last took them.

Read by ListGateways (`waygate gateways`) in every mode; in Kubernetes mode
the resolver's leader writes what changed through the status subresource.

Proxies' listener reports (ReportListeners, one state per open stream) are
laid over the translated statuses: a Gateway listener that some proxy cannot
serve (its port in use, say) shows Programmed=False with that proxy's reason
and message, and its Gateway too when no listener of it is programmed. The
translation stays a pure function of the objects; when a report changes or
its stream ends, the board publishes again (and the writer writes the change).
Host conflicts are laid over the same way: the store decides host ownership
across every source and kind (waygate.resolver.status), and an HTTPRoute,
GRPCRoute, TLSRoute or Ingress whose routes lose their host to another
namespace's older claim shows Conflicted=True (HostAlreadyClaimed) on each
parent, and Accepted=False when none of its routes is served (an Ingress, which
has no conditions in Kubernetes, shows it in `waygate gateways` only); a Gateway
whose listener's hostname claimed for routes that lost shows that listener
Conflicted=True (HostAlreadyClaimed).
A report is caller input written into Kubernetes objects: its reason is one
of `LISTENER_REASONS` (else `UNKNOWN_LISTENER_REASON`, so it always passes the
CRD's reason pattern), its message an `excerpt` of at most
`LISTENER_MESSAGE_LIMIT` characters, and proxies are listed in name order (a
reconnect that changes no state changes no status).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Iterable, Mapping
from dataclasses import replace
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from waygate.core.errors import excerpt
from waygate.resolver.gateway.translate import Ignored, ObjectStatus
from waygate.resolver.model import ListenerState
from waygate.resolver.status import HOST_ALREADY_CLAIMED, HostConflict

if TYPE_CHECKING:
    from waygate.resolver.store import Store

StatusKey = tuple[str, str, str]  # (kind, namespace, name)

#: Reasons a proxy may give for a listener it does not serve (Gateway API
#: listener condition reasons); any other is replaced by the fallback.
LISTENER_REASONS = frozenset({"PortUnavailable", "Invalid", "Pending", "UnsupportedProtocol"})
UNKNOWN_LISTENER_REASON = "Invalid"
#: A proxy's message in a condition: at most this many characters (plus quotes
#: and the cut length); four proxies' messages stay far under the CRD's 32768.
LISTENER_MESSAGE_LIMIT = 256


def _checked(state: ListenerState) -> ListenerState:
    """A reported state whose reason and message are safe to write into a condition."""
    if not state.reason:
        return state
    reason = state.reason if state.reason in LISTENER_REASONS else UNKNOWN_LISTENER_REASON
    return replace(state, reason=reason, message=excerpt(state.message, LISTENER_MESSAGE_LIMIT))


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _stamp(new: Any, old: Any, now: str) -> None:
    """Give every condition in `new` a lastTransitionTime (kept from `old` when unchanged)."""
    if isinstance(new, dict):
        if "conditions" in new and isinstance(new["conditions"], list):
            before = {}
            if isinstance(old, dict):
                before = {
                    c.get("type"): c for c in old.get("conditions") or [] if isinstance(c, dict)
                }
            for item in new["conditions"]:
                previous = before.get(item.get("type"))
                if previous is not None and previous.get("status") == item.get("status"):
                    item["lastTransitionTime"] = previous.get("lastTransitionTime", now)
                else:
                    item["lastTransitionTime"] = now
        for key, value in new.items():
            if key == "conditions":
                continue
            _stamp(value, old.get(key) if isinstance(old, dict) else None, now)
    elif isinstance(new, list):
        olds = old if isinstance(old, list) else []
        for index, value in enumerate(new):
            _stamp(value, _counterpart(value, olds, index), now)


def _counterpart(value: Any, olds: list[Any], index: int) -> Any:
    """The old entry a list entry continues: same listener name, parentRef or ancestorRef, else same index."""
    if isinstance(value, dict):
        for field in ("name", "parentRef", "ancestorRef"):
            if field in value:
                return next(
                    (o for o in olds if isinstance(o, dict) and o.get(field) == value[field]), None
                )
    return olds[index] if index < len(olds) else None


def _without_times(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_times(v) for k, v in value.items() if k != "lastTransitionTime"}
    if isinstance(value, list):
        return [_without_times(v) for v in value]
    return value


class StatusBoard:
    def __init__(self, clock: Callable[[], str] = _now) -> None:
        self._clock = clock
        self._statuses: dict[StatusKey, ObjectStatus] = {}
        # Keys whose status changed (or appeared) since `take_changed`.
        self._changed: set[StatusKey] = set()
        self.version = 0
        # The last translation, before listener reports are laid over it.
        self._translated: list[ObjectStatus] = []
        # Per ReportListeners stream: (proxy, its listener states).
        self._reports: dict[object, tuple[str, tuple[ListenerState, ...]]] = {}
        # Objects whose routes lose their host to an older claim (the store's view).
        self._host_conflicts: dict[StatusKey, HostConflict] = {}
        self._following: Store | None = None
        self.ignored: tuple[Ignored, ...] = ()

    def replace(self, statuses: Iterable[ObjectStatus], ignored: Iterable[Ignored] = ()) -> None:
        self._translated = list(statuses)
        # Objects of other classes (no status written): ListGateways lists them.
        self.ignored = tuple(ignored)
        self._publish()

    def report_listeners(self, stream: object, proxy: str, states: Iterable[ListenerState]) -> None:
        """A proxy's full listener state (replacing what its stream said before)."""
        report = (proxy, tuple(_checked(state) for state in states))
        if self._reports.get(stream) == report:
            return
        self._reports[stream] = report
        self._publish()

    def forget_listeners(self, stream: object) -> None:
        """The stream ended: what it reported no longer holds."""
        if self._reports.pop(stream, None) is not None:
            self._publish()

    def _overlay(self, item: ObjectStatus, status: dict[str, Any]) -> None:
        """Proxies' listener problems onto a Gateway's (copied) status."""
        gateway = f"{item.namespace}/{item.name}"
        problems: dict[int, list[tuple[str, ListenerState]]] = {}
        for proxy, states in sorted(self._reports.values(), key=lambda report: report[0]):
            for state in states:
                if state.gateway == gateway and state.reason:
                    problems.setdefault(state.port, []).append((proxy, state))
        if not problems:
            return
        ports = dict(item.listener_ports)
        programmed = 0
        for listener in status.get("listeners") or []:
            found = problems.get(ports.get(listener.get("name"), -1))
            for condition in listener.get("conditions") or []:
                if condition.get("type") != "Programmed":
                    continue
                if found:
                    condition["status"] = "False"
                    condition["reason"] = found[0][1].reason
                    condition["message"] = "; ".join(
                        f"proxy {proxy}: {state.message}" for proxy, state in found[:4]
                    )
                elif condition.get("status") == "True":
                    programmed += 1
        if status.get("listeners") and not programmed:
            for condition in status.get("conditions") or []:
                if condition.get("type") == "Programmed" and condition.get("status") == "True":
                    condition["status"] = "False"
                    condition["reason"] = "Invalid"
                    condition["message"] = "no listener is programmed on every proxy"

    def follow(self, store: Store) -> None:
        """Lay `store`'s host conflicts over the statuses after every version that
        changes a route (host ownership is decided there, over every source). Every
        source feeding this board calls it; the first call wires it."""
        if self._following is store:
            return
        self._following = store
        store.on_route_changes(lambda: self.set_host_conflicts(store.host_conflicts()))

    def set_host_conflicts(self, conflicts: Mapping[StatusKey, HostConflict]) -> None:
        """The objects whose routes lose their host to another namespace's older claim
        (the store's `host_conflicts`)."""
        if conflicts == self._host_conflicts:
            return
        self._host_conflicts = dict(conflicts)
        self._publish()

    def _host_overlay(self, item: ObjectStatus, status: dict[str, Any]) -> None:
        """A host conflict onto an object's (copied) status: Conflicted=True
        (HostAlreadyClaimed) on every parent of a route, Accepted=False when none of
        its routes is served; on an Ingress; on a Gateway's listeners that lost."""
        conflict = self._host_conflicts[item.key]
        conflicted = {
            "type": "Conflicted",
            "status": "True",
            "reason": HOST_ALREADY_CLAIMED,
            "message": conflict.message,
            "observedGeneration": item.generation,
        }
        if item.kind == "Gateway":
            for listener in status.get("listeners") or []:
                if listener.get("name") not in conflict.listeners:
                    continue
                conditions = listener.setdefault("conditions", [])
                conditions[:] = [c for c in conditions if c.get("type") != "Conflicted"]
                conditions.append(dict(conflicted))
            return
        holders = status.get("parents") if item.kind != "Ingress" else [status]
        for holder in holders or []:
            conditions = holder.setdefault("conditions", [])
            for condition in conditions:
                if conflict.every and condition.get("type") == "Accepted":
                    condition.update(
                        status="False", reason=HOST_ALREADY_CLAIMED, message=conflict.message
                    )
            conditions.append(dict(conflicted))

    def _publish(self) -> None:
        now = self._clock()
        fresh: dict[StatusKey, ObjectStatus] = {}
        for item in self._translated:
            old = self._statuses.get(item.key)
            status = copy.deepcopy(item.status)
            if item.kind == "Gateway" and self._reports:
                self._overlay(item, status)
            if item.key in self._host_conflicts:
                self._host_overlay(item, status)
            _stamp(status, old.status if old is not None else None, now)
            kept = ObjectStatus(
                item.kind,
                item.namespace,
                item.name,
                item.generation,
                status,
                item.listener_ports,
            )
            fresh[item.key] = kept
            if (
                old is None
                or old.generation != kept.generation
                or _without_times(old.status) != _without_times(kept.status)
            ):
                self._changed.add(item.key)
        gone = set(self._statuses) - set(fresh)
        self._changed -= gone
        if gone or self._changed:
            self.version += 1
        self._statuses = fresh

    def get(self, kind: str, namespace: str, name: str) -> ObjectStatus | None:
        return self._statuses.get((kind, namespace, name))

    def items(self, kinds: Iterable[str] = (), namespace: str = "") -> list[ObjectStatus]:
        wanted = set(kinds)
        return [
            item
            for key, item in sorted(self._statuses.items())
            if (not wanted or item.kind in wanted)
            and (not namespace or item.namespace == namespace)
        ]

    def take_changed(self) -> list[ObjectStatus]:
        """The statuses that changed since the last call (for the Kubernetes writer)."""
        out = [self._statuses[k] for k in sorted(self._changed) if k in self._statuses]
        self._changed.clear()
        return out

    def mark_changed(self, key: StatusKey) -> None:
        """Ask for `key` to be written again (a write that failed, a new leader)."""
        if key in self._statuses:
            self._changed.add(key)

    def mark_all_changed(self) -> None:
        self._changed = set(self._statuses)
