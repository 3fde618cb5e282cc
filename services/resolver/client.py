"""The resolver's client library: one Watch stream kept as a local, immutable View.

Any consumer of the resolver's view (the proxy, `waygate routes --watch`)
uses `ResolverWatch` instead of talking to the Watch RPC itself. It re-exports
the domain model (`waygate.resolver.model`), so consumers import this module
and nothing else of the resolver.

Invariants:
- A published `View` is never mutated: every applied event publishes a new
  one (its mappings are read-only proxies over dicts no one else holds).
- A snapshot is applied atomically: its chunks (`Snapshot.more`) are gathered
  aside and replace the view only when the last one arrives; a stream that
  breaks mid-snapshot leaves the previous view serving.
- A stream resumes from the (version, epoch) of the view it holds; an event
  that does not continue that view (another epoch, a gap in versions) is never
  applied: the client reconnects asking for a fresh snapshot.
- Every attempt uses a fresh channel from `channel_factory` (`in_turn`: the
  next of several resolver replicas), closed when the attempt ends, and waits out a jittered backoff after a failure; a stream
  silent for `stale_after` seconds (no event, no heartbeat) counts as failed.
- A stream on a lent rotating channel (`waygate.core.grpctls.LentChannel`) moves
  to the renewed channel after a certificate renewal, make-before-break: a new
  stream resumes from the view held while the old one keeps applying; once the
  new one has answered and nothing was applied meanwhile, the old call is
  cancelled and its channel let go (an event the old stream delivered after
  that point is dropped: the new stream, resuming before it, delivers it). No
  update is lost or applied twice. A handover not done within
  `handover_timeout` (or failing on a bug) becomes an ordinary reconnect (resume from the held view,
  which keeps serving), so a retired channel is let go within that bound.
- While the resolver is away, the last view keeps serving; `staleness()` and
  the `waygate_resolver_client_staleness_seconds` gauge say for how long.
- Cancelling `run()` closes the channel and leaves no task behind.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import grpc
from prometheus_client import Counter, Gauge

from waygate.core.backoff import Backoff
from waygate.core.errors import Unavailable, WaygateError
from waygate.core.grpctls import LentChannel
from waygate.resolver import convert
from waygate.resolver.backendcerts import BackendCertificateState
from waygate.resolver.model import (
    HSTS,
    TCP_LISTENER,
    BalancePolicy,
    Canary,
    ClientCertificate,
    Cors,
    Endpoint,
    EndpointPort,
    ExternalAuth,
    ForwardedHeadersMode,
    HeaderModifier,
    InsecureEdgePolicy,
    Kind,
    ListenerState,
    PathMatchType,
    PathModifierType,
    RateLimit,
    Redirect,
    Rewrite,
    Route,
    RouteAccess,
    RouteBackend,
    RouteCondition,
    RouteKey,
    RouteMatch,
    RouteStatus,
    RouteTimeouts,
    RouteTLS,
    SameSite,
    Service,
    ServiceKey,
    ServicePort,
    SourceState,
    StickySessions,
    TLSTermination,
    TunnelPresence,
    TunnelServer,
    UrlMirror,
    ValueMatchType,
    speaks_http2,
)
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

# The resolver's model as other services use it: they import it from here (the
# client surface), never waygate.resolver.model (tests/unit/test_layering.py).
__all__ = [
    "HSTS",
    "TCP_LISTENER",
    "BackendCertificateState",
    "BalancePolicy",
    "Canary",
    "ClientCertificate",
    "Cors",
    "Endpoint",
    "EndpointPort",
    "ExternalAuth",
    "ForwardedHeadersMode",
    "HeaderModifier",
    "InsecureEdgePolicy",
    "Kind",
    "ListenerState",
    "PathMatchType",
    "PathModifierType",
    "RateLimit",
    "Redirect",
    "ResolverWatch",
    "Rewrite",
    "Route",
    "RouteAccess",
    "RouteBackend",
    "RouteCondition",
    "RouteKey",
    "RouteMatch",
    "RouteStatus",
    "RouteTLS",
    "RouteTimeouts",
    "SameSite",
    "Service",
    "ServiceKey",
    "ServicePort",
    "SourceState",
    "StickySessions",
    "TLSTermination",
    "TunnelPresence",
    "TunnelServer",
    "UrlMirror",
    "ValueMatchType",
    "View",
    "speaks_http2",
]

log = logging.getLogger(__name__)

#: Objects of a snapshot chunk converted between two turns of the event loop.
SLICE_OBJECTS = 1000
#: Changes of one Changes event converted between two turns of the event loop.
CHANGES_SLICE = 1000
#: How long tunnel presence a fresh snapshot from another epoch lacks is kept: a
#: restarted resolver (or another replica) knows no presence until the tunnel
#: servers report to it again, within their reconnect backoff; the tunnel
#: servers' default presence lease.
PRESENCE_GRACE = 15.0
#: Default silence after which a stream is considered dead: a little over two of
#: the resolver's default 30 s heartbeats.
DEFAULT_STALE_AFTER = 75.0
#: Default bound on moving a stream to a renewed channel (connect, handshake with
#: the new certificate, the resolver's first answer), after which the watch
#: reconnects instead and the retired channel is let go.
HANDOVER_TIMEOUT = 10.0
#: Pause between two handover attempts within that bound.
HANDOVER_RETRY = 0.2

STALENESS = Gauge(
    "waygate_resolver_client_staleness_seconds",
    "Seconds since the resolver last confirmed this process's view (an event or a "
    "heartbeat); +Inf before the first complete snapshot.",
)
CONNECTED = Gauge(
    "waygate_resolver_client_connected",
    "1 while this process's resolver Watch stream is open and its view current.",
)
RECONNECTS = Counter(
    "waygate_resolver_client_reconnects_total",
    "Resolver Watch streams that ended and were reopened after a backoff.",
)
HANDOVERS = Counter(
    "waygate_resolver_client_handovers_total",
    "Resolver Watch streams moved to a renewed channel (outcome=moved), or "
    "reconnected because the move did not complete in time (outcome=reconnected).",
    ["outcome"],
)


@dataclass(frozen=True)
class View:
    """One consistent, immutable state of the resolver's view (never mutated after publish)."""

    version: int
    epoch: int
    source: str
    last_sync: float | None  # unix seconds, from the server
    services: Mapping[ServiceKey, Service]
    # Grouped by service, ALL endpoints (consumers filter on `.usable`).
    endpoints: Mapping[ServiceKey, tuple[Endpoint, ...]]
    routes: Mapping[RouteKey, Route]
    tunnels: Mapping[str, TunnelPresence]  # by node name
    # True when this view replaced the previous one wholesale (a snapshot), not by
    # changes applied on top of it.
    from_snapshot: bool = False
    # The route sources' own state (the routes file: valid, or its last error),
    # as of the last event (heartbeats included).
    sources: tuple[SourceState, ...] = ()
    # Why the resolver sends this watcher no route private keys ("" when it does):
    # a route certificate without its key is refused with this reason.
    route_keys_withheld: str = ""


