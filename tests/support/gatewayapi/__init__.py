"""The Gateway API conformance suite's manifests, run against a real resolver and proxy.

`conformance/` holds files of kubernetes-sigs/gateway-api v1.6.1 (Apache License
2.0), unchanged: `base.yaml` is `conformance/base/manifests.yaml` and
`httproute-*.yaml` and `backendtlspolicy*.yaml` are `conformance/tests/`'s. The suite fills
`{GATEWAY_CLASS_NAME}` and creates the GatewayClass and the listeners' TLS
Secret itself; `manifests()` does the same here. Instead of the suite's
echo Deployments, every Service of the base file gets an EndpointSlice that
points at a `RecordingUpstream` named "namespace/service", so a test can ask
which backend served a request and what it received, as the suite does.

`Conformance` is one resolver (`--manifests DIR`) and one proxy on port 0;
`apply` replaces the test manifests in DIR (the resolver reloads them, as the
suite applies and deletes manifests between tests) and `request` sends one
HTTP/1.1 request.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from tests.support.pki import self_signed
from tests.support.poll import until
from tests.support.processes import RunningService, start_service
from tests.support.proxyharness import RecordingUpstream, read_response

CONFORMANCE = Path(__file__).parent / "conformance"
CLASS_NAME = "waygate"
INFRA = "gateway-conformance-infra"
GATEWAY_CLASS = f"""apiVersion: gateway.networking.k8s.io/v1
kind: GatewayClass
metadata:
  name: {CLASS_NAME}
spec:
  controllerName: waygate.io/gateway-controller
