"""Traces you can open: `waygate up --otlp-endpoint` passes tracing to every child,
the proxy starts a trace for a request that carries none (at
`--trace-sample-ratio 1`), and that one trace runs client -> proxy -> tunnel
server -> agent -> backend, exported over OTLP (to the stand-in receiver), with
the trace id on the log lines of the request.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from tests.support.otlp import OtlpReceiver
from tests.support.poll import until
from tests.support.processes import proxy_get
from waygate.components import COMPONENTS

from .test_up import Up

pytestmark = pytest.mark.system

PROXY = next(c for c in COMPONENTS if c.name == "proxy")


def log_lines(path: Path) -> list[dict]:
    lines = []
    for raw in path.read_text(errors="replace").splitlines():
        try:
            entry = json.loads(raw)
        except json.JSONDecodeError:
            continue
        if isinstance(entry, dict):
            lines.append(entry)
    return lines


async def test_one_trace_from_the_client_to_the_backend_with_its_id_in_the_logs(tmp_path):
    otlp = OtlpReceiver()
    await otlp.start()
    stderr = tmp_path / "up.log"
    up = Up(
        tmp_path,
        "--otlp-endpoint",
        otlp.endpoint,
        "--trace-sample-ratio",
        "1",
        stderr=stderr,
    )
    try:
        await up.start()
        http_port = PROXY.port("http_port") + up.offset
        answer: dict = {}

        async def through_the_tunnel() -> bool:
            # No trace context from the client: the proxy starts the trace.
            status, body = await proxy_get(http_port, "hello.localtest.me", "/traced")
            if status == 200:
                answer.update(json.loads(body))
            return status == 200

        await until(through_the_tunnel, "demo/hello through the tunnel", timeout=60, interval=0.5)
        # The backend got trace context the client never sent: the proxy started it.
        headers = dict(line.split(": ", 1) for line in answer["headers"])
        headers = {name.lower(): value for name, value in headers.items()}
        version, trace_id, parent_id, flags = headers["traceparent"].split("-")
        assert (version, flags) == ("00", "01")

        def complete(spans: list) -> bool:
            services = {s.service for s in spans if s.trace_id == trace_id}
            return {"waygate-proxy", "waygate-tunnel-server", "waygate-tunnel-agent"} <= services

        spans = [s for s in await otlp.wait_for(complete, 30) if s.trace_id == trace_id]
        by_id = {s.span_id: s for s in spans}
        proxy = next(
            s for s in spans if s.service == "waygate-proxy" and s.kind == otlp.SPAN_KIND_SERVER
        )
        assert proxy.parent_span_id == "", "the proxy's span is the trace's root"
        assert proxy.attributes["waygate.route"] == "demo/hello"
        agent = next(s for s in spans if s.service == "waygate-tunnel-agent")
        served = by_id[agent.parent_span_id]
        assert served.service == "waygate-tunnel-server" and served.name.endswith("Tunnel/Dial")
        dialing = by_id[served.parent_span_id]
        assert dialing.service == "waygate-proxy" and dialing.parent_span_id == proxy.span_id
        # The backend's parent is the proxy's span: client -> proxy -> (tunnel) -> backend.
        assert parent_id == proxy.span_id

        # The request's log lines carry the trace: the proxy's access-log line names
        # its span, and every line that names the trace is one of this trace's spans.
        async def logged() -> bool:
            return any(
                e.get("msg") == "request" and e.get("path") == "/traced" for e in log_lines(stderr)
            )

        await until(logged, "the proxy's access-log line", timeout=10, interval=0.2)
        lines = log_lines(stderr)
        (access,) = [e for e in lines if e.get("msg") == "request" and e.get("path") == "/traced"]
        assert access["service"] == "proxy" and access["status"] == 200
        assert access["trace_id"] == trace_id and access["span_id"] == proxy.span_id
        for entry in lines:
            if entry.get("trace_id") == trace_id:
                assert entry["span_id"] in by_id, entry
    finally:
        if up.process is not None and up.process.returncode is None:
            up.process.terminate()
            await asyncio.wait_for(up.process.wait(), 60)
        await otlp.stop()