class _StreamBroken(Exception):
    """The stream sent something that does not continue the view held."""


class _StreamSilent(Exception):
    """No event or heartbeat within `stale_after`: the stream is taken for dead."""


class _HandoverTimedOut(Exception):
    """The stream could not move to its renewed channel within the bound."""


class _Staging:
    """Chunks of one snapshot being gathered, applied only once complete."""

    def __init__(self, version: int, epoch: int) -> None:
        self.version = version
        self.epoch = epoch
        self.services: dict[ServiceKey, Service] = {}
        self.endpoints: dict[ServiceKey, dict[str, Endpoint]] = {}
        self.routes: dict[RouteKey, Route] = {}
        self.tunnels: dict[str, TunnelPresence] = {}
        self._tuples: dict[ServiceKey, tuple[Endpoint, ...]] | None = None

    def finish(self) -> dict[ServiceKey, tuple[Endpoint, ...]]:
        """The endpoints grouped as the View holds them (built once)."""
        if self._tuples is None:
            self._tuples = {key: tuple(eps.values()) for key, eps in self.endpoints.items()}
        return self._tuples

    def add(self, snapshot: pb.Snapshot) -> Iterator[None]:
        """Gather one chunk; yields after every `SLICE_OBJECTS` objects converted."""
        for service_message in snapshot.services:
            service = convert.service_from_proto(service_message)
            self.services[service.key] = service
        endpoints = self.endpoints
        for index, endpoint_message in enumerate(snapshot.endpoints, 1):
            endpoint = convert.endpoint_from_proto(endpoint_message)
            endpoints.setdefault(endpoint.service_key, {})[endpoint.address] = endpoint
            if index % SLICE_OBJECTS == 0:
                yield
        for route_message in snapshot.routes:
            route = convert.route_from_proto(route_message)
            self.routes[route.key] = route
        for tunnel_message in snapshot.tunnels:
            presence = convert.tunnel_from_proto(tunnel_message)
            if presence.servers:
                self.tunnels[presence.node] = presence