"""
# The Secret the suite makes for the base file's HTTPS listeners.
TLS_SECRET = "tls-validity-checks-certificate"
TLS_HOSTS = ("example.org", "second-example.org", "*.wildcard.org")


def conformance_text(name: str) -> str:
    return (CONFORMANCE / name).read_text().replace("{GATEWAY_CLASS_NAME}", CLASS_NAME)


def base_services() -> list[dict[str, Any]]:
    return [
        doc
        for doc in yaml.safe_load_all(conformance_text("base.yaml"))
        if doc and doc.get("kind") == "Service"
    ]


def local_slice(service: dict[str, Any], port: int) -> dict[str, Any]:
    """An EndpointSlice for `service` (a manifest): every port of it at 127.0.0.1:`port`."""
    namespace = service["metadata"]["namespace"]
    name = service["metadata"]["name"]
    return {
        "apiVersion": "discovery.k8s.io/v1",
        "kind": "EndpointSlice",
        "metadata": {
            "name": f"{name}-local",
            "namespace": namespace,
            "labels": {"kubernetes.io/service-name": name},
        },
        "addressType": "IPv4",
        "ports": [
            {"name": p.get("name", ""), "port": port, "protocol": "TCP"}
            for p in service["spec"]["ports"]
        ],
        "endpoints": [{"addresses": ["127.0.0.1"], "conditions": {"ready": True}}],
    }


def endpoint_slices(ports: dict[tuple[str, str], int]) -> str:
    """One EndpointSlice per Service, every port of it at 127.0.0.1:ports[(ns, name)]."""
    return yaml.safe_dump_all(
        [
            local_slice(s, ports[(s["metadata"]["namespace"], s["metadata"]["name"])])
            for s in base_services()
        ]
    )


def tls_secret(namespace: str, name: str, host: str = "example.org") -> str:
    cert, key = self_signed(host)
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "kubernetes.io/tls",
            "metadata": {"namespace": namespace, "name": name},
            "data": {
                "tls.crt": base64.b64encode(cert.encode()).decode(),
                "tls.key": base64.b64encode(key.encode()).decode(),
            },
        }
    )


@dataclass
class Response:
    status: int
    headers: list[tuple[str, str]]
    body: bytes

    def header(self, name: str) -> str | None:
        return next((v for k, v in self.headers if k.lower() == name.lower()), None)

    @property
    def echo(self) -> dict[str, Any]:
        """What the RecordingUpstream answered: upstream, method, target, headers."""
        return json.loads(self.body)  # type: ignore[no-any-return]

    @property
    def backend(self) -> str:
        return str(self.echo["upstream"]) if self.status == 200 else ""

    def request_header(self, name: str) -> str | None:
        """The header as the backend read it: repeated lines joined by "," (Go's echo)."""
        values = [v for k, v in self.echo["headers"] if k.lower() == name.lower()]
        return ",".join(values) if values else None

    def response_header(self, name: str) -> str | None:
        values = [v for k, v in self.headers if k.lower() == name.lower()]
        return ",".join(values) if values else None


def parse_response(data: bytes) -> Response:
    head, _, body = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = [tuple(line.split(": ", 1)) for line in lines[1:] if ": " in line]
    return Response(int(lines[0].split(" ")[1]), headers, body)  # type: ignore[arg-type]


@dataclass
class Conformance:
    directory: Path
    backends: dict[tuple[str, str], RecordingUpstream] = field(default_factory=dict)
    resolver: RunningService | None = None
    proxy: RunningService | None = None
    port: int = 0
    https_port: int = 0
    applied: int = 0
    # More `waygate resolver serve` flags (--ingress-nginx ...).
    resolver_args: tuple[str, ...] = ()

    async def start(self, *proxy_args: str) -> Conformance:
        for service in base_services():
            key = (service["metadata"]["namespace"], service["metadata"]["name"])
            self.backends[key] = await RecordingUpstream("/".join(key)).start()
        (self.directory / "00-class.yaml").write_text(GATEWAY_CLASS)
        (self.directory / "01-base.yaml").write_text(conformance_text("base.yaml"))
        (self.directory / "02-backends.yaml").write_text(
            endpoint_slices({key: up.port for key, up in self.backends.items()})
        )
        (self.directory / "03-secret.yaml").write_text(tls_secret(INFRA, TLS_SECRET))
        self.resolver = await start_service(
            [
                "waygate",
                "resolver",
                "serve",
                "--grpc-port",
                "0",
                "--admin-port",
                "0",
                "--manifests",
                str(self.directory),
                "--routes-poll-interval",
                "100ms",
                "--gateway-addresses",
                "127.0.0.1",
                *self.resolver_args,
            ]
        )
        return await self.start_proxy(*proxy_args)

    async def start_proxy(self, *proxy_args: str) -> Conformance:
        """A proxy (again) on port 0, watching the resolver."""
        assert self.resolver is not None
        self.proxy = await start_service(
            [
                "waygate",
                "proxy",
                "serve",
                "--http-port",
                "0",
                "--https-port",
                "0",
                "--admin-port",
                "0",
                "--resolver-address",
                self.resolver.grpc_address,
                *proxy_args,
            ]
        )
        entry = next(
            e for e in self.proxy.logs if e.get("msg") == "proxy listening" and "http_port" in e
        )
        self.port = int(entry["http_port"])
        secure = next(
            e for e in self.proxy.logs if e.get("msg") == "proxy listening" and "https_port" in e
        )
        self.https_port = int(secure["https_port"])
        return self

    async def stop(self) -> None:
        for service in (self.proxy, self.resolver):
            if service is not None:
                await service.stop()
        for upstream in self.backends.values():
            await upstream.stop()

    async def apply(self, *names: str, extra: str = "", wait: bool = True) -> None:
        """Make the test manifests exactly these conformance files (plus `extra`).

        With `wait`, returns once the proxy serves them: the edit carries a marker
        route (its own host, on the all-namespaces Gateway) and the proxy's views
        are whole versions, so once the marker answers, everything else is there."""
        self.applied += 1
        marker = f"apply-{self.applied}.marker.test"
        text = "\n---\n".join(conformance_text(n) for n in names)
        if extra:
            text += "\n---\n" + extra
        text += f"""
---
apiVersion: gateway.networking.k8s.io/v1
kind: HTTPRoute
metadata: {{name: marker, namespace: {INFRA}}}
spec:
  parentRefs: [{{name: all-namespaces}}]
  hostnames: ["{marker}"]
  rules:
  - filters:
    - type: RequestHeaderModifier
      requestHeaderModifier: {{set: [{{name: X-Test-Marker, value: "{self.applied}"}}]}}
    backendRefs: [{{name: infra-backend-v3, port: 8080}}]
"""
        (self.directory / "10-test.yaml").write_text(text)
        if not wait:
            return
        applied = str(self.applied)

        async def served() -> bool:
            response = await self.request("/", host=marker)
            return response.status == 200 and response.request_header("X-Test-Marker") == applied

        assert self.resolver is not None
        resolver = self.resolver
        await until(
            served,
            f"the proxy to serve edit {applied} (resolver: "
            f"{[e['msg'] for e in resolver.logs if 'rejected' in str(e.get('msg'))][-1:]})",
            timeout=20,
        )

    async def request(
        self,
        path: str = "/",
        *,
        host: str = "example.com",
        method: str = "GET",
        headers: dict[str, str] | None = None,
        tls: bool | ssl.SSLContext = False,
    ) -> Response:
        """One request; `tls`: to the HTTPS port with SNI `host` (certificate not checked;
        an SSLContext: with that one, a client certificate in it, say)."""
        if tls:
            reader, writer = await asyncio.open_connection(
                "127.0.0.1",
                self.https_port,
                ssl=tls if isinstance(tls, ssl.SSLContext) else tls_client_context(),
                server_hostname=host.split(":")[0],
            )
        else:
            reader, writer = await asyncio.open_connection("127.0.0.1", self.port)
        try:
            lines = [f"{method} {path} HTTP/1.1", f"Host: {host}"]
            lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
            writer.write(("\r\n".join(lines) + "\r\n\r\n").encode())
            if method == "HEAD":
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                return parse_response(head)
            return parse_response(await read_response(reader, timeout=10))
        finally:
            writer.close()

    async def eventually(
        self, path: str = "/", *, backend: str = "", status: int = 200, **kw: Any
    ) -> Response:
        """Poll until the request gets `backend` (or `status`): the view reaches the proxy
        after a reload, as the suite's MakeRequestAndExpectEventuallyConsistentResponse waits."""
        last: list[Response] = []

        async def check() -> bool:
            response = await self.request(path, **kw)
            last[:] = [response]
            if backend:
                return response.status == 200 and response.backend == backend
            return response.status == status

        await until(check, f"{path} {kw} -> {backend or status} (last: {last})", timeout=20)
        return last[0]

    async def gateways(self, *args: str) -> list[dict[str, Any]]:
        """`waygate gateways -o json`: the objects with their status."""
        from tests.support.processes import run_cli

        assert self.resolver is not None
        code, out, err = await run_cli(
            "gateways", "--addr", self.resolver.grpc_address, "-o", "json", *args
        )
        assert code == 0, err
        return json.loads(out)["items"]  # type: ignore[no-any-return]


class TlsRecordingUpstream(RecordingUpstream):
    """A RecordingUpstream behind TLS with `certificate` (PEM chain, key); `server_names`
    records the SNI of every handshake, as the suite's echo backend reports it."""

    def __init__(self, name: str, certificate: tuple[bytes, bytes]) -> None:
        super().__init__(name)
        from waygate.core.tls import server_context

        self.context = server_context(chain_pem=certificate[0], key_pem=certificate[1])
        self.server_names: list[str | None] = []

        def record(_obj: Any, name: str | None, _context: Any) -> None:
            self.server_names.append(name)

        self.context.sni_callback = record

    async def start(self) -> TlsRecordingUpstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0, ssl=self.context)
        self.port = self._server.sockets[0].getsockname()[1]
        return self


def tls_backend_objects(names: tuple[str, ...], port: int, config_maps: dict[str, str]) -> str:
    """What the suite creates for its BackendTLSPolicy tests: one EndpointSlice per
    Service of `names` selecting `app: tls-backend` (every port at 127.0.0.1:`port`)
    and the ConfigMaps of `config_maps` (name -> ca.crt)."""
    docs: list[dict[str, Any]] = [
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": {"name": name, "namespace": INFRA},
            "data": {"ca.crt": pem},
        }
        for name, pem in config_maps.items()
    ]
    for text in (conformance_text(n) for n in names):
        for doc in yaml.safe_load_all(text):
            if not doc or doc.get("kind") != "Service":
                continue
            if (doc["spec"].get("selector") or {}).get("app") != "tls-backend":
                continue
            docs.append(local_slice(doc, port))
    return yaml.safe_dump_all(docs)


def tls_client_context() -> ssl.SSLContext:
    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context
