"""The gRPC server bootstrap every service uses.

A `GrpcServer` is a `grpc.aio` server with:
- `grpc.health.v1.Health`, NOT_SERVING for every service until the process
  declares itself ready, and again from the moment it starts draining;
- server reflection, so generic clients (grpcurl, Postman) can call it;
- one boundary around every handler (wrapped once, at registration) that opens the SERVER span (W3C context from the
  metadata), counts the call in Prometheus, and maps domain errors
  (`waygate.core.errors`) to status codes with their message. Any other
  exception is logged with its traceback and becomes INTERNAL with a short
  message and the trace id, never a bare UNKNOWN;
- fair limits, so that no client can starve another (see `CallLimits`):
  * every streaming method is a long-lived call (watches and reports never end
    by themselves). They are capped per peer - the verified client-certificate
    identity, else the peer IP, with a lower cap for peers without a
    certificate - in total, and, for peers without a certificate, in total
    below that (so peers with one keep room); a call over a cap gets
    RESOURCE_EXHAUSTED naming the cap and its setting, before the handler runs;
  * the unauthenticated total is shared fairly among addresses: when it is
    full, a new stream from an address holding less than its fair share (the
    total divided by the addresses holding streams, itself included) ends the
    oldest stream of the address holding the most, if that one holds more than
    its share (RESOURCE_EXHAUSTED naming the fair share). So 20 addresses
    filling the total cannot lock out a 21st (issue 18: certs' WatchTrustBundle);
  * unary calls have their own budget, which streams never use, so 1,000 open
    watches cannot make a Certify or a Resolve fail; grpc.health.v1 Check has
    a small budget of its own, so slow unary calls cannot make health fail;
  * per connection: HTTP/2 MAX_CONCURRENT_STREAMS, an idle timeout and a
    maximum age with a grace period (GOAWAY; clients reconnect), a handshake
    timeout; grpc core's own `maximum_concurrent_rpcs` stays as an outer bound
    far above the two budgets. Plus message size and keepalive enforcement.
  A registration may name streaming methods it bounds itself (`uncapped_streams`,
  e.g. a data stream per proxied connection); those skip the stream caps.
  It may also name streaming methods whose steps run without the stream's span
  current (`untraced_steps`: the span still opens and ends with the stream);
  for a stream that makes no child spans and is fanned out to many watchers
  (the resolver's Watch), attaching and detaching the span at every step was
  about 13% of the fan-out's busy time.
- a streaming handler may yield `bytes`, a message it serialized itself (once,
  for many streams); they go out as they are.

Servicers therefore raise domain errors and never call `context.abort` for them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode
from prometheus_client import Counter, Histogram

from waygate.core import tracing
from waygate.core.errors import WaygateError, excerpt
from waygate.core.settings import GrpcServerSettings

log = logging.getLogger(__name__)

HANDLED = Counter(
    "waygate_grpc_server_handled_total",
    "gRPC calls completed by the server, by method and status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
)
HANDLING_SECONDS = Histogram(
    "waygate_grpc_server_handling_seconds",
    "Time from the start of a gRPC call to its end (whole stream for streaming calls).",
    ["grpc_service", "grpc_method"],
    buckets=(
        0.0005,
        0.001,
        0.0025,
        0.005,
        0.01,
        0.025,
        0.05,
        0.1,
        0.25,
        0.5,
        1,
        2.5,
        5,
        10,
        30,
        60,
    ),
)


REFUSED = Counter(
    "waygate_grpc_server_refused_total",
    "gRPC calls refused with RESOURCE_EXHAUSTED by a fair-share limit, by limit.",
    ["limit"],
)
#: At most one warning per limit this often; the rest are only counted.
REFUSAL_LOG_INTERVAL = 10.0


@dataclass(frozen=True)
class ServiceRegistration:
    """One servicer and the generated function that adds it to a server."""

    name: str  # full service name, e.g. "waygate.resolver.v1.Resolver"
    add_to_server: Callable[[Any, grpc.aio.Server], None]
    servicer: Any
    # Streaming methods (short names, e.g. "Dial") this service bounds itself:
    # they skip the per-peer and total stream caps (never the per-connection limit).
    uncapped_streams: frozenset[str] = field(default_factory=frozenset)
    # Streaming methods (short names) whose steps run without the span current:
    # they make no child spans, and attaching it per step is not free.
    untraced_steps: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True, kw_only=True)
class CallLimits:
    """The fair-share budgets of one server; the names are the settings that set them."""

    max_concurrent_unary: int = 1000
    # grpc.health.v1 Check has a budget of its own: health must answer even while
    # slow unary calls (a Certify waiting for a TokenReview) hold every unary place.
    max_concurrent_health: int = 100
    max_streams: int = 4000
    # Streams without a client certificate, all addresses together: below
    # max_streams, so authenticated peers always keep room (attackers from many
    # IPs, or many clients behind one SNAT, cannot fill the whole pool).
    max_unauthenticated_streams: int = 1000
    max_streams_per_peer: int = 512
    max_streams_per_unauthenticated_peer: int = 64


def peer_of(context: grpc.aio.ServicerContext) -> tuple[str, bool]:
    """Who is calling, as (key, authenticated): the verified certificate identity
    (its spiffe:// URI when it has one), else the peer's IP address without the port."""
    identities = context.peer_identities()
    if identities:
        names = [i.decode(errors="replace") for i in identities]
        return next((n for n in names if n.startswith("spiffe://")), names[0]), True
    peer = unquote(context.peer() or "")
    if peer.startswith("ipv4:"):
        return peer[5:].rsplit(":", 1)[0], False
    if peer.startswith("ipv6:"):
        return peer[5:].rsplit(":", 1)[0].strip("[]"), False
    return peer, False  # unix sockets: one peer


Evict = Callable[[str], None]


class _Admission:
    """Counts the calls in flight of one server against its `CallLimits`.

    Runs on the event loop only, so plain counters need no lock. Every admit
    that returns None is paired with exactly one release. An unauthenticated
    stream admitted with a `ticket` and an `evict` callback may be evicted for
    a newcomer (fair share): its place is released at once, on eviction, and
    its own later release (same ticket) is then a no-op.
    """

    def __init__(self, limits: CallLimits) -> None:
        self.limits = limits
        self.unary = 0
        self.health = 0
        self.streams = 0
        self.unauthenticated_streams = 0
        self.streams_by_peer: dict[str, int] = {}
        # Unauthenticated streams that can be evicted, by address, oldest first
        # (dicts keep insertion order): ticket -> evict callback.
        self._evictable: dict[str, dict[object, Evict]] = {}
        self._logged_at: dict[str, float] = {}
        self._unlogged: dict[str, int] = {}

    def admit_unary(self) -> str | None:
        if self.unary >= self.limits.max_concurrent_unary:
            return self._refuse(
                "max_concurrent_unary",
                f"too many unary calls in flight on this server: the cap is "
                f"{self.limits.max_concurrent_unary} (setting max_concurrent_unary, "
                "--max-concurrent-unary); retry with backoff",
            )
        self.unary += 1
        return None

    def release_unary(self) -> None:
        self.unary -= 1

    def admit_health(self) -> str | None:
        if self.health >= self.limits.max_concurrent_health:
            return self._refuse(
                "max_concurrent_health",
                f"too many health checks in flight on this server: the cap is "
                f"{self.limits.max_concurrent_health} (setting max_concurrent_health, "
                "--max-concurrent-health)",
            )
        self.health += 1
        return None

    def release_health(self) -> None:
        self.health -= 1

    def admit_stream(
        self,
        peer: str,
        authenticated: bool,
        ticket: object = None,
        evict: Evict | None = None,
    ) -> str | None:
        limits = self.limits
        held = self.streams_by_peer.get(peer, 0)
        if authenticated and held >= limits.max_streams_per_peer:
            return self._refuse(
                "max_streams_per_peer",
                f"too many long-lived streams from {excerpt(peer)}: the cap is "
                f"{limits.max_streams_per_peer} per client identity (setting "
                "max_streams_per_peer, --max-streams-per-peer); close streams you no longer need",
            )
        if not authenticated and held >= limits.max_streams_per_unauthenticated_peer:
            return self._refuse(
                "max_streams_per_unauthenticated_peer",
                f"too many long-lived streams from {peer} without a client certificate: the cap "
                f"is {limits.max_streams_per_unauthenticated_peer} per address (setting "
                "max_streams_per_unauthenticated_peer, --max-streams-per-unauthenticated-peer)",
            )
        if (
            not authenticated
            and self.unauthenticated_streams >= limits.max_unauthenticated_streams
            and not self._evict_for(peer, held)
        ):
            return self._refuse(
                "max_unauthenticated_streams",
                f"too many long-lived streams without a client certificate on this server: the "
                f"cap is {limits.max_unauthenticated_streams} for all such clients together "
                "(setting max_unauthenticated_streams, --max-unauthenticated-streams); "
                "retry with backoff",
            )
        if self.streams >= limits.max_streams:
            return self._refuse(
                "max_streams",
                f"too many long-lived streams on this server: the cap is {limits.max_streams} "
                "for all clients together (setting max_streams, --max-streams); retry with backoff",
            )
        self.streams += 1
        if not authenticated:
            self.unauthenticated_streams += 1
        self.streams_by_peer[peer] = held + 1
        if not authenticated and ticket is not None and evict is not None:
            self._evictable.setdefault(peer, {})[ticket] = evict
        return None

    def fair_share(self, peer: str) -> int:
        """The unauthenticated streams one address may keep when the total is full:
        the total divided by the addresses holding streams, `peer` included."""
        peers = len(self._evictable) + (peer not in self._evictable)
        return max(1, self.limits.max_unauthenticated_streams // peers)

    def _evict_for(self, peer: str, held: int) -> bool:
        """Make room for one more stream of `peer` (below its fair share) by ending
        the oldest stream of the address holding the most, when that one holds
        more than the share. True when a place was freed."""
        share = self.fair_share(peer)
        if held >= share or not self._evictable:
            return False
        victim = max(self._evictable, key=lambda p: len(self._evictable[p]))
        holders = self._evictable[victim]
        if victim == peer or len(holders) <= share:
            return False
        ticket, evict = next(iter(holders.items()))
        self.release_stream(victim, False, ticket)
        REFUSED.labels("unauthenticated_fair_share").inc()
        evict(
            f"this stream was ended to make room for another address: without a client "
            f"certificate, {excerpt(victim)} held {len(holders) + 1} of the "
            f"{self.limits.max_unauthenticated_streams} long-lived streams this server allows "
            f"all such clients together (setting max_unauthenticated_streams), over its fair "
            f"share of {share}; reconnect with backoff, or poll the unary call instead"
        )
        return True

    def release_stream(self, peer: str, authenticated: bool, ticket: object = None) -> None:
        if ticket is not None and not authenticated:
            holders = self._evictable.get(peer)
            if holders is None or holders.pop(ticket, None) is None:
                return  # evicted: its place was released then
            if not holders:
                del self._evictable[peer]
        self.streams -= 1
        if not authenticated:
            self.unauthenticated_streams -= 1
        held = self.streams_by_peer[peer] - 1
        if held:
            self.streams_by_peer[peer] = held
        else:
            del self.streams_by_peer[peer]

    def _refuse(self, limit: str, message: str) -> str:
        REFUSED.labels(limit).inc()
        now = time.monotonic()
        if now - self._logged_at.get(limit, -REFUSAL_LOG_INTERVAL) >= REFUSAL_LOG_INTERVAL:
            log.warning(
                "refusing calls over a limit",
                extra={
                    "limit": limit,
                    "detail": message,
                    "refused_since_last_warning": self._unlogged.pop(limit, 0) + 1,
                },
            )
            self._logged_at[limit] = now
        else:
            self._unlogged[limit] = self._unlogged.get(limit, 0) + 1
        return message


def _status_of(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    if isinstance(exc, WaygateError):
        return getattr(grpc.StatusCode, exc.status), str(exc) or type(exc).__name__
    return None


class _MethodBoundary:
    """What the boundary needs for one method, computed once: names, attributes, metric children."""

    def __init__(
        self,
        full_method: str,
        admission: _Admission,
        capped: bool = True,
        traced_steps: bool = True,
    ) -> None:
        self.full_method = full_method
        self.admission = admission
        self.capped = capped
        self.traced_steps = traced_steps
        self.span_name = full_method.lstrip("/")
        self.service, self.method = tracing.split_method(full_method)
        self.attributes = tracing.rpc_attributes(full_method)
        self.tracer = tracing.tracer()
        self.seconds = HANDLING_SECONDS.labels(self.service, self.method)
        self._handled: dict[grpc.StatusCode, Any] = {}

    def start_span(self, context: grpc.aio.ServicerContext) -> trace.Span:
        return self.tracer.start_span(
            self.span_name,
            context=tracing.extract_context(context.invocation_metadata()),
            kind=SpanKind.SERVER,
            attributes=self.attributes,
        )

    def finish(
        self, span: trace.Span, started: float, code: grpc.StatusCode, message: str = ""
    ) -> None:
        span.set_attribute("rpc.grpc.status_code", code.value[0])
        if code != grpc.StatusCode.OK:
            span.set_status(Status(StatusCode.ERROR, message or code.name))
        span.end()
        handled = self._handled.get(code)
        if handled is None:
            handled = self._handled[code] = HANDLED.labels(self.service, self.method, code.name)
        handled.inc()
        self.seconds.observe(time.perf_counter() - started)

    async def fail(
        self,
        context: grpc.aio.ServicerContext,
        span: trace.Span,
        started: float,
        exc: BaseException,
    ) -> None:
        mapped = _status_of(exc)
        if mapped is None:
            trace_id = format(span.get_span_context().trace_id, "032x")
            log.exception("unhandled error in %s", self.full_method, extra={"trace_id": trace_id})
            mapped = (
                grpc.StatusCode.INTERNAL,
                f"internal error in {self.method}; see the server log (trace {trace_id})",
            )
        self.finish(span, started, *mapped)
        await context.abort(*mapped)

    async def refuse(self, context: grpc.aio.ServicerContext, message: str) -> None:
        """End a call a limit refused, before its handler ran (no span: it did nothing)."""
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
        handled = self._handled.get(code)
        if handled is None:
            handled = self._handled[code] = HANDLED.labels(self.service, self.method, code.name)
        handled.inc()
        await context.abort(code, message)

    async def admit_stream(
        self, context: grpc.aio.ServicerContext, eviction: _Eviction | None = None
    ) -> tuple[str, bool, object]:
        """Take a long-lived call's place (or end it with the refusal); returns its peer
        key, whether it is authenticated and its ticket (what `release_stream` needs).
        With an `eviction`, the place may be taken back for a fairer share."""
        peer, authenticated = peer_of(context)
        refusal = self.admission.admit_stream(
            peer, authenticated, eviction, None if eviction is None else eviction.evict
        )
        if refusal is not None:
            await self.refuse(context, refusal)
        return peer, authenticated, eviction

    def wrap(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        """The same kind of handler, with span, metrics and error mapping around it."""
        boundary = self

        if handler.unary_unary or handler.stream_unary:
            # The handler's declared types are grpc's sync ones; under grpc.aio they are coroutines.
            behavior: Any = handler.unary_unary or handler.stream_unary
            admission = self.admission
            # A client stream is long-lived (it ends when the client says so).
            client_stream = handler.stream_unary is not None
            capped = self.capped
            if self.service == "grpc.health.v1.Health":
                admit, release = admission.admit_health, admission.release_health
            else:
                admit, release = admission.admit_unary, admission.release_unary

            async def unary_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
                if client_stream:
                    if not capped:
                        return await boundary.run_unary(behavior, request, context)
                    peer = await boundary.admit_stream(context)
                    try:
                        return await boundary.run_unary(behavior, request, context)
                    finally:
                        admission.release_stream(*peer)
                refusal = admit()  # no await on the path every call takes
                if refusal is not None:
                    await boundary.refuse(context, refusal)
                try:
                    return await boundary.run_unary(behavior, request, context)
                finally:
                    release()

            unary_factory = (
                grpc.unary_unary_rpc_method_handler
                if handler.unary_unary
                else grpc.stream_unary_rpc_method_handler
            )
            return unary_factory(
                unary_response,
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )

        return self._wrap_stream(handler)

    async def run_unary(
        self, behavior: Any, request: Any, context: grpc.aio.ServicerContext
    ) -> Any:
        """One call of a single-response handler inside the span, metrics and error mapping."""
        span, started = self.start_span(context), time.perf_counter()
        try:
            with trace.use_span(
                span,
                end_on_exit=False,
                record_exception=False,
                set_status_on_exception=False,
            ):
                response = await behavior(request, context)
        except grpc.aio.AbortError:
            self.finish(span, started, _code_of(context), context.details() or "")
            raise
        except asyncio.CancelledError:
            self.finish(span, started, grpc.StatusCode.CANCELLED, CANCELLED_MESSAGE)
            raise
        except Exception as exc:
            await self.fail(context, span, started, exc)
            raise AssertionError("unreachable: context.abort raises") from exc
        self.finish(span, started, _code_of(context))
        return response

    def _wrap_stream(self, handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
        boundary = self
        # An async generator or a coroutine.
        behavior: Any = handler.unary_stream or handler.stream_stream
        is_generator = inspect.isasyncgenfunction(behavior)
        capped = self.capped
        traced_steps = self.traced_steps

        # One generator (not one wrapping another): closing it runs the handler's
        # cleanup and releases the stream's place at once, never at GC.
        async def stream_response(request: Any, context: grpc.aio.ServicerContext) -> Any:
            eviction = _Eviction()
            peer = await boundary.admit_stream(context, eviction) if capped else ("", False, None)
            # From here on the place is released whatever happens, even if the span or
            # the handler's generator cannot be made.
            try:
                span, started = boundary.start_span(context), time.perf_counter()
                responses = behavior(request, context) if is_generator else None
                try:
                    if responses is None:
                        with trace.use_span(
                            span,
                            end_on_exit=False,
                            record_exception=False,
                            set_status_on_exception=False,
                        ):
                            await behavior(request, context)
                    # The span is current only while the handler runs a step (never,
                    # for `untraced_steps`), never across our own yield: a context
                    # attached in one step and detached in another (after a
                    # cancellation) is an error.
                    step: Callable[[], contextlib.AbstractContextManager[Any]] = (
                        functools.partial(
                            trace.use_span,
                            span,
                            end_on_exit=False,
                            record_exception=False,
                            set_status_on_exception=False,
                        )
                        if traced_steps
                        else contextlib.nullcontext
                    )
                    while responses is not None:
                        with step():
                            try:
                                response = await responses.__anext__()
                            except StopAsyncIteration:
                                break
                        yield response
                except grpc.aio.AbortError:
                    boundary.finish(span, started, _code_of(context), context.details() or "")
                    raise
                except asyncio.CancelledError:
                    if eviction.message is None or not eviction.take_back():
                        boundary.finish(span, started, grpc.StatusCode.CANCELLED, CANCELLED_MESSAGE)
                        raise
                    # Evicted for a fairer share: said to the client as such.
                    code = grpc.StatusCode.RESOURCE_EXHAUSTED
                    boundary.finish(span, started, code, eviction.message)
                    await context.abort(code, eviction.message)
                except GeneratorExit:
                    boundary.finish(span, started, grpc.StatusCode.CANCELLED, CANCELLED_MESSAGE)
                    raise
                except Exception as exc:
                    await boundary.fail(context, span, started, exc)
                    raise AssertionError("unreachable: context.abort raises") from exc
                finally:
                    if responses is not None:
                        await responses.aclose()  # the handler's own cleanup runs now, not at GC
                boundary.finish(span, started, _code_of(context))
            finally:
                if capped:
                    boundary.admission.release_stream(*peer)

        stream_factory = (
            grpc.unary_stream_rpc_method_handler
            if handler.unary_stream
            else grpc.stream_stream_rpc_method_handler
        )
        return stream_factory(
            stream_response,
            request_deserializer=handler.request_deserializer,
            response_serializer=_passing_bytes(handler.response_serializer),
        )


CANCELLED_MESSAGE = "cancelled by the client or shutdown"


def _passing_bytes(serialize: Callable[[Any], bytes] | None) -> Callable[[Any], bytes] | None:
    """A streaming handler may yield a message already serialized (`bytes`): what
    many streams send alike (a resolver snapshot to a thousand watchers) is then
    serialized once, not once per stream."""
    if serialize is None:
        return None

    def serializer(message: Any) -> bytes:
        return message if type(message) is bytes else serialize(message)

    return serializer


class _Eviction:
    """How a long-lived call is ended to make room for a fairer share: its task is
    cancelled, and the boundary turns that cancellation (its own, not the
    client's) into RESOURCE_EXHAUSTED with `message`."""

    __slots__ = ("_task", "message")

    def __init__(self) -> None:
        self._task = asyncio.current_task()
        self.message: str | None = None

    def evict(self, message: str) -> None:
        if self.message is None and self._task is not None:
            self.message = message
            self._task.cancel()

    def take_back(self) -> bool:
        """Undo our own cancel of the task (True), so the call can end with a status."""
        task = self._task
        if task is None or task.cancelling() != 1:
            return False  # someone else cancelled it too: let the cancellation win
        task.uncancel()
        return True


def _code_of(context: grpc.aio.ServicerContext) -> grpc.StatusCode:
    code = context.code()
    return code if isinstance(code, grpc.StatusCode) else grpc.StatusCode.OK


class _BoundaryGenericHandler(grpc.GenericRpcHandler):
    """A generic handler whose methods come wrapped in the boundary (built once per method)."""

    def __init__(
        self,
        inner: grpc.GenericRpcHandler,
        admission: _Admission,
        uncapped: frozenset[str],
        untraced: frozenset[str] = frozenset(),
    ) -> None:
        self._inner = inner
        self._admission = admission
        self._uncapped = uncapped
        self._untraced = untraced
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    def service(
        self, handler_call_details: grpc.HandlerCallDetails
    ) -> grpc.RpcMethodHandler | None:
        handler = self._inner.service(handler_call_details)
        if handler is None:
            return None
        method: str = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            name = method.rsplit("/", 1)[-1]
            boundary = _MethodBoundary(
                method, self._admission, name not in self._uncapped, name not in self._untraced
            )
            cached = self._wrapped[method] = (handler, boundary.wrap(handler))
        return cached[1]


class _BoundaryRegistrar:
    """Stands in for the server while servicers register, wrapping every handler once.

    Wrapping at registration rather than with a grpc.aio ServerInterceptor keeps
    grpc's fast path: an interceptor makes grpc.aio run its interceptor pipeline
    (extra awaits and tasks) on every call, measured at a third of a small call.
    """

    def __init__(
        self,
        server: grpc.aio.Server,
        admission: _Admission,
        uncapped: frozenset[str] = frozenset(),
        untraced: frozenset[str] = frozenset(),
    ) -> None:
        self._server = server
        self._admission = admission
        self._uncapped = uncapped
        self._untraced = untraced

    def add_generic_rpc_handlers(self, handlers: Sequence[grpc.GenericRpcHandler]) -> None:
        self._server.add_generic_rpc_handlers(
            tuple(
                _BoundaryGenericHandler(h, self._admission, self._uncapped, self._untraced)
                for h in handlers
            )
        )

    def add_registered_method_handlers(
        self, service: str, handlers: dict[str, grpc.RpcMethodHandler]
    ) -> None:
        self._server.add_registered_method_handlers(
            service,
            {
                name: _MethodBoundary(
                    f"/{service}/{name}",
                    self._admission,
                    name not in self._uncapped,
                    name not in self._untraced,
                ).wrap(h)
                for name, h in handlers.items()
            },
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(self._server, name)


class GrpcServer:
    """A grpc.aio server with health, reflection, limits and the boundary interceptor."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        registrations: Sequence[ServiceRegistration],
        credentials: grpc.ServerCredentials | None = None,
        max_concurrent_rpcs: int = 10_000,
        max_message_bytes: int = 4 * 1024 * 1024,
        keepalive_time: float = 30.0,
        limits: CallLimits | None = None,
        max_concurrent_streams: int = 100,
        max_connection_idle: float = 120.0,
        max_connection_age: float = 1800.0,
        max_connection_age_grace: float = 30.0,
        handshake_timeout: float = 10.0,
        reuse_port: bool = False,
    ) -> None:
        self._address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._credentials = credentials
        self.service_names = tuple(r.name for r in registrations)
        self.health = health.aio.HealthServicer()
        self.admission = _Admission(limits or CallLimits())
        options: list[tuple[str, Any]] = [
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            ("grpc.keepalive_time_ms", int(keepalive_time * 1000)),
            ("grpc.keepalive_timeout_ms", 10_000),
            # Clients may ping idle connections every 10s, not more often.
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.max_concurrent_streams", max_concurrent_streams),
            ("grpc.max_connection_age_grace_ms", int(max_connection_age_grace * 1000)),
            ("grpc.server_handshake_timeout_ms", int(handshake_timeout * 1000)),
            # Only for a --workers group sharing one port; otherwise a second
            # process on the port is an error, not a silent split.
            ("grpc.so_reuseport", 1 if reuse_port else 0),
        ]
        # 0 means never: grpc core's own default when the option is absent.
        if max_connection_idle > 0:
            options.append(("grpc.max_connection_idle_ms", int(max_connection_idle * 1000)))
        if max_connection_age > 0:
            options.append(("grpc.max_connection_age_ms", int(max_connection_age * 1000)))
        self._server = grpc.aio.server(
            # Only an outer bound: the fair budgets are enforced in the boundary,
            # where a refusal can say which cap was hit and how to raise it.
            maximum_concurrent_rpcs=max_concurrent_rpcs,
            options=options,
        )
        registrar: Any
        for registration in registrations:
            # Wrapped at registration, each with the streams its service bounds itself.
            registrar = _BoundaryRegistrar(
                self._server,
                self.admission,
                registration.uncapped_streams,
                registration.untraced_steps,
            )
            registration.add_to_server(registration.servicer, registrar)
        registrar = _BoundaryRegistrar(self._server, self.admission)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, registrar)
        # What enable_server_reflection does for an aio server (it cannot tell the
        # registrar is one).
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(
            reflection.aio.ReflectionServicer(
                (*self.service_names, health.SERVICE_NAME, reflection.SERVICE_NAME)
            ),
            registrar,
        )
        self.port = 0

    @classmethod
    def from_settings(
        cls,
        settings: GrpcServerSettings,
        registrations: Sequence[ServiceRegistration],
        credentials: grpc.ServerCredentials | None = None,
        port: int | None = None,
        reuse_port: bool = False,
    ) -> GrpcServer:
        return cls(
            host=settings.host,
            port=settings.grpc_port if port is None else port,
            registrations=registrations,
            credentials=credentials,
            max_concurrent_rpcs=settings.max_concurrent_rpcs,
            max_message_bytes=settings.max_message_bytes,
            keepalive_time=settings.keepalive_time,
            limits=CallLimits(
                max_concurrent_unary=settings.max_concurrent_unary,
                max_concurrent_health=settings.max_concurrent_health,
                max_streams=settings.max_streams,
                max_unauthenticated_streams=settings.max_unauthenticated_streams,
                max_streams_per_peer=settings.max_streams_per_peer,
                max_streams_per_unauthenticated_peer=settings.max_streams_per_unauthenticated_peer,
            ),
            max_concurrent_streams=settings.max_concurrent_streams,
            max_connection_idle=settings.max_connection_idle,
            max_connection_age=settings.max_connection_age,
            max_connection_age_grace=settings.max_connection_age_grace,
            handshake_timeout=settings.handshake_timeout,
            reuse_port=reuse_port,
        )

    async def start(self) -> int:
        """Bind and start; health says NOT_SERVING until `set_serving`. Returns the port."""
        await self._set_all(health_pb2.HealthCheckResponse.NOT_SERVING)
        try:
            if self._credentials is None:
                self.port = self._server.add_insecure_port(self._address)
            else:
                self.port = self._server.add_secure_port(self._address, self._credentials)
        except RuntimeError as exc:  # grpcio's way of saying the bind failed
            raise OSError(
                f"cannot listen on {self._address} (address in use, not permitted, "
                f"or unusable TLS settings): {exc}"
            ) from None
        await self._server.start()
        return self.port

    async def set_serving(self) -> None:
        await self._set_all(health_pb2.HealthCheckResponse.SERVING)

    async def _set_all(self, status: int) -> None:
        for name in ("", *self.service_names):
            await self.health.set(name, status)

    async def stop(self, grace: float) -> None:
        """NOT_SERVING at once, refuse new calls, let in-flight calls finish within grace."""
        await self.health.enter_graceful_shutdown()
        await self._server.stop(grace)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
