"""HTTPS benchmark: Waygate's HTTPS listener (edge termination) beside HAProxy's.

    python -m bench.proxy.tls [--duration 5]

Both terminate TLS with the same certificate and key (ECDSA P-256, made here)
and forward HTTP/1.1 to the same upstream (bench/proxy's nginx serving a
64-byte body). Waygate `--workers 1` with the certificate as its default
(`--default-certificate`), HAProxy `nbthread 1` with Mozilla intermediate
ciphers; each proxy pinned to core 0, wrk and the upstream to core 1, taking
turns in the same run:

- keep-alive: wrk -t1 -c50 over HTTPS, 64 B responses (TLS on established
  connections: the record layer's cost);
- handshakes: the same with `Connection: close`, so every request is a new
  TCP connection and a full TLS handshake (wrk does not resume sessions).

Reported as req/s and Waygate / HAProxy. `bench.proxy` runs this after its
HTTP rounds; it also runs alone.
"""

from __future__ import annotations

import argparse
import datetime as dt
import sys
import tempfile
import textwrap
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bench.machine import describe
from bench.proxy.__main__ import (
    CLIENT_CORE,
    HOST,
    PROXY_CORE,
    Proxy,
    free_port,
    install_peers,
    load,
    pinned,
    routes_file,
    upstream_conf,
)

CONNECTIONS = 50


