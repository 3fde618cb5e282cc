"""`waygate check`: one command that says whether a Waygate installation works
(as `linkerd check` does): a ✔/✖ line per check, a hint under every ✖, and a
non-zero exit when anything failed.

What it checks, for a local `waygate up` (the state directory's `up.json`
says where each process serves) or for the addresses given:
- every gRPC service (certs, resolver, tunnel server) answers grpc.health
  SERVING; over TLS, its certificate verifies against the trust bundle, names
  the identity expected of it (under `up`), and has days left (warned under
  20% of its life, failed when expired); under `up` the proxy's HTTPS
  certificate and your own client certificate too;
- every admin port (under `up`) answers /readyz 200, and the proxy refuses no
  route certificate (its status document's "Route certificates refused": a
  private key the resolver withheld, an expired or mismatched certificate) and
  reads the PROXY protocol where routes say their clients send it ("PROXY
  protocol not read": ingress-nginx's use-proxy-protocol on a proxy without
  --proxy-protocol);
- the trust bundle certs serves is the one clients trust (the state
  directory's ca.pem, or --ca-file);
- every route source (the routes file, each manifests path, Kubernetes) is
  valid, else its error and since when; every route is admitted with
  resolved refs (and its own private key reaches a proxy); no Gateway API
  or Ingress object has Accepted=False or ResolvedRefs=False; Gateways and
  Ingresses ignored for their class are listed (‼) with the reason;
- the resolver's view is fresh (last sync within --max-staleness) and, when
  routes send traffic through a tunnel, an agent holds each of their nodes.

Each check is bounded by the client timeout; nothing here waits without one.
A cluster is checked by its addresses (port-forwards or Services) with the TLS
flags every client command takes, or by kube context (`--kube-context`, with
`--kubeconfig` and `--namespace`) through the Kubernetes API, using the one
Kubernetes layer (waygate.core.kube): every Waygate workload has its desired
replicas ready (a missing tunnel workload is a warning: it is optional),
every Route object's status says admitted with resolved refs, and the trust
bundle ConfigMap exists. A context that does not exist or an API server that
cannot be reached is one line on stderr and exit 2.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import socket
import ssl
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import grpc
from cryptography import x509

from waygate.core.clientcli import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE_OR_UNREACHABLE,
    ClientSettings,
    UpRecord,
    fail,
    http_status,
    printable,
    run_client,
)
from waygate.core.errors import FailedPrecondition
from waygate.core.grpcclient import open_channel
from waygate.core.kube import JSON, KubeAPI, KubeError, load_api_client
from waygate.core.settings import add_settings_arguments
from waygate.core.statuspage import fetch_document

OK, FAILED, WARN = "✔", "✖", "‼"
#: Under this fraction of its lifetime left, a certificate is worth a warning.
LOW_LIFE = 0.2


@dataclasses.dataclass
class Result:
    mark: str
    title: str
    hint: str = ""

    @property
    def failed(self) -> bool:
        return self.mark == FAILED


@dataclasses.dataclass(frozen=True)
class Target:
    """One gRPC service to check."""

    name: str  # "certs", "resolver", "tunnel-server"
    address: str
    health_service: str


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--resolver", metavar="ADDR", help="resolver gRPC host:port")
    parser.add_argument("--certs", metavar="ADDR", help="certs gRPC host:port")
    parser.add_argument("--tunnel", metavar="ADDR", help="tunnel server dialer gRPC host:port")
    parser.add_argument(
        "--kube-context",
        metavar="CONTEXT",
        help="check a cluster through the Kubernetes API with this kubeconfig context",
    )
    parser.add_argument(
        "--kubeconfig",
        metavar="PATH",
        help="kubeconfig for --kube-context (default: $KUBECONFIG, then ~/.kube/config)",
    )
    parser.add_argument(
        "--namespace",
        default="waygate",
        metavar="NS",
        help="namespace Waygate is installed in, for --kube-context",
    )
    parser.add_argument(
        "--max-staleness",
        type=float,
        default=90.0,
        metavar="SECONDS",
        help="the resolver's view must have been confirmed by its sources this recently",
    )
    parser.add_argument(
        "-o", "--output", choices=("table", "json"), default="table", help="✔/✖ list or JSON"
    )
    add_settings_arguments(parser, ClientSettings)
    parser.set_defaults(func=run_check)


def run_check(args: argparse.Namespace) -> int:
    async def body(settings: ClientSettings) -> int:
        try:
            results = await Checker(args, settings).run()
        except (FailedPrecondition, KubeError) as exc:
            return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
        if args.output == "json":
            print(json.dumps([dataclasses.asdict(r) for r in results], indent=2))
        else:
            for result in results:
                print(f"{result.mark} {printable(result.title)}")
                if result.hint and result.mark != OK:
                    print(f"    hint: {printable(result.hint)}")
            failed = sum(r.failed for r in results)
            print(
                f"\nStatus check results are {FAILED} ({failed} failed)"
                if failed
                else f"\nStatus check results are {OK}"
            )
        return EXIT_FAILED if any(r.failed for r in results) else EXIT_OK

    return run_client(args, body)


class Checker:
    def __init__(self, args: argparse.Namespace, settings: ClientSettings) -> None:
        self.args = args
        self.settings = settings
        self.results: list[Result] = []
        self.kube = bool(getattr(args, "kube_context", None))
        self.state_dir = None if self.kube else settings.found_state_dir()
        self.record = UpRecord.read(self.state_dir) if self.state_dir is not None else None
        # "route NS/NAME" of the proxy's backend-certificate findings (said once, not twice).
        self.backend_said: set[str] = set()

    def add(self, mark: str, title: str, hint: str = "") -> None:
        self.results.append(Result(mark, title, hint))

    # ------------------------------------------------------------ plan

    def targets(self) -> list[Target]:
        given = {
            "certs": self.args.certs,
            "resolver": self.args.resolver,
            "tunnel-server": self.args.tunnel,
        }
        fields = {"certs": "grpc_port", "resolver": "grpc_port", "tunnel-server": "dial_port"}
        health = {
            "certs": "waygate.certs.v1.Certs",
            "resolver": "waygate.resolver.v1.Resolver",
            "tunnel-server": "",
        }
        targets = []
        for name, address in given.items():
            if not address and self.record is not None and not any(given.values()):
                address = self.record.addresses.get(name, {}).get(fields[name])
            if address:
                targets.append(Target(name, address, health[name]))
        return targets

    async def run(self) -> list[Result]:
        if self.kube:
            await asyncio.to_thread(self.check_cluster)
            if not (self.args.resolver or self.args.certs or self.args.tunnel):
                return self.results
        else:
            self.check_state()
        targets = self.targets()
        if not targets:
            if any(r.failed for r in self.results):
                return self.results  # already said why
            self.add(
                FAILED,
                "nothing to check",
                "run `waygate up` here (or in a parent directory), point at its state with "
                "--state-dir, or give --resolver/--certs/--tunnel HOST:PORT",
            )
            return self.results
        for target in targets:
            await self.check_service(target)
        if self.record is not None and not (self.args.resolver or self.args.certs):
            await self.check_admin_ports()
            await self.check_backend_certificates()
            await asyncio.to_thread(self.check_local_certificates)
        certs = next((t for t in targets if t.name == "certs"), None)
        if certs is not None:
            await self.check_bundle(certs)
        resolver = next((t for t in targets if t.name == "resolver"), None)
        if resolver is not None:
            await self.check_routes(resolver)
        return self.results

    # ------------------------------------------------------------ checks

    def check_state(self) -> None:
        if self.state_dir is None:
            if not (self.args.resolver or self.args.certs or self.args.tunnel):
                self.add(
                    FAILED,
                    "no waygate state directory found",
                    "run `waygate up` in this directory or a parent, use --state-dir DIR, "
                    "or give the services' addresses",
                )
            return
        if self.record is None:
            self.add(OK, f"state directory {self.state_dir} (no up.json: addresses from flags)")
            return
        alive = _pid_alive(self.record.pid)
        self.add(
            OK if alive else FAILED,
            f"`waygate up` (pid {self.record.pid}) of {self.state_dir} is "
            + ("running" if alive else "not running"),
            "start it again with `make run` or `waygate up`",
        )

    def tls_files(self) -> tuple[Path | None, Path | None, Path | None]:
        tls = self.settings.tls()
        if tls is None:
            return None, None, None
        return tls.ca_file, tls.cert_file, tls.key_file

    async def check_service(self, target: Target) -> None:
        from grpc_health.v1 import health_pb2, health_pb2_grpc

        tls = self.settings.tls()
        try:
            async with open_channel(target.address, tls=tls, retry=False) as channel:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=target.health_service),
                    timeout=self.settings.timeout,
                )
        except grpc.aio.AioRpcError as exc:
            self.add(
                FAILED,
                f"{target.name} at {target.address} is unreachable: {exc.code().name}: "
                f"{exc.details()}",
                _reach_hint(tls is not None),
            )
            return
        serving = reply.status == health_pb2.HealthCheckResponse.SERVING
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        self.add(
            OK if serving else FAILED,
            f"{target.name} at {target.address} answers health {status}",
            f"see its log; `waygate health {target.address}` repeats this check",
        )
        if tls is not None:
            await asyncio.to_thread(self.check_certificate, target)

    def check_certificate(self, target: Target) -> None:
        """The serving certificate: verified against the trust bundle, the identity
        expected under `up`, and the life it has left."""
        ca_file, cert_file, key_file = self.tls_files()
        host, _, port = target.address.rpartition(":")
        context = ssl.create_default_context(cafile=str(ca_file) if ca_file else None)
        context.set_alpn_protocols(["h2", "http/1.1"])
        if cert_file is not None and key_file is not None:
            context.load_cert_chain(cert_file, key_file)
        try:
            with (
                socket.create_connection((host, int(port)), timeout=self.settings.timeout) as raw,
                context.wrap_socket(raw, server_hostname=host) as tls,
            ):
                der = tls.getpeercert(binary_form=True)
        except (OSError, ssl.SSLError) as exc:
            self.add(
                FAILED,
                f"{target.name}: TLS to {target.address} fails: {exc}",
                "the trust bundle (ca.pem) may be stale: `waygate cert bundle --out "
                f"{ca_file}` refreshes it",
            )
            return
        assert der is not None
        cert = x509.load_der_x509_certificate(der)
        try:
            sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
            uris = sans.get_values_for_type(x509.UniformResourceIdentifier)
        except x509.ExtensionNotFound:
            uris = []
        expected = f"spiffe://waygate.local/ns/local/sa/{target.name}"
        if self.record is not None and target.name != "certs":
            self.add(
                OK if expected in uris else FAILED,
                f"{target.name}: certificate identity {', '.join(uris) or '(none)'}",
                f"expected {expected}: another process may hold the port "
                "(`waygate up` fails on a taken port; is this an older copy?)",
            )
        self.add_expiry(
            f"{target.name}: serving certificate",
            cert,
            "renewal is failing: look for 'renew' in its log; certs must be reachable",
        )

    def add_expiry(self, what: str, cert: x509.Certificate, hint: str) -> None:
        """✔ with the days left; ‼ under 20% of its life; ✖ once expired."""
        left = cert.not_valid_after_utc - datetime.now(UTC)
        life = cert.not_valid_after_utc - cert.not_valid_before_utc
        days = left.total_seconds() / 86400
        if left.total_seconds() <= 0:
            mark = FAILED
        elif life.total_seconds() > 0 and left / life < LOW_LIFE:
            mark = WARN
        else:
            mark = OK
        self.add(
            mark,
            f"{what} valid, {days:.1f} days left (until {cert.not_valid_after_utc:%Y-%m-%dT%H:%MZ})",
            hint,
        )

    def check_local_certificates(self) -> None:
        """Under `up`: the proxy's HTTPS certificate, and your own client certificate."""
        assert self.record is not None
        https = self.record.addresses.get("proxy", {}).get("https_port")
        if https is not None and self.tls_files()[0] is not None:
            self.check_certificate(Target("proxy", https, ""))
        if self.state_dir is not None:
            mine = self.state_dir / "client" / "cert.pem"
            try:
                cert = x509.load_pem_x509_certificate(mine.read_bytes())
            except (OSError, ValueError):
                self.add(
                    FAILED,
                    f"your client certificate {mine} is missing or unreadable",
                    "`waygate up` writes it once certs is ready; see its log",
                )
                return
            self.add_expiry("your client certificate", cert, "`waygate up` renews it while it runs")

    async def check_admin_ports(self) -> None:
        assert self.record is not None
        for name, ports in sorted(self.record.addresses.items()):
            address = ports.get("admin_port")
            if address is None:
                continue
            status = await http_status(address, "/readyz", self.settings.timeout)
            self.add(
                OK if status == 200 else FAILED,
                f"{name} admin {address}: /readyz " + (str(status) if status else "unreachable"),
                f"`curl http://{address}/readyz` says what it waits for",
            )
            if name == "proxy" and status == 200:
                await self.check_refused_certificates(address)

    async def check_refused_certificates(self, address: str) -> None:
        """✖ for each route certificate the proxy refuses now (a private key withheld by
        the resolver, expired, for another host), from its status document's
        "Route certificates refused" section (docs/status-json.md)."""
        host, _, port = address.rpartition(":")
        try:
            document = await fetch_document(host, int(port), self.settings.timeout)
        except (OSError, TimeoutError, ValueError):
            return  # /readyz answered: a status page that does not is not this check's
        for service in document["services"]:
            for section in service.get("sections", []):
                if section.get("title") == "PROXY protocol not read":
                    for route, reason in section.get("rows", []):
                        why = reason.get("text") if isinstance(reason, dict) else reason
                        self.add(
                            FAILED,
                            f"route {route}: {why}",
                            "start the proxy behind the load balancer with --proxy-protocol "
                            "(or set use-proxy-protocol to false when it sends no header)",
                        )
                if section.get("title") != "Route certificates refused":
                    continue
                for route, host_name, reason in section.get("rows", []):
                    why = reason.get("text") if isinstance(reason, dict) else reason
                    self.add(
                        FAILED,
                        f"route {route}: {why} (the proxy serves its default certificate "
                        f"for {host_name})",
                        _refusal_hint(str(why)),
                    )

    async def check_backend_certificates(self) -> None:
        """Under `up`: the proxy's backend certificates (its status page) — a warning
        days before one expires, a failure for one out of rotation."""
        from waygate.proxy.backendcerts import check_findings

        assert self.record is not None
        address = self.record.addresses.get("proxy", {}).get("admin_port")
        if address is None:
            return
        host, _, port = address.rpartition(":")
        try:
            async with asyncio.timeout(self.settings.timeout):
                reader, writer = await asyncio.open_connection(host, int(port))
                try:
                    writer.write(b"GET /status.json HTTP/1.1\r\nHost: waygate\r\n\r\n")
                    head = await reader.readuntil(b"\r\n\r\n")
                    length = next(
                        int(line.split(b":", 1)[1])
                        for line in head.split(b"\r\n")
                        if line.lower().startswith(b"content-length:")
                    )
                    document = json.loads(await reader.readexactly(length))
                finally:
                    writer.close()
        except (OSError, TimeoutError, ValueError, StopIteration, asyncio.IncompleteReadError):
            return  # the admin port check says whether the proxy answers
        marks = {"ok": OK, "warn": WARN, "failed": FAILED}
        for level, title, hint in check_findings(document):
            self.add(marks[level], title, hint)
            self.backend_said.add(title.split(":", 1)[0])  # "route NS/NAME"

    async def check_bundle(self, certs: Target) -> None:
        from waygate.certs.v1 import certs_pb2, certs_pb2_grpc

        ca_file = self.tls_files()[0]
        try:
            async with open_channel(certs.address, tls=self.settings.tls(), retry=False) as ch:
                bundle = await certs_pb2_grpc.CertsStub(ch).GetTrustBundle(
                    certs_pb2.GetTrustBundleRequest(), timeout=self.settings.timeout
                )
        except grpc.aio.AioRpcError as exc:
            self.add(FAILED, f"trust bundle: {exc.code().name}: {exc.details()}")
            return
        served = {_fingerprint(a.certificate) for a in bundle.authorities}
        self.add(OK, f"trust bundle version {bundle.version}: {len(served)} CA(s)")
        await self.check_trust_consumers(certs)
        if ca_file is None:
            return
        try:
            trusted = {
                _fingerprint(c.public_bytes(_der()))
                for c in x509.load_pem_x509_certificates(ca_file.read_bytes())
            }
        except (OSError, ValueError) as exc:
            self.add(FAILED, f"trust bundle file {ca_file} unreadable: {exc}")
            return
        self.add(
            OK if trusted == served else FAILED,
            f"{ca_file} matches the bundle certs serves"
            if trusted == served
            else f"{ca_file} differs from the bundle certs serves",
            f"`waygate cert bundle --out {ca_file}` writes the current one",
        )

    async def check_trust_consumers(self, certs: Target) -> None:
        """Who holds which trust bundle, and whether a CA rotation waits for someone
        (an admin call: with the state directory's user token, else skipped)."""
        from waygate.certs.commands import fetch_rotation_status, rotation_findings
        from waygate.certs.v1 import certs_pb2_grpc

        token_file = None if self.state_dir is None else self.state_dir / "tokens" / "user.token"
        if token_file is None or not token_file.is_file():
            return
        try:
            async with open_channel(certs.address, tls=self.settings.tls(), retry=False) as ch:
                status = await fetch_rotation_status(
                    certs_pb2_grpc.CertsStub(ch),
                    self.settings.timeout,
                    token_file.read_text().strip(),
                )
        except (grpc.aio.AioRpcError, OSError) as exc:
            detail = f"{exc.code().name}" if isinstance(exc, grpc.aio.AioRpcError) else str(exc)
            self.add(WARN, f"trust consumers: not readable ({detail})")
            return
        marks = {"ok": OK, "warn": WARN, "failed": FAILED}
        for level, title, hint in rotation_findings(status, datetime.now(UTC)):
            self.add(marks[level], title, hint)

    async def check_routes(self, resolver: Target) -> None:
        from waygate.resolver.backendcerts import EXPIRING_SOON
        from waygate.resolver.backendcerts import VERDICTS as BACKEND_VERDICTS
        from waygate.resolver.commands import (
            list_routes,
            route_problem,
            source_failure,
            source_hint,
            source_name,
        )
        from waygate.resolver.v1 import resolver_pb2, resolver_pb2_grpc

        try:
            async with open_channel(resolver.address, tls=self.settings.tls(), retry=False) as ch:
                stub = resolver_pb2_grpc.ResolverStub(ch)
                routes, sources, _ = await list_routes(stub, "", self.settings.timeout)
                gateways = await stub.ListGateways(
                    resolver_pb2.ListGatewaysRequest(), timeout=self.settings.timeout
                )
                first = await _first_view(stub, self.settings.timeout)
        except (grpc.aio.AioRpcError, TimeoutError) as exc:
            detail = (
                f"{exc.code().name}: {exc.details()}"
                if isinstance(exc, grpc.aio.AioRpcError)
                else "no snapshot in time"
            )
            self.add(FAILED, f"resolver routes: {detail}")
            return
        for state in sources:
            what = source_name(state.source)
            if state.valid:
                self.add(OK, f"{what} is valid")
            else:
                since = (
                    f" (since {_stamp(state.error_since)})" if state.HasField("error_since") else ""
                )
                self.add(
                    FAILED,
                    f"{what} {source_failure(state.source)}{since}: {state.last_error}",
                    f"{source_hint(state.source)}; the resolver serves the last good "
                    "content until then",
                )
        self.check_gateway_objects(list(gateways.objects))
        for item in gateways.ignored:
            self.add(
                WARN,
                f"{item.kind} {item.namespace}/{item.name} ignored: {item.reason}",
                "another controller may serve it; to have Waygate serve it, give it "
                "Waygate's class",
            )
        bad = 0
        for route in routes:
            status, message = route_problem(route)
            if status not in ("Admitted", "-"):
                bad += 1
                if status in BACKEND_VERDICTS and (
                    f"route {route.namespace}/{route.name}" in self.backend_said
                ):
                    continue  # the proxy's own finding for it was shown above
                self.add(
                    # Served, an ingress-nginx annotation not honoured, or a backend
                    # certificate expiring soon (BackendCertificate): a warning.
                    WARN if status in ("NotHonoured", EXPIRING_SOON) else FAILED,
                    f"route {route.namespace}/{route.name}: {status}: {message}",
                    _route_hint(status),
                )
        if routes and not bad:
            self.add(OK, f"all {len(routes)} routes admitted, their services resolved")
        for route in routes:
            if route.listener_protocol == "TCP" and route_problem(route)[0] in ("Admitted", "-"):
                backend = route.backends[0]
                self.add(
                    OK,
                    f"TCP service port {route.listener_port}: {backend.namespace}/"
                    f"{backend.service}:{backend.port} ({route.origin})",
                )
        synced, tunnels, endpoints = first
        if synced is None:
            self.add(FAILED, "resolver view never synced", "its source has not loaded yet")
        else:
            age = time.time() - synced
            self.add(
                OK if age <= self.args.max_staleness else FAILED,
                f"resolver view confirmed {age:.0f}s ago",
                "its source (file or Kubernetes) stopped confirming: see the resolver's log",
            )
        for node in sorted({e.node_name for e in endpoints if e.tunnel and e.node_name}):
            held = [t for t in tunnels if t.node == node and t.servers]
            self.add(
                OK if held else FAILED,
                f"edge node {node}: "
                + (
                    f"agent connected to {', '.join(s.id for s in held[0].servers)}"
                    if held
                    else "no tunnel agent connected"
                ),
                "start `waygate tunnel agent` on that node (under `up`: see the tunnel-agent log)",
            )

    def check_gateway_objects(self, objects: list[Any]) -> None:
        """✖ for each Gateway API or Ingress object (or route parent) with
        Accepted=False or ResolvedRefs=False, with its reason."""
        for item in objects:
            name = f"{item.kind} {item.namespace + '/' if item.namespace else ''}{item.name}"
            places = [("", item.conditions)] + [
                (f" on {p.gateway_namespace}/{p.gateway_name}", p.conditions) for p in item.parents
            ]
            places += [(f" listener {ls.name}", ls.conditions) for ls in item.listeners]
            for where, conditions in places:
                for c in conditions:
                    if c.type in ("Accepted", "ResolvedRefs") and c.status == "False":
                        self.add(
                            FAILED,
                            f"{name}{where}: {c.type}=False ({c.reason}): {c.message}",
                            "`waygate gateways` shows its status; fix the object it names",
                        )

    # ------------------------------------------------------------ cluster

    def check_cluster(self) -> None:
        """By kube context: workloads ready, Route statuses, the trust bundle ConfigMap.

        Raises FailedPrecondition (no such context, unreadable kubeconfig) or a
        KubeError with status 0 (API server unreachable): one line for the caller.
        """
        context = self.args.kube_context
        kubeconfig = _kubeconfig_path(self.args.kubeconfig)
        # urllib3 logs every retry of a refused connection; the outcome is one line.
        logging.getLogger("urllib3").setLevel(logging.ERROR)
        api = KubeAPI(
            load_api_client(kubeconfig, context=context),
            timeout=self.settings.timeout,
        )
        try:
            self._check_cluster(api, context)
        finally:
            api.close()

    def _check_cluster(self, api: KubeAPI, context: str) -> None:
        ns = self.args.namespace
        try:
            api.get(f"/api/v1/namespaces/{ns}")
        except KubeError as exc:
            if exc.status == 0:
                raise
            self.add(
                FAILED,
                f"namespace {ns} in context {context}: {exc.message}",
                "install Waygate (`kubectl apply -k deploy/kustomize/overlays/...`) "
                "or give --namespace",
            )
            return
        self.add(OK, f"context {context}: API server {api.host}, namespace {ns}")
        for kind, name, optional in WORKLOADS:
            self.check_workload(api, ns, kind, name, optional)
        self.check_route_objects(api)
        try:
            api.get(f"/api/v1/namespaces/{ns}/configmaps/{TRUST_BUNDLE_CONFIGMAP}")
        except KubeError as exc:
            if exc.status == 0:
                raise
            self.add(
                FAILED,
                f"trust bundle ConfigMap {ns}/{TRUST_BUNDLE_CONFIGMAP}: {exc.message}",
                "waygate-certs publishes it once it runs as leader (--bundle-configmap): "
                "see its log",
            )
        else:
            self.add(OK, f"trust bundle ConfigMap {ns}/{TRUST_BUNDLE_CONFIGMAP} exists")

    def check_workload(self, api: KubeAPI, ns: str, kind: str, name: str, optional: bool) -> None:
        plural = {"Deployment": "deployments", "StatefulSet": "statefulsets"}.get(
            kind, "daemonsets"
        )
        try:
            obj = api.get(f"/apis/apps/v1/namespaces/{ns}/{plural}/{name}")
        except KubeError as exc:
            if exc.status == 0:
                raise
            if exc.not_found and optional:
                self.add(WARN, f"{kind} {ns}/{name} not installed (optional)")
                return
            self.add(
                FAILED,
                f"{kind} {ns}/{name}: {exc.message}",
                "apply deploy/kustomize (base or an overlay) to this namespace",
            )
            return
        desired, ready = _replicas(kind, obj)
        self.add(
            OK if ready >= desired else FAILED,
            f"{kind} {ns}/{name}: {ready}/{desired} ready",
            f"`kubectl -n {ns} describe {kind.lower()} {name}` and its pods' logs say why",
        )

    def check_route_objects(self, api: KubeAPI) -> None:
        try:
            routes, _ = api.list("/apis/waygate.io/v1/routes")
        except KubeError as exc:
            if exc.status == 0:
                raise
            self.add(
                FAILED,
                f"Route objects: {exc.message}",
                "the Route CRD (deploy/kustomize/base/crd-route.yaml) may not be installed",
            )
            return
        bad = 0
        for route in routes:
            meta = route.get("metadata") or {}
            name = f"{meta.get('namespace', '')}/{meta.get('name', '')}"
            problem = _route_object_problem(route)
            if problem is None:
                continue
            bad += 1
            mark, reason, message = problem
            self.add(
                mark,
                f"route {name}: {reason}: {message}" if message else f"route {name}: {reason}",
                _route_hint(reason),
            )
        if not bad:
            self.add(OK, f"all {len(routes)} Route objects admitted, their services resolved")


