"""Certs benchmark: Certify against its two unavoidable costs, per worker, beside cfssl.

All in one run, on loopback, P-256 keys, 8 concurrent callers:
- echo:    a bare grpc.aio unary echo server (separate process) sending a
           request the size of a CertifyRequest;
- issue:   in-process CSR-to-leaf issuance with `cryptography` (parse the
           CSR, verify its signature, build and sign the leaf), one thread;
- Certify: `waygate certs serve` (plaintext loopback, static token) with
           `--workers 1` (one process) and `--workers 2` (two processes on one
           port), pre-made CSRs. Reported as a ratio of the serial combination
           of the two costs, 1 / (1/echo + 1/issue): what one process doing
           both, one after the other, could reach at best; per worker and as
           the scaling from 1 to 2 workers;
- cfssl:   Debian's golang-cfssl `cfssl serve` signing the same kind of CSR
           (P-256, same SANs) over its HTTP API (/api/v1/cfssl/sign), the same
           number of concurrent callers; rate and server CPU per certificate
           beside Certify's (installed with apt-get when missing);
- renewal: the time to renew 10,000 certificates right after a CA rotation
           (the new CA signs, the old one is still trusted: every workload
           renewing at once), each renewal a fresh key and CSR made by the
           caller, at 1 and 2 workers;
- latency: Certify p50/p99 at a steady 200 calls/s (open loop) for 10 s while
           RotateCA (propagation delay 0) switches the signing CA mid-way.

Run: .venv/bin/python -m bench.certs [--seconds 5] [--renewals 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import dataclasses
import datetime as dt
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import grpc
import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID
from grpc_health.v1 import health_pb2, health_pb2_grpc

from bench.machine import describe
from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

ROOT = Path(__file__).resolve().parents[2]
CONCURRENCY = 8
IDENTITY = "spiffe://waygate.local/ns/bench/sa/client"
SANS = [x509.UniformResourceIdentifier(IDENTITY), x509.DNSName("client.bench.svc")]
TOKEN = "bench-" + "t" * 40
ADMIN_TOKEN = "bench-admin-" + "a" * 40
#: Why Certify calls failed during the latency-with-rotation run (reported).
ROTATION_FAILURES = ""
CSR_POOL = 256


def make_csr() -> bytes:
    key = ec.generate_private_key(ec.SECP256R1())
    csr = (
        x509.CertificateSigningRequestBuilder()
        .subject_name(x509.Name([]))
        .add_extension(x509.SubjectAlternativeName(SANS), critical=True)
        .sign(key, hashes.SHA256())
    )
    return csr.public_bytes(serialization.Encoding.DER)


# ---------------------------------------------------------------- processes


class Process:
    """A child process; its stdout and stderr go to files, as a container runtime's would.

    A pipe that the (busy) driver drains would make every log line of the
    measured process wait on the driver: a cost no deployment has.
    """

    def __init__(self, argv: list[str], log_dir: Path) -> None:
        self.argv = argv
        self.log_path = log_dir / f"{len(list(log_dir.glob('*.log')))}.log"
        self.process: asyncio.subprocess.Process | None = None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    async def start_reporting_port(self, ready: str) -> int:
        """Start; the port comes from a "listening" JSON log line or the first stdout line."""
        with self.log_path.open("wb") as log:
            self.process = await asyncio.create_subprocess_exec(
                *self.argv,
                cwd=ROOT,
                stdin=asyncio.subprocess.PIPE,
                stdout=log,
                stderr=asyncio.subprocess.STDOUT,
                env={
                    k: v for k, v in os.environ.items() if not k.startswith(("WAYGATE_", "OTEL_"))
                },
            )
        async with asyncio.timeout(60):
            while True:
                for line in self.log_path.read_text().splitlines():
                    if ready == "port" and line.strip().isdigit():
                        return int(line)
                    with contextlib.suppress(json.JSONDecodeError):
                        entry = json.loads(line)
                        if not isinstance(entry, dict):
                            continue
                        if entry.get("msg") == "certs workers listening":
                            return int(entry["grpc_port"])
                        if entry.get("msg") == "listening" and entry.get("grpc_ports"):
                            return int(entry["grpc_ports"][0])
                if self.process.returncode is not None:
                    raise RuntimeError(
                        f"{self.argv[2:5]} exited: {self.log_path.read_text()[-2000:]}"
                    )
                await asyncio.sleep(0.05)

    async def stop(self) -> None:
        process = self.process
        if process is None:
            return
        if process.stdin is not None:
            process.stdin.close()
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                process.terminate()
        await asyncio.wait_for(process.wait(), 30)


async def start(argv: list[str], ready: str, log_dir: Path) -> tuple[Process, int]:
    process = Process(argv, log_dir)
    try:
        return process, await process.start_reporting_port(ready)
    except BaseException:
        await process.stop()
        raise


async def stop(process: Process) -> None:
    await process.stop()


def certs_argv(directory: Path, *extra: str) -> list[str]:
    tokens = directory / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {
                        "token": TOKEN,
                        "name": "bench",
                        "allowed": [f"uri:{IDENTITY}", "dns:client.bench.svc"],
                    },
                    {"token": ADMIN_TOKEN, "name": "ops", "admin": True},
                ]
            }
        )
    )
    tokens.chmod(0o600)
    return [
        sys.executable, "-m", "waygate", "certs", "serve", "--grpc-port", "0",
        "--admin-port", "0", "--ca-dir", str(directory / "ca"), "--tokens-file", str(tokens),
        *extra,
    ]  # fmt: skip


# ---------------------------------------------------------------- measurements


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU time used so far by these processes (Linux /proc)."""
    total = 0.0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    return total


