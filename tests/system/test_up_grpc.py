"""gRPC through the proxy under `waygate up`: the resolver's own Resolve and health
service reached on the proxy's 8443 (routes waygate/resolver-resolve and
waygate/resolver-health in the example routes file).

Real processes on a port offset. The grpcio client verifies the proxy's
certificate (from up's certs, its names include resolver.localtest.me) and
calls through it; the proxy speaks HTTP/2 with TLS to the resolver (which
requires a client certificate: the proxy presents its own). The same call is
made with the CLI, as the README shows:

    waygate resolve demo/echo --addr 127.0.0.1:8443 --server-name resolver.localtest.me

Watch is not routed (the proxy's identity receives route keys over Watch):
through the proxy it is UNAVAILABLE with the proxy's reason.
"""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from waygate.components import COMPONENTS
from waygate.resolver.v1 import resolver_pb2, resolver_pb2_grpc

from .test_up import Up

pytestmark = pytest.mark.system

PROXY = next(c for c in COMPONENTS if c.name == "proxy")
NAME = "resolver.localtest.me"


@pytest.fixture
async def up(tmp_path: Path):
    instance = Up(tmp_path)
    yield instance
    if instance.process is not None and instance.process.returncode is None:
        instance.process.kill()
        await instance.process.wait()


async def test_grpc_client_reaches_the_resolver_through_the_proxy(up: Up) -> None:
    await up.start()
    https_port = PROXY.port("https_port") + up.offset
    ca = (up.state_dir / "ca.pem").read_bytes()
    credentials = grpc.ssl_channel_credentials(root_certificates=ca)
    options = [("grpc.ssl_target_name_override", NAME), ("grpc.default_authority", NAME)]
    async with grpc.aio.secure_channel(f"127.0.0.1:{https_port}", credentials, options) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        async with asyncio.timeout(60):
            while True:  # until the proxy has the routes (its first resolver snapshot)
                try:
                    reply = await health.Check(health_pb2.HealthCheckRequest(), timeout=5)
                    break
                except grpc.aio.AioRpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    await asyncio.sleep(0.3)
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        resolver = resolver_pb2_grpc.ResolverStub(channel)
        answer = await resolver.Resolve(
            resolver_pb2.ResolveRequest(namespace="demo", name="echo"), timeout=10
        )
        assert answer.service.name == "echo"
        assert [t.address for t in answer.targets] == ["127.0.0.1"]
        with pytest.raises(grpc.aio.AioRpcError) as watched:
            stream = resolver.Watch(resolver_pb2.WatchRequest(), timeout=10)
            await stream.read()
        assert watched.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "no route for host resolver.localtest.me" in (watched.value.details() or "")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "waygate", "resolve", "demo/echo",
        "--addr", f"127.0.0.1:{https_port}", "--server-name", NAME,
        "--ca-file", str(up.state_dir / "ca.pem"),
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env={**os.environ, "WAYGATE_STATE_DIR": str(up.state_dir)},
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(), 60)
    assert process.returncode == 0, err.decode()
    assert b"127.0.0.1" in out
