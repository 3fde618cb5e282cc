"""The gRPC boundary of waygate.resolver.v1.Resolver: proto <-> domain, nothing else.

Domain errors raised below are mapped to status codes by the shared boundary
interceptor (waygate.core.grpcserver). Invariants:
- A Watch or ReportTunnels stream that ends for any reason (client cancel,
  error, shutdown) releases its subscription or its tunnel presence in a
  `finally`.
- Write RPCs are checked against the peer's certificate identities before
  anything else (the rules live in waygate.resolver.access; only reading the
  identities off the connection is done here).
- Replies that show routes (ListRoutes, ApplyRoute) never carry tls.key;
  Watch carries it only to route readers (waygate.resolver.access).
- No reply is ever larger than its bound: a Watch snapshot goes out in chunks
  of `watch_chunk_bytes`, a Changes batch too large for one event becomes a
  chunked snapshot for that subscriber, ListRoutes pages stop at
  `LIST_PAGE_BYTES`; what cannot be bounded is RESOURCE_EXHAUSTED with a reason.
- A large snapshot is converted off the event loop, once per (version,
  redaction) however many watchers ask for it at the same time, and each event
  is serialized once for every stream that sends it (the wire bytes are
  shared; issue 18's watcher storm: a thousand watchers of 100,000 endpoints).
- At most `SNAPSHOT_SLOTS` streams send a large snapshot at once; the others
  wait their turn (for at most `SNAPSHOT_SLOT_WAIT`, so a stalled reader
  holding a slot delays others, never starves them).
- A Watch stream sends at most one event per `WATCH_EVENT_INTERVAL` (longer
  with many streams: WATCH_EVENT_COST per stream); what lands meanwhile waits
  in its subscription, coalesced to the latest state per key, so the streams
  together never send more than the loop can write and a change source is
  never starved by the fan-out of its own changes.
- Every Watch event carries this replica's epoch; a resume naming another
  epoch (another replica, a restarted one, or none) starts with a snapshot.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import functools
from collections import OrderedDict
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

import grpc
from cryptography import x509

from waygate.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    ResourceExhausted,
    Unavailable,
    excerpt,
)
from waygate.core.grpcserver import ServiceRegistration
from waygate.resolver import convert, events
from waygate.resolver.access import WriteAccess
from waygate.resolver.backendcerts import MAX_STATES, BackendCertificateReports
from waygate.resolver.filesource import FileSource
from waygate.resolver.gateway.status import StatusBoard
from waygate.resolver.model import Route, Service, TunnelServer
from waygate.resolver.resolve import MAX_CACHED_PORTS, Pick, Resolution, Resolver, Target
from waygate.resolver.status import PRIVATE_KEY_DELIVERED
from waygate.resolver.store import DEFAULT_MAX_PENDING, Batch, Snapshot, Store, SubscriptionEnded
from waygate.resolver.tunnels import TunnelRegistry
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

SERVICE_NAME = "waygate.resolver.v1.Resolver"

#: ListRoutes page size when the request names none, and the most it may ask for.
DEFAULT_PAGE_SIZE = 100
# A proxy's ReportListeners state: one entry per Gateway listener port it has routes for.
MAX_LISTENER_STATES = 4096
# A proxy's ReportBackendCertificates state (waygate.resolver.backendcerts bounds the rest).
MAX_BACKEND_CERTIFICATES = MAX_STATES
MAX_PAGE_SIZE = 1000
#: A page also ends once its routes reach this many serialized bytes.
LIST_PAGE_BYTES = 1024 * 1024
#: Snapshots and Changes batches with more objects than this are converted in a
#: worker thread (one conversion shared by every watcher waiting for it): a
#: 100,000-endpoint view takes seconds to convert, and the loop must keep
#: answering Resolve and health checks meanwhile.
OFFLOAD_SNAPSHOT_OBJECTS = 5000
#: Large snapshots being sent at once (each holds up to a chunk in gRPC's buffers
#: per stream), and how long a stream waits for a turn before sending anyway.
SNAPSHOT_SLOTS = 32
SNAPSHOT_SLOT_WAIT = 10.0
#: Serialized events kept for the streams that send the same event object: by
#: count and by bytes (a 100,000-endpoint snapshot is about 10 MiB of chunks).
WIRE_CACHE_EVENTS = 256
WIRE_CACHE_BYTES = 64 * 1024 * 1024
#: Least time between two events of one Watch stream: changes that land within
#: it go out as one coalesced event (a change to a quiet stream goes out at
#: once). It grows with the number of streams, by WATCH_EVENT_COST each, so
#: that all of them together send at most about 1/WATCH_EVENT_COST events per
#: second: a write costs the loop a fraction of a millisecond per stream, and
#: without a bound a thousand streams took every change the moment their
#: previous write completed, saturated the loop, starved the change source's
#: own reads (changes queued before the store, where nothing coalesces them)
#: and reached the last watcher 11-40 s late (bench/resolver_storm).
WATCH_EVENT_INTERVAL = 0.01
WATCH_EVENT_COST = 0.0002
#: No serialized Change is smaller than this: a batch with more changes than the
#: event bound divided by it cannot fit, and is not converted only to be discarded.
MIN_CHANGE_BYTES = 20

_PICKS = {
    pb.PICK_POLICY_UNSPECIFIED: Pick.NONE,
    pb.PICK_POLICY_RANDOM: Pick.RANDOM,
    pb.PICK_POLICY_ROUND_ROBIN: Pick.ROUND_ROBIN,
    pb.PICK_POLICY_HASH: Pick.HASH,
}


def _target(target: Target) -> pb.Target:
    return pb.Target(
        address=target.address,
        port=target.port,
        node_name=target.node_name,
        zone=target.zone,
        tunnel=target.tunnel,
    )


class _ResolveTemplates:
    """The service and targets part of ResolveResponse, built once per service port.

    Building a thousand Target messages per call costs milliseconds; copying a
    built message costs a few percent of that. A template is reused while the
    resolver hands out the very same service and targets objects (it caches them
    per store revision), so an answer is never older than the store.
    """

    def __init__(self, max_bytes: int = events.DEFAULT_MAX_EVENT_BYTES) -> None:
        self._templates: dict[
            tuple[str, str, str], tuple[Service, tuple[Target, ...], pb.ResolveResponse]
        ] = {}
        self._max_bytes = max_bytes

    def response(self, port: str, resolution: Resolution) -> pb.ResolveResponse:
        service, targets = resolution.service, resolution.targets
        key = (service.namespace, service.name, port)
        entry = self._templates.get(key)
        if entry is None or entry[0] is not service or entry[1] is not targets:
            if len(self._templates) >= MAX_CACHED_PORTS and key not in self._templates:
                self._templates.clear()
            template = pb.ResolveResponse(
                service=convert.service_to_proto(service),
                targets=[_target(t) for t in targets],
            )
            if template.ByteSize() > self._max_bytes:
                # Said here, as a status, rather than by gRPC failing the send.
                raise ResourceExhausted(
                    f"service {service.namespace}/{service.name} has {len(targets)} ready "
                    f"endpoints: a {template.ByteSize()}-byte reply, over the "
                    f"{self._max_bytes}-byte limit; Watch the endpoints instead"
                )
            entry = self._templates[key] = (service, targets, template)
        response = pb.ResolveResponse()
        response.CopyFrom(entry[2])
        response.version = resolution.version
        if resolution.last_sync is not None:
            response.last_sync.FromDatetime(resolution.last_sync)
        if resolution.picked is not None:
            response.picked.CopyFrom(_target(resolution.picked))
        return response


def peer_identities(context: grpc.aio.ServicerContext) -> tuple[str, ...]:
    """The client certificate's URI SANs (SPIFFE IDs) and DNS SANs; () without one.

    Read from the certificate itself: gRPC's own SAN property does not carry
    URI SANs in every version.
    """
    pems = list(context.auth_context().get("x509_pem_cert") or ())
    if not pems:
        return ()
    try:
        certificate = x509.load_pem_x509_certificate(pems[0])
        names = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except (ValueError, x509.ExtensionNotFound):
        return ()
    return (
        *names.get_values_for_type(x509.UniformResourceIdentifier),
        *names.get_values_for_type(x509.DNSName),
    )


def _page_token(last: pb.Route) -> str:
    """Opaque to clients: where the next page starts (after this route's key)."""
    raw = f"{last.namespace}\n{last.name}".encode()
    return base64.urlsafe_b64encode(raw).decode()


def _page_position(token: str) -> tuple[str, str]:
    try:
        namespace, name = base64.urlsafe_b64decode(token.encode()).decode().split("\n")
    except (binascii.Error, UnicodeError, ValueError):
        raise InvalidArgument(
            f"page_token: {excerpt(token)} is not a token from a ListRoutes reply"
        ) from None
    return (namespace, name)


def _object_count(snapshot: Snapshot) -> int:
    return (
        len(snapshot.services)
        + len(snapshot.endpoints)
        + len(snapshot.routes)
        + len(snapshot.tunnels)
    )


class _WireCache:
    """Serialized WatchEvents by event object, least recently used dropped first.

    Watchers share event objects (a snapshot's chunks, a store batch's Changes,
    the same stamped last event), so the bytes are made once for all of them.
    The entry holds the event, so its id cannot be reused while cached.
    """

    def __init__(self, max_events: int, max_bytes: int) -> None:
        self._entries: OrderedDict[int, tuple[pb.WatchEvent, bytes]] = OrderedDict()
        self._max_events = max_events
        self._max_bytes = max_bytes
        self._bytes = 0

    def bytes_of(self, event: pb.WatchEvent) -> bytes:
        key = id(event)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is event:
            self._entries.move_to_end(key)
            return entry[1]
        data = event.SerializeToString()
        if len(data) > self._max_bytes // 4:
            return data  # too large to keep: it would push everything else out
        if entry is not None:
            self._bytes -= len(entry[1])
        self._entries[key] = (event, data)
        self._entries.move_to_end(key)
        self._bytes += len(data)
        while len(self._entries) > self._max_events or self._bytes > self._max_bytes:
            _, (_, dropped) = self._entries.popitem(last=False)
            self._bytes -= len(dropped)
        return data


class ResolverServicer(resolver_pb2_grpc.ResolverServicer):
    def __init__(
        self,
        store: Store,
        *,
        resolver: Resolver | None = None,
        routes: FileSource | None = None,
        gateways: StatusBoard | None = None,
        tunnels: TunnelRegistry | None = None,
        backend_certificates: BackendCertificateReports | None = None,
        access: WriteAccess | None = None,
        watch_max_pending: int = DEFAULT_MAX_PENDING,
        watch_heartbeat: float = 0.0,
        watch_chunk_bytes: int = events.DEFAULT_CHUNK_BYTES,
        max_event_bytes: int = events.DEFAULT_MAX_EVENT_BYTES,
        watch_interval: float = WATCH_EVENT_INTERVAL,
    ) -> None:
        self._store = store
        self._watch_interval = watch_interval
        self._resolver = resolver or Resolver(store)
        self._templates = _ResolveTemplates(max_event_bytes)
        # The writable route source; None: routes are read-only here.
        self._routes = routes
        # Gateway API and Ingress statuses (ListGateways); None: none kept.
        self._gateways = gateways
        self._tunnels = tunnels or TunnelRegistry(store)
        # Proxies' backend-certificate reports (ReportBackendCertificates), and the
        # timer that drops the state of a proxy that stopped reporting.
        self._backend_certificates = (
            BackendCertificateReports() if backend_certificates is None else backend_certificates
        )
        self._backend_lapse: asyncio.TimerHandle | None = None
        # Default: a listener without client certificates (writes unchecked).
        self._access = access or WriteAccess()
        self._watch_max_pending = watch_max_pending
        # Seconds of silence after which a Watch gets an empty Changes (0: never).
        self._watch_heartbeat = watch_heartbeat or None
        self._watch_chunk_bytes = watch_chunk_bytes
        self._max_event_bytes = max_event_bytes
        # Large snapshots being converted in a worker thread, shared by the
        # watchers that wait for the same one.
        self._converting: dict[
            tuple[object, ...], asyncio.Future[tuple[pb.WatchEvent, ...] | None]
        ] = {}
        self._wire = _WireCache(WIRE_CACHE_EVENTS, WIRE_CACHE_BYTES)
        self._snapshot_slots = asyncio.Semaphore(SNAPSHOT_SLOTS)

    def registration(self) -> ServiceRegistration:
        # Watch makes no child spans, and is fanned out to every watcher: its
        # steps run without the stream's span current (the span still covers it).
        return ServiceRegistration(
            SERVICE_NAME,
            resolver_pb2_grpc.add_ResolverServicer_to_server,
            self,
            untraced_steps=frozenset({"Watch"}),
        )

    async def Resolve(
        self, request: pb.ResolveRequest, context: grpc.aio.ServicerContext
    ) -> pb.ResolveResponse:
        pick = _PICKS.get(request.pick)
        if pick is None:
            raise InvalidArgument(f"pick: unknown value {request.pick}")
        return self._templates.response(
            request.port,
            self._resolver.resolve(
                request.namespace,
                request.name,
                request.port,
                pick=pick,
                hash_key=request.hash_key,
            ),
        )

    async def Watch(
        self, request: pb.WatchRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[pb.WatchEvent]:
        kinds = convert.kinds_from_proto(list(request.kinds))
        withheld = self._access.route_keys_withheld(peer_identities(context))
        with_keys = not withheld
        # Per watcher, while the events are shared: a serialized field appended to
        # a serialized message merges into it (protobuf's concatenation rule).
        withheld_field = pb.WatchEvent(route_keys_withheld=withheld).SerializeToString()
        store = self._store
        subscription = store.subscribe(
            kinds,
            resume_from=request.resume_from_version,
            resume_epoch=request.resume_epoch,
            max_pending=self._watch_max_pending,
        )
        # A resume honoured with nothing new: an empty Changes at once, so the
        # consumer knows its stream is live and its view current (else it would
        # wait for the next change or heartbeat to hear so).
        resumed = bool(request.resume_from_version) and not subscription.ready()
        first: Batch | None = subscription.heartbeat() if resumed else None
        try:
            while True:
                # After a quiet `heartbeat`, an empty Changes tells the consumer the
                # view is still current as of the sources' last sync.
                item: Snapshot | Batch
                try:
                    if first is not None:
                        item, first = first, None
                    else:
                        item = await subscription.next(self._watch_heartbeat)
                except SubscriptionEnded:
                    raise Unavailable(
                        "the resolver is shutting down; reconnect and resume from version "
                        f"{subscription.version}"
                    ) from None
                source, last_sync = store.last_sync()
                outgoing = await self._events(item, source, last_sync, with_keys)
                if outgoing is None:
                    # Too many changes for one bounded event: start this
                    # subscriber over from a (chunked) snapshot instead.
                    subscription.resync()
                    continue
                slot = (
                    isinstance(item, Snapshot)
                    and _object_count(item) > OFFLOAD_SNAPSHOT_OBJECTS
                    and await self._snapshot_turn()
                )
                try:
                    for event in outgoing:
                        yield self._wire.bytes_of(event) + withheld_field  # type: ignore[misc]
                finally:
                    if slot:
                        self._snapshot_slots.release()
                # What lands meanwhile waits in the subscription, coalesced.
                await asyncio.sleep(
                    max(self._watch_interval, store.subscriber_count * WATCH_EVENT_COST)
                )
        finally:
            subscription.close()

    async def _snapshot_turn(self) -> bool:
        """Wait for a turn to send a large snapshot: True with a slot held (release
        it), False when none came free in time (send anyway: delay, never starve)."""
        try:
            await asyncio.wait_for(self._snapshot_slots.acquire(), SNAPSHOT_SLOT_WAIT)
        except TimeoutError:
            return False
        return True

    async def _events(
        self, item: Snapshot | Batch, source: str, last_sync: datetime | None, with_keys: bool
    ) -> tuple[pb.WatchEvent, ...] | None:
        states = self._store.source_states()
        convert_item = functools.partial(
            events.watch_events,
            item,
            source,
            last_sync,
            self._store.epoch,
            with_keys=with_keys,
            chunk_bytes=self._watch_chunk_bytes,
            max_event_bytes=self._max_event_bytes,
            states=states,
        )
        if isinstance(item, Batch):
            if len(item.changes) * MIN_CHANGE_BYTES > self._max_event_bytes:
                return None  # too large for one event whatever its content: resync
            objects = len(item.changes)
        else:
            objects = _object_count(item)
        if objects <= OFFLOAD_SNAPSHOT_OBJECTS:
            return convert_item()
        # Not keyed by the sync time, which moves with every poll: watchers that
        # arrive while one conversion runs share it and stamp their own copy.
        key = (item, with_keys)
        future = self._converting.get(key)
        if future is None:
            future = asyncio.ensure_future(asyncio.to_thread(convert_item))
            self._converting[key] = future

            def done(finished: asyncio.Future[tuple[pb.WatchEvent, ...] | None]) -> None:
                self._converting.pop(key, None)
                if not finished.cancelled():
                    finished.exception()  # retrieved: every waiter may have gone

            future.add_done_callback(done)
        # Shielded: one watcher leaving must not cancel the others' conversion.
        converted = await asyncio.shield(future)
        return None if converted is None else events.restamp(converted, source, last_sync, states)

    async def ListRoutes(
        self, request: pb.ListRoutesRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListRoutesResponse:
        limit = min(request.page_size or DEFAULT_PAGE_SIZE, MAX_PAGE_SIZE)
        after = _page_position(request.page_token) if request.page_token else None
        response = pb.ListRoutesResponse(
            version=self._store.version,
            sources=[convert.source_state_to_proto(s) for s in self._store.source_states()],
        )
        size = 0
        routes = self._store.routes(request.namespace)
        for index, route in enumerate(r for r in routes if after is None or r.key > after):
            if index == limit or (index and size >= LIST_PAGE_BYTES):
                response.next_page_token = _page_token(response.routes[-1])
                break
            message = self._listed(route)
            size += message.ByteSize()
            response.routes.append(message)
        return response

    def _listed(self, route: Route) -> pb.Route:
        """A route as ListRoutes and ApplyRoute answer it: without its key, and with a
        PrivateKeyDelivered=False condition when it has one no Watch client (no proxy)
        can receive (a proxy hears why over its Watch; `routes` and `check` show this)."""
        message = convert.route_to_proto(route, with_key=False)
        reason, why = self._access.keys_withheld_from_everyone()
        if reason and route.tls is not None and route.tls.key:
            message.status.conditions.append(
                pb.RouteCondition(
                    type=PRIVATE_KEY_DELIVERED, status="False", reason=reason, message=why
                )
            )
        return message

    async def ListGateways(
        self, request: pb.ListGatewaysRequest, context: grpc.aio.ServicerContext
    ) -> pb.ListGatewaysResponse:
        response = pb.ListGatewaysResponse(
            sources=[convert.source_state_to_proto(s) for s in self._store.source_states()]
        )
        if self._gateways is None:
            return response
        kinds = set(request.kinds)
        response.ignored.extend(
            pb.IgnoredObject(
                kind=item.kind, namespace=item.namespace, name=item.name, reason=item.reason
            )
            for item in self._gateways.ignored
            if (not kinds or item.kind in kinds)
            and (not request.namespace or item.namespace == request.namespace)
        )
        for item in self._gateways.items(request.kinds, request.namespace):
            response.objects.append(
                convert.gateway_status_to_proto(
                    item.kind, item.namespace, item.name, item.generation, item.status
                )
            )
        return response

    async def ReportListeners(
        self,
        request_iterator: AsyncIterator[pb.GatewayListenerReport],
        context: grpc.aio.ServicerContext,
    ) -> pb.GatewayListenerReportResponse:
        """A proxy's Gateway listeners, while its stream lasts (gateway.status.StatusBoard)."""
        self._access.check_listener_reporter(peer_identities(context))
        board = self._gateways
        stream = object()
        reports = aiter(request_iterator)
        try:
            # Ended with UNAVAILABLE when draining starts, as ReportTunnels streams are
            # (the drain sets the one `ending` event): the proxy reports elsewhere.
            while (report := await self._next_report(reports)) is not None:
                if len(report.listeners) > MAX_LISTENER_STATES:
                    raise InvalidArgument(
                        f"listeners: at most {MAX_LISTENER_STATES} per report "
                        f"(got {len(report.listeners)})"
                    )
                if board is not None:
                    board.report_listeners(
                        stream,
                        excerpt(report.proxy or "unnamed", 120),
                        [convert.listener_state_from_proto(s) for s in report.listeners],
                    )
        finally:
            if board is not None:
                board.forget_listeners(stream)
        return pb.GatewayListenerReportResponse()

    async def ReportBackendCertificates(
        self,
        request_iterator: AsyncIterator[pb.BackendCertificateReport],
        context: grpc.aio.ServicerContext,
    ) -> pb.BackendCertificateReportResponse:
        """A proxy's backend certificates needing attention: each report its full state,
        kept until the TTL passes without another (waygate.resolver.backendcerts)."""
        self._access.check_backend_certificate_reporter(peer_identities(context))
        reports = aiter(request_iterator)
        while (report := await self._next_report(reports)) is not None:
            if len(report.certificates) > MAX_BACKEND_CERTIFICATES:
                raise InvalidArgument(
                    f"certificates: at most {MAX_BACKEND_CERTIFICATES} per report "
                    f"(got {len(report.certificates)})"
                )
            states = [convert.backend_certificate_from_proto(c) for c in report.certificates]
            for index, state in enumerate(states):
                problem = state.problem()
                if problem is not None:
                    raise InvalidArgument(f"certificates[{index}]: {problem}")
            book = self._backend_certificates
            loop = asyncio.get_running_loop()
            if not book.report(excerpt(report.proxy or "unnamed", 120), states, loop.time()):
                raise ResourceExhausted(
                    f"backend certificates: {book.max_reporters} proxies already report; "
                    "the state of one that stops lapses after "
                    f"{book.ttl:.0f} s"
                )
            self._backend_certificates_changed()
        return pb.BackendCertificateReportResponse()

    def _backend_certificates_changed(self) -> None:
        """Drop lapsed reports, give the store the findings, arm the next lapse."""
        book = self._backend_certificates
        loop = asyncio.get_running_loop()
        book.expire(loop.time())
        self._store.set_backend_certificates(book.findings())
        if self._backend_lapse is not None:
            self._backend_lapse.cancel()
            self._backend_lapse = None
        lapse = book.next_lapse()
        if lapse is not None:
            self._backend_lapse = loop.call_at(lapse, self._backend_certificates_changed)

    def _writable_routes(self) -> FileSource:
        if self._routes is None:
            raise FailedPrecondition(
                "routes are read-only on this resolver: it has no routes file "
                "(routes come from Kubernetes, or start it with --routes-file)"
            )
        return self._routes

    async def ApplyRoute(
        self, request: pb.ApplyRouteRequest, context: grpc.aio.ServicerContext
    ) -> pb.ApplyRouteResponse:
        self._access.check_route_admin("ApplyRoute", peer_identities(context))
        routes = self._writable_routes()
        if not request.HasField("route"):
            raise InvalidArgument("route: required")
        stored = await routes.apply_route(convert.route_from_proto(request.route))
        return pb.ApplyRouteResponse(route=self._listed(stored), version=self._store.version)

    async def DeleteRoute(
        self, request: pb.DeleteRouteRequest, context: grpc.aio.ServicerContext
    ) -> pb.DeleteRouteResponse:
        self._access.check_route_admin("DeleteRoute", peer_identities(context))
        routes = self._writable_routes()
        if not request.ref.namespace or not request.ref.name:
            raise InvalidArgument("ref: namespace and name are required")
        await routes.delete_route(request.ref.namespace, request.ref.name)
        return pb.DeleteRouteResponse(version=self._store.version)

    async def ReportTunnels(
        self,
        request_iterator: AsyncIterator[pb.TunnelReport],
        context: grpc.aio.ServicerContext,
    ) -> pb.ReportTunnelsResponse:
        self._access.check_tunnel_reporter(peer_identities(context))
        stream = self._tunnels.open()
        reports = aiter(request_iterator)
        try:
            while (report := await self._next_report(reports)) is not None:
                lease = convert.seconds(report.lease) if report.HasField("lease") else None
                self._tunnels.report(
                    stream,
                    TunnelServer(report.server.id, report.server.address),
                    report.nodes,
                    lease,
                )
        finally:
            self._tunnels.close(stream)
        return pb.ReportTunnelsResponse(version=self._store.version)

    async def _next_report(self, reports: AsyncIterator[Any]) -> Any:
        """The next report, None at the end of the stream; Unavailable when draining."""
        read = asyncio.ensure_future(anext(reports, None))
        ending = asyncio.ensure_future(self._tunnels.ending.wait())
        try:
            await asyncio.wait({read, ending}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            ending.cancel()
            if not read.done():
                read.cancel()
        if not read.done() or read.cancelled():
            raise Unavailable("the resolver is shutting down; report to another replica")
        return read.result()