@dataclasses.dataclass(frozen=True)
class Measured:
    rate: float  # completed calls per second
    server_cpu_us: float | None = None  # CPU time per call in the serving process(es)


async def rate(
    call, seconds: float, concurrency: int = CONCURRENCY, pids: list[int] | None = None
) -> Measured:  # type: ignore[no-untyped-def]
    """Calls per second of `call(i)` from `concurrency` callers over `seconds`, and the
    CPU time per call the processes `pids` spent meanwhile."""
    done = 0
    stop_at = 0.0

    async def caller(n: int) -> None:
        nonlocal done
        i = n
        while time.perf_counter() < stop_at:
            await call(i)
            done += 1
            i += concurrency

    # Warm-up: connections, code paths, caches.
    stop_at = time.perf_counter() + min(1.0, seconds / 5)
    await asyncio.gather(*(caller(n) for n in range(concurrency)))
    done = 0
    cpu_before = cpu_seconds(pids) if pids else 0.0
    started = time.perf_counter()
    stop_at = started + seconds
    await asyncio.gather(*(caller(n) for n in range(concurrency)))
    elapsed = time.perf_counter() - started
    cpu_us = (cpu_seconds(pids) - cpu_before) / done * 1e6 if pids and done else None
    return Measured(done / elapsed, cpu_us)


def issue_rate(csrs: list[bytes], seconds: float) -> Measured:
    """In-process CSR -> leaf with cryptography only, the way any CA must do it."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench CA")])
    now = dt.datetime.now(dt.UTC)
    ca_ski = x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key())
    aki = x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski)
    usage = x509.KeyUsage(True, False, False, False, False, False, False, False, False)
    eku = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])

    def issue(der: bytes) -> x509.Certificate:
        csr = x509.load_der_x509_csr(der)
        if not csr.is_signature_valid:
            raise ValueError("bad CSR")
        sans = csr.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        public_key = csr.public_key()
        return (
            x509.CertificateBuilder()
            .subject_name(x509.Name([]))
            .issuer_name(name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now)
            .not_valid_after(now + dt.timedelta(hours=24))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(usage, critical=True)
            .add_extension(eku, critical=False)
            .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False)
            .add_extension(aki, critical=False)
            .add_extension(sans, critical=True)
            .sign(ca_key, hashes.SHA256())
        )

    for der in csrs[:50]:
        issue(der)
    done, started, cpu_started = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - started < seconds:
        issue(csrs[done % len(csrs)])
        done += 1
    cpu_us = (time.process_time() - cpu_started) / done * 1e6
    return Measured(done / (time.perf_counter() - started), cpu_us)


def certify_request(der: bytes) -> certs_pb2.CertifyRequest:
    return certs_pb2.CertifyRequest(identity=IDENTITY, token=TOKEN, certificate_signing_request=der)


async def certify_rate(
    ports: list[int], csrs: list[bytes], seconds: float, pids: list[int]
) -> Measured:
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
    stubs = [certs_pb2_grpc.CertsStub(c) for c in channels]
    requests = [certify_request(d) for d in csrs]
    try:

        async def call(i: int) -> None:
            await stubs[i % len(stubs)].Certify(requests[i % len(requests)], timeout=30)

        return await rate(call, seconds, pids=pids)
    finally:
        for channel in channels:
            await channel.close()


async def echo_rate(port: int, payload: bytes, seconds: float, pid: int) -> Measured:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        echo = channel.unary_unary("/bench.Echo/Echo")

        async def call(i: int) -> None:
            await echo(payload, timeout=30)

        return await rate(call, seconds, pids=[pid])


async def health_rate(port: int, seconds: float, pid: int) -> Measured:
    """grpc.health.v1 Check on the certs server: the shared GrpcServer's own cost per call."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        request = health_pb2.HealthCheckRequest()

        async def call(i: int) -> None:
            await check(request, timeout=30)

        return await rate(call, seconds, pids=[pid])


