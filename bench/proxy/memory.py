"""Where the proxy's memory goes under steady load: tracemalloc snapshots compared.

    python -m bench.proxy.memory [--phase 75] [--phases 4] [--frames 8]

(`--frames 0`: no tracemalloc, RSS only, the proxy at its own speed.)

The soak saw the proxy's RSS grow 86 -> 145 MiB over 30 minutes. This runs one
Waygate proxy (`--workers 1`, in one process) with tracemalloc started before
anything is imported, behind the bench's upstream nginx and a resolver with the
bench's route (an edge route with bench.proxy.tls's certificate as the default,
plain HTTP allowed), and loads it with six loops at once: wrk on kept-alive
connections (50), wrk with a new connection per request (`Connection: close`,
20), h2load over h2c (10 connections x 10 streams), wrk downloading 1 MiB bodies
(4 connections), wrk over HTTPS with a full handshake per request (10), and
h2load over TLS (4 connections x 10 streams). After a warm-up phase and after each further phase,
SIGUSR1 makes the proxy note its VmRSS, run the cyclic GC and `malloc_trim(0)`,
note VmRSS again, count the sessions in every `ssl.SSLContext`'s cache, then dump
a snapshot (with tracemalloc's traced total and the number of unreachable objects
the GC found), so the second RSS counts what the allocator could not give back and
the snapshot holds only what is reachable. (wrk and h2load leave no session in the
proxy's cache; Python clients, as the soak's, leave one per handshake.) The report lists, per phase, RSS,
traced Python memory and requests served, and the allocation sites whose size
grew most from the first snapshot to the last, grouped by source line (and, for
the top ones, their traceback). A site that grows in every phase in step with
the requests is a leak; RSS that grows while traced memory stays flat is native
memory (OpenSSL, gRPC core) or the allocator's fragmentation.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
import tracemalloc
from pathlib import Path

from bench.proxy.__main__ import (
    BIG,
    HOST,
    Proxy,
    free_port,
    install_peers,
    routes_file,
    upstream_conf,
)
from bench.proxy.tls import certificate

# Runs the proxy with tracemalloc on from the first import; SIGUSR1 dumps a snapshot.
WRAPPER = textwrap.dedent(
    """\
    import ctypes, gc, os, runpy, signal, ssl, sys, tracemalloc
    frames = int(os.environ["WAYGATE_TM_FRAMES"])
    if frames:
        tracemalloc.start(frames)
    out = os.environ["WAYGATE_TM_DIR"]
    count = [0]
    def rss():
        return [l for l in open("/proc/self/status") if l.startswith("VmRSS:")][0].split()[1]
    def dump(*_):
        as_is = rss()
        unreachable = gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        trimmed = rss()  # before the snapshot, which takes memory of its own
        sessions = sum(  # OpenSSL's server session caches, all contexts
            o.session_stats()["number"] for o in gc.get_objects() if isinstance(o, ssl.SSLContext)
        )
        count[0] += 1
        if frames:
            tracemalloc.take_snapshot().dump(f"{out}/snap{count[0]}.tm")
        with open(f"{out}/snap{count[0]}.txt", "w") as f:
            f.write(f"{as_is} {trimmed} {tracemalloc.get_traced_memory()[0]} {unreachable} {sessions}")
    signal.signal(signal.SIGUSR1, dump)
    sys.argv = ["waygate", *sys.argv[1:]]
    runpy.run_module("waygate", run_name="__main__", alter_sys=True)
    """
)


def start_load(port: int, https: int, seconds: float) -> list[subprocess.Popen[str]]:
    url = f"http://127.0.0.1:{port}/64"
    secure = f"https://127.0.0.1:{https}/64"
    argvs = [
        ["wrk", "-t1", "-c50", f"-d{seconds:g}s", "-H", f"Host: {HOST}", url],
        ["wrk", "-t1", "-c20", f"-d{seconds:g}s", "-H", f"Host: {HOST}",
         "-H", "Connection: close", url],
        ["h2load", "-c10", "-m10", f"-D{seconds:g}", "-H", f"host: {HOST}", url],
        ["wrk", "-t1", "-c4", f"-d{seconds:g}s", "-H", f"Host: {HOST}",
         f"http://127.0.0.1:{port}/1m"],
        ["wrk", "-t1", "-c10", f"-d{seconds:g}s", "-H", f"Host: {HOST}",
         "-H", "Connection: close", secure],
        ["h2load", "-c4", "-m10", f"-D{seconds:g}", "-H", f"host: {HOST}", secure],
    ]  # fmt: skip
    return [
        subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for argv in argvs
    ]


def requests_of(outputs: list[str]) -> int:
    total = 0
    for out in outputs:
        for line in out.splitlines():
            if "requests in" in line:  # wrk: "  123 requests in 10.0s, ..."
                total += int(line.split()[0])
            elif line.startswith(
                "requests:"
            ):  # h2load: "requests: N total, N started, N done, ..."
                total += int(line.split(",")[2].split()[0])
    return total


def snapshot(proxy: Proxy, directory: Path, index: int) -> tuple[int, int, int, int, int]:
    os.kill(proxy.pid, signal.SIGUSR1)
    marker = directory / f"snap{index}.txt"
    deadline = time.monotonic() + 120
    while not marker.exists() or not marker.read_text():
        if time.monotonic() > deadline:
            raise RuntimeError(f"no snapshot {index} from the proxy")
        time.sleep(0.2)
    as_is, trimmed, traced, unreachable, sessions = marker.read_text().split()
    return int(as_is), int(trimmed), int(traced), int(unreachable), int(sessions)


def main(args: argparse.Namespace) -> str:
    install_peers()
    lines: list[str] = []
    with tempfile.TemporaryDirectory(prefix="waygate-bench-memory-") as tmp:
        directory = Path(tmp)
        directory.chmod(0o755)
        big = directory / "big.bin"
        with open(big, "wb") as f:
            f.truncate(BIG)
        upstream_port = free_port()
        upstream = Proxy(
            "upstream nginx",
            ["nginx", "-e", "stderr", "-c", str(upstream_conf(directory, upstream_port, big))],
            upstream_port, "0,1",
        )  # fmt: skip
        (directory / "www" / "1m").write_bytes(b"z" * (1 << 20))
        resolver_port = free_port()
        resolver = subprocess.Popen(
            [sys.executable, "-m", "waygate", "resolver", "serve", "--grpc-port",
             str(resolver_port), "--admin-port", "0", "--routes-file",
             str(routes_file(directory / "routes.yaml", upstream_port, edge_tls=True))],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip
        port, https = free_port(), free_port()
        cert, key, _ = certificate(directory)
        wrapper = directory / "traced.py"
        wrapper.write_text(WRAPPER)
        os.environ["WAYGATE_TM_DIR"] = str(directory)
        os.environ["WAYGATE_TM_FRAMES"] = str(args.frames)
        proxy = Proxy(
            "Waygate (tracemalloc)",
            [sys.executable, str(wrapper), "proxy", "serve", "--http-port", str(port),
             "--https-port", str(https), "--default-certificate", str(cert),
             "--default-key", str(key), "--admin-port", "0", "--resolver-address",
             f"127.0.0.1:{resolver_port}", "--workers", "1", "--upstream-max-idle", "512"],
            port, "0,1", log=directory / "proxy.log",
        )  # fmt: skip
        try:
            upstream.start()
            proxy.start()
            rows = []
            served = 0
            for phase in range(args.phases + 1):
                load = start_load(port, https, args.phase)
                outputs = [p.communicate(timeout=args.phase + 60)[0] for p in load]
                served += requests_of(outputs)
                time.sleep(1)  # let the last connections close
                as_is, rss, traced, unreachable, sessions = snapshot(proxy, directory, phase + 1)
                rows.append((phase, served, as_is, rss, traced, unreachable, sessions, outputs))
                print(f"phase {phase}: {served} requests ({[requests_of([o]) for o in outputs]}), "
                      f"RSS {as_is / 1024:.1f} -> {rss / 1024:.1f} MiB, traced "
                      f"{traced / 2**20:.1f} MiB, {sessions} TLS sessions cached",
                      file=sys.stderr, flush=True)  # fmt: skip
            if args.frames:
                first = tracemalloc.Snapshot.load(str(directory / "snap1.tm"))
                last = tracemalloc.Snapshot.load(str(directory / f"snap{args.phases + 1}.tm"))
                middle = tracemalloc.Snapshot.load(
                    str(directory / f"snap{args.phases // 2 + 1}.tm")
                )
        finally:
            proxy.stop()
            resolver.terminate()
            resolver.wait(10)
            upstream.stop()
    lines += [
        "| after phase | requests so far | of them HTTPS (new connection; h2) | VmRSS as is "
        "| VmRSS after gc + malloc_trim | traced by tracemalloc | unreachable objects "
        "collected | TLS sessions cached |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for phase, served, as_is, rss, traced, unreachable, sessions, outputs in rows:
        label = "warm-up" if phase == 0 else str(phase)
        https = " ; ".join(f"{requests_of([out]):,}" for out in outputs[4:])
        lines.append(
            f"| {label} | {served:,} | {https} | {as_is / 1024:.1f} MiB | {rss / 1024:.1f} MiB "
            f"| {traced / 2**20:.2f} MiB | {unreachable:,} | {sessions:,} |"
        )
    if not args.frames:
        return "\n".join(lines)
    filters = [
        tracemalloc.Filter(False, tracemalloc.__file__),
        tracemalloc.Filter(False, "<frozen importlib._bootstrap>"),
    ]
    stats = sorted(
        last.filter_traces(filters).compare_to(first.filter_traces(filters), "lineno"),
        key=lambda stat: stat.size_diff,
        reverse=True,
    )
    half = {
        str(s.traceback): s.size_diff
        for s in middle.filter_traces(filters).compare_to(first.filter_traces(filters), "lineno")
    }
    lines += ["", "Top allocation sites by growth, warm-up -> last (-> middle):", "",
              "| site | growth to last | growth to middle | blocks now |", "|---|---:|---:|---:|"]  # fmt: skip
    for stat in stats[:15]:
        frame = stat.traceback[0]
        lines.append(
            f"| {frame.filename.split('site-packages/')[-1].split('services/')[-1]}:{frame.lineno} "
            f"| {stat.size_diff / 1024:+.1f} KiB | {half.get(str(stat.traceback), 0) / 1024:+.1f} KiB "
            f"| {stat.count:,} |"
        )
    growth = sorted(
        last.filter_traces(filters).compare_to(first.filter_traces(filters), "traceback"),
        key=lambda stat: stat.size_diff,
        reverse=True,
    )
    lines += ["", "Tracebacks of the three largest growths:", ""]
    for stat in growth[:3]:
        lines.append(f"- {stat.size_diff / 1024:+.1f} KiB, {stat.count_diff:+,} blocks:")
        lines += [f"    {line}" for line in stat.traceback.format()[-args.frames * 2 :]]
    return "\n".join(lines)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", type=float, default=75.0, help="seconds of load per phase")
    parser.add_argument("--phases", type=int, default=4, help="measured phases after the warm-up")
    parser.add_argument(
        "--frames", type=int, default=8, help="tracemalloc frames kept (0: no tracemalloc)"
    )
    print(main(parser.parse_args()))
