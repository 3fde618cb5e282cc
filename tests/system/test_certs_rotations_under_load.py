"""Three CA rotations back to back under load, through the proxy and the tunnel,
with zero failed handshakes (issue 30's test list).

The soak's stack (bench/soak: two certs replicas electing a writer, two resolver
replicas, two tunnel-server replicas, two agents for one edge node, the proxy,
real backends; every process with a certificate from certs, 10 s leaves) and its
load (new TLS connections to the proxy, tunnelled requests on new and kept
connections, HTTP/2, gRPC, WebSockets). Three rotations follow one another, each
taking the acknowledged path (prepare -> activate once every trust consumer
acknowledged the new CA -> retire once the old CA's last leaf expired and every
consumer dropped it -> idle) before the next starts. Not one request fails:
no client handshake with the proxy, no proxy-to-tunnel handshake, no agent's.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from pathlib import Path

import grpc
import pytest

from bench.soak.run import Soak
from bench.soak.stack import Stack
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

pytestmark = pytest.mark.system


async def rotation_status(stack: Stack, address: str) -> certs_pb2.RotationStatus | None:
    credentials = grpc.ssl_channel_credentials(stack.bundle.read_bytes())
    try:
        async with grpc.aio.secure_channel(address, credentials) as channel:
            return await certs_pb2_grpc.CertsStub(channel).GetRotationStatus(
                certs_pb2.GetRotationStatusRequest(),
                metadata=(("authorization", f"Bearer {stack.tokens['admin']}"),),
                timeout=10,
            )
    except grpc.aio.AioRpcError:
        return None


@pytest.mark.timeout(300)
async def test_three_ca_rotations_back_to_back_under_load_fail_no_handshake(
    tmp_path: Path,
) -> None:
    if shutil.which("haproxy") is None:
        pytest.skip("haproxy is not installed (.ci/run installs it: apt-get install haproxy)")
    # No leaf outlives 10 s and the stored bound on each CA's leaves (what a replica that
    # did not sign them goes by) runs 2 s ahead, so each old CA retires seconds after the
    # switch: three rotations fit in a minute.
    stack = Stack(
        tmp_path,
        leaf_lifetime=10.0,
        certs_args=("--max-leaf-lifetime", "10s", "--leaf-bound-step", "2s"),
    )
    soak = Soak(stack, hold=1.0, cycles=0, leaf_phase=False, scale=0.5)
    phases: list[list[str]] = []
    try:
        await stack.start_all()
        await soak._wait_serving()
        soak.load.start()
        await asyncio.sleep(2)
        began = time.monotonic()
        authorities = []
        for _ in range(3):
            rotation, address = await soak._rotate_ca()  # RotateCA, 1 s propagation delay
            authorities.append(rotation.new_authority.fingerprint_sha256)
            seen: list[str] = []
            deadline = time.monotonic() + 90  # a loaded 2-core machine: retire waits for leaves
            while True:
                status = await rotation_status(stack, address)
                if status is not None:
                    name = certs_pb2.RotationPhase.Name(status.phase)
                    if not seen or seen[-1] != name:
                        seen.append(name)
                    if status.phase == certs_pb2.ROTATION_PHASE_IDLE:
                        break
                assert time.monotonic() < deadline, f"rotation stuck: {seen} {status}"
                await asyncio.sleep(0.2)
            phases.append(seen)
        rotations_took = time.monotonic() - began
        await asyncio.sleep(2)
        await soak.load.stop()
    finally:
        await soak.load.stop()
        stack.stop_all()
    assert len(set(authorities)) == 3
    for seen in phases:  # each went through the gated steps (a poll may miss a short one)
        assert seen[-1] == "ROTATION_PHASE_IDLE" and "ROTATION_PHASE_ACTIVATE" in seen, phases
    outcomes = soak.load.outcomes
    failed = [o for o in outcomes if not o.ok]
    assert failed == [], [(o.kind, o.cause, o.detail) for o in failed[:5]]
    during = [o for o in outcomes if began <= o.start <= began + rotations_took]
    kinds = {o.kind for o in during}
    # New TLS connections to the proxy, and new tunnelled connections, all through.
    assert {"tls-newconn", "tunnel-newconn", "tunnel-keepalive"} <= kinds, kinds
    assert len(during) > 100
    print(f"3 rotations in {rotations_took:.1f}s, {len(during)} requests during them: {phases}")