def _sources(event: pb.WatchEvent) -> tuple[SourceState, ...]:
    return tuple(convert.source_state_from_proto(s) for s in event.sources)


def _last_sync(event: pb.WatchEvent) -> float | None:
    if not event.HasField("last_sync"):
        return None
    return event.last_sync.seconds + event.last_sync.nanos / 1e9


class ResolverWatch:
    """Keeps a local copy of the resolver's view over one Watch stream.

    `channel_factory` builds a new channel for each attempt (with the process's
    TLS settings, see `waygate.core.grpcclient.open_channel`); the watch closes
    it. `on_view` is called on the event loop, synchronously, with each new
    View (after every applied event that changed it; heartbeats refresh
    `view.last_sync` and the staleness without a call). `on_disconnect` hears
    (reason, seconds until the next attempt) for each lost stream; the default
    logs a warning.
    """

    def __init__(
        self,
        channel_factory: Callable[[], grpc.aio.Channel],
        *,
        kinds: Sequence[Kind] = (),
        on_view: Callable[[View], None] | None = None,
        backoff: Backoff | None = None,
        stale_after: float = DEFAULT_STALE_AFTER,
        on_disconnect: Callable[[str, float], None] | None = None,
        presence_grace: float = PRESENCE_GRACE,
        handover_timeout: float = HANDOVER_TIMEOUT,
    ) -> None:
        if stale_after <= 0:
            raise ValueError("stale_after must be positive")
        if handover_timeout <= 0:
            raise ValueError("handover_timeout must be positive")
        self._handover_timeout = handover_timeout
        self._channel_factory = channel_factory
        self._kinds = [convert.KINDS[kind] for kind in kinds]
        self._on_view = on_view
        # At most 5 s between attempts: a resolver that comes back is heard from
        # within seconds (changes made while it was down must arrive soon after;
        # issue 18), and a refused connect every 5 s per watcher costs it nothing.
        self._backoff = backoff or Backoff(initial=0.5, maximum=5.0)
        self._stale_after = stale_after
        self._on_disconnect = on_disconnect or self._log_disconnect
        self._view: View | None = None
        self._synced = asyncio.Event()
        # Monotonic time the server last confirmed the view; None before sync.
        self._confirmed: float | None = None
        self._connected = False
        self._last_error = "not connected yet"
        # Set when the stream sent something that does not continue the view
        # held: the next attempt asks for a fresh snapshot instead of resuming.
        self._resync = False
        # The view's working tables; the published View holds read-only copies.
        self._services: dict[ServiceKey, Service] = {}
        self._endpoints: dict[ServiceKey, dict[str, Endpoint]] = {}
        self._endpoint_tuples: dict[ServiceKey, tuple[Endpoint, ...]] = {}
        self._routes: dict[RouteKey, Route] = {}
        self._tunnels: dict[str, TunnelPresence] = {}
        # Presence kept from before an epoch change, until the grace ends or the
        # resolver says something about the node (issue 18: a resolver restart
        # made every tunnelled route fail until the tunnel servers reported again).
        self._presence_grace = presence_grace
        self._carried: dict[str, TunnelPresence] = {}
        self._carry_timer: asyncio.TimerHandle | None = None

    # ------------------------------------------------------------ public surface

    @property
    def view(self) -> View | None:
        """The latest applied view; None before the first complete snapshot."""
        return self._view

    @property
    def connected(self) -> bool:
        """True while a stream is open and its view complete."""
        return self._connected

    def staleness(self) -> float:
        """Seconds since the server last confirmed the view (event or heartbeat); inf before sync."""
        if self._confirmed is None:
            return math.inf
        return time.monotonic() - self._confirmed

    async def wait_synced(self, timeout: float) -> View:
        """The first complete view; Unavailable when none arrives within `timeout` seconds."""
        try:
            async with asyncio.timeout(timeout):
                await self._synced.wait()
        except TimeoutError:
            raise Unavailable(
                f"no view from the resolver within {timeout:g}s: {self._last_error}"
            ) from None
        assert self._view is not None
        return self._view

    async def run(self) -> None:
        """Watch forever: apply, resume, reconnect with backoff on a fresh channel.

        Returns only by cancellation, which closes the current channel.
        """
        STALENESS.set_function(self.staleness)
        CONNECTED.set_function(lambda: 1.0 if self._connected else 0.0)
        logged_unexpected = False
        while True:
            try:
                # _stream closes the channel (and any it moved to) when it ends.
                await self._stream(self._channel_factory())
                reason = "the resolver ended the Watch stream"
            except grpc.aio.AioRpcError as exc:
                # The server's own words (cut: a message never floods a log line).
                reason = (exc.details() or exc.code().name)[:300]
                if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    # An event too large to receive: resuming would get the same
                    # one again; a snapshot comes in bounded chunks.
                    self._resync = True
            except (_StreamSilent, _HandoverTimedOut) as exc:
                reason = str(exc)
            except (_StreamBroken, WaygateError) as exc:
                # WaygateError: an event this client cannot read (convert refused it).
                reason = str(exc)
                self._resync = True
            except asyncio.CancelledError:
                current = asyncio.current_task()
                if current is None or current.cancelling():
                    raise
                # Not our task's cancellation: the channel was closed under the
                # stream (a shared channel retired after a certificate renewal
                # cancels its calls). Without this the watch task ended there,
                # silently, and the view froze (issue 18 soak).
                reason = "the channel was closed under the stream"
            except Exception as exc:
                # A bug here or in gRPC (or a channel factory that failed) must not
                # end the watch every consumer relies on: start over, with backoff.
                reason = f"unexpected {type(exc).__name__}: {str(exc)[:300]}"
                self._resync = True
                if not logged_unexpected:
                    logged_unexpected = True
                    log.exception("resolver watch: unexpected error; retrying with backoff")
            finally:
                self._connected = False
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                # Cancelled while the stream was failing anyway: stop, do not retry.
                raise asyncio.CancelledError
            self._last_error = reason
            delay = self._backoff.next_delay()
            RECONNECTS.inc()
            self._on_disconnect(reason, delay)
            await asyncio.sleep(delay)

    # ------------------------------------------------------------ the stream

    @staticmethod
    def _log_disconnect(reason: str, delay: float) -> None:
        log.warning(
            "resolver watch lost; reconnecting",
            extra={"reason": reason, "retry_in_seconds": round(delay, 3)},
        )

    def _request(self) -> pb.WatchRequest:
        view = None if self._resync else self._view
        return pb.WatchRequest(
            kinds=self._kinds,
            resume_from_version=view.version if view else 0,
            resume_epoch=view.epoch if view else 0,
        )

    def _watch(self, channel: grpc.aio.Channel | LentChannel) -> Any:
        return resolver_pb2_grpc.ResolverStub(channel).Watch(self._request())

    async def _stream(self, channel: grpc.aio.Channel | LentChannel) -> None:
        """One stream (moved to the renewed channel after each renewal, see
        `_Handover`) until it ends or fails; closes every channel it used."""
        call: Any = None
        handover: _Handover | None = None
        staging: _Staging | None = None
        loop = asyncio.get_running_loop()
        try:
            call = self._watch(channel)
            if isinstance(channel, LentChannel):
                handover = _Handover(self, channel, call)
            # One deadline, pushed forward by every event: a silent stream is dead.
            # (asyncio.timeout, not wait_for: wait_for can swallow a cancellation
            # that races with the read's own failure.)
            async with asyncio.timeout(self._stale_after) as deadline:
                while True:
                    if handover is None:
                        event = await call.read()
                    else:
                        event = await handover.read()
                        if handover.moved is not None:
                            # Anything the old stream read after the move is
                            # dropped: the new one resumed before it.
                            call.cancel()
                            await channel.close()
                            lent, call, event = handover.moved
                            handover.moved = None
                            channel = lent
                            handover = _Handover(self, lent, call)
                            staging = None  # a snapshot's chunks came from the old stream
                    if event is grpc.aio.EOF:
                        return
                    deadline.reschedule(loop.time() + self._stale_after)
                    staging = await self._on_event(event, staging)
        except TimeoutError:
            raise _StreamSilent(
                f"no event or heartbeat from the resolver for {self._stale_after:g}s"
            ) from None
        finally:
            if handover is not None:
                await handover.close()
            if call is not None:
                call.cancel()
            await channel.close()

    async def _on_event(self, event: pb.WatchEvent, staging: _Staging | None) -> _Staging | None:
        """Apply one event; returns the snapshot still being gathered, if any."""
        kind = event.WhichOneof("event")
        if kind == "snapshot":
            if staging is None:
                staging = _Staging(event.version, event.epoch)
            elif (staging.version, staging.epoch) != (event.version, event.epoch):
                raise _StreamBroken("a snapshot's chunks changed version mid-way")
            chunk = event.snapshot
            # Converting a 1 MiB chunk takes a good part of a second: in slices,
            # letting the loop (maybe a proxy's data plane) run in between.
            for _ in staging.add(chunk):
                await asyncio.sleep(0)
            if chunk.more:
                return staging
            self._apply_snapshot(staging, event)
        elif kind == "changes":
            if staging is not None:
                raise _StreamBroken("changes arrived before the snapshot's last chunk")
            await self._apply_changes(event)
        else:
            raise _StreamBroken(f"unknown watch event {kind!r}")
        self._confirmed = time.monotonic()
        self._connected = True
        self._backoff.reset()
        return None

    def _apply_snapshot(self, staging: _Staging, event: pb.WatchEvent) -> None:
        self._resync = False
        self._services = staging.services
        self._endpoints = staging.endpoints
        self._endpoint_tuples = staging.finish()
        self._routes = staging.routes
        self._tunnels = self._carry_presence(staging.tunnels, staging.epoch)
        self._publish(event, from_snapshot=True)

    def _carry_presence(
        self, tunnels: dict[str, TunnelPresence], epoch: int
    ) -> dict[str, TunnelPresence]:
        """`tunnels` plus the presence a snapshot from a new epoch lacks, kept for the grace."""
        previous = self._view
        if previous is None or self._presence_grace <= 0:
            return tunnels
        held = self._tunnels if previous.epoch != epoch else self._carried
        carried = {node: p for node, p in held.items() if node not in tunnels}
        self._carried = carried
        if not carried:
            return tunnels
        tunnels.update(carried)
        if previous.epoch != epoch or self._carry_timer is None:
            if self._carry_timer is not None:
                self._carry_timer.cancel()
            self._carry_timer = asyncio.get_running_loop().call_later(
                self._presence_grace, self._end_carry
            )
        return tunnels

    def _end_carry(self) -> None:
        """The grace is over: presence nobody confirmed since the epoch changed goes."""
        self._carry_timer = None
        carried, self._carried = self._carried, {}
        view = self._view
        if not carried or view is None:
            return
        tunnels = {n: p for n, p in self._tunnels.items() if carried.get(n) is not p}
        self._tunnels = tunnels
        self._emit(
            dataclasses.replace(view, tunnels=MappingProxyType(tunnels), from_snapshot=False)
        )

    async def _apply_changes(self, event: pb.WatchEvent) -> None:
        view = self._view
        changes = event.changes
        if view is None or event.epoch != view.epoch or changes.from_version != view.version:
            raise _StreamBroken(
                f"changes from version {changes.from_version} (epoch {event.epoch}) do not "
                f"continue the view held (version {view.version if view else 0}); resyncing"
            )
        if not changes.changes:
            # A heartbeat: the view is current as of the source's last sync, at the
            # server's version (changes of kinds not watched advance it).
            sources = _sources(event)
            self._view = dataclasses.replace(
                view,
                version=event.version,
                last_sync=_last_sync(event),
                from_snapshot=False,
                sources=sources,
                route_keys_withheld=event.route_keys_withheld,
            )
            if sources != view.sources:
                # A route source turned valid or invalid (the resolver says so at
                # once, with an empty Changes): consumers hear it now.
                self._emit(self._view)
            return
        # Converting 100,000 changes takes seconds: in slices, letting the loop (maybe
        # a proxy's data plane) run in between; then applied at once, so a stream
        # that fails mid-way leaves the held state untouched.
        decoded: list[tuple[str, Any]] = []
        for index, change in enumerate(changes.changes):
            if index and index % CHANGES_SLICE == 0:
                await asyncio.sleep(0)
            decoded.append(_decode_change(change))
        touched_services: set[ServiceKey] = set()
        services, routes, tunnels = dict(self._services), dict(self._routes), dict(self._tunnels)
        for which, value in decoded:
            if which == "service_upserted":
                services[value.key] = value
            elif which == "service_deleted":
                services.pop(value, None)
            elif which == "endpoint_upserted":
                self._endpoint_table(value.service_key, touched_services)[value.address] = value
            elif which == "endpoint_deleted":
                key, address = value
                if key in self._endpoints:
                    self._endpoint_table(key, touched_services).pop(address, None)
            elif which == "route_upserted":
                routes[value.key] = value
            elif which == "route_deleted":
                routes.pop(value, None)
            elif value.servers:
                tunnels[value.node] = value
                self._carried.pop(value.node, None)
            else:
                tunnels.pop(value.node, None)
                self._carried.pop(value.node, None)
        if touched_services:
            tuples = dict(self._endpoint_tuples)
            for key in touched_services:
                table = self._endpoints.get(key)
                if table:
                    tuples[key] = tuple(table.values())
                else:
                    self._endpoints.pop(key, None)
                    tuples.pop(key, None)
            self._endpoint_tuples = tuples
        self._services, self._routes, self._tunnels = services, routes, tunnels
        self._publish(event, from_snapshot=False)

    def _endpoint_table(self, key: ServiceKey, touched: set[ServiceKey]) -> dict[str, Endpoint]:
        """The service's endpoint table, copied once per event (the old View keeps its own)."""
        if key not in touched:
            touched.add(key)
            self._endpoints[key] = dict(self._endpoints.get(key, {}))
        return self._endpoints[key]

    def _publish(self, event: pb.WatchEvent, *, from_snapshot: bool) -> None:
        view = View(
            version=event.version,
            epoch=event.epoch,
            source=event.source,
            last_sync=_last_sync(event),
            services=MappingProxyType(self._services),
            endpoints=MappingProxyType(self._endpoint_tuples),
            routes=MappingProxyType(self._routes),
            tunnels=MappingProxyType(self._tunnels),
            from_snapshot=from_snapshot,
            sources=_sources(event),
            route_keys_withheld=event.route_keys_withheld,
        )
        self._emit(view)

    def _emit(self, view: View) -> None:
        self._view = view
        self._synced.set()
        if self._on_view is not None:
            try:
                self._on_view(view)
            except Exception:
                # A consumer's bug must not stop the watch every consumer relies on.
                log.exception("resolver watch: on_view failed")


