"""What ingress-nginx's commonest annotations cost a request, in Waygate and in nginx
configured as ingress-nginx would be (issue 27 item 10).

    python -m bench.proxy.annotations [--rounds 3] [--seconds 5] [--connections 50]

Two routes to the same nginx upstream, on each proxy: a plain one, and one whose
Ingress carries the annotations users rely on most:

    nginx.ingress.kubernetes.io/enable-cors: "true"
    nginx.ingress.kubernetes.io/cors-allow-origin: https://app.example.com
    nginx.ingress.kubernetes.io/use-regex: "true"
    nginx.ingress.kubernetes.io/rewrite-target: /$2      (path /api(/|$)(.*))
    nginx.ingress.kubernetes.io/whitelist-source-range: 127.0.0.0/8,10.0.0.0/8
    nginx.ingress.kubernetes.io/affinity: cookie
    nginx.ingress.kubernetes.io/session-cookie-name: route

Waygate: a real resolver (`--manifests --ingress-nginx`) and one proxy worker.
nginx (Debian's, one worker) with what ingress-nginx's template renders for those
annotations: its CORS block (`$http_origin` matched case-insensitively, `set $cors`,
`more_set_headers` from the headers-more module, the 204 preflight), `allow`/`deny`,
`rewrite "(?i)/api(/|$)(.*)" /$2 break` in a `~*` location. Cookie affinity is
ingress-nginx's Lua balancer, which nginx OSS lacks: the nearest is used, the
upstream chosen by `hash $cookie_route consistent` and a Set-Cookie added when the
client holds none (a first visit, as wrk's every request is; Waygate sets its
cookie then too).

Both proxies on core 0; wrk (1 thread), the upstream and the resolver on core 1.
Every request is the same GET /api/64 with an `Origin: https://app.example.com`
(the plain routes, on the path prefix /api beside /, serve /api/64 as it is; the
annotated ones rewrite it to /64);
each answer is checked first (the CORS lines and the Set-Cookie on the annotated
route, neither on the plain one). The four cells take `--rounds` turns, order
rotated, each after 1 s of warm-up; the medians of req/s and of the proxy's CPU
(user + system, from /proc) per request, and the ratios annotated / plain: of the
medians, and the median of each round's own ratio (the two routes of a round run
one after the other, so a drift of the shared machine between rounds cancels).
"""

from __future__ import annotations

import argparse
import socket
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.machine import describe
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

ANNOTATED_HOST = "annotated." + HOST
ORIGIN = "https://app.example.com"
PATH = "/api/64"
HEADERS_MORE = "/usr/lib/nginx/modules/ngx_http_headers_more_filter_module.so"
ANNOTATIONS = {
    "enable-cors": "true",
    "cors-allow-origin": ORIGIN,
    "use-regex": "true",
    "rewrite-target": "/$2",
    "whitelist-source-range": "127.0.0.0/8,10.0.0.0/8",
    "affinity": "cookie",
    "session-cookie-name": "route",
}
# ingress-nginx's cors-* defaults (the resolver's too).
CORS_METHODS = "GET, PUT, POST, DELETE, PATCH, OPTIONS"
CORS_HEADERS = (
    "DNT,Keep-Alive,User-Agent,X-Requested-With,If-Modified-Since,Cache-Control,"
    "Content-Type,Range,Authorization"
)


def manifests(path: Path, upstream: int) -> None:
    path.mkdir()
    annotations = "".join(
        f'\n    nginx.ingress.kubernetes.io/{name}: "{value}"'
        for name, value in ANNOTATIONS.items()
    )
    (path / "bench.yaml").write_text(
        upstream_objects(upstream)
        + f"""---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata: {{name: plain, namespace: bench}}
spec:
  ingressClassName: nginx
  rules:
  - host: {HOST}
    http:
      paths:
      - path: /api
        pathType: Prefix
        backend: {{service: {{name: upstream, port: {{number: 80}}}}}}
      - path: /
        pathType: Prefix
        backend: {{service: {{name: upstream, port: {{number: 80}}}}}}
---
apiVersion: networking.k8s.io/v1
kind: Ingress
metadata:
  name: annotated
  namespace: bench
  annotations:{annotations}
spec:
  ingressClassName: nginx
  rules:
  - host: {ANNOTATED_HOST}
    http:
      paths:
      - path: /api(/|$)(.*)
        pathType: ImplementationSpecific
        backend: {{service: {{name: upstream, port: {{number: 80}}}}}}
"""
    )


