"""How exactly the proxy keeps ingress-nginx's `limit-rps` (issue 27 item 10).

    python -m bench.proxy.ratelimit [--rate 1000] [--duration 10] [--connections 20]

A real resolver (`--manifests --ingress-nginx`) serves one Ingress with
`limit-rps: RATE` (limit-burst-multiplier: ingress-nginx's default, 5) to an
nginx upstream; one proxy worker (core 0) takes wrk's closed loop of
CONNECTIONS connections from one address (core 1), well above the rate. A
warm-up first spends the burst (RATE x 5 at once, then the rate), so the
measured window shows the steady state: the requests answered 200 per second,
against RATE, and the error as a share of it (the goal: within 10%). The
others are answered 503 (the ConfigMap's limit-req-status-code default).
wrk offers more than the rate only if the proxy answers faster than that:
the offered rate is reported too, and a run that could not offer more than
the rate says so instead of a figure.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

from bench.peer import pinned
from bench.proxy.__main__ import (
    CLIENT_CORE,
    HOST,
    PROXY_CORE,
    Proxy,
    free_port,
    install_peers,
    upstream_conf,
)


def upstream_objects(upstream: int) -> str:
    """The Service bench/upstream and its EndpointSlice: the nginx upstream's port."""
    return textwrap.dedent(
        f"""\
        apiVersion: v1
        kind: Service
        metadata: {{name: upstream, namespace: bench}}
        spec:
          ports: [{{name: http, port: 80, targetPort: {upstream}}}]
        ---
        apiVersion: discovery.k8s.io/v1
        kind: EndpointSlice
        metadata:
          name: upstream-local
          namespace: bench
          labels: {{kubernetes.io/service-name: upstream}}
        addressType: IPv4
        ports: [{{name: http, port: {upstream}, protocol: TCP}}]
        endpoints: [{{addresses: [127.0.0.1], conditions: {{ready: true}}}}]
        """
    )


def manifests(path: Path, upstream: int, rate: int) -> None:
    path.mkdir()
    (path / "bench.yaml").write_text(
        upstream_objects(upstream)
        + textwrap.dedent(
            f"""\
            ---
            apiVersion: networking.k8s.io/v1
            kind: Ingress
            metadata:
              name: limited
              namespace: bench
              annotations:
                nginx.ingress.kubernetes.io/limit-rps: "{rate}"
            spec:
              ingressClassName: nginx
              rules:
              - host: {HOST}
                http:
                  paths:
                  - path: /
                    pathType: Prefix
                    backend: {{service: {{name: upstream, port: {{number: 80}}}}}}
            """
        )
    )


def wrk_counts(port: int, connections: int, seconds: float) -> tuple[int, int, float]:
    """(requests, non-2xx answers, seconds measured) of one wrk run."""
    result = subprocess.run(
        pinned(CLIENT_CORE, ["wrk", "-t1", f"-c{connections}", f"-d{seconds:g}s",
                             "-H", f"Host: {HOST}", f"http://127.0.0.1:{port}/64"]),
        capture_output=True, text=True, timeout=seconds + 60,
    )  # fmt: skip
    out = result.stdout
    found = re.search(r"(\d+) requests in ([\d.]+)(s|ms|m)", out)
    if found is None:
        raise RuntimeError(f"wrk: {out}{result.stderr}")
    took = float(found.group(2)) * {"s": 1.0, "ms": 0.001, "m": 60.0}[found.group(3)]
    refused = re.search(r"Non-2xx or 3xx responses: (\d+)", out)
    return int(found.group(1)), int(refused.group(1)) if refused else 0, took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rate", type=int, default=1000)
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=20)
    args = parser.parse_args()
    install_peers()
    with tempfile.TemporaryDirectory(prefix="waygate-bench-ratelimit-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)  # nginx workers run as nobody
        upstream_port, resolver_port, proxy_port = free_port(), free_port(), free_port()
        manifests(directory / "manifests", upstream_port, args.rate)
        upstream = Proxy(
            "upstream nginx",
            ["nginx", "-e", "stderr", "-c", str(upstream_conf(directory, upstream_port, Path("/dev/null")))],
            upstream_port, CLIENT_CORE,
        )  # fmt: skip
        resolver = subprocess.Popen(
            [sys.executable, "-m", "waygate", "resolver", "serve", "--grpc-port", str(resolver_port),
             "--admin-port", "0", "--manifests", str(directory / "manifests"), "--ingress-nginx"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        proxy = Proxy(
            "Waygate (1 worker)",
            [sys.executable, "-m", "waygate", "proxy", "serve", "--http-port", str(proxy_port),
             "--https-port", "0", "--admin-port", "0",
             "--resolver-address", f"127.0.0.1:{resolver_port}"],
            proxy_port, PROXY_CORE, log=directory / "proxy.log",
        )  # fmt: skip
        try:
            upstream.start()
            proxy.start()
            wrk_counts(proxy_port, args.connections, 3)  # warm-up: spends the burst
            total, refused, took = wrk_counts(proxy_port, args.connections, args.duration)
        finally:
            proxy.stop()
            upstream.stop()
            resolver.terminate()
            resolver.wait(10)
    offered, admitted = total / took, (total - refused) / took
    error = (admitted - args.rate) / args.rate
    print(f"limit-rps {args.rate}: offered {offered:,.0f} req/s over {took:.1f} s "
          f"({args.connections} connections, one client address)")  # fmt: skip
    if offered <= args.rate * 1.1:
        print(f"not measured: the proxy answered only {offered:,.0f} req/s, not above the rate")
        return
    print(f"admitted (200) {admitted:,.1f} req/s, refused (503) {refused / took:,.0f} req/s: "
          f"error {error:+.1%} of the rate ({'within' if abs(error) <= 0.10 else 'OUTSIDE'} 10%)")  # fmt: skip


if __name__ == "__main__":
    main()
