"""certs as real replicas: leader election, failover, rotation across leaders, slow writes.

Each replica is a real `waygate certs serve` process with its CA in a Secret
of the STAND-IN Kubernetes API server (no real one can run here), reached
through its own kubeconfig and bearer token, so the stand-in can cut one
replica off (`partition(token)`) as a network partition would. Lease timings
are short (lease 2 s, renew deadline 1 s, retry 0.25 s) so failover fits in a
test; the rules are client-go's.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from google.protobuf import duration_pb2

from tests.support.kubeapi import KubeAPI as StandInAPI
from tests.support.poll import until
from tests.support.processes import RunningService, http_get, start_service
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

pytestmark = pytest.mark.system

TOKEN = "replica-user-" + "t" * 32
ADMIN = "replica-admin-" + "a" * 32
IDENTITY = "spiffe://waygate.local/ns/local/sa/user"
SECRET = ("waygate", "waygate-certs-ca")
WRITTEN_BY = "waygate.io/written-by"


@pytest.fixture
def standin() -> Iterator[StandInAPI]:
    with StandInAPI() as api:
        yield api


def tokens_file(tmp_path: Path) -> Path:
    path = tmp_path / "tokens.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {"token": TOKEN, "name": "user", "allowed": [f"uri:{IDENTITY}"]},
                    {"token": ADMIN, "name": "ops", "admin": True},
                ]
            }
        )
    )
    path.chmod(0o600)
    return path


class Replicas:
    """N certs processes against one stand-in; replica i uses token `replica-i`."""

    def __init__(self, standin: StandInAPI, tmp_path: Path, count: int, *extra: str) -> None:
        self.standin, self.tmp_path, self.count, self.extra = standin, tmp_path, count, extra
        self.by_name: dict[str, RunningService] = {}
        self.writers: list[str] = []  # WRITTEN_BY of every Secret version seen, in order
        self._stop = threading.Event()
        self._recorder = threading.Thread(target=self._record, daemon=True)

    def argv(self, name: str) -> list[str]:
        kubeconfig = self.standin.kubeconfig(self.tmp_path / f"kubeconfig-{name}", name)
        return [
            "waygate", "certs", "serve", "--grpc-port", "0", "--admin-port", "0",
            "--kubeconfig", str(kubeconfig), "--ca-secret", "/".join(SECRET),
            "--tokens-file", str(tokens_file(self.tmp_path)),
            "--leader-identity", name, "--lease-duration", "2s", "--renew-deadline", "1s",
            "--retry-period", "0.25s",
            # A leader resuming a rotation waits this long for consumers to report to it.
            "--consumer-settle", "1s", *self.extra,
        ]  # fmt: skip

    def _record(self) -> None:
        seen = ""
        while not self._stop.is_set():
            with contextlib.suppress(Exception):
                secret = self.standin.get("v1", "Secret", SECRET[1], SECRET[0])
                version = secret["metadata"]["resourceVersion"]
                if version != seen:
                    seen = version
                    self.writers.append(secret["metadata"]["annotations"][WRITTEN_BY])
            time.sleep(0.005)

    async def __aenter__(self) -> Replicas:
        names = [f"replica-{i}" for i in range(self.count)]
        started = await asyncio.gather(*(start_service(self.argv(n)) for n in names))
        self.by_name = dict(zip(names, started, strict=True))
        self._recorder.start()
        await until(lambda: self.leader() in self.by_name, "a leader", timeout=20)
        async with asyncio.timeout(30):
            for service in self.by_name.values():
                while (await http_get(service.admin_port, "/readyz"))[0] != 200:
                    await asyncio.sleep(0.1)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        self._recorder.join(2)
        for service in self.by_name.values():
            if service.process.returncode is None:
                await service.stop()

    def leader(self) -> str:
        with contextlib.suppress(Exception):
            lease = self.standin.get(
                "coordination.k8s.io/v1", "Lease", "waygate-certs-leader", SECRET[0]
            )
            return str(lease["spec"].get("holderIdentity") or "")
        return ""

    def alive(self) -> dict[str, RunningService]:
        return {n: s for n, s in self.by_name.items() if s.process.returncode is None}


def csr_der() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(
            x509.SubjectAlternativeName([x509.UniformResourceIdentifier(IDENTITY)]),
            critical=False,
        )
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.DER)


async def certify(service: RunningService, timeout: float = 10.0) -> x509.Certificate:
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        reply = await certs_pb2_grpc.CertsStub(channel).Certify(
            certs_pb2.CertifyRequest(
                identity=IDENTITY, token=TOKEN, certificate_signing_request=csr_der()
            ),
            timeout=timeout,
        )
    return x509.load_der_x509_certificate(reply.leaf_certificate)


async def bundle(service: RunningService) -> certs_pb2.TrustBundle:
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        return await certs_pb2_grpc.CertsStub(channel).GetTrustBundle(
            certs_pb2.GetTrustBundleRequest(), timeout=10
        )


async def rotate(service: RunningService, delay_seconds: int) -> certs_pb2.RotateCAResponse:
    async with grpc.aio.insecure_channel(service.grpc_address) as channel:
        return await certs_pb2_grpc.CertsStub(channel).RotateCA(
            certs_pb2.RotateCARequest(
                propagation_delay=duration_pb2.Duration(seconds=delay_seconds)
            ),
            metadata=(("authorization", f"Bearer {ADMIN}"),),
            timeout=30,
        )


async def rotate_when_leading(
    service: RunningService, delay_seconds: int
) -> certs_pb2.RotateCAResponse:
    async with asyncio.timeout(10):
        while True:
            try:
                return await rotate(service, delay_seconds)
            except grpc.aio.AioRpcError as exc:
                if exc.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
            await asyncio.sleep(0.1)


def fingerprints(reply: certs_pb2.TrustBundle) -> set[str]:
    return {a.fingerprint_sha256 for a in reply.authorities}


class CertifyLoad:
    """Certify on the given replicas every 50 ms; every failure is kept."""

    def __init__(self, services: list[RunningService]) -> None:
        self.services = services
        self.failures: list[str] = []
        self.done = 0
        self.slowest = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _run(self) -> None:
        while True:
            for service in self.services:
                started = time.monotonic()
                try:
                    await certify(service)
                    self.done += 1
                except grpc.aio.AioRpcError as exc:
                    self.failures.append(f"{exc.code().name}: {exc.details()}")
                self.slowest = max(self.slowest, time.monotonic() - started)
            await asyncio.sleep(0.05)

    def __enter__(self) -> CertifyLoad:
        self._task = asyncio.ensure_future(self._run())
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()


def compressed(writers: list[str]) -> list[str]:
    """Consecutive repeats folded: [a, a, b, b, a] -> [a, b, a]."""
    return [w for i, w in enumerate(writers) if i == 0 or writers[i - 1] != w]


async def test_three_replicas_serve_one_leader_writes_and_a_rotation_survives_kill_9(
    standin: StandInAPI, tmp_path: Path
) -> None:
    async with Replicas(standin, tmp_path, 3) as replicas:
        leader = replicas.leader()
        followers = [s for n, s in replicas.by_name.items() if n != leader]
        # Every replica signs with the one CA in the Secret.
        issuers = {(await certify(s)).issuer for s in replicas.by_name.values()}
        assert len(issuers) == 1

        # RotateCA on a follower: UNAVAILABLE naming the leader, nothing written.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await rotate(followers[0], 5)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert leader in (refused.value.details() or "")

        # The leader stages a CA; every replica's bundle has it within seconds.
        rotation = await rotate(replicas.by_name[leader], 6)
        new = rotation.new_authority.fingerprint_sha256
        for service in replicas.by_name.values():
            await until_bundle_has(service, new)

        # kill -9 the leader before the switch: a follower takes over, carries the
        # rotation on (the new CA signs after the switch), and Certify never fails.
        with CertifyLoad(followers) as load:
            replicas.by_name[leader].process.kill()
            await replicas.by_name[leader].process.wait()
            await until(lambda: replicas.leader() not in ("", leader), "a new leader", timeout=20)
            successor = replicas.by_name[replicas.leader()]
            await until(
                lambda: bool(state_of(standin, new) == "ACTIVE"), "the switch stored", timeout=30
            )
            issued = await certify(successor)
            await asyncio.sleep(0.5)
        assert load.failures == [] and load.done > 0
        assert fingerprint_of_issuer(issued, await bundle(successor)) == new
        for service in replicas.alive().values():
            await until_signing_with(service, new)
        # The Secret had one writer at a time: the old leader, then its successor.
        assert compressed(replicas.writers) == [leader, replicas.leader()]


async def test_a_partitioned_leader_stops_writing_and_another_takes_over(
    standin: StandInAPI, tmp_path: Path
) -> None:
    async with Replicas(standin, tmp_path, 2) as replicas:
        leader = replicas.leader()
        (other,) = [n for n in replicas.by_name if n != leader]
        with CertifyLoad([replicas.by_name[other]]) as load:
            standin.partition(leader)
            await until(lambda: replicas.leader() == other, "the other to lead", timeout=20)
            # The partitioned one refuses writes (rotation) naming no writable leadership.
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await rotate(replicas.by_name[leader], 5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            # The Lease names it a moment before it has heard its own take answered.
            rotation = await rotate_when_leading(replicas.by_name[other], 3600)
            await asyncio.sleep(0.5)
        assert load.failures == []
        # The partitioned replica still serves Certify from the CA it knows.
        await certify(replicas.by_name[leader])
        standin.heal(leader)
        new = rotation.new_authority.fingerprint_sha256
        await until_bundle_has(replicas.by_name[leader], new)
        assert compressed(replicas.writers)[-1] == other
        assert leader not in compressed(replicas.writers)[1:]


async def test_writes_answered_5s_late_do_not_delay_certify(
    standin: StandInAPI, tmp_path: Path
) -> None:
    async with Replicas(
        standin, tmp_path, 2, "--bundle-configmap", "waygate/waygate-ca-bundle"
    ) as replicas:
        # Every write now takes 5 s, longer than the 1 s renew deadline: leadership
        # is lost and contested meanwhile, and Certify must not notice any of it.
        standin.write_delay = 5.0
        await until(
            lambda: standin.requests and standin.requests[-1].method != "GET",
            "a write in flight",
            timeout=10,
        )
        with CertifyLoad(list(replicas.by_name.values())) as load:
            await asyncio.sleep(6.0)
        assert load.failures == [] and load.done >= 10
        # Generous (the machine is shared); a Certify that waited on a write takes 5 s.
        assert load.slowest < 3.0, load.slowest


async def until_bundle_has(service: RunningService, fingerprint: str) -> None:
    async with asyncio.timeout(15):
        while fingerprint not in fingerprints(await bundle(service)):
            await asyncio.sleep(0.1)


async def until_signing_with(service: RunningService, fingerprint: str) -> None:
    async with asyncio.timeout(15):
        while True:
            leaf = await certify(service)
            if fingerprint_of_issuer(leaf, await bundle(service)) == fingerprint:
                return
            await asyncio.sleep(0.2)


def fingerprint_of_issuer(leaf: x509.Certificate, reply: certs_pb2.TrustBundle) -> str:
    for authority in reply.authorities:
        cert = x509.load_der_x509_certificate(authority.certificate)
        if cert.subject == leaf.issuer:
            return authority.fingerprint_sha256
    return ""


def state_of(standin: StandInAPI, fingerprint: str) -> str:
    import base64
    import json

    secret = standin.get("v1", "Secret", SECRET[1], SECRET[0])
    state = json.loads(base64.b64decode(secret["data"]["state.json"]))
    for entry in state["authorities"]:
        if entry.get("fingerprint_sha256") == fingerprint:
            return str(entry["state"])
    return ""
