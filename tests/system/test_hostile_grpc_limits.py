"""Issue 8, fair limits: one client cannot starve the others of a real process.

Each test reproduces an attack against a real `waygate ... serve` process on
port 0 and asserts that a well-behaved client stays served:
- 1,000 WatchTrustBundle streams with no token (the attack that made Certify
  fail with "Concurrent RPC limit exceeded!"): Certify still issues;
- 1,000 resolver Watch streams: health and Resolve still answer;
- idle HTTP/2 connections are closed after `--max-connection-idle` (the
  server's file descriptors are counted in /proc/PID/fd before and after).
The attackers come from 127.0.0.1, like the well-behaved client: one peer.
The flood tests raise the per-peer caps to 1,000 (`--max-streams-per-peer`,
`--max-streams-per-unauthenticated-peer`) so the attacker really holds all
1,000 streams: the per-peer cap cannot be what saves the victim; the unary
(and health) budgets are.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import pytest
from cryptography.hazmat.primitives import serialization
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.support.pki import make_csr
from tests.support.poll import until
from tests.support.processes import RunningService, certs_serve_argv, start_service
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc
from waygate.resolver.filesource import EXAMPLE_ROUTES
from waygate.resolver.v1 import resolver_pb2, resolver_pb2_grpc

pytestmark = pytest.mark.system

TOKEN = "hostile-test-" + "t" * 40
IDENTITY = "spiffe://waygate.local/ns/local/sa/user"
ATTACK_STREAMS = 1000
ATTACK_CONNECTIONS = 10  # 100 streams each: the per-connection HTTP/2 limit
#: "Answering within a second" on an idle machine; generous on this shared one.
ANSWER_BOUND = 5.0


def attacker_channels(address: str, count: int) -> list[grpc.aio.Channel]:
    # A local subchannel pool each: separate TCP connections, not one shared.
    return [
        grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(count)
    ]


async def flood(
    channels: list[grpc.aio.Channel], open_stream: Callable[[grpc.aio.Channel], Any]
) -> tuple[list[Any], list[grpc.aio.AioRpcError]]:
    """Open ATTACK_STREAMS streams over `channels`; (held calls, refusals) once each answered."""
    calls = [open_stream(channels[i % len(channels)]) for i in range(ATTACK_STREAMS)]

    async def first_message(call: Any) -> grpc.aio.AioRpcError | None:
        try:
            await asyncio.wait_for(call.read(), 60)
        except grpc.aio.AioRpcError as exc:
            return exc
        return None

    outcomes = await asyncio.gather(*(first_message(c) for c in calls))
    held = [c for c, o in zip(calls, outcomes, strict=True) if o is None]
    refused = [o for o in outcomes if o is not None]
    return held, refused


async def close_all(calls: list[Any], channels: list[grpc.aio.Channel]) -> None:
    for call in calls:
        call.cancel()
    await asyncio.gather(*(c.close() for c in channels))


#: Per-peer caps out of the way: the attacker gets every one of its streams.
NO_PEER_CAP = (
    "--max-streams-per-peer", str(ATTACK_STREAMS),
    "--max-streams-per-unauthenticated-peer", str(ATTACK_STREAMS),
)  # fmt: skip


def assert_every_stream_held(held: list[Any], refused: list[grpc.aio.AioRpcError]) -> None:
    assert not refused, [f"{r.code().name}: {r.details()}" for r in refused[:3]]
    assert len(held) == ATTACK_STREAMS


# ---------------------------------------------------------------- certs


async def start_certs(tmp_path: Path, *extra: str) -> RunningService:
    user = {"token": TOKEN, "name": "user", "allowed": [f"uri:{IDENTITY}"]}
    return await start_service(certs_serve_argv(tmp_path, [user], *extra))


async def test_a_thousand_trust_bundle_watches_cannot_stop_certify(tmp_path: Path) -> None:
    certs = await start_certs(tmp_path, *NO_PEER_CAP)
    channels = attacker_channels(certs.grpc_address, ATTACK_CONNECTIONS)
    held: list[Any] = []
    try:
        held, refused = await flood(
            channels,
            lambda ch: certs_pb2_grpc.CertsStub(ch).WatchTrustBundle(
                certs_pb2.WatchTrustBundleRequest()
            ),
        )
        assert_every_stream_held(held, refused)

        # While the attacker holds every stream it could get, a valid Certify is issued.
        csr, _ = make_csr([f"uri:{IDENTITY}"])
        async with grpc.aio.insecure_channel(certs.grpc_address) as channel:
            reply = await certs_pb2_grpc.CertsStub(channel).Certify(
                certs_pb2.CertifyRequest(
                    identity=IDENTITY,
                    token=TOKEN,
                    certificate_signing_request=csr.public_bytes(serialization.Encoding.DER),
                ),
                timeout=ANSWER_BOUND,
            )
            assert reply.leaf_certificate and reply.serial
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=ANSWER_BOUND
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
        assert all(not c.done() for c in held)  # the attack was still on
    finally:
        await close_all(held, channels)
        assert await certs.stop() == 0


# ---------------------------------------------------------------- resolver


async def start_resolver(tmp_path: Path, *extra: str) -> RunningService:
    routes = tmp_path / "routes.yaml"
    shutil.copyfile(EXAMPLE_ROUTES, routes)
    argv = [
        "waygate", "resolver", "serve", "--grpc-port", "0", "--admin-port", "0",
        "--routes-file", str(routes), *extra,
    ]  # fmt: skip
    return await start_service(argv)


async def test_a_thousand_resolver_watches_cannot_stop_health_or_resolve(tmp_path: Path) -> None:
    resolver = await start_resolver(tmp_path, *NO_PEER_CAP)
    channels = attacker_channels(resolver.grpc_address, ATTACK_CONNECTIONS)
    held: list[Any] = []
    try:
        held, refused = await flood(
            channels,
            lambda ch: resolver_pb2_grpc.ResolverStub(ch).Watch(resolver_pb2.WatchRequest()),
        )
        assert_every_stream_held(held, refused)

        async with grpc.aio.insecure_channel(resolver.grpc_address) as channel:
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=ANSWER_BOUND
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
            resolved = await resolver_pb2_grpc.ResolverStub(channel).Resolve(
                resolver_pb2.ResolveRequest(namespace="demo", name="hello", port="http"),
                timeout=ANSWER_BOUND,
            )
            assert resolved.targets and resolved.service.name == "hello"
        assert all(not c.done() for c in held)
    finally:
        await close_all(held, channels)
        assert await resolver.stop() == 0


def open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


async def test_idle_connections_are_closed_after_the_idle_limit(tmp_path: Path) -> None:
    # 10 s: the 100 connections are surely all open (and counted) before any is idle.
    resolver = await start_resolver(tmp_path, "--max-connection-idle", "10s")
    pid = resolver.process.pid
    channels = attacker_channels(resolver.grpc_address, 100)
    try:
        before = open_fds(pid)
        # One call each, then nothing: 100 idle HTTP/2 connections.
        await asyncio.gather(
            *(
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
                for ch in channels
            )
        )
        assert open_fds(pid) >= before + 90  # the connections are really held (idle < 10 s yet)
        await until(
            lambda: open_fds(pid) <= before + 5,
            "the server to close the idle connections (its fd count back to the start)",
            timeout=40,
        )
        # Dropped with GOAWAY, not broken: a channel just reconnects for its next call.
        reply = await health_pb2_grpc.HealthStub(channels[0]).Check(
            health_pb2.HealthCheckRequest(), timeout=ANSWER_BOUND
        )
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await asyncio.gather(*(c.close() for c in channels))
        assert await resolver.stop() == 0