# ---------------------------------------------------------------- helpers

#: (kind, name, optional): the workloads of deploy/kustomize/base.
WORKLOADS = (
    ("Deployment", "waygate-resolver", False),
    ("Deployment", "waygate-certs", False),
    ("Deployment", "waygate-proxy", False),
    ("StatefulSet", "waygate-tunnel-server", True),
    ("DaemonSet", "waygate-tunnel-agent", True),
)
TRUST_BUNDLE_CONFIGMAP = "waygate-trust-bundle"


def _kubeconfig_path(given: str | None) -> Path:
    """--kubeconfig, else the first of $KUBECONFIG, else ~/.kube/config (as kubectl)."""
    if given:
        return Path(given)
    first = next((p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p), None)
    return Path(first) if first else Path.home() / ".kube" / "config"


def _replicas(kind: str, obj: JSON) -> tuple[int, int]:
    """(desired, ready) of a Deployment, StatefulSet or DaemonSet."""
    spec = obj.get("spec") or {}
    status = obj.get("status") or {}
    if kind == "DaemonSet":
        return int(status.get("desiredNumberScheduled") or 0), int(status.get("numberReady") or 0)
    desired = spec.get("replicas")
    return (1 if desired is None else int(desired)), int(status.get("readyReplicas") or 0)