def ingress_nginx_conf(directory: Path, port: int, upstream: int) -> Path:
    """nginx as ingress-nginx renders the two Ingresses (its template's CORS block,
    allow/deny, the capture rewrite), affinity by the nearest nginx OSS has."""
    proxying = """
        proxy_http_version 1.1;
        proxy_set_header Connection "";
        proxy_set_header Host $host;
        proxy_set_header X-Forwarded-For $proxy_add_x_forwarded_for;"""
    cors_lines = f"""
            more_set_headers 'Access-Control-Allow-Origin: $http_origin';
            more_set_headers 'Access-Control-Allow-Credentials: true';
            more_set_headers 'Access-Control-Allow-Methods: {CORS_METHODS}';
            more_set_headers 'Access-Control-Allow-Headers: {CORS_HEADERS}';
            more_set_headers 'Access-Control-Max-Age: 1728000';"""
    origin = ORIGIN.replace(".", r"\.")
    return nginx_conf(
        directory / "ingress-nginx.conf",
        directory,
        workers=1,
        main=f"load_module {HEADERS_MORE};\n",
        http=f"""
            upstream plain {{ server 127.0.0.1:{upstream}; keepalive 512; }}
            upstream sticky {{
              hash $cookie_route consistent;
              server 127.0.0.1:{upstream};
              keepalive 512;
            }}
            map $cookie_route $route_cookie {{
              "" "route=5f3b1c; Path=/; HttpOnly";
              default "";
            }}
            server {{
              listen 127.0.0.1:{port};
              server_name {ANNOTATED_HOST};
              location ~* "^/api(/|$)(.*)" {{
                set $cors '';
                if ($http_origin ~* (^{origin}$)) {{ set $cors 'true'; }}
                if ($request_method = 'OPTIONS') {{ set $cors "${{cors}}options"; }}
                if ($cors = "true") {{{cors_lines}
                }}
                if ($cors = "trueoptions") {{{cors_lines}
                  more_set_headers 'Content-Type: text/plain charset=UTF-8';
                  more_set_headers 'Content-Length: 0';
                  return 204;
                }}
                allow 127.0.0.0/8;
                allow 10.0.0.0/8;
                deny all;
                rewrite "(?i)/api(/|$)(.*)" /$2 break;
                add_header Set-Cookie $route_cookie;
                proxy_pass http://sticky;{proxying}
              }}
            }}
        """,
        server=f"""
            listen 127.0.0.1:{port} backlog=4096 default_server;
            server_name {HOST};
            location /api {{
              proxy_pass http://plain;{proxying}
            }}
            location / {{
              proxy_pass http://plain;{proxying}
            }}
        """,
    )


def answer_head(port: int, host: str) -> bytes:
    """The response head (and body) to the benchmark's request."""
    with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
        conn.sendall(
            f"GET {PATH} HTTP/1.1\r\nHost: {host}\r\nOrigin: {ORIGIN}\r\n"
            "Connection: close\r\n\r\n".encode()
        )
        data = b""
        while chunk := conn.recv(65536):
            data += chunk
    return data


