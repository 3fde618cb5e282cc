"""CA rotation waits for the trust consumers, across real processes.

certs (`waygate certs serve`, directory store) behind a TCP forwarder (the
stand-in for a Service in front of it, so a restarted certs keeps its address),
and two real trust consumers (`waygate tunnel serve`, which follow the bundle and
acknowledge it with ReportTrust through the certs client library). A consumer
frozen with SIGSTOP holds the rotation at prepare and is named by certs (status
RPC, `waygate cert status -o json`); after SIGCONT the rotation completes. kill -9
of certs in each phase: the next certs process resumes that phase.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import yaml
from google.protobuf import duration_pb2

from tests.support.poll import until
from tests.support.processes import RunningService, run_cli, start_service
from tests.support.tcpforward import TcpForwarder
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

pytestmark = pytest.mark.system

DOMAIN = "waygate.test"
SERVER_ID = f"spiffe://{DOMAIN}/ns/t/sa/tunnel-server"
ADMIN_TOKEN = "admin-" + "a" * 40
PREPARE = certs_pb2.ROTATION_PHASE_PREPARE
ACTIVATE = certs_pb2.ROTATION_PHASE_ACTIVATE
RETIRE = certs_pb2.ROTATION_PHASE_RETIRE
IDLE = certs_pb2.ROTATION_PHASE_IDLE


class Cluster:
    """certs (restartable behind a forwarder) and the consumers following it."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp_path = tmp_path
        self.bundle = tmp_path / "bundle.pem"
        self.forwarder = TcpForwarder(0)
        self.certs: RunningService | None = None
        self.consumers: dict[str, RunningService] = {}
        secret = os.urandom(24).hex()
        (tmp_path / "tunnel-server.token").write_text(secret + "\n")
        (tmp_path / "tunnel-server.token").chmod(0o600)
        tokens = [
            {
                "token": secret,
                "name": "tunnel-server",
                "allowed": [f"uri:{SERVER_ID}", "ip:127.0.0.1"],
            },
            {"token": ADMIN_TOKEN, "name": "ops", "admin": True},
        ]
        (tmp_path / "tokens.yaml").write_text(yaml.safe_dump({"tokens": tokens}))
        (tmp_path / "tokens.yaml").chmod(0o600)
        (tmp_path / "admin.token").write_text(ADMIN_TOKEN + "\n")
        (tmp_path / "admin.token").chmod(0o600)

    @property
    def address(self) -> str:
        return self.forwarder.address

    async def start_certs(self) -> RunningService:
        self.certs = await start_service(
            [
                "waygate", "certs", "serve", "--grpc-port", "0", "--admin-port", "0",
                "--ca-dir", str(self.tmp_path / "ca"),
                "--tokens-file", str(self.tmp_path / "tokens.yaml"),
                "--bundle-file", str(self.bundle), "--trust-domain", DOMAIN,
                "--serving-identity", f"spiffe://{DOMAIN}/ns/t/sa/certs",
                "--serving-sans", "ip:127.0.0.1",
                # Short leaves, so the old CA retires within the test.
                "--leaf-lifetime", "10s", "--clock-skew", "1", "--consumer-settle", "3s",
            ]
        )  # fmt: skip
        await self.forwarder.switch(self.certs.grpc_ports[0])
        return self.certs

    async def kill_certs(self) -> None:
        assert self.certs is not None
        self.certs.process.kill()
        await self.certs.process.wait()

    async def start_consumer(self, name: str) -> RunningService:
        consumer = await start_service(
            [
                "waygate", "tunnel", "serve", "--grpc-port", "0", "--dial-port", "0",
                "--data-port", "0", "--front-port", "0", "--admin-port", "0", "--server-id", name,
                "--certs-address", self.address,
                "--certs-token-file", str(self.tmp_path / "tunnel-server.token"),
                "--certs-ca-file", str(self.bundle), "--cert-identity", SERVER_ID,
                "--cert-sans", "ip:127.0.0.1",
            ]
        )  # fmt: skip
        self.consumers[name] = consumer
        return consumer

    def instance(self, name: str) -> str:
        return f"{os.uname().nodename}/{self.consumers[name].process.pid}"

    async def call(self, method: str, request: object) -> object:
        credentials = grpc.ssl_channel_credentials(self.bundle.read_bytes())
        async with grpc.aio.secure_channel(self.address, credentials) as channel:
            return await getattr(certs_pb2_grpc.CertsStub(channel), method)(
                request, timeout=10, metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),)
            )

    async def status(self) -> certs_pb2.RotationStatus:
        try:
            return await self.call("GetRotationStatus", certs_pb2.GetRotationStatusRequest())  # type: ignore[return-value]
        except grpc.aio.AioRpcError:
            return certs_pb2.RotationStatus()  # certs restarting: no answer yet

    async def rotate(self, delay: int) -> certs_pb2.RotateCAResponse:
        request = certs_pb2.RotateCARequest(propagation_delay=duration_pb2.Duration(seconds=delay))
        return await self.call("RotateCA", request)  # type: ignore[return-value]

    async def until_phase(
        self, phase: int, what: str, timeout: float = 40
    ) -> certs_pb2.RotationStatus:
        async def reached() -> bool:
            return (await self.status()).phase == phase

        await until(reached, what, timeout=timeout, interval=0.2)
        return await self.status()

    async def until_reported(self, count: int, fingerprint: str | None = None) -> None:
        async def reported() -> bool:
            status = await self.status()
            holding = [
                c
                for c in status.consumers
                if fingerprint is None or fingerprint in c.fingerprints_sha256
            ]
            return len(holding) >= count

        await until(reported, f"{count} consumers' reports", timeout=30, interval=0.2)

    async def close(self) -> None:
        for consumer in [*self.consumers.values(), *([self.certs] if self.certs else [])]:
            if consumer.process.returncode is None:
                consumer.process.send_signal(signal.SIGCONT)
                await consumer.stop()
        await self.forwarder.close()


