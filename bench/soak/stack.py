"""The soak's processes: every Waygate service as its own process, TLS everywhere.

- the STAND-IN Kubernetes API server (tests/support/kubeapi.py, in its own
  process): where the certs replicas keep their CA (a Secret) and elect their
  leader (a Lease);
- certs, two replicas (certs-a, certs-b) against it: only the Lease holder
  writes CA state, both serve Certify and the bundle; short leaf lifetime so
  every leaf rotates during the soak, `--clock-skew 1` so that lifetime is
  nearly the real one (1 s covers the lag of the clock TLS checks against:
  a leaf used at once is never 'not yet valid'); short Lease timings (6 s lease) so a failover fits in a phase;
- resolver, two replicas (resolver-a, resolver-b) over one routes file (file
  mode on one host: both read the same file, as both would mount the same
  ConfigMap). Each replica knows only the tunnel presence reported to it, so
  every tunnel server reports to both (`--resolver-address A,B`); the proxy is
  given both too and its Watch moves to the other when its replica dies
  (Gateway listener reports go to both);
- HAProxy in TCP mode as the load balancer in front of certs (every certs
  client) and of the tunnel-server replicas (the agents), one address per
  service as a Kubernetes Service would be: a killed replica's clients
  reconnect and land on the other;
- two tunnel-server replicas (`--replicas`);
- two agents for the one edge node;
- the proxy (HTTP and HTTPS), watching the resolver, dialling tunnelled
  endpoints through whichever replica holds the node;
- backends (bench.soak.backend): two direct endpoints, a third added later,
  one tunnelled endpoint; backend-a also serves gRPC (service port
  appProtocol grpc: the proxy speaks HTTP/2 to it).
Every port is chosen once, so a killed process restarts on the same address.
Processes log JSON to DIR/logs/NAME.log; each gets SIGKILL if the driver dies
(PR_SET_PDEATHSIG, set by `_TRAMPOLINE` before exec).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import yaml

ROOT = Path(__file__).resolve().parents[2]
TRUST = "waygate.local"
NODE = "edge-soak"
DIRECT_HOST, TUNNEL_HOST, TLS_HOST, LATE_HOST, GRPC_HOST = (
    "direct.soak.test",
    "tunnel.soak.test",
    "tls.soak.test",
    "late.soak.test",
    "grpc.soak.test",
)
DIRECT_ADDRESSES = ("127.0.0.1", "127.0.0.2")
CERTS_REPLICAS = ("certs-a", "certs-b")
RESOLVER_REPLICAS = ("resolver-a", "resolver-b")
#: Where the certs replicas keep the CA (NAMESPACE/NAME); the Lease is beside it.
CA_SECRET = "soak/waygate-certs-ca"
ADDED_ADDRESS = "127.0.0.3"


def spiffe(name: str) -> str:
    return f"spiffe://{TRUST}/ns/soak/sa/{name}"


#: Ports are chosen below the kernel's ephemeral range (32768 and up by
#: default): a port-0 bind elsewhere on the machine (other tests) never takes
#: one, so a killed process can always restart on its port.
PORT_RANGE = (20000, 32000)


def free_port(host: str = "127.0.0.1") -> int:
    for _ in range(1000):
        port = random.randrange(*PORT_RANGE)
        with socket.socket() as probe:
            try:
                probe.bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE}")


def shared_port(hosts: tuple[str, ...]) -> int:
    """A port free on every one of `hosts` (endpoints of one service share their port)."""
    for _ in range(100):
        port = free_port(hosts[0])
        try:
            for host in hosts[1:]:
                with socket.socket() as probe:
                    probe.bind((host, port))
        except OSError:
            continue
        return port
    raise RuntimeError("no port free on every loopback address")


#: Every process starts through this: it asks the kernel to SIGKILL it when the
#: driver dies (PR_SET_PDEATHSIG, kept across exec), then becomes the real
#: program. Not a `preexec_fn`: that runs Python in the forked child of a driver
#: whose gRPC threads are busy (the load's gRPC channel), and the child then
#: died in gRPC core before exec now and then (SIGABRT "Check failed:
#: next_worker->state == KICKED", a SIGSEGV in event_engine) - three restarts
#: of the round-4 30-minute soak and the whole first run were lost that way.
_TRAMPOLINE = (
    "import ctypes, os, signal, sys; "
    "ctypes.CDLL('libc.so.6', use_errno=True).prctl(1, signal.SIGKILL); "
    "os.execv(sys.argv[1], sys.argv[1:])"
)


@dataclass
class Proc:
    name: str
    argv: list[str]
    admin_port: int | None  # /readyz there says when it serves; None: wait for the port
    # Without an admin port: ready once this address accepts connections.
    ready_address: tuple[str, int] | None = None
    process: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    @property
    def pid(self) -> int | None:
        return None if self.process is None else self.process.pid

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


@dataclass
class Stack:
    directory: Path
    leaf_lifetime: float = 120.0
    procs: dict[str, Proc] = field(default_factory=dict)
    # Extra flags for the proxy (`--proxy-arg`: e.g. --tunnel-end-to-end).
    proxy_args: tuple[str, ...] = ()
    # Extra flags for both certs replicas (e.g. --max-leaf-lifetime: how soon an old CA retires).
    certs_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        d = self.directory
        (d / "logs").mkdir(parents=True, exist_ok=True)
        # Per process: how long its last start took, and when it was last ready.
        self.start_seconds: dict[str, float] = {}
        self.ready_at: dict[str, float] = {}
        self.ports: dict[str, int] = {}
        for name in (
                "certs-a", "certs-a-admin", "certs-b", "certs-b-admin", "certs-lb",
                "resolver-a", "resolver-a-admin", "resolver-b", "resolver-b-admin",
                "proxy-http", "proxy-https", "proxy-admin", "agents-lb",
                "agent-1-admin", "agent-2-admin", "backend-t", "backend-grpc",
                *(f"{r}-{p}" for r in ("ts-a", "ts-b")
                  for p in ("grpc", "dial", "front", "data", "admin")),
        ):  # fmt: skip
            port = free_port()
            while port in self.ports.values():
                port = free_port()
            self.ports[name] = port
        self.ports["backend-direct"] = shared_port((*DIRECT_ADDRESSES, ADDED_ADDRESS))
        self.tokens = {
            name: secrets.token_urlsafe(24)
            for name in ("resolver", "tunnel-server", "proxy", "agent", "user", "admin")
        }
        self._write_tokens()
        self.routes_file = d / "routes.yaml"
        self.write_routes(direct=DIRECT_ADDRESSES, late=False)
        self._define()

    # ------------------------------------------------------------ files

    @property
    def bundle(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def kubeapi_url_file(self) -> Path:
        return self.directory / "kubeapi.url"

    def kubeconfig(self, replica: str) -> Path:
        return self.directory / f"kubeconfig-{replica}"

    def _write_tokens(self) -> None:
        allowed = {
            "resolver": [f"uri:{spiffe('resolver')}", "ip:127.0.0.1"],
            "tunnel-server": [f"uri:{spiffe('tunnel-server')}", "ip:127.0.0.1"],
            "proxy": [f"uri:{spiffe('proxy')}", "ip:127.0.0.1", f"dns:{TLS_HOST}"],
            "agent": [f"dns:{NODE}"],
            "user": [f"uri:{spiffe('user')}"],
        }
        entries: list[dict[str, object]] = [
            {"token": self.tokens[n], "name": n, "allowed": a} for n, a in allowed.items()
        ]
        entries.append({"token": self.tokens["admin"], "name": "admin", "admin": True})
        tokens_dir = self.directory / "tokens"
        tokens_dir.mkdir(mode=0o700, exist_ok=True)
        for name, token in self.tokens.items():
            path = tokens_dir / f"{name}.token"
            path.write_text(token + "\n")
            path.chmod(0o600)
        path = self.directory / "tokens.yaml"
        path.write_text(yaml.safe_dump({"tokens": entries}))
        path.chmod(0o600)

    def write_routes(self, *, direct: tuple[str, ...], late: bool) -> None:
        """The routes file: direct endpoints at `direct`, the late route when `late`."""
        port, tport = self.ports["backend-direct"], self.ports["backend-t"]
        gport = self.ports["backend-grpc"]
        services = [
            {
                "namespace": "soak", "name": "direct",
                "ports": [{"name": "http", "port": 80, "targetPort": port}],
                "endpoints": [{"address": a} for a in direct],
            },
            {
                "namespace": "soak", "name": "tunnelled",
                "ports": [{"name": "http", "port": 80, "targetPort": tport}],
                "endpoints": [{"address": "127.0.0.1", "nodeName": NODE, "tunnel": True}],
            },
            {
                "namespace": "soak", "name": "grpc",
                "ports": [{"name": "grpc", "port": 50051, "targetPort": gport,
                           "appProtocol": "grpc"}],
                "endpoints": [{"address": DIRECT_ADDRESSES[0]}],
            },
        ]  # fmt: skip
        routes = [
            {"namespace": "soak", "name": "direct", "host": DIRECT_HOST, "to": "direct",
             "targetPort": "http", "balance": "roundrobin"},
            {"namespace": "soak", "name": "tunnel", "host": TUNNEL_HOST, "to": "tunnelled",
             "targetPort": "http"},
            {"namespace": "soak", "name": "tls", "host": TLS_HOST, "to": "direct",
             "targetPort": "http", "tls": {"termination": "edge"}},
            {"namespace": "soak", "name": "grpc", "host": GRPC_HOST, "to": "grpc",
             "targetPort": "grpc"},
        ]  # fmt: skip
        if late:
            routes.append(
                {"namespace": "soak", "name": "late", "host": LATE_HOST, "to": "direct",
                 "targetPort": "http"}
            )  # fmt: skip
        text = yaml.safe_dump({"services": services, "routes": routes}, sort_keys=False)
        tmp = self.routes_file.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.chmod(0o600)
        tmp.replace(self.routes_file)

    # ------------------------------------------------------------ processes

    def _certs_client(self, token: str, identity: str, sans: list[str]) -> list[str]:
        return [
            "--certs-address", f"127.0.0.1:{self.ports['certs-lb']}",
            "--certs-token-file", str(self.directory / "tokens" / f"{token}.token"),
            "--certs-ca-file", str(self.bundle), "--cert-identity", identity,
            *(["--cert-sans", ",".join(sans)] if sans else []),
        ]  # fmt: skip

    def _define(self) -> None:
        p, d = self.ports, self.directory
        waygate = [sys.executable, "-m", "waygate"]
        common = ["--host", "127.0.0.1", "--log-format", "json"]
        lifetime = f"{int(self.leaf_lifetime)}s"
        self._add(
            "kubeapi",
            [sys.executable, "-m", "tests.support.kubeapi_process",
             "--url-file", str(self.kubeapi_url_file)],
            None,
        )  # fmt: skip
        for replica in CERTS_REPLICAS:
            # Both write the one bundle file (atomically, the same content): it is
            # what every client trusts certs by, whichever replica it reaches.
            self._add(
                replica,
                [*waygate, "certs", "serve", *common, "--grpc-port", str(p[replica]),
                 "--admin-port", str(p[f"{replica}-admin"]),
                 "--kubeconfig", str(self.kubeconfig(replica)), "--ca-secret", CA_SECRET,
                 "--leader-identity", replica, "--lease-duration", "6s",
                 "--renew-deadline", "4s", "--retry-period", "1s",
                 "--tokens-file", str(d / "tokens.yaml"), "--bundle-file", str(self.bundle),
                 "--serving-identity", spiffe("certs"),
                 "--serving-sans", f"dns:certs.{TRUST},ip:127.0.0.1",
                 "--leaf-lifetime", lifetime, "--clock-skew", "1", *self.certs_args],
                p[f"{replica}-admin"],
            )  # fmt: skip
        for replica in RESOLVER_REPLICAS:
            self._add(
                replica,
                [*waygate, "resolver", "serve", *common, "--grpc-port", str(p[replica]),
                 "--admin-port", str(p[f"{replica}-admin"]),
                 "--routes-file", str(self.routes_file), "--routes-poll-interval", "200ms",
                 "--tunnel-reporters", spiffe("tunnel-server"), "--route-admins", spiffe("user"),
                 "--route-readers", spiffe("proxy"),
                 *self._certs_client("resolver", spiffe("resolver"), ["ip:127.0.0.1"])],
                p[f"{replica}-admin"],
            )  # fmt: skip
        every_resolver = ",".join(f"127.0.0.1:{p[r]}" for r in RESOLVER_REPLICAS)
        for replica, other in (("ts-a", "ts-b"), ("ts-b", "ts-a")):
            self._add(
                replica,
                [*waygate, "tunnel", "serve", *common,
                 "--grpc-port", str(p[f"{replica}-grpc"]), "--dial-port", str(p[f"{replica}-dial"]),
                 "--front-port", str(p[f"{replica}-front"]), "--data-port", str(p[f"{replica}-data"]),
                 "--admin-port", str(p[f"{replica}-admin"]), "--server-id", replica,
                 "--replicas", other, "--advertise-address", f"127.0.0.1:{p[f'{replica}-dial']}",
                 "--resolver-address", every_resolver,
                 "--dialers", f"{spiffe('proxy')},{spiffe('user')}", "--shutdown-grace", "2s",
                 *self._certs_client("tunnel-server", spiffe("tunnel-server"), ["ip:127.0.0.1"])],
                p[f"{replica}-admin"],
            )  # fmt: skip
        for agent in ("agent-1", "agent-2"):
            self._add(
                agent,
                [*waygate, "tunnel", "agent", "--log-format", "json",
                 "--admin-port", str(p[f"{agent}-admin"]),
                 "--server-address", f"127.0.0.1:{p['agents-lb']}",
                 "--allow", f"127.0.0.1/32:{p['backend-t']}", "--reconnect-max", "1s",
                 *self._certs_client("agent", NODE, [])],
                p[f"{agent}-admin"],
            )  # fmt: skip
        self._add(
            "proxy",
            [*waygate, "proxy", "serve", *common, "--http-port", str(p["proxy-http"]),
             "--https-port", str(p["proxy-https"]), "--admin-port", str(p["proxy-admin"]),
             "--resolver-address", every_resolver, *self.proxy_args,
             *self._certs_client("proxy", spiffe("proxy"), ["ip:127.0.0.1", f"dns:{TLS_HOST}"])],
            p["proxy-admin"],
        )  # fmt: skip
        backend = [sys.executable, "-m", "bench.soak.backend"]
        for name, host in zip(
            ("backend-a", "backend-b", "backend-c"), (*DIRECT_ADDRESSES, ADDED_ADDRESS), strict=True
        ):
            grpc = ["--grpc-port", str(p["backend-grpc"])] if name == "backend-a" else []
            self._add(
                name,
                [*backend, "--host", host, "--port", str(p["backend-direct"]), "--name", name,
                 *grpc],
                None,
                (host, p["backend-direct"]),
            )  # fmt: skip
        self._add(
            "backend-t",
            [*backend, "--port", str(p["backend-t"]), "--name", "backend-t"],
            None,
            ("127.0.0.1", p["backend-t"]),
        )

    def _add(
        self, name: str, argv: list[str], admin: int | None, address: tuple[str, int] | None = None
    ) -> None:
        self.procs[name] = Proc(name, argv, admin, address)

    def start_haproxy(self) -> None:
        binary = shutil.which("haproxy")
        if binary is None:
            raise RuntimeError("haproxy is not installed (Debian: apt-get install haproxy)")
        p = self.ports

        def frontend(name: str, port: str, replicas: tuple[str, ...]) -> str:
            servers = "".join(
                f"    server {r} 127.0.0.1:{p[r]} check inter 500ms fall 1 rise 1\n"
                for r in replicas
            )
            return (
                f"frontend {name}\n    bind 127.0.0.1:{p[port]}\n    default_backend {name}\n"
                f"backend {name}\n    balance roundrobin\n{servers}"
            )

        config = self.directory / "haproxy.cfg"
        config.write_text(
            f"""global
    maxconn 512