async def renew(port: int, count: int, channels: int = 1) -> float:
    """Seconds to renew `count` certificates: new key + CSR + Certify each, 8 callers
    over `channels` connections (with workers, the kernel spreads connections)."""
    opened = [grpc.aio.insecure_channel(f"127.0.0.1:{port}") for _ in range(channels)]
    stubs = [certs_pb2_grpc.CertsStub(c) for c in opened]
    remaining = count
    try:

        async def caller(n: int) -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                reply = await stubs[n % len(stubs)].Certify(certify_request(make_csr()), timeout=30)
                assert reply.leaf_certificate

        started = time.perf_counter()
        await asyncio.gather(*(caller(n) for n in range(CONCURRENCY)))
        return time.perf_counter() - started
    finally:
        for channel in opened:
            await channel.close()


def client_process_main(port: int, seconds: float, concurrency: int) -> None:
    """Entry point of a load-generator process: print its Certify rate."""
    csrs = [make_csr() for _ in range(64)]

    async def run() -> float:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = certs_pb2_grpc.CertsStub(channel)
            requests = [certify_request(d) for d in csrs]

            async def call(i: int) -> None:
                await stub.Certify(requests[i % len(requests)], timeout=30)

            return (await rate(call, seconds, concurrency)).rate

    print(asyncio.run(run()), flush=True)


