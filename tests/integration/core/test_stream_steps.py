"""A streaming method named in `untraced_steps` runs its steps without the stream's
span current, and the span still opens and ends with the stream (the resolver's
Watch: attaching the span at every step cost its fan-out ~13%). Real grpc.aio
server and client on port 0; spans from an SDK tracer kept in memory."""

from __future__ import annotations

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from waygate.core import tracing
from waygate.core.grpcserver import GrpcServer, ServiceRegistration

SERVICE = "waygate.test.Steps"


async def current_span_ids(_request: bytes, _context: grpc.aio.ServicerContext):  # type: ignore[no-untyped-def]
    """Three steps, each answering the span id current while it runs (0: none)."""
    for _ in range(3):
        yield trace.get_current_span().get_span_context().span_id.to_bytes(8, "big")


def _add(_servicer: object, server: grpc.aio.Server) -> None:
    same = lambda b: b  # noqa: E731
    handler = grpc.unary_stream_rpc_method_handler(
        current_span_ids, request_deserializer=same, response_serializer=same
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE, {"Traced": handler, "Quiet": handler}),)
    )


async def test_untraced_steps_run_without_the_span_which_still_covers_the_stream(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(tracing, "tracer", lambda: provider.get_tracer("test"))
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[
            ServiceRegistration(SERVICE, _add, None, untraced_steps=frozenset({"Quiet"}))
        ],
    )
    port = await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            answers = {}
            for method in ("Traced", "Quiet"):
                call = channel.unary_stream(f"/{SERVICE}/{method}")
                answers[method] = [int.from_bytes(m, "big") async for m in call(b"", timeout=5)]
    finally:
        await server.stop(0)
    spans = {span.name: span for span in exporter.get_finished_spans()}
    traced, quiet = spans[f"{SERVICE}/Traced"], spans[f"{SERVICE}/Quiet"]
    assert answers["Traced"] == [traced.context.span_id] * 3
    assert answers["Quiet"] == [0, 0, 0], "no span current in an untraced step"
    assert quiet.end_time is not None and quiet.kind == trace.SpanKind.SERVER
