"""What a replica that stops re-encrypting would buy: the relay's two designs, side by side.

    python -m bench.tunnel.e2e_probe [--mib 1024] [--rounds 2]

Not Waygate's code: a probe for the design question issue 19's bulk aim leaves (1.5x
`ssh -R`; perf puts 35% of a bulk transfer's CPU in libcrypto, the replica alone at 44%,
bench/RESULTS.md round 7). The same harness runs both designs, so only the relay
differs: a dialer (this process) sends `--mib` MiB in 64 KiB writes over TLS 1.3
through a relay process to an agent process, which decrypts and writes plain TCP to a
sink process, which reports when every byte arrived. Blocking sockets, one thread per
process, no event loop: each side is as cheap as Python gets, so the figures bound what
each design can do rather than measure Waygate's relay.

- `reencrypt` (the tunnel today): the relay terminates the dialer's TLS and opens its
  own to the agent, decrypting and re-encrypting every byte.
- `splice`: the relay copies TCP bytes with `splice(2)` through a pipe, never in user
  space; the dialer's TLS session ends at the agent (TLS end to end). Authorizing
  the dial on the relay's own mTLS first, and the agent verifying the dialer, are what
  such a design would add; they cost nothing per byte and are not modelled here.

Prints, per design, the best GB/s and the CPU seconds per GiB of each process.
"""

from __future__ import annotations

import argparse
import fcntl
import multiprocessing
import os
import socket
import ssl
import sys
import tempfile
import threading
import time
from pathlib import Path

from bench.tunnel.__main__ import cpu_seconds, gbps
from tests.support.pki import LocalCA

CHUNK = 64 * 1024
PIPE_SIZE = 1 << 20


def _server_context(files: tuple[str, str]) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_cert_chain(*files)
    return context


def _client_context(ca_pem: str) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.minimum_version = ssl.TLSVersion.TLSv1_3
    context.load_verify_locations(cadata=ca_pem)
    return context


def _listen() -> socket.socket:
    listener = socket.create_server(("127.0.0.1", 0))
    return listener


def _sink(listener: socket.socket, done: multiprocessing.Queue, total: int) -> None:
    buffer = bytearray(1 << 20)
    while True:
        connection, _ = listener.accept()
        received = 0
        while received < total and (got := connection.recv_into(buffer)):
            received += got
        connection.close()
        done.put(received)


def _agent(listener: socket.socket, sink_port: int, files: tuple[str, str]) -> None:
    context = _server_context(files)
    buffer = bytearray(256 * 1024)
    view = memoryview(buffer)
    while True:
        raw, _ = listener.accept()
        tls = context.wrap_socket(raw, server_side=True)
        out = socket.create_connection(("127.0.0.1", sink_port))
        out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            while got := tls.recv_into(buffer):
                out.sendall(view[:got])
        except (ssl.SSLError, OSError):
            pass
        out.close()
        tls.close()


def _relay(
    listener: socket.socket, agent_port: int, mode: str, files: tuple[str, str], ca_pem: str
) -> None:
    server_context, client_context = _server_context(files), _client_context(ca_pem)
    buffer = bytearray(256 * 1024)
    view = memoryview(buffer)
    while True:
        raw_in, _ = listener.accept()
        raw_out = socket.create_connection(("127.0.0.1", agent_port))
        raw_out.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        ends = [raw_in, raw_out]
        try:
            if mode == "splice":
                # The handshake's answers (and the agent's tickets) go back on a thread.
                back = threading.Thread(target=_splice, args=(raw_out, raw_in), daemon=True)
                back.start()
                _splice(raw_in, raw_out)
                raw_out.shutdown(socket.SHUT_WR)
                back.join(10)
            else:
                tls_in = server_context.wrap_socket(raw_in, server_side=True)
                ends.append(tls_in)
                tls_out = client_context.wrap_socket(raw_out, server_hostname="localhost")
                ends.append(tls_out)
                while got := tls_in.recv_into(buffer):
                    tls_out.sendall(view[:got])
        except (ssl.SSLError, OSError):
            pass
        for end in ends:
            end.close()


def _splice(source: socket.socket, target: socket.socket) -> None:
    """Copy `source` to `target` until EOF, through a pipe, never into user space."""
    read_end, write_end = os.pipe()
    try:
        fcntl.fcntl(write_end, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        while moved := os.splice(source.fileno(), write_end, PIPE_SIZE):
            while moved:
                moved -= os.splice(read_end, target.fileno(), moved)
    except OSError:
        pass  # the other end closed or reset: this direction is over
    finally:
        os.close(read_end)
        os.close(write_end)


def _push(port: int, ca_pem: str, total: int, done: multiprocessing.Queue) -> int:
    """Send `total` bytes and wait for the sink's count before closing (a close with the
    relay's tickets unread would reset the connection under bytes still in flight)."""
    context = _client_context(ca_pem)
    with socket.create_connection(("127.0.0.1", port)) as raw:
        raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with context.wrap_socket(raw, server_hostname="localhost") as tls:
            chunk = b"\x5a" * CHUNK
            sent = 0
            while sent < total:
                tls.sendall(chunk)
                sent += CHUNK
            return int(done.get(timeout=300))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB per transfer [1024]")
    parser.add_argument("--rounds", type=int, default=2, help="transfers per design, best kept [2]")
    args = parser.parse_args()
    total = args.mib << 20
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="bench-e2e-probe-") as tmp:
        ca = LocalCA()
        files = ca.write_files(Path(tmp) / "server", dns=["localhost"], ips=["127.0.0.1"])
        identity = (str(files.cert), str(files.key))
        ca_pem = ca.pem.decode()
        done: multiprocessing.Queue = context.Queue()
        print(
            f"e2e probe: {args.mib} MiB per transfer, 64 KiB writes, TLS 1.3, best of "
            f"{args.rounds}; load {os.getloadavg()[0]:.1f}"
        )
        for mode in ("reencrypt", "splice"):
            listeners = [_listen() for _ in range(3)]
            sink_port, agent_port, relay_port = (s.getsockname()[1] for s in listeners)
            children = [
                context.Process(target=_sink, args=(listeners[0], done, total), daemon=True),
                context.Process(
                    target=_agent, args=(listeners[1], sink_port, identity), daemon=True
                ),
                context.Process(
                    target=_relay,
                    args=(listeners[2], agent_port, mode, identity, ca_pem),
                    daemon=True,
                ),
            ]
            for child in children:
                child.start()
            pids = [c.pid for c in children if c.pid is not None]
            best = float("inf")
            spent: list[float] = []
            for _ in range(args.rounds):
                before = [cpu_seconds([p]) - cpu_seconds([]) for p in pids] + [cpu_seconds([])]
                started = time.perf_counter()
                received = _push(relay_port, ca_pem, total, done)
                elapsed = time.perf_counter() - started
                after = [cpu_seconds([p]) - cpu_seconds([]) for p in pids] + [cpu_seconds([])]
                if received != total:
                    print(f"{mode}: the sink received {received} of {total} bytes", file=sys.stderr)
                    return 1
                if elapsed < best:
                    best = elapsed
                    spent = [a - b for a, b in zip(after, before, strict=True)]
            for child in children:
                child.kill()
                child.join()
            for listener in listeners:
                listener.close()
            gib = total / (1 << 30)
            sink, agent, relay, dialer = (s / gib for s in spent)
            print(
                f"- {mode}: {gbps(total, best):.2f} GB/s; CPU s per GiB: relay {relay:.2f}, "
                f"agent {agent:.2f}, dialer {dialer:.2f}, sink {sink:.2f}; "
                f"total {relay + agent + dialer + sink:.2f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
