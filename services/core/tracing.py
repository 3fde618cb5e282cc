"""Tracing: the OpenTelemetry SDK, W3C trace context, and gRPC client spans.

`configure_tracing` installs one TracerProvider per process with
`service.name = waygate-<service>`; spans are exported over OTLP/gRPC only when
an endpoint is configured, but are always created so log lines carry trace ids.
Server spans are opened by the gRPC boundary interceptor in
`waygate.core.grpcserver`; client spans by the interceptors here, which every
channel from `waygate.core.grpcclient` carries. Trace context travels in gRPC
metadata as `traceparent` / `tracestate`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterable, MutableMapping
from typing import Any
from urllib.parse import urlsplit

import grpc
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.propagators.composite import CompositePropagator
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

log = logging.getLogger(__name__)

_provider: TracerProvider | None = None
TRACER_NAME = "waygate"


def configure_tracing(service: str, otlp_endpoint: str | None) -> TracerProvider:
    """Install the process's tracer provider (once) and the W3C propagators."""
    global _provider
    propagate.set_global_textmap(
        CompositePropagator([TraceContextTextMapPropagator(), W3CBaggagePropagator()])
    )
    if _provider is not None:
        return _provider
    provider = TracerProvider(resource=Resource.create({"service.name": f"waygate-{service}"}))
    if otlp_endpoint:
        # Imported lazily: the exporter pulls in its own grpc channel machinery.
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        # Only an explicit https:// endpoint is TLS; "host:4317" and http:// are plaintext.
        insecure = urlsplit(otlp_endpoint).scheme != "https"
        provider.add_span_processor(
            BatchSpanProcessor(OTLPSpanExporter(endpoint=otlp_endpoint, insecure=insecure))
        )
        log.info("exporting traces over OTLP", extra={"otlp_endpoint": otlp_endpoint})
    trace.set_tracer_provider(provider)
    _provider = provider
    return provider


def shutdown_tracing() -> None:
    """Flush and stop the exporter; spans still buffered are sent first."""
    if _provider is not None:
        _provider.shutdown()


def tracer() -> trace.Tracer:
    return trace.get_tracer(TRACER_NAME)


def split_method(full_method: str) -> tuple[str, str]:
    """'/pkg.Service/Method' -> ('pkg.Service', 'Method')."""
    service, _, method = full_method.lstrip("/").rpartition("/")
    return service, method


def rpc_attributes(full_method: str) -> dict[str, str]:
    service, method = split_method(full_method)
    return {"rpc.system": "grpc", "rpc.service": service, "rpc.method": method}


def extract_context(metadata: Iterable[tuple[str, Any]] | None) -> otel_context.Context:
    carrier = {k: v for k, v in (metadata or ()) if isinstance(v, str)}
    return propagate.extract(carrier)


def inject_context(
    carrier: MutableMapping[str, str], ctx: otel_context.Context | None = None
) -> None:
    propagate.inject(carrier, context=ctx)


# ---------------------------------------------------------------- client spans


class _ClientTracing:
    """Opens a CLIENT span per call, injects it into the metadata, ends it when the call ends."""

    def __init__(self) -> None:
        self._pending: set[asyncio.Task[None]] = set()

    def _start(
        self, details: grpc.aio.ClientCallDetails
    ) -> tuple[trace.Span, grpc.aio.ClientCallDetails]:
        method = details.method.decode() if isinstance(details.method, bytes) else details.method
        span = tracer().start_span(
            method.lstrip("/"), kind=SpanKind.CLIENT, attributes=rpc_attributes(method)
        )
        carrier: dict[str, str] = {}
        inject_context(carrier, trace.set_span_in_context(span))
        metadata = grpc.aio.Metadata(*(details.metadata or ()))
        for key, value in carrier.items():
            metadata.add(key, value)
        new_details = grpc.aio.ClientCallDetails(
            method=details.method,
            timeout=details.timeout,
            metadata=metadata,
            credentials=details.credentials,
            wait_for_ready=details.wait_for_ready,
        )
        return span, new_details

    def _finish_when_done(self, span: trace.Span, call: Any) -> Any:
        def on_done(done_call: Any) -> None:
            task = asyncio.get_event_loop().create_task(self._finish(span, done_call))
            self._pending.add(task)
            task.add_done_callback(self._pending.discard)

        call.add_done_callback(on_done)
        return call

    @staticmethod
    async def _finish(span: trace.Span, call: Any) -> None:
        try:
            code = await call.code()
            span.set_attribute("rpc.grpc.status_code", code.value[0])
            if code != grpc.StatusCode.OK:
                span.set_status(Status(StatusCode.ERROR, await call.details() or code.name))
        except Exception as exc:
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        finally:
            span.end()


class TracingUnaryUnary(_ClientTracing, grpc.aio.UnaryUnaryClientInterceptor):
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        span, details = self._start(client_call_details)
        return self._finish_when_done(span, await continuation(details, request))


class TracingUnaryStream(_ClientTracing, grpc.aio.UnaryStreamClientInterceptor):
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: Any, request: Any
    ) -> Any:
        span, details = self._start(client_call_details)
        return self._finish_when_done(span, await continuation(details, request))


class TracingStreamUnary(_ClientTracing, grpc.aio.StreamUnaryClientInterceptor):
    async def intercept_stream_unary(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        span, details = self._start(client_call_details)
        return self._finish_when_done(span, await continuation(details, request_iterator))


class TracingStreamStream(_ClientTracing, grpc.aio.StreamStreamClientInterceptor):
    async def intercept_stream_stream(
        self, continuation: Any, client_call_details: Any, request_iterator: Any
    ) -> Any:
        span, details = self._start(client_call_details)
        return self._finish_when_done(span, await continuation(details, request_iterator))


def client_interceptors() -> list[grpc.aio.ClientInterceptor]:
    return [TracingUnaryUnary(), TracingUnaryStream(), TracingStreamUnary(), TracingStreamStream()]