class _Handover:
    """Moves one Watch stream to its lent channel's successor after a renewal.

    Make-before-break: when the channel is retired, a task opens a new stream on
    `renew()` (the connection and the new certificate's handshake happen while
    the old stream keeps applying), asking to resume from the view held at that
    moment. Its first event (a resume's immediate answer: the backlog, or an
    empty Changes confirming the version; or a snapshot) is accepted only if the
    view is still the one it resumed from, which is checked while the watch
    waits in the old stream's read (not halfway through applying an event).
    Accepted, the old call is cancelled to wake that read and `moved` holds the
    new (channel, call, first event); otherwise the attempt is dropped and
    another starts from the view now held. All within `handover_timeout`, after
    which the old call is cancelled and `read()` raises _HandoverTimedOut.
    One task per renewal, none per event."""

    def __init__(self, watch: ResolverWatch, lent: LentChannel, call: Any) -> None:
        self._watch = watch
        self._lent = lent
        self._call = call
        self._reading = asyncio.Event()  # set while the watch waits in call.read()
        self._task: asyncio.Task[None] | None = None
        self._timed_out = False
        self.moved: tuple[LentChannel, Any, Any] | None = None
        lent.on_retired(self._begin)

    def _begin(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def read(self) -> Any:
        """The old call's next event, or None after a move (then see `moved`)."""
        self._reading.set()
        try:
            event = await self._call.read()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise
            if self._timed_out:
                raise _HandoverTimedOut(
                    "the Watch stream did not move to the renewed channel within "
                    f"{self._watch._handover_timeout:g}s; reconnecting"
                ) from None
            if self.moved is None:
                raise  # cancelled by someone else: the run loop's business
            return None
        except grpc.aio.AioRpcError:
            if self.moved is None:
                raise
            return None  # the old stream failed after the move: it no longer matters
        finally:
            self._reading.clear()
        return None if self.moved is not None else event

    async def _run(self) -> None:
        watch = self._watch
        try:
            async with asyncio.timeout(watch._handover_timeout):
                while not await self._attempt():
                    await asyncio.sleep(HANDOVER_RETRY)
            HANDOVERS.labels("moved").inc()
        except TimeoutError:
            HANDOVERS.labels("reconnected").inc()
            self._timed_out = True
        except Exception:
            # A bug here must not leave the stream on the retired channel for good:
            # reconnect, as after the bound.
            log.exception("resolver watch: moving to the renewed channel failed; reconnecting")
            HANDOVERS.labels("reconnected").inc()
            self._timed_out = True
        self._call.cancel()  # wakes the watch's read

    async def _attempt(self) -> bool:
        """One try: True once `moved` is set (the new stream is the watch's now)."""
        lent = self._lent.renew()
        call: Any = None
        try:
            await lent.channel_ready()
            await self._reading.wait()
            view, resync = self._watch._view, self._watch._resync
            call = self._watch._watch(lent)
            first = await call.read()
            if first is grpc.aio.EOF:
                return False
            await self._reading.wait()
            if self._watch._view is not view or self._watch._resync is not resync:
                return False  # the old stream applied something meanwhile: again
            self.moved = (lent, call, first)
            return True
        except grpc.aio.AioRpcError:
            return False
        finally:
            if self.moved is None or self.moved[0] is not lent:
                if call is not None:
                    call.cancel()
                await lent.close()

    async def close(self) -> None:
        """Stop a handover in progress (the stream ended): nothing left behind."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        moved, self.moved = self.moved, None
        if moved is not None:  # moved, but the stream ended before taking it
            moved[1].cancel()
            await moved[0].close()


def _decode_change(change: pb.Change) -> tuple[str, Any]:
    """One Change as (which, model object or key); _StreamBroken when unknown."""
    which = change.WhichOneof("change")
    if which == "service_upserted":
        return which, convert.service_from_proto(change.service_upserted)
    if which == "service_deleted":
        return which, (change.service_deleted.namespace, change.service_deleted.name)
    if which == "endpoint_upserted":
        return which, convert.endpoint_from_proto(change.endpoint_upserted)
    if which == "endpoint_deleted":
        ref = change.endpoint_deleted
        return which, ((ref.namespace, ref.service), ref.address)
    if which == "route_upserted":
        return which, convert.route_from_proto(change.route_upserted)
    if which == "route_deleted":
        return which, (change.route_deleted.namespace, change.route_deleted.name)
    if which == "tunnel_presence":
        return which, convert.tunnel_from_proto(change.tunnel_presence)
    raise _StreamBroken(f"unknown change {which!r}")


async def report_tunnels(
    channel: grpc.aio.Channel,
    server_id: str,
    address: str,
    reports: AsyncIterator[tuple[Sequence[str], float]],
) -> None:
    """Stream `ReportTunnels` for tunnel-server replica `server_id` (dialers reach it at
    `address`): each item of `reports` is one full report, (nodes held, lease in
    seconds). Returns when `reports` ends; grpc.aio.AioRpcError when the stream fails."""
    server = pb.TunnelServer(id=server_id, address=address)

    async def messages() -> AsyncIterator[pb.TunnelReport]:
        async for nodes, lease in reports:
            report = pb.TunnelReport(server=server, nodes=list(nodes))
            report.lease.FromNanoseconds(int(lease * 1e9))
            yield report

    await resolver_pb2_grpc.ResolverStub(channel).ReportTunnels(messages())


async def report_listeners(
    channel: grpc.aio.Channel,
    proxy: str,
    reports: AsyncIterator[Sequence[ListenerState]],
) -> None:
    """Stream `ReportListeners` for `proxy`: each item of `reports` is the full state of
    its Gateway listeners. Returns when `reports` ends; grpc.aio.AioRpcError when the
    stream fails."""

    async def messages() -> AsyncIterator[pb.GatewayListenerReport]:
        async for states in reports:
            yield pb.GatewayListenerReport(
                proxy=proxy, listeners=[convert.listener_state_to_proto(s) for s in states]
            )

    await resolver_pb2_grpc.ResolverStub(channel).ReportListeners(messages())


async def report_backend_certificates(
    channel: grpc.aio.Channel,
    proxy: str,
    reports: AsyncIterator[Sequence[BackendCertificateState]],
) -> None:
    """Stream `ReportBackendCertificates` for `proxy`: each item of `reports` is the full
    set of backend certificates needing attention. Returns when `reports` ends;
    grpc.aio.AioRpcError when the stream fails."""

    async def messages() -> AsyncIterator[pb.BackendCertificateReport]:
        async for states in reports:
            yield pb.BackendCertificateReport(
                proxy=proxy,
                certificates=[convert.backend_certificate_to_proto(s) for s in states],
            )

    await resolver_pb2_grpc.ResolverStub(channel).ReportBackendCertificates(messages())


def in_turn(factories: Sequence[Callable[[], grpc.aio.Channel]]) -> Callable[[], grpc.aio.Channel]:
    """A `ResolverWatch` channel factory over several resolver replicas: each attempt
    takes the next one in turn, so a Watch whose replica died reconnects to another
    (any one replica serves the whole view; a switch costs a fresh snapshot, since
    each replica has its own epoch). One factory: that one, every time."""
    if not factories:
        raise ValueError("at least one resolver address is needed")
    turn = itertools.cycle(factories)
    return lambda: next(turn)()


async def keep_reporting(
    hold: Callable[[], AbstractAsyncContextManager[grpc.aio.Channel]],
    stream: Callable[[grpc.aio.Channel], Awaitable[None]],
    backoff: Backoff,
    *,
    what: str,
    extra: Mapping[str, Any] | None = None,
) -> None:
    """Keep a report stream to the resolver open (`report_listeners`, `report_tunnels`):
    each attempt holds a channel from `hold()` (`RotatingChannel.hold`: kept across
    certificate rotations) and runs `stream(channel)` until it ends or fails; a failed
    RPC is a warning ("<what> failed", with `extra`), then `backoff.next_delay()` is
    waited out and the next attempt starts. The caller's report iterator resets
    `backoff` on each report sent, so a stream that worked reconnects quickly. Never
    returns; other exceptions propagate; cancel it to stop."""
    while True:
        try:
            async with hold() as channel:
                await stream(channel)
        except grpc.aio.AioRpcError as exc:
            log.warning(
                "%s failed",
                what,
                extra={**(extra or {}), "error": f"{exc.code().name}: {exc.details()}"},
            )
        await asyncio.sleep(backoff.next_delay())
