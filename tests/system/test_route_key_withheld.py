"""Issue 29 finding 9: a proxy the resolver sends no route private keys says why,
and so does the resolver, in the route's status (ListRoutes: PrivateKeyDelivered
False, reason NotMTLS), which `waygate routes` and `waygate check` show.

Real processes: `waygate resolver serve` on a plaintext loopback listener (so no
Watch client is a route reader: keys are withheld) and `waygate proxy serve`
watching it. The route's own certificate arrives without its key; the proxy logs
"route demo/shop: private key withheld: this connection to the resolver is not
mTLS", counts it under reason="key_withheld", lists it on its status page
(/status.json) and serves its default certificate for the host, which is what a
real TLS client is shown.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from pathlib import Path

import pytest
from cryptography import x509

from tests.support.pki import LocalCA
from tests.support.poll import until
from tests.support.processes import http_get, run_cli
from waygate.core.clientcli import UpRecord

from .test_proxy_system import start_proxy, start_resolver, wait_ready

pytestmark = pytest.mark.system


def routes(cert: bytes, key: bytes) -> str:
    def block(pem: bytes) -> str:
        return "\n".join("          " + line for line in pem.decode().splitlines())

    return f"""
services:
  - namespace: demo
    name: shop
    ports: [{{name: http, port: 80, targetPort: 8080}}]
    endpoints: [{{address: 127.0.0.1}}]
routes:
  - namespace: demo
    name: shop
    host: shop.test
    to: shop
    tls:
      termination: edge
      certificate: |
{block(cert)}
      key: |
{block(key)}
"""


async def presented_names(port: int, ca: LocalCA) -> list[str]:
    context = ssl.create_default_context(cadata=ca.pem.decode())
    context.check_hostname = False
    _, writer = await asyncio.open_connection(
        "127.0.0.1", port, ssl=context, server_hostname="shop.test"
    )
    try:
        ssl_object = writer.get_extra_info("ssl_object")
        leaf = x509.load_der_x509_certificate(ssl_object.getpeercert(binary_form=True))
        sans = leaf.extensions.get_extension_for_class(x509.SubjectAlternativeName)
        return list(sans.value.get_values_for_type(x509.DNSName))
    finally:
        writer.close()


async def test_a_withheld_route_key_is_named_logged_counted_and_shown(tmp_path: Path) -> None:
    ca = LocalCA()
    route_cert, route_key = ca.issue(dns=["shop.test"])
    default = ca.write_files(tmp_path / "default", dns=["proxy.test"])
    routes_file = tmp_path / "routes.yaml"
    routes_file.write_text(routes(route_cert, route_key))
    resolver = await start_resolver(routes_file)
    proxy, _ = await start_proxy(
        resolver.grpc_address,
        "--default-certificate",
        str(default.cert),
        "--default-key",
        str(default.key),
    )
    try:
        await wait_ready(proxy)
        expected = (
            "route demo/shop: private key withheld: this connection to the resolver is "
            "not mTLS; serving the default certificate for its host"
        )
        await until(lambda: any(e.get("msg") == expected for e in proxy.logs), expected)
        assert not any("do not load" in str(e.get("msg")) for e in proxy.logs)

        https = next(int(e["https_port"]) for e in proxy.logs if "https_port" in e)
        assert await presented_names(https, ca) == ["proxy.test"]

        code, text = await http_get(proxy.admin_port, "/metrics")
        assert code == 200
        assert (
            'waygate_proxy_route_certificates_refused_total{reason="key_withheld",'
            'route="demo/shop"} 1.0' in text
        )
        code, body = await http_get(proxy.admin_port, "/status.json")
        sections = json.loads(body)["services"][0]["sections"]
        (refused,) = [s for s in sections if s["title"] == "Route certificates refused"]
        assert refused["columns"] == ["route", "host", "reason"]
        ((route, host, reason),) = refused["rows"]
        assert (route, host) == ("demo/shop", "shop.test")
        assert reason["text"] == "private key withheld: this connection to the resolver is not mTLS"
        assert reason["state"] == "bad"

        # The resolver says so in the route's status: `routes` and `routes get`.
        addr = ("--addr", resolver.grpc_address, "--plaintext")
        code, text, problem = await run_cli("routes", *addr, "-o", "wide")
        assert code == 0, problem
        (row,) = [line for line in text.splitlines() if line.startswith("demo ") and "shop" in line]
        assert "NotMTLS" in row and "private key withheld: the resolver's gRPC listener" in row
        code, text, problem = await run_cli("routes", "get", "demo/shop", *addr, "-o", "yaml")
        assert code == 0, problem
        assert "type: PrivateKeyDelivered" in text and "reason: NotMTLS" in text

        # `waygate check` lists it, reading the proxy's status document as it does
        # under `up` (an up.json naming this proxy's admin port).
        state = tmp_path / "state"
        state.mkdir()
        admin = f"127.0.0.1:{proxy.admin_port}"
        addresses = {
            "resolver": {"grpc_port": resolver.grpc_address},
            "proxy": {"admin_port": admin},
        }
        UpRecord("127.0.0.1", 0, os.getpid(), addresses).write(state)
        code, text, _ = await run_cli("check", "--state-dir", str(state), "--plaintext")
        assert code == 1
        assert (
            "✖ route demo/shop: private key withheld: this connection to the resolver is not "
            "mTLS (the proxy serves its default certificate for shop.test)\n    hint: give the "
            "proxy a client certificate for the resolver" in text
        ), text
        assert "✖ route demo/shop: NotMTLS: private key withheld: the resolver's gRPC" in text
    finally:
        await proxy.stop()
        await resolver.stop()
