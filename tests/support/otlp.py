"""A test OTLP/gRPC trace receiver: a STAND-IN for Jaeger's collector port.

There is no Jaeger on these machines. This is a real gRPC server implementing
`opentelemetry.proto.collector.trace.v1.TraceService` on 127.0.0.1 port 0, so
the real OTLP exporter of a Waygate process sends to it exactly as it would to
Jaeger (or to an OpenTelemetry collector) on :4317.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    kind: int
    trace_id: str
    span_id: str
    parent_span_id: str
    attributes: dict[str, object]


def _attr_value(value: object) -> object:
    kind = value.WhichOneof("value")  # type: ignore[attr-defined]
    return getattr(value, kind) if kind else None


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, spans: list[ReceivedSpan], arrived: asyncio.Event) -> None:
        self._spans, self._arrived = spans, arrived

    async def Export(self, request, context):
        for resource_spans in request.resource_spans:
            attrs = {a.key: _attr_value(a.value) for a in resource_spans.resource.attributes}
            service = str(attrs.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    self._spans.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            kind=span.kind,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            attributes={a.key: _attr_value(a.value) for a in span.attributes},
                        )
                    )
        self._arrived.set()
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    SPAN_KIND_SERVER = trace_pb2.Span.SPAN_KIND_SERVER
    SPAN_KIND_CLIENT = trace_pb2.Span.SPAN_KIND_CLIENT

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._arrived = asyncio.Event()
        self._server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(
            _TraceService(self.spans, self._arrived), self._server
        )
        self.endpoint = ""

    async def start(self) -> str:
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        return self.endpoint

    async def stop(self) -> None:
        await self._server.stop(None)

    async def wait_for(self, predicate, timeout: float = 20.0) -> list[ReceivedSpan]:
        """Wait until predicate(spans) is true; returns the spans, or raises TimeoutError."""
        async with asyncio.timeout(timeout):
            while not predicate(self.spans):
                self._arrived.clear()
                await self._arrived.wait()
        return self.spans
