"""Certs benchmark: Certify throughput against its two unavoidable costs, and renewal time.

All in one run, on loopback, P-256 keys:
- echo:    a bare grpc.aio unary echo server (separate process), 8 concurrent
           callers sending a request the size of a CertifyRequest;
- issue:   in-process CSR-to-leaf issuance with `cryptography` (parse the
           CSR, verify its signature, build and sign the leaf), one thread;
- Certify: `waygate certs serve` (separate process, plaintext loopback,
           static token), 8 concurrent callers, pre-made CSRs.
Certify is reported as a ratio of the serial combination of the two costs,
1 / (1/echo + 1/issue): what one process doing both, one after the other,
could reach at best.
- scaling: the same load on 2 certs processes (each with its own CA
           directory; callers split evenly), and with the callers in 2
           processes of their own;
- renewal: the time to renew 10,000 certificates through Certify, each
           renewal a fresh key and CSR made by the caller (as the rotation
           client does), 8 concurrent callers.

Run: .venv/bin/python -m bench.certs [--seconds 5] [--renewals 10000]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import sys
import tempfile
import time
from pathlib import Path

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
                        if isinstance(entry, dict) and entry.get("msg") == "listening":
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


def certs_argv(directory: Path) -> list[str]:
    tokens = directory / "tokens.yaml"
    tokens.write_text(
        yaml.safe_dump(
            {
                "tokens": [
                    {
                        "token": TOKEN,
                        "name": "bench",
                        "allowed": [f"uri:{IDENTITY}", "dns:client.bench.svc"],
                    }
                ]
            }
        )
    )
    tokens.chmod(0o600)
    return [
        sys.executable, "-m", "waygate", "certs", "serve", "--grpc-port", "0",
        "--admin-port", "0", "--ca-dir", str(directory / "ca"), "--tokens-file", str(tokens),
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


async def renew(port: int, count: int) -> float:
    """Seconds to renew `count` certificates: new key + CSR + Certify each, 8 callers."""
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = certs_pb2_grpc.CertsStub(channel)
        remaining = count

        async def caller() -> None:
            nonlocal remaining
            while remaining > 0:
                remaining -= 1
                reply = await stub.Certify(certify_request(make_csr()), timeout=30)
                assert reply.leaf_certificate

        started = time.perf_counter()
        await asyncio.gather(*(caller() for _ in range(CONCURRENCY)))
        return time.perf_counter() - started


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


async def main(args: argparse.Namespace) -> str:
    csrs = [make_csr() for _ in range(CSR_POOL)]
    payload = certify_request(csrs[0]).SerializeToString()
    load_before = os.getloadavg()[0]
    issue = issue_rate(csrs, args.seconds)

    with (
        tempfile.TemporaryDirectory() as logs,
        tempfile.TemporaryDirectory() as first,
        tempfile.TemporaryDirectory() as second,
    ):
        log_dir = Path(logs)
        echo_process, echo_port = await start([sys.executable, "-m", "bench.echo"], "port", log_dir)
        try:
            echo = await echo_rate(echo_port, payload, args.seconds, echo_process.pid)
        finally:
            await stop(echo_process)

        certs_a, port_a = await start(certs_argv(Path(first)), "listening", log_dir)
        try:
            certify = await certify_rate([port_a], csrs, args.seconds, [certs_a.pid])
            health = await health_rate(port_a, args.seconds, certs_a.pid)
            certify_clients_apart = await certify_rate_from_processes(port_a, args.seconds, 2)
            certs_b, port_b = await start(certs_argv(Path(second)), "listening", log_dir)
            try:
                certify_two = await certify_rate(
                    [port_a, port_b], csrs, args.seconds, [certs_a.pid, certs_b.pid]
                )
            finally:
                await stop(certs_b)
            renewal_seconds = await renew(port_a, args.renewals)
        finally:
            await stop(certs_a)
    load_after = os.getloadavg()[0]

    serial = 1 / (1 / echo.rate + 1 / issue.rate)
    assert echo.server_cpu_us and issue.server_cpu_us and certify.server_cpu_us
    assert certify_two.server_cpu_us and health.server_cpu_us
    floor_us = echo.server_cpu_us + issue.server_cpu_us
    command = "python -m bench.certs"
    if args.seconds != 5:
        command += f" --seconds {args.seconds:g}"
    if args.renewals != 10000:
        command += f" --renewals {args.renewals}"
    lines = [
        "# bench/certs: Certify throughput and renewal time",
        "",
        f"Command: `{command}`  ",
        f"Machine: {describe()}  ",
        f"Load average (1 min) before / after the run: {load_before:.1f} / {load_after:.1f} "
        "(other work on the machine shares its cores)",
        "",
        f"P-256 everywhere; {CONCURRENCY} concurrent callers; {args.seconds:g} s per figure.",
        "",
        "| measurement | calls/s | ratio | CPU per call in the serving process |",
        "|---|---:|---:|---:|",
        f"| bare grpc.aio unary echo ({len(payload)}-byte request) | {echo.rate:,.0f} | | {echo.server_cpu_us:,.0f} us |",
        f"| in-process CSR -> leaf with cryptography (1 thread) | {issue.rate:,.0f} | | {issue.server_cpu_us:,.0f} us |",
        f"| serial combination 1/(1/echo + 1/issue) | {serial:,.0f} | 1.00 | {floor_us:,.0f} us |",
        f"| **Certify**, 1 certs process, callers in 1 process | {certify.rate:,.0f} | **{certify.rate / serial:.2f}** | {certify.server_cpu_us:,.0f} us |",
        f"| Certify, 1 certs process, callers in 2 processes | {certify_clients_apart:,.0f} | {certify_clients_apart / serial:.2f} | |",
        f"| Certify, 2 certs processes, callers in 1 process | {certify_two.rate:,.0f} | {certify_two.rate / serial:.2f} | {certify_two.server_cpu_us:,.0f} us |",
        f"| for reference: health Check on the certs server (GrpcServer: interceptor, span, metrics) | {health.rate:,.0f} | | {health.server_cpu_us:,.0f} us |",
        "",
        "CPU ratio (less sensitive to other load than calls/s): the serial combination's CPU "
        f"per call over Certify's = {floor_us:,.0f} / {certify.server_cpu_us:,.0f} = "
        f"**{floor_us / certify.server_cpu_us:.2f}**.",
        "",
        f"Renewing {args.renewals:,} certificates through Certify (1 certs process; each renewal "
        f"a new P-256 key and CSR made by the caller): **{renewal_seconds:.1f} s** "
        f"({args.renewals / renewal_seconds:,.0f}/s).",
        "",
        f"Cores on this machine: {os.cpu_count()}; the callers, the certs process(es) and the "
        "echo server share them.",
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
