"""A/B of proxy builds beside HAProxy and the minimal relay: the probe behind a speed change.

    python -m bench.proxy.ab [NAME=DIR ...] [--rounds 4] [--seconds 4] [--connections 50]
                             [--burn-us 15 30]

Each NAME=DIR is a Waygate build: DIR holds a `waygate` package (for an old commit,
`git archive REV services | tar -x -C DIR && mv DIR/services DIR/waygate`), put first
on PYTHONPATH; `NAME=` (empty DIR) is this tree. With no build given, this tree alone.
Same set-up as `python -m bench.proxy`'s round 1 (every proxy pinned to core 0; wrk,
the nginx upstream and the resolver on core 1; 64-byte responses), but the proxies
take `--rounds` turns, order rotated, and each one's median req/s and CPU per request
(user and system apart, from /proc) is printed with its ratio to HAProxy. Alternating
turns is what lets two builds be compared on a machine whose speed drifts.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.proxy.__main__ import (
    CLIENT_CORE,
    PROXY_CORE,
    Proxy,
    free_port,
    haproxy_conf,
    pinned,
    routes_file,
    tree,
    upstream_conf,
    wrk,
)


def user_and_system(pids: list[int]) -> tuple[float, float]:
    """Seconds of user and of system time of `pids` so far."""
    user = system = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        user += int(fields[11])
        system += int(fields[12])
    hertz = os.sysconf("SC_CLK_TCK")
    return user / hertz, system / hertz


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.proxy.ab")
    parser.add_argument("builds", nargs="*", help="NAME=DIR (DIR holds a waygate package)")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--connections", type=int, default=50)
    parser.add_argument(
        "--burn-us",
        type=float,
        nargs="*",
        default=[],
        help="also minimal relays that busy-wait this many µs per read (one per value)",
    )
    args = parser.parse_args()
    builds = [build.split("=", 1) for build in args.builds] or [["this tree", ""]]
    with tempfile.TemporaryDirectory(prefix="waygate-bench-ab-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)  # nginx workers run as nobody
        big = directory / "big"
        big.write_bytes(b"")
        upstream_port = free_port()
        upstream = Proxy(
            "upstream",
            ["nginx", "-e", "stderr", "-c", str(upstream_conf(directory, upstream_port, big))],
            upstream_port, CLIENT_CORE,
        )  # fmt: skip
        resolver_port = free_port()
        resolver = subprocess.Popen(
            pinned(CLIENT_CORE, [sys.executable, "-m", "waygate", "resolver", "serve",
                   "--grpc-port", str(resolver_port), "--admin-port", "0", "--routes-file",
                   str(routes_file(directory / "routes.yaml", upstream_port))]),
            stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        proxies: list[Proxy] = []
        try:
            upstream.start()
            for name, path in builds:
                port = free_port()
                argv = [sys.executable, "-m", "waygate", "proxy", "serve", "--http-port",
                        str(port), "--https-port", "0", "--admin-port", "0",
                        "--resolver-address", f"127.0.0.1:{resolver_port}", "--workers", "1",
                        "--upstream-max-idle", "512"]  # fmt: skip
                if path:
                    argv = ["env", f"PYTHONPATH={path}", *argv]
                proxies.append(Proxy(name, argv, port, PROXY_CORE, log=directory / "p.log"))
            port = free_port()
            proxies.append(
                Proxy("HAProxy", ["haproxy", "-db", "-f",
                      str(haproxy_conf(directory, port, upstream_port, 1))], port, PROXY_CORE)
            )  # fmt: skip
            port = free_port()
            proxies.append(
                Proxy("minimal relay", [sys.executable, "-m", "bench.proxy.minimal", str(port),
                      str(upstream_port)], port, PROXY_CORE)
            )  # fmt: skip
            for burn in args.burn_us:
                port = free_port()
                proxies.append(
                    Proxy(f"minimal +{burn:g} us", [sys.executable, "-m", "bench.proxy.minimal",
                          str(port), str(upstream_port), str(burn)], port, PROXY_CORE)
                )  # fmt: skip
            for proxy in proxies:
                proxy.start()
            runs: dict[str, list[tuple[float, float, float]]] = {p.name: [] for p in proxies}
            for turn in range(args.rounds):
                for proxy in proxies[turn % len(proxies) :] + proxies[: turn % len(proxies)]:
                    wrk(proxy.port, "/64", args.connections, 1, CLIENT_CORE)  # warm-up
                    pids = tree(proxy.pid)
                    user, system = user_and_system(pids)
                    run = wrk(proxy.port, "/64", args.connections, args.seconds, CLIENT_CORE)
                    after_user, after_system = user_and_system(pids)
                    requests = max(run.rps * args.seconds, 1)
                    runs[proxy.name].append(
                        (
                            run.rps,
                            (after_user - user) / requests,
                            (after_system - system) / requests,
                        )
                    )
            haproxy = statistics.median(rps for rps, _, _ in runs["HAProxy"])
            for name, measured in runs.items():
                rps = statistics.median(r for r, _, _ in measured)
                user_us = statistics.median(u for _, u, _ in measured) * 1e6
                system_us = statistics.median(s for _, _, s in measured) * 1e6
                print(
                    f"{name:16} {rps:9,.0f} req/s  / HAProxy {rps / haproxy:.3f}  CPU per request "
                    f"{user_us + system_us:5.1f} us (user {user_us:.1f}, system {system_us:.1f})"
                )
        finally:
            for proxy in proxies:
                proxy.stop()
            if resolver.stdin is not None:
                resolver.stdin.close()
            resolver.terminate()
            resolver.wait()
            upstream.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