def certificate(directory: Path) -> tuple[Path, Path, Path]:
    """(cert, key, combined) PEM files: a P-256 leaf for HOST from a throw-away CA."""
    now = dt.datetime.now(dt.UTC)
    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "bench CA")])
    key = ec.generate_private_key(ec.SECP256R1())
    leaf = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([]))
        .issuer_name(ca_name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(hours=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.SubjectAlternativeName([x509.DNSName(HOST)]), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    cert_pem = leaf.public_bytes(serialization.Encoding.PEM)
    key_pem = key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )
    paths = directory / "cert.pem", directory / "key.pem", directory / "combined.pem"
    paths[0].write_bytes(cert_pem)
    paths[1].write_bytes(key_pem)
    paths[1].chmod(0o600)
    paths[2].write_bytes(cert_pem + key_pem)
    paths[2].chmod(0o600)
    return paths


def haproxy_tls_conf(directory: Path, port: int, upstream: int, combined: Path) -> Path:
    path = directory / "haproxy-tls.cfg"
    path.write_text(
        textwrap.dedent(
            f"""\
            global
              nbthread 1
              maxconn 8000
              ssl-default-bind-ciphers ECDHE-ECDSA-AES128-GCM-SHA256:ECDHE-RSA-AES128-GCM-SHA256:ECDHE-ECDSA-AES256-GCM-SHA384:ECDHE-RSA-AES256-GCM-SHA384:ECDHE-ECDSA-CHACHA20-POLY1305:ECDHE-RSA-CHACHA20-POLY1305
              ssl-default-bind-options ssl-min-ver TLSv1.2 no-tls-tickets
            defaults
              mode http
              option http-keep-alive
              option forwardfor
              http-reuse safe
              timeout connect 5s
              timeout client 30s
              timeout server 30s
            frontend bench
              bind 127.0.0.1:{port} ssl crt {combined} alpn http/1.1
              default_backend upstream
            backend upstream
              server up 127.0.0.1:{upstream}
            """
        )
    )
    return path


def https_status(port: int) -> int:
    import socket
    import ssl

    context = ssl.create_default_context()
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with (
            socket.create_connection(("127.0.0.1", port), timeout=2) as raw,
            context.wrap_socket(raw, server_hostname=HOST) as conn,
        ):
            conn.sendall(f"GET /64 HTTP/1.1\r\nHost: {HOST}\r\nConnection: close\r\n\r\n".encode())
            return int(conn.recv(64).split(b" ", 2)[1])
    except (OSError, ValueError, IndexError):
        return 0


def wait_https(proxy: Proxy, port: int) -> None:
    deadline = time.monotonic() + 120
    while https_status(port) != 200:
        if proxy.processes[-1].poll() is not None or time.monotonic() > deadline:
            tail = proxy.log.read_text()[-2000:] if proxy.log else ""
            raise RuntimeError(f"{proxy.name} did not serve HTTPS on {port}:\n{tail}")
        time.sleep(0.2)


def wrk_https(port: int, seconds: float, *, close: bool) -> tuple[float, str]:
    import re
    import subprocess

    argv = ["wrk", "-t1", f"-c{CONNECTIONS}", f"-d{seconds:g}s", "-H", f"Host: {HOST}"]
    if close:
        argv += ["-H", "Connection: close"]
    argv.append(f"https://127.0.0.1:{port}/64")
    result = subprocess.run(
        pinned(CLIENT_CORE, argv), capture_output=True, text=True, timeout=seconds + 60
    )
    match = re.search(r"Requests/sec:\s+([\d.]+)", result.stdout)
    if match is None:
        return 0.0, (result.stdout + result.stderr)[-300:]
    errors = re.search(r"(Non-2xx or 3xx responses: \d+|Socket errors: .*)", result.stdout)
    return float(match.group(1)), errors.group(1) if errors else ""


def main(duration: float) -> str:
    import subprocess

    install_peers()
    load_before = load()
    rows: list[str] = []
    with tempfile.TemporaryDirectory(prefix="waygate-bench-tls-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)
        cert, key, combined = certificate(directory)
        big = directory / "big.bin"
        big.write_bytes(b"")
        upstream_port = free_port()
        upstream = Proxy(
            "upstream nginx",
            ["nginx", "-e", "stderr", "-c", str(upstream_conf(directory, upstream_port, big))],
            upstream_port,
            CLIENT_CORE,
        )
        resolver_port = free_port()
        resolver_argv = [
            sys.executable, "-m", "waygate", "resolver", "serve", "--grpc-port",
            str(resolver_port), "--admin-port", "0", "--routes-file",
            str(routes_file(directory / "routes.yaml", upstream_port, edge_tls=True)),
        ]  # fmt: skip
        resolver = subprocess.Popen(
            pinned(CLIENT_CORE, resolver_argv),
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        https_ports = [free_port(), free_port()]
        waygate = Proxy(
            "Waygate (1 worker)",
            [
                sys.executable, "-m", "waygate", "proxy", "serve", "--http-port",
                str(free_port()), "--https-port", str(https_ports[0]), "--admin-port", "0",
                "--resolver-address", f"127.0.0.1:{resolver_port}",
                "--default-certificate", str(cert), "--default-key", str(key),
                "--upstream-max-idle", "512",
            ],
            https_ports[0],
            PROXY_CORE,
            log=directory / "waygate.log",
        )  # fmt: skip
        haproxy = Proxy(
            "HAProxy (nbthread 1)",
            ["haproxy", "-db", "-f", str(haproxy_tls_conf(directory, https_ports[1],
                                                          upstream_port, combined))],
            https_ports[1],
            PROXY_CORE,
            log=directory / "haproxy.log",
        )  # fmt: skip
        proxies = [waygate, haproxy]
        try:
            upstream.start()
            for proxy in proxies:
                out = open(proxy.log, "wb") if proxy.log else subprocess.DEVNULL  # noqa: SIM115
                proxy.processes.append(
                    subprocess.Popen(
                        pinned(proxy.cores, proxy.argv),
                        stdin=subprocess.PIPE,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                    )
                )
                wait_https(proxy, proxy.port)
            figures: dict[tuple[str, str], tuple[float, str]] = {}
            for turn, (label, close) in enumerate(
                (("keep-alive, 64 B", False), ("new connection + full handshake", True))
            ):
                order = proxies if turn % 2 == 0 else list(reversed(proxies))
                for proxy in order:
                    wrk_https(proxy.port, 1, close=close)  # warm-up
                    figures[(label, proxy.name)] = wrk_https(proxy.port, duration, close=close)
                haproxy_rps = figures[(label, haproxy.name)][0] or 1.0
                for proxy in proxies:
                    rps, errors = figures[(label, proxy.name)]
                    bold = "**" if proxy is waygate else ""
                    rows.append(
                        f"| {label} | {CONNECTIONS} | {bold}{proxy.name}{bold} | {rps:,.0f} | "
                        f"{bold}{rps / haproxy_rps:.2f}{bold} | {errors} |"
                    )
        finally:
            for proxy in proxies:
                proxy.stop()
            upstream.stop()
            resolver.terminate()
            resolver.wait(20)
    return "\n".join(
        [
            "## HTTPS: edge termination, Waygate beside HAProxy",
            "",
            f"Command: `.venv/bin/python -m bench.proxy.tls --duration {duration:g}`. "
            f"Machine: {describe()}. Load average before / after: {load_before} / {load()}. "
            "Same ECDSA P-256 certificate and key for both; wrk -t1 on core 1, proxy on core 0.",
            "",
            "| test | conns | proxy | req/s | / HAProxy | errors |",
            "|---|---:|---|---:|---:|---|",
            *rows,
            "",
        ]
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m bench.proxy.tls")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds per figure")
    report = main(parser.parse_args().duration)
    print(report)
    sys.stdout.flush()