def _route_object_problem(route: JSON) -> tuple[str, str, str] | None:
    """None when a Route object's status says admitted, resolved and not conflicted;
    else (mark, reason, message) of the first condition that is wrong."""
    status = route.get("status") or {}
    conditions = [c for c in status.get("conditions") or () if isinstance(c, dict)]
    if not conditions:
        return (
            WARN,
            "NoStatus",
            "no conditions yet: the resolver's leader writes them (is it running?)",
        )
    seen = {c.get("type") for c in conditions}
    for condition in conditions:
        kind = condition.get("type")
        wrong = (
            condition.get("status") == "True"
            if kind == "Conflicted"
            else kind in ("Admitted", "ResolvedRefs") and condition.get("status") != "True"
        )
        if wrong:
            return (
                FAILED,
                str(condition.get("reason") or kind),
                str(condition.get("message") or ""),
            )
    if "Admitted" not in seen:
        return WARN, "NoStatus", "no Admitted condition yet"
    return None


def _reach_hint(tls: bool) -> str:
    hint = "is it running? `waygate up` prints where each service listens"
    if tls:
        hint += "; a TLS error means the trust bundle or client certificate does not fit"
    return hint


def _route_hint(reason: str) -> str:
    return {
        "ServiceNotFound": "create the service, or point the route at one that exists",
        "PortNotFound": "targetPort must name a port of the service (by name or number)",
        "NoReadyEndpoints": "no ready endpoint: is the backend running and ready?",
        "HostAlreadyClaimed": "an older route owns this host or host and path: rename the "
        "host or path, or delete the other route",
        "NoBackends": "give the route a backend of non-zero weight",
        # ingress-nginx Ingresses (waygate.resolver.ingress_nginx).
        "UnsupportedAnnotation": "an annotation Waygate cannot honour bears on access, so "
        "the Ingress is not served: `waygate ingress-nginx check` names it",
        "InvalidAnnotation": "an annotation value outside its grammar: fix the Ingress",
        "InvalidPath": "a path outside its pathType (regular expressions need use-regex)",
        "SnippetsNotAllowed": "the controller ConfigMap does not allow snippets",
        "InvalidTCPService": 'fix the TCP services ConfigMap entry: "PORT": '
        '"NAMESPACE/SERVICE:PORT[:PROXY][:PROXY]"',
        "NotHonoured": "served; `waygate ingress-nginx check` lists what is not honoured",
        "NotMTLS": "run the resolver with TLS and client certificates (as `waygate up` does), "
        "and the proxy with a certificate whose identity is in --route-readers",
        "NoRouteReaders": "set the resolver's --route-readers to the proxy's identity",
        # BackendCertificate (waygate.resolver.backendcerts), reported by the proxies.
        "ExpiringSoon": "replace the backend's certificate before it expires: the proxy "
        "stops using that endpoint then",
        "Expired": "the proxy sends no request there while another endpoint is healthy; "
        "replace the backend's certificate",
        "NotYetValid": "the proxy sends no request there while another endpoint is healthy; "
        "check the backend's clock and certificate",
        "Untrusted": "the proxy sends no request there while another endpoint is healthy; "
        "give the backend a certificate the route's destination CA signed",
    }.get(reason, "`waygate routes get NS/NAME` shows every condition")


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _refusal_hint(reason: str) -> str:
    if "not mTLS" in reason:
        return "give the proxy a client certificate for the resolver (--certs-address or TLS files)"
    if "--route-readers" in reason:
        return "add the proxy's identity to the resolver's --route-readers"
    return "fix the route's certificate (waygate routes get NS/NAME -o yaml shows it)"