@pytest.fixture
async def cluster(tmp_path: Path) -> AsyncIterator[Cluster]:
    setup = Cluster(tmp_path)
    await setup.forwarder.start()
    try:
        yield setup
    finally:
        await setup.close()


async def test_a_frozen_consumer_holds_prepare_and_is_named_until_it_resumes(
    cluster: Cluster, tmp_path: Path
) -> None:
    await cluster.start_certs()
    await cluster.start_consumer("a")
    frozen = await cluster.start_consumer("b")
    await cluster.until_reported(2)
    frozen.process.send_signal(signal.SIGSTOP)
    rotation = await cluster.rotate(2)
    new = rotation.new_authority.fingerprint_sha256
    await cluster.until_reported(1, new)  # the live consumer applied the new bundle
    await asyncio.sleep(4)  # past the propagation delay and the settling time

    status = await cluster.status()
    assert status.phase == PREPARE and status.next_step == "activate"
    assert [(c.identity, c.instance) for c in status.waiting_for] == [
        (SERVER_ID, cluster.instance("b"))
    ]
    # The CLI names it too (admin token from a file, TLS against the bundle).
    code, out, err = await run_cli(
        "cert", "status", "-o", "json", "--addr", cluster.address,
        "--token-file", str(tmp_path / "admin.token"), "--ca-file", str(cluster.bundle),
    )  # fmt: skip
    assert code == 0, err
    document = json.loads(out)
    assert document["rotation"]["phase"] == "prepare"
    assert document["rotation"]["waitingFor"] == [f"{SERVER_ID} ({cluster.instance('b')})"]
    assert {(c["identity"], c["instance"]) for c in document["consumers"]} == {
        (SERVER_ID, cluster.instance("a")),
        (SERVER_ID, cluster.instance("b")),
    }

    frozen.process.send_signal(signal.SIGCONT)
    await cluster.until_phase(ACTIVATE, "activation once the frozen consumer resumed", 30)
    await cluster.until_phase(IDLE, "the old CA retired and dropped by both", 60)


async def test_kill_9_of_certs_in_prepare_and_in_activate_resumes_that_phase(
    cluster: Cluster,
) -> None:
    await cluster.start_certs()
    await cluster.start_consumer("a")
    second = await cluster.start_consumer("b")
    await cluster.until_reported(2)

    # prepare, held by a frozen consumer: kill -9, and the next certs is in prepare.
    second.process.send_signal(signal.SIGSTOP)
    new = (await cluster.rotate(2)).new_authority.fingerprint_sha256
    await cluster.until_reported(1, new)
    await asyncio.sleep(3)
    assert (await cluster.status()).phase == PREPARE
    await cluster.kill_certs()
    await cluster.start_certs()
    status = await cluster.status()
    assert status.phase == PREPARE and status.HasField("settle_until")
    # The frozen consumer never reports to this process: after settling, it moves on.
    await cluster.until_phase(ACTIVATE, "the resumed activation")

    # activate: kill -9 again; the next certs keeps the old CA published (a restart
    # knows its leaves only by the stored bound, so it retires later, never earlier).
    await cluster.kill_certs()
    await cluster.start_certs()
    status = await cluster.status()
    assert status.phase == ACTIVATE and status.next_step == "retire"
    second.process.send_signal(signal.SIGCONT)
    await cluster.until_reported(2, new)


async def test_kill_9_of_certs_in_retire_resumes_that_phase(cluster: Cluster) -> None:
    await cluster.start_certs()
    first = await cluster.start_consumer("a")
    await cluster.start_consumer("b")
    await cluster.until_reported(2)
    new = (await cluster.rotate(2)).new_authority.fingerprint_sha256
    await cluster.until_reported(2, new)
    await cluster.until_phase(ACTIVATE, "activation")
    # The first consumer holds the bundle with both CAs; frozen, it keeps holding it.
    first.process.send_signal(signal.SIGSTOP)
    await cluster.until_phase(RETIRE, "the old CA retired once its last leaf expired")
    await asyncio.sleep(1)
    status = await cluster.status()
    assert status.phase == RETIRE and status.next_step == "finish"
    assert [c.instance for c in status.waiting_for] == [cluster.instance("a")]
    await cluster.kill_certs()
    await cluster.start_certs()
    assert (await cluster.status()).phase == RETIRE
    # The frozen consumer never reports to this process: after settling, it ends.
    await cluster.until_phase(IDLE, "the rotation's end")
    first.process.send_signal(signal.SIGCONT)
