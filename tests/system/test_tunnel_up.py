"""`waygate up` serves demo/hello through proxy -> tunnel server -> agent -> demo backend,
and one sampled request is one trace across those processes.

The example route's endpoint is on node `edge-local` and marked `tunnel`, so the
proxy has no way to it but the tunnel. Ports are offset (as in test_up.py); the
routes file `up` would copy from the example is seeded first with the demo
backend's offset port, and the agent allows exactly that port.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest
import yaml

from tests.support.otlp import OtlpReceiver
from tests.support.processes import ROOT, child_env, free_up_offset
from waygate.components import DEMO_PORT
from waygate.resolver.filesource import EXAMPLE_ROUTES

pytestmark = pytest.mark.system


async def test_up_serves_the_edge_route_through_the_tunnel(tmp_path: Path) -> None:
    otlp = OtlpReceiver()
    await otlp.start()
    offset = free_up_offset()
    state = tmp_path / "state"
    state.mkdir()
    routes = yaml.safe_load(EXAMPLE_ROUTES.read_text())
    hello = next(s for s in routes["services"] if s["name"] == "hello")
    assert hello["endpoints"][0]["tunnel"] is True
    assert hello["endpoints"][0]["nodeName"] == "edge-local"
    hello["ports"][0]["targetPort"] = DEMO_PORT + offset
    (state / "routes.yaml").write_text(yaml.safe_dump(routes))
    (state / "routes.yaml").chmod(0o600)
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "waygate", "up", "--port-offset", str(offset),
        "--state-dir", str(state), cwd=ROOT,
        env=child_env({"WAYGATE_OTLP_ENDPOINT": otlp.endpoint}),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
    )  # fmt: skip
    try:
        status, body = 0, b""
        async with asyncio.timeout(90):
            while status != 200:
                await asyncio.sleep(0.5)
                # A new trace per attempt: only the one that succeeds is checked.
                trace_id, parent = os.urandom(16).hex(), os.urandom(8).hex()
                try:
                    reader, writer = await asyncio.open_connection("127.0.0.1", 8080 + offset)
                except OSError:
                    continue
                writer.write(b"GET /through-the-tunnel HTTP/1.1\r\nHost: hello.localtest.me\r\n"
                             b"traceparent: 00-%s-%s-01\r\n"
                             b"Connection: close\r\n\r\n" % (trace_id.encode(), parent.encode()))  # fmt: skip
                data = await reader.read()
                writer.close()
                head, _, body = data.partition(b"\r\n\r\n")
                status = int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else 0
        assert b'"path": "/through-the-tunnel"' in body

        # One trace: proxy (server span, then its dial client span) -> tunnel server ->
        # agent, and the backend got the traceparent continued from the proxy's span.
        def complete(spans: list) -> bool:
            services = {s.service for s in spans if s.trace_id == trace_id}
            return {"waygate-proxy", "waygate-tunnel-server", "waygate-tunnel-agent"} <= services

        spans = [s for s in await otlp.wait_for(complete, 30) if s.trace_id == trace_id]
        by_id = {s.span_id: s for s in spans}
        agent = next(s for s in spans if s.service == "waygate-tunnel-agent")
        served = by_id[agent.parent_span_id]
        assert served.service == "waygate-tunnel-server"
        assert served.name.endswith("Tunnel/Dial")
        dialing = by_id[served.parent_span_id]
        assert dialing.service == "waygate-proxy" and dialing.name.endswith("Tunnel/Dial")
        proxy = by_id[dialing.parent_span_id]
        assert proxy.service == "waygate-proxy" and proxy.parent_span_id == parent
        for span in (served, agent):
            assert span.attributes["waygate.tunnel.node"] == "edge-local"
            assert span.attributes["waygate.tunnel.replica"] == "tunnel-server-0"
            assert "waygate.tunnel.connection_id" in span.attributes
        # The backend got the trace continued from the proxy's span.
        assert f"00-{trace_id}-{proxy.span_id}-01".encode() in body
    finally:
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), 30)
        except TimeoutError:
            process.kill()
            await process.wait()
        await otlp.stop()