async def certify_rate_from_processes(port: int, seconds: float, processes: int) -> float:
    argv = [sys.executable, "-m", "bench.certs", "--client", str(port), "--seconds", str(seconds)]
    argv += ["--concurrency", str(CONCURRENCY // processes)]
    children = [
        await asyncio.create_subprocess_exec(*argv, cwd=ROOT, stdout=asyncio.subprocess.PIPE)
        for _ in range(processes)
    ]
    outputs = await asyncio.gather(*(c.communicate() for c in children))
    return sum(float(out.decode().strip().splitlines()[-1]) for out, _ in outputs)


# ---------------------------------------------------------------- report


# ---------------------------------------------------------------- the run


async def start_certs(directory: Path, log_dir: Path, workers: int) -> tuple[Process, int]:
    """A certs group; returns once its admin port says ready (every worker ready)."""
    process = Process(certs_argv(directory, "--workers", str(workers)), log_dir)
    try:
        port = await process.start_reporting_port("listening")
        admin = 0
        async with asyncio.timeout(60):
            while not admin:
                for line in process.log_path.read_text().splitlines():
                    with contextlib.suppress(json.JSONDecodeError, TypeError, KeyError):
                        entry = json.loads(line)
                        if entry.get("msg") == "listening":
                            admin = int(entry["admin_port"])
                await asyncio.sleep(0.05)
            async with aiohttp.ClientSession() as session:
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.get(f"http://127.0.0.1:{admin}/readyz") as reply:
                            if reply.status == 200:
                                return process, port
                    await asyncio.sleep(0.1)
    except BaseException:
        await process.stop()
        raise


def group_pids(process: Process) -> list[int]:
    """The parent and its worker children (Linux /proc)."""
    children = Path(f"/proc/{process.pid}/task/{process.pid}/children")
    with contextlib.suppress(OSError):
        return [process.pid, *(int(p) for p in children.read_text().split())]
    return [process.pid]


def rotated_ca_dir(directory: Path) -> None:
    """A CA directory right after a rotation: the new CA signs, the old one is still
    trusted (as `RotateCA` with propagation delay 0 leaves it)."""
    from waygate.certs.authority import Authority, AuthorityConfig
    from waygate.certs.issuing import leaf_request
    from waygate.certs.store import DirectoryCAStore

    authority = Authority.open(DirectoryCAStore(directory / "ca"), AuthorityConfig())
    # Workloads hold leaves of the old CA, so it stays trusted until they expire.
    csr = x509.load_der_x509_csr(make_csr())
    authority.issue(leaf_request(csr, authority.config, identity=IDENTITY, requested_by="bench"))
    authority.rotate(propagation_delay=dt.timedelta(0))
    assert len(authority.trust_bundle().authorities) == 2


def ensure_cfssl() -> str:
    found = shutil.which("cfssl")
    if found:
        return found
    subprocess.run(["apt-get", "install", "-y", "golang-cfssl"], check=True, capture_output=True)
    found = shutil.which("cfssl")
    assert found, "golang-cfssl installed no cfssl binary"
    return found


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


async def cfssl_rate(directory: Path, log_dir: Path, csrs: list[bytes], seconds: float) -> Measured:
    """cfssl serve signing the same CSRs (P-256 CA) over its HTTP API."""
    ca_key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench cfssl CA")])
    now = dt.datetime.now(dt.UTC)
    ca = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(minutes=5))
        .not_valid_after(now + dt.timedelta(days=365))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(True, False, False, False, False, True, True, False, False),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    key_file = directory / "ca-key.pem"
    key_file.write_bytes(
        ca_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.TraditionalOpenSSL,
            serialization.NoEncryption(),
        )
    )
    key_file.chmod(0o600)
    (directory / "config.json").write_text(
        json.dumps(
            {
                "signing": {
                    "default": {
                        "expiry": "24h",
                        "usages": ["digital signature", "server auth", "client auth"],
                    }
                }
            }
        )
    )
    port = free_port()
    process = Process(
        [
            ensure_cfssl(), "serve", "-address", "127.0.0.1", "-port", str(port),
            "-ca", str(directory / "ca.pem"), "-ca-key", str(key_file),
            "-config", str(directory / "config.json"), "-loglevel", "4",
        ],
        log_dir,
    )  # fmt: skip
    with process.log_path.open("wb") as log:
        process.process = await asyncio.create_subprocess_exec(
            *process.argv, stdout=log, stderr=asyncio.subprocess.STDOUT
        )
    try:
        bodies = [
            json.dumps(
                {
                    "certificate_request": x509.load_der_x509_csr(d)
                    .public_bytes(serialization.Encoding.PEM)
                    .decode()
                }
            ).encode()
            for d in csrs
        ]
        url = f"http://127.0.0.1:{port}/api/v1/cfssl/sign"
        connector = aiohttp.TCPConnector(limit=CONCURRENCY)
        async with aiohttp.ClientSession(connector=connector) as session:
            async with asyncio.timeout(30):
                while True:
                    with contextlib.suppress(aiohttp.ClientError):
                        async with session.post(url, data=bodies[0]) as reply:
                            if reply.status == 200:
                                break
                    await asyncio.sleep(0.1)

            async def call(i: int) -> None:
                async with session.post(url, data=bodies[i % len(bodies)]) as reply:
                    answer = await reply.json(content_type=None)
                    if reply.status != 200 or not answer.get("success"):
                        raise RuntimeError(f"cfssl sign failed: {reply.status} {answer}")

            return await rate(call, seconds, pids=[process.pid])
    finally:
        await process.stop()


async def renew_after_rotation(directory: Path, log_dir: Path, workers: int, count: int) -> float:
    rotated_ca_dir(directory)
    certs, port = await start_certs(directory, log_dir, workers)
    try:
        return await renew(port, count, channels=2 * workers)
    finally:
        await stop(certs)


