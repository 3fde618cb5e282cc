"""What a process's spans are when no OTLP endpoint is configured: ids always (for the
logs and the calls they make), recording only for a trace the caller sampled."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from waygate.core import tracing


@pytest.fixture
def fresh_provider(monkeypatch: pytest.MonkeyPatch) -> None:
    # configure_tracing installs its provider once per process: start from none, and
    # keep the test's provider out of the process-global slot.
    monkeypatch.setattr(tracing, "_provider", None)
    monkeypatch.setattr(trace, "set_tracer_provider", lambda _provider: None)


@pytest.mark.usefixtures("fresh_provider")
def test_without_an_endpoint_roots_carry_ids_but_record_nothing() -> None:
    tracer = tracing.configure_tracing("test", None).get_tracer("t")
    span = tracer.start_span("root")
    context = span.get_span_context()
    assert not span.is_recording()
    assert context.is_valid and not context.trace_flags.sampled
    with trace.use_span(span):
        child = tracer.start_span("child")
    assert child.get_span_context().trace_id == context.trace_id
    assert not child.is_recording()


@pytest.mark.usefixtures("fresh_provider")
def test_without_an_endpoint_a_sampled_callers_trace_is_recorded_and_stays_sampled() -> None:
    tracer = tracing.configure_tracing("test", None).get_tracer("t")
    trace_id = "0af7651916cd43dd8448eb211c80319c"
    parent = TraceContextTextMapPropagator().extract(
        {"traceparent": f"00-{trace_id}-b7ad6b7169203331-01"}
    )
    span = tracer.start_span("server", context=parent)
    assert span.is_recording()
    assert format(span.get_span_context().trace_id, "032x") == trace_id
    assert span.get_span_context().trace_flags.sampled


@pytest.mark.usefixtures("fresh_provider")
def test_with_an_endpoint_every_span_is_recorded() -> None:
    provider = tracing.configure_tracing("test", "127.0.0.1:1")
    try:
        assert provider.get_tracer("t").start_span("root").is_recording()
    finally:
        provider.shutdown()