def _stamp(stamp: Any) -> str:
    """A protobuf Timestamp as RFC 3339 (UTC, seconds)."""
    return str(stamp.ToDatetime().strftime("%Y-%m-%dT%H:%M:%SZ"))


def _fingerprint(der: bytes) -> str:
    import hashlib

    return hashlib.sha256(der).hexdigest()


def _der() -> Any:
    from cryptography.hazmat.primitives.serialization import Encoding

    return Encoding.DER


async def _first_view(stub: Any, timeout: float) -> tuple[float | None, list[Any], list[Any]]:
    """(last sync as unix time or None, tunnel presences, endpoints) of one Watch snapshot."""
    from waygate.resolver.v1 import resolver_pb2 as pb

    tunnels: list[Any] = []
    endpoints: list[Any] = []
    call = stub.Watch(
        pb.WatchRequest(kinds=[pb.RESOURCE_KIND_TUNNELS, pb.RESOURCE_KIND_ENDPOINTS]),
        timeout=timeout,
    )
    try:
        async with asyncio.timeout(timeout):
            async for event in call:
                tunnels += event.snapshot.tunnels
                endpoints += event.snapshot.endpoints
                if not event.snapshot.more:
                    synced = (
                        event.last_sync.seconds + event.last_sync.nanos / 1e9
                        if event.HasField("last_sync")
                        else None
                    )
                    return synced, tunnels, endpoints
    finally:
        call.cancel()
    raise TimeoutError("the Watch stream ended before its snapshot")
