"""What ingress-nginx's `auth-url` costs through the proxy (issue 27 item 10).

    python -m bench.proxy.extauth [--duration 10] [--connections 20]

A real resolver (`--manifests --ingress-nginx`) serves two Ingresses to the same
nginx upstream: one plain, one with `auth-url` naming an auth service (nginx
answering 200 at once: the subrequest's cost is measured, not the service's).
One proxy worker (core 0); wrk (1 thread, core 1) takes each in turn. The table:
req/s, p99 latency and the proxy's CPU per request, the auth route against the
plain one. With `--cache`, the Ingress also sets `auth-cache-key` and
`auth-cache-duration` (when the proxy honours them; refused otherwise).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.proxy.__main__ import (
    CLIENT_CORE,
    HOST,
    PROXY_CORE,
    Proxy,
    cpu_seconds,
    free_port,
    install_peers,
    nginx_conf,
    tree,
    upstream_conf,
    wrk,
)
from bench.proxy.ratelimit import upstream_objects

AUTH_HOST = "auth." + HOST


def manifests(path: Path, upstream: int, auth: int, cache: bool) -> None:
    path.mkdir()
    caching = (
        '\n    nginx.ingress.kubernetes.io/auth-cache-key: "fixed"'
        '\n    nginx.ingress.kubernetes.io/auth-cache-duration: "200 5m"'
        if cache
        else ""
    )
    rule = """\
  rules:
  - host: {host}
    http:
      paths:
      - path: /
        pathType: Prefix
        backend: {{service: {{name: upstream, port: {{number: 80}}}}}}"""
    (path / "bench.yaml").write_text(
        upstream_objects(upstream)
        + f"""---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata: {{name: plain, namespace: bench}}
spec:
  ingressClassName: nginx
{rule.format(host=HOST)}
---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata:
  name: authed
  namespace: bench
  annotations:
    nginx.ingress.kubernetes.io/auth-url: "http://127.0.0.1:{auth}/auth"{caching}
spec:
  ingressClassName: nginx
{rule.format(host=AUTH_HOST)}
"""
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=10.0)
    parser.add_argument("--connections", type=int, default=20)
    parser.add_argument("--cache", action="store_true")
    args = parser.parse_args()
    install_peers()
    with tempfile.TemporaryDirectory(prefix="waygate-bench-extauth-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)  # nginx workers run as nobody
        upstream_port, auth_port = free_port(), free_port()
        resolver_port, proxy_port = free_port(), free_port()
        manifests(directory / "manifests", upstream_port, auth_port, args.cache)
        upstream = Proxy(
            "upstream nginx",
            ["nginx", "-e", "stderr", "-c", str(upstream_conf(directory, upstream_port, Path("/dev/null")))],
            upstream_port, CLIENT_CORE,
        )  # fmt: skip
        (directory / "auth").mkdir()
        auth_conf = nginx_conf(
            directory / "auth.conf", directory / "auth", workers=1,
            server=f"listen 127.0.0.1:{auth_port}; location / {{ return 200; }}",
        )  # fmt: skip
        auth = Proxy(
            "auth nginx", ["nginx", "-e", "stderr", "-c", str(auth_conf)], auth_port, CLIENT_CORE
        )
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
        rows = []
        try:
            upstream.start()
            auth.start()
            proxy.start()
            pids = tree(proxy.pid)
            for name, host in (("plain", HOST), ("auth-url" + " + cache" * args.cache, AUTH_HOST)):
                wrk(proxy_port, "/64", args.connections, 1, CLIENT_CORE, host=host)  # warm-up
                before = cpu_seconds(pids)
                run = wrk(
                    proxy_port, "/64", args.connections, args.duration, CLIENT_CORE, host=host
                )
                used = cpu_seconds(pids) - before
                cpu_us = used / max(run.rps * args.duration, 1) * 1e6
                rows.append((name, run.rps, run.p99_ms, cpu_us, run.errors))
        finally:
            proxy.stop()
            auth.stop()
            upstream.stop()
            resolver.terminate()
            resolver.wait(10)
    print("| route | req/s | p99 | proxy CPU per request | errors |")
    print("|---|---:|---:|---:|---|")
    for name, rps, p99, cpu_us, errors in rows:
        print(f"| {name} | {rps:,.0f} | {p99:.2f} ms | {cpu_us:,.0f} µs | {errors or '-'} |")
    plain, authed = rows[0], rows[1]
    print(f"\nauth-url / plain: {authed[1] / plain[1]:.2f}x the req/s, "
          f"{authed[3] / plain[3]:.2f}x the CPU per request")  # fmt: skip


if __name__ == "__main__":
    main()
