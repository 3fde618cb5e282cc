"""`waygate certs serve --workers 2`: Certify from two processes on one gRPC port.

Real processes throughout: the parent writes CA state and serves the admin
port; its two workers serve the gRPC port together (SO_REUSEPORT), follow the
CA directory and never write it. Checked: every worker signs with the parent's
CA and answers health and reflection, the parent's /metrics covers both
(every family once), and RotateCA on the shared port is forwarded to the
parent, which stores it once, and reaches every worker. Workers report ready only after following a change the parent
stored (the leaf-expiry bound it raises for them), so readiness itself proves
they follow the CA directory.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.support.processes import http_get, start_service
from tests.system.test_certs_replicas import ADMIN, bundle, certify, tokens_file
from waygate.certs.authority import Authority, AuthorityConfig
from waygate.certs.store import DirectoryCAStore

pytestmark = pytest.mark.system


class Address:
    def __init__(self, port: int) -> None:
        self.grpc_address = f"127.0.0.1:{port}"


async def test_two_workers_share_the_port_follow_the_parent_and_report_metrics(
    tmp_path: Path,
) -> None:
    argv = [
        "waygate", "certs", "serve", "--grpc-port", "0", "--admin-port", "0",
        "--ca-dir", str(tmp_path / "ca"), "--tokens-file", str(tokens_file(tmp_path)),
        "--workers", "2",
    ]  # fmt: skip
    parent = await start_service(argv)
    try:
        async with asyncio.timeout(30):
            while not parent.logged("certs workers listening"):
                await asyncio.sleep(0.05)
        entry = next(e for e in parent.logs if e.get("msg") == "certs workers listening")
        port = Address(int(entry["grpc_port"]))
        async with asyncio.timeout(30):
            while (await http_get(parent.admin_port, "/readyz"))[0] != 200:
                await asyncio.sleep(0.1)

        # Many connections: the kernel spreads them over both workers.
        issuers = set()
        for _ in range(12):
            issuers.add((await certify(port)).issuer)  # type: ignore[arg-type]
        assert len(issuers) == 1
        async with grpc.aio.insecure_channel(port.grpc_address) as channel:
            reply = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service="waygate.certs.v1.Certs"), timeout=5
            )
            assert reply.status == health_pb2.HealthCheckResponse.SERVING
            stream = reflection_pb2_grpc.ServerReflectionStub(channel).ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5
            )
            names = [s.name async for r in stream for s in r.list_services_response.service]
            assert "waygate.certs.v1.Certs" in names

        status, metrics = await http_get(parent.admin_port, "/metrics")
        assert status == 200
        workers = {
            line.split('worker="', 1)[1].split('"', 1)[0]
            for line in metrics.splitlines()
            if line.startswith("waygate_certs_issued_total{") and 'worker="' in line
        }
        assert {"0", "1"} <= workers, metrics[:2000]
        # Each family once: no TYPE line twice.
        types = [line for line in metrics.splitlines() if line.startswith("# TYPE ")]
        assert len(types) == len(set(types))

        # RotateCA reaching a worker is forwarded to the parent, the writer: the
        # staged CA is stored once and reaches every worker's bundle.
        from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

        async with grpc.aio.insecure_channel(port.grpc_address) as channel:
            reply = await certs_pb2_grpc.CertsStub(channel).RotateCA(
                certs_pb2.RotateCARequest(),
                metadata=(("authorization", f"Bearer {ADMIN}"),),
                timeout=30,
            )
            with pytest.raises(grpc.aio.AioRpcError) as refused:  # the parent's refusal
                await certs_pb2_grpc.CertsStub(channel).RotateCA(
                    certs_pb2.RotateCARequest(), metadata=(("authorization", "Bearer x"),)
                )
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        new = reply.new_authority.fingerprint_sha256
        state = json.loads((tmp_path / "ca" / "state.json").read_text())
        assert new in {a["fingerprint_sha256"] for a in state["authorities"]}
        async with asyncio.timeout(15):
            # Fresh connections land on either worker: all of them must have it.
            seen = 0
            while seen < 8:
                reply_bundle = await bundle(port)  # type: ignore[arg-type]
                found = new in {a.fingerprint_sha256 for a in reply_bundle.authorities}
                seen = seen + 1 if found else 0
                await asyncio.sleep(0.05)
    finally:
        assert await parent.stop() == 0


def test_a_workers_directory_store_never_writes(tmp_path: Path) -> None:
    from waygate.certs.leader import FollowingStore, ParentWrites
    from waygate.core.errors import Unavailable

    Authority.open(DirectoryCAStore(tmp_path / "ca"), AuthorityConfig())
    store = FollowingStore(DirectoryCAStore(tmp_path / "ca"), ParentWrites(1, 2))
    authority = Authority.open(store, AuthorityConfig())
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ca").iterdir()}
    with pytest.raises(Unavailable, match="parent certs process 1"):
        authority.rotate()
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "ca").iterdir()} == before