defaults
    mode tcp
    timeout connect 2s
    timeout client 1h
    timeout server 1h
    # A connect refused by a replica that just died goes to the other one.
    retries 3
    option redispatch
{frontend("agents", "agents-lb", ("ts-a-grpc", "ts-b-grpc"))}
{frontend("certs", "certs-lb", CERTS_REPLICAS)}
"""
        )
        self.procs["haproxy"] = Proc(
            "haproxy", [binary, "-f", str(config), "-db"], None, ("127.0.0.1", p["agents-lb"])
        )
        self.spawn("haproxy")

    def spawn(self, name: str) -> None:
        proc = self.procs[name]
        proc.log = self.directory / "logs" / f"{name}.log"
        with proc.log.open("ab") as out:
            proc.process = subprocess.Popen(
                [sys.executable, "-c", _TRAMPOLINE, *proc.argv],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={
                    k: v for k, v in os.environ.items() if not k.startswith(("WAYGATE_", "OTEL_"))
                },
            )

    async def start(self, name: str, timeout: float = 60.0) -> None:
        began = time.monotonic()
        self.spawn(name)
        await self.wait_ready(name, timeout)
        self.ready_at[name] = time.monotonic()
        self.start_seconds[name] = self.ready_at[name] - began

    async def wait_ready(self, name: str, timeout: float = 60.0) -> None:
        proc = self.procs[name]
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not proc.alive:
                tail = proc.log.read_text(errors="replace")[-2000:] if proc.log else ""
                code = proc.process.returncode if proc.process is not None else None
                raise RuntimeError(
                    f"{name} exited while starting (exit status {code}); its log ends:\n{tail}"
                )
            if await _ready(proc):
                return
            await asyncio.sleep(0.1)
        raise RuntimeError(f"{name} not ready within {timeout}s; see {proc.log}")

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        if proc.process is not None and proc.alive:
            proc.process.send_signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.process.wait(20)
            if proc.alive:
                proc.process.kill()
                proc.process.wait(5)

    async def start_kubeapi(self, timeout: float = 30.0) -> None:
        """The stand-in API server, then a kubeconfig (own token) per certs replica."""
        self.spawn("kubeapi")
        deadline = time.monotonic() + timeout
        while not self.kubeapi_url_file.exists():
            if not self.procs["kubeapi"].alive or time.monotonic() > deadline:
                raise RuntimeError(
                    f"the stand-in API server did not start; see {self.procs['kubeapi'].log}"
                )
            await asyncio.sleep(0.05)
        url = self.kubeapi_url_file.read_text().strip()
        for replica in CERTS_REPLICAS:
            path = self.kubeconfig(replica)
            path.write_text(
                "apiVersion: v1\nkind: Config\n"
                f'clusters: [{{name: stand-in, cluster: {{server: "{url}"}}}}]\n'
                f"users: [{{name: user, user: {{token: {replica}-{secrets.token_hex(8)}}}}}]\n"
                "contexts: [{name: c, context: {cluster: stand-in, user: user}}]\n"
                "current-context: c\n"
            )
            path.chmod(0o600)

    async def certs_leader(self) -> str:
        """The certs replica holding the Lease ("" when none does or the stand-in is slow)."""
        url = self.kubeapi_url_file.read_text().strip()
        namespace, _, _ = CA_SECRET.partition("/")
        path = f"/apis/coordination.k8s.io/v1/namespaces/{namespace}/leases/waygate-certs-leader"
        try:
            async with (
                aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session,
                session.get(url + path) as response,
            ):
                if response.status != 200:
                    return ""
                lease = await response.json()
        except (aiohttp.ClientError, TimeoutError):
            return ""
        holder = str(lease.get("spec", {}).get("holderIdentity") or "")
        return holder if holder in CERTS_REPLICAS else ""

    async def start_all(self) -> None:
        for name in ("backend-a", "backend-b", "backend-c", "backend-t"):
            self.spawn(name)
        await self.start_kubeapi()
        # First: certs and the tunnel servers are reached through it from the start.
        self.start_haproxy()
        await self.wait_ready("haproxy")
        await asyncio.gather(*(self.start(r) for r in CERTS_REPLICAS))
        await asyncio.gather(*(self.start(r) for r in RESOLVER_REPLICAS))
        await asyncio.gather(self.start("ts-a"), self.start("ts-b"))
        await asyncio.gather(self.start("agent-1"), self.start("agent-2"))
        await self.start("proxy")
        for name in ("backend-a", "backend-b", "backend-c", "backend-t"):
            await self.wait_ready(name)

    def stop_all(self) -> None:
        for name in reversed(list(self.procs)):
            self.kill(name, signal.SIGTERM)

    def sockets(self, name: str) -> str:
        """`name`'s TCP sockets counted by state and the stack port at either end (from
        `ss`): what a file-descriptor check that failed was holding."""
        proc = self.procs[name]
        if not proc.alive or proc.pid is None:
            return "not running"
        try:
            listing = subprocess.run(
                ["ss", "-tanpH"], capture_output=True, text=True, timeout=10, check=True
            ).stdout
        except (OSError, subprocess.SubprocessError) as exc:
            return f"ss failed: {exc}"
        by_port = {port: port_name for port_name, port in self.ports.items()}
        counts: dict[str, int] = {}
        for line in listing.splitlines():
            fields = line.split()
            if len(fields) < 6 or f"pid={proc.pid}," not in fields[5]:
                continue
            local, peer = (a.rpartition(":")[2] for a in fields[3:5])
            local, peer = (int(p) if p.isdigit() else 0 for p in (local, peer))
            ends = by_port.get(local) or f"-> {by_port.get(peer, 'other')}"
            key = f"{fields[0]} {ends}"
            counts[key] = counts.get(key, 0) + 1
        return ", ".join(f"{k} x{n}" for k, n in sorted(counts.items()))

    def usage(self) -> dict[str, dict[str, int]]:
        """Per live process: resident memory (bytes), open fds, threads (from /proc)."""
        figures: dict[str, dict[str, int]] = {}
        for name, proc in self.procs.items():
            if not proc.alive or proc.pid is None:
                continue
            with contextlib.suppress(OSError):
                status = Path(f"/proc/{proc.pid}/status").read_text()
                fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
                figures[name] = {
                    "rss": int(fields["VmRSS"].split()[0]) * 1024,
                    "threads": int(fields["Threads"]),
                    "fds": len(os.listdir(f"/proc/{proc.pid}/fd")),
                }
        return figures


async def _ready(proc: Proc) -> bool:
    if proc.admin_port is not None:
        host, port, probe = "127.0.0.1", proc.admin_port, True
    else:
        assert proc.ready_address is not None
        (host, port), probe = proc.ready_address, False
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 1.0)
    except (OSError, TimeoutError):
        return False
    try:
        if not probe:
            return True
        writer.write(b"GET /readyz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
        status = await asyncio.wait_for(reader.readline(), 2.0)
        return status.startswith(b"HTTP/1.1 200")
    except (OSError, TimeoutError):
        return False
    finally:
        writer.close()