async def latency_during_rotation(
    directory: Path, log_dir: Path, csrs: list[bytes], per_second: int, seconds: float
) -> tuple[float, float, int, int]:
    """(p50 ms, p99 ms, calls, failures) of Certify at a fixed arrival rate while
    RotateCA (delay 0) switches the signing CA half-way through."""
    certs, port = await start_certs(directory, log_dir, 1)
    latencies: list[float] = []
    failures = 0
    reasons: collections.Counter[str] = collections.Counter()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = certs_pb2_grpc.CertsStub(channel)
            requests = [certify_request(d) for d in csrs]
            for request in requests[:20]:
                await stub.Certify(request, timeout=30)

            async def one(i: int) -> None:
                nonlocal failures
                started = time.perf_counter()
                try:
                    await stub.Certify(requests[i % len(requests)], timeout=30)
                    latencies.append(time.perf_counter() - started)
                except grpc.aio.AioRpcError as exc:
                    failures += 1
                    reasons[f"{exc.code().name}: {exc.details()}"[:120]] += 1

            async def rotate_half_way() -> None:
                await asyncio.sleep(seconds / 2)
                await stub.RotateCA(
                    certs_pb2.RotateCARequest(),
                    metadata=(("authorization", f"Bearer {ADMIN_TOKEN}"),),
                    timeout=30,
                )

            rotation = asyncio.ensure_future(rotate_half_way())
            calls: list[asyncio.Task[None]] = []
            started = time.perf_counter()
            for i in range(int(per_second * seconds)):
                delay = started + i / per_second - time.perf_counter()
                if delay > 0:
                    await asyncio.sleep(delay)
                calls.append(asyncio.ensure_future(one(i)))
            await asyncio.gather(*calls, rotation)
    finally:
        await stop(certs)
    latencies.sort()
    p50 = latencies[len(latencies) // 2] * 1000 if latencies else 0.0
    p99 = latencies[int(len(latencies) * 0.99) - 1] * 1000 if latencies else 0.0
    global ROTATION_FAILURES
    ROTATION_FAILURES = "; ".join(f"{n}x {reason}" for reason, n in reasons.most_common(3))
    return p50, p99, len(latencies) + failures, failures


async def main(args: argparse.Namespace) -> str:
    csrs = [make_csr() for _ in range(CSR_POOL)]
    payload = certify_request(csrs[0]).SerializeToString()
    load_before = os.getloadavg()[0]
    issue = issue_rate(csrs, args.seconds)

    with tempfile.TemporaryDirectory() as scratch:
        work = Path(scratch)
        log_dir = work / "logs"
        dirs = {n: work / n for n in ("w1", "w2", "cfssl", "r1", "r2", "lat")}
        for d in (log_dir, *dirs.values()):
            d.mkdir()
        echo_process, echo_port = await start([sys.executable, "-m", "bench.echo"], "port", log_dir)
        try:
            echo = await echo_rate(echo_port, payload, args.seconds, echo_process.pid)
        finally:
            await stop(echo_process)

        certify: dict[int, Measured] = {}
        for workers in (1, 2):
            certs, port = await start_certs(dirs[f"w{workers}"], log_dir, workers)
            try:
                # One channel per caller: with workers, the kernel spreads connections.
                certify[workers] = await certify_rate(
                    [port] * CONCURRENCY, csrs, args.seconds, group_pids(certs)
                )
            finally:
                await stop(certs)
        cfssl = await cfssl_rate(dirs["cfssl"], log_dir, csrs, args.seconds)
        renewal = {
            w: await renew_after_rotation(dirs[f"r{w}"], log_dir, w, args.renewals) for w in (1, 2)
        }
        p50, p99, calls, failures = await latency_during_rotation(
            dirs["lat"], log_dir, csrs, 200, 10.0
        )
    load_after = os.getloadavg()[0]

    serial = 1 / (1 / echo.rate + 1 / issue.rate)
    one, two = certify[1], certify[2]
    assert echo.server_cpu_us and issue.server_cpu_us and one.server_cpu_us
    assert two.server_cpu_us and cfssl.server_cpu_us
    floor_us = echo.server_cpu_us + issue.server_cpu_us
    command = "python -m bench.certs"
    if args.seconds != 5:
        command += f" --seconds {args.seconds:g}"
    if args.renewals != 10000:
        command += f" --renewals {args.renewals}"
    lines = [
        "# bench/certs: Certify per worker, beside cfssl; renewals after a rotation",
        "",
        f"Command: `{command}`  ",
        f"Machine: {describe()}  ",
        f"Load average (1 min) before / after the run: {load_before:.1f} / {load_after:.1f} "
        "(other work on the machine shares its cores)",
        "",
        f"P-256 everywhere; {CONCURRENCY} concurrent callers; {args.seconds:g} s per figure.",
        "",
        "| measurement | calls/s | ratio to serial | CPU per call in the server |",
        "|---|---:|---:|---:|",
        f"| bare grpc.aio unary echo ({len(payload)}-byte request) | {echo.rate:,.0f} | | {echo.server_cpu_us:,.0f} us |",
        f"| in-process CSR -> leaf with cryptography (1 thread) | {issue.rate:,.0f} | | {issue.server_cpu_us:,.0f} us |",
        f"| serial combination 1/(1/echo + 1/issue) | {serial:,.0f} | 1.00 | {floor_us:,.0f} us |",
        f"| **Certify, --workers 1** | {one.rate:,.0f} | **{one.rate / serial:.2f}** | {one.server_cpu_us:,.0f} us |",
        f"| **Certify, --workers 2** (one port) | {two.rate:,.0f} | **{two.rate / serial:.2f}** ({two.rate / serial / 2:.2f} per worker) | {two.server_cpu_us:,.0f} us |",
        f"| cfssl serve, /api/v1/cfssl/sign over HTTP/1.1 | {cfssl.rate:,.0f} | {cfssl.rate / serial:.2f} | {cfssl.server_cpu_us:,.0f} us |",
        "",
        f"Scaling from 1 to 2 workers: {two.rate / one.rate:.2f}x (linear: 2.00x; within 20%: "
        f"at least 1.60x). Certify / cfssl: {one.rate / cfssl.rate:.2f} at 1 worker, "
        f"{two.rate / cfssl.rate:.2f} at 2; server CPU per certificate, Certify / cfssl: "
        f"{one.server_cpu_us / cfssl.server_cpu_us:.2f}.",
        "",
        f"CPU ratio (less sensitive to other load than calls/s): the serial combination's CPU "
        f"per call over Certify's = {floor_us:,.0f} / {one.server_cpu_us:,.0f} = "
        f"**{floor_us / one.server_cpu_us:.2f}**.",
        "",
        f"Renewing {args.renewals:,} certificates right after a CA rotation (each a new P-256 "
        f"key and CSR made by the caller, {CONCURRENCY} callers): "
        f"**{renewal[1]:.1f} s** at 1 worker ({args.renewals / renewal[1]:,.0f}/s), "
        f"**{renewal[2]:.1f} s** at 2 workers ({args.renewals / renewal[2]:,.0f}/s).",
        "",
        f"Certify at a steady 200 calls/s for 10 s with RotateCA (delay 0) half-way, 1 worker: "
        f"p50 **{p50:.1f} ms**, p99 **{p99:.1f} ms**, {calls:,} calls, {failures} failed"
        + (f" ({ROTATION_FAILURES})." if ROTATION_FAILURES else "."),
        "",
        f"Cores on this machine: {os.cpu_count()}; the callers, the servers and the echo "
        "server share them.",
    ]
    return "\n".join(lines) + "\n"


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench.certs")
    parser.add_argument("--seconds", type=float, default=5.0, help="measuring time per figure")
    parser.add_argument("--renewals", type=int, default=10000, help="certificates to renew")
    parser.add_argument("--client", type=int, help=argparse.SUPPRESS)  # load-generator mode
    parser.add_argument("--concurrency", type=int, default=CONCURRENCY, help=argparse.SUPPRESS)
    return parser.parse_args()


if __name__ == "__main__":
    arguments = parse_args()
    if arguments.client is not None:
        client_process_main(arguments.client, arguments.seconds, arguments.concurrency)
    else:
        print(asyncio.run(main(arguments)), end="")