def check(name: str, port: int, host: str, annotated: bool) -> None:
    """The route answers 200 with the 64-byte file, with (annotated) or without the
    CORS lines and the affinity cookie."""
    data = answer_head(port, host)
    head, _, body = data.partition(b"\r\n\r\n")
    lower = head.lower()
    ok = head.startswith(b"HTTP/1.1 200") and len(body) == 64
    for line in (b"access-control-allow-origin: " + ORIGIN.encode(), b"set-cookie: route="):
        ok = ok and ((line in lower) == annotated)
    if not ok:
        raise RuntimeError(f"{name} on {host}: unexpected answer\n{data[:1500]!r}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=5.0)
    parser.add_argument("--connections", type=int, default=50)
    args = parser.parse_args()
    install_peers({HEADERS_MORE: "libnginx-mod-http-headers-more-filter"})
    print(describe())
    with tempfile.TemporaryDirectory(prefix="waygate-bench-annotations-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)  # nginx workers run as nobody
        upstream_port, resolver_port = free_port(), free_port()
        waygate_port, nginx_port = free_port(), free_port()
        manifests(directory / "manifests", upstream_port)
        upstream = Proxy(
            "upstream nginx",
            ["nginx", "-e", "stderr", "-c", str(upstream_conf(directory, upstream_port, Path("/dev/null")))],
            upstream_port, CLIENT_CORE,
        )  # fmt: skip
        (directory / "www" / "api").mkdir()
        (directory / "www" / "api" / "64").write_bytes(b"x" * 63 + b"\n")
        resolver = subprocess.Popen(
            [sys.executable, "-m", "waygate", "resolver", "serve", "--grpc-port", str(resolver_port),
             "--admin-port", "0", "--manifests", str(directory / "manifests"), "--ingress-nginx"],
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        proxies = [
            Proxy(
                "Waygate (1 worker)",
                [sys.executable, "-m", "waygate", "proxy", "serve", "--http-port", str(waygate_port),
                 "--https-port", "0", "--admin-port", "0", "--workers", "1",
                 "--upstream-max-idle", "512", "--resolver-address", f"127.0.0.1:{resolver_port}"],
                waygate_port, PROXY_CORE, log=directory / "proxy.log",
            ),
            Proxy(
                "nginx (1 worker)",
                ["nginx", "-e", "stderr", "-c",
                 str(ingress_nginx_conf(directory, nginx_port, upstream_port))],
                nginx_port, PROXY_CORE,
            ),
        ]  # fmt: skip
        cells = [
            (proxy, route, host)
            for proxy in proxies
            for route, host in (("plain", HOST), ("annotated", ANNOTATED_HOST))
        ]
        runs: dict[tuple[str, str], list[tuple[float, float, float]]] = {
            (p.name, route): [] for p, route, _ in cells
        }
        try:
            upstream.start()
            for proxy in proxies:
                proxy.start()
                for _, route, host in (c for c in cells if c[0] is proxy):
                    check(proxy.name, proxy.port, host, route == "annotated")
            origin = (f"Origin: {ORIGIN}",)
            for turn in range(args.rounds):
                for proxy, route, host in cells[turn % len(cells) :] + cells[: turn % len(cells)]:
                    wrk(proxy.port, PATH, args.connections, 1, CLIENT_CORE, host, origin)
                    pids = tree(proxy.pid)
                    before = cpu_seconds(pids)
                    run = wrk(
                        proxy.port, PATH, args.connections, args.seconds, CLIENT_CORE, host, origin
                    )
                    used = cpu_seconds(pids) - before
                    if run.errors:
                        raise RuntimeError(f"{proxy.name} {route}: {run.errors}")
                    cpu_us = used / max(run.rps * args.seconds, 1) * 1e6
                    runs[(proxy.name, route)].append((run.rps, run.p99_ms, cpu_us))
        finally:
            for proxy in proxies:
                proxy.stop()
            upstream.stop()
            if resolver.stdin is not None:
                resolver.stdin.close()
            resolver.terminate()
            resolver.wait(10)
    print(f"\n{args.rounds} rounds x {args.seconds:g} s, wrk -c{args.connections}, medians")
    print(
        "| proxy | route | req/s | p99 | CPU per request | annotated / plain (CPU) "
        "| the same, round by round (median) |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for proxy in proxies:
        medians = {}
        for route in ("plain", "annotated"):
            measured = runs[(proxy.name, route)]
            medians[route] = tuple(statistics.median(m[i] for m in measured) for i in range(3))
        # Each round measures both routes one after the other: the ratio within a round
        # leaves out what drifts between rounds (the shared machine's other work).
        by_round = statistics.median(
            a[2] / p[2]
            for p, a in zip(
                runs[(proxy.name, "plain")], runs[(proxy.name, "annotated")], strict=True
            )
        )
        for route, (rps, p99, cpu_us) in medians.items():
            ratio = cpu_us / medians["plain"][2]
            within = f"{by_round:.2f}" if route == "annotated" else ""
            print(
                f"| {proxy.name} | {route} | {rps:,.0f} | {p99:.2f} ms | {cpu_us:.1f} µs "
                f"| {ratio:.2f} | {within} |"
            )
    rounds = {key: [f"{cpu:.1f}" for _, _, cpu in value] for key, value in runs.items()}
    print("\nCPU per request (µs), every round:", rounds)


if __name__ == "__main__":
    main()
