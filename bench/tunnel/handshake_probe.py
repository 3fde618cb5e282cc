"""What one TLS 1.3 handshake with client certificates costs here: the price of a dial end
to end (bench/RESULTS.md, round 8).

    python -m bench.tunnel.handshake_probe [--count 50]

The contexts are the tunnel's own for TLS end to end (`relay.end_to_end_context`: the
agent's side requires the dialer's certificate, ECDSA P-256 leaves from a `LocalCA`).
Prints the p50 of `--count` handshakes between two `SocketLink`s over a socketpair on
one uvloop loop (the agent's and dialer's path, minus the network), and of the same
handshake with blocking sockets in two threads (OpenSSL alone, no event loop).
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import uvloop

from tests.support.pki import LocalCA
from waygate.tunnel.relay import SocketLink, client_context, end_to_end_context


def _contexts(directory: Path) -> tuple[object, object]:
    ca = LocalCA()
    agent = ca.write_files(directory, dns=["edge-1"], prefix="agent-", client_only=True)
    dialer = ca.write_files(directory, uris=["spiffe://bench/dialer"], prefix="dialer-")

    def outer(files: object) -> object:
        return client_context(
            files.ca.read_bytes(),  # type: ignore[attr-defined]
            files.cert.read_bytes(),  # type: ignore[attr-defined]
            files.key.read_bytes(),  # type: ignore[attr-defined]
        )

    return (
        end_to_end_context(outer(agent), server_side=True),  # type: ignore[arg-type]
        end_to_end_context(outer(dialer), server_side=False),  # type: ignore[arg-type]
    )


async def _on_loop(server: object, client: object, count: int) -> list[float]:
    took = []
    for _ in range(count):
        left, right = socket.socketpair()
        left.setblocking(False)
        right.setblocking(False)
        started = time.perf_counter()
        accepting = SocketLink(server, left, server_side=True)  # type: ignore[arg-type]
        dialling = SocketLink(client, right, server_side=False)  # type: ignore[arg-type]
        accepting.start()
        dialling.start()
        await asyncio.gather(accepting.established, dialling.established)
        took.append((time.perf_counter() - started) * 1000)
        accepting.abort()
        dialling.abort()
    return took


def _blocking(server: object, client: object, count: int) -> list[float]:
    took = []
    for _ in range(count):
        left, right = socket.socketpair()
        accepting = threading.Thread(
            target=lambda: server.wrap_socket(left, server_side=True).close()  # type: ignore[attr-defined]  # noqa: B023
        )
        accepting.start()
        started = time.perf_counter()
        dialled = client.wrap_socket(right)  # type: ignore[attr-defined]
        took.append((time.perf_counter() - started) * 1000)
        dialled.close()
        accepting.join()
    return took


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=50)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-handshake-") as tmp:
        server, client = _contexts(Path(tmp))
        on_loop = uvloop.run(_on_loop(server, client, args.count))
        blocking = _blocking(server, client, args.count)
    print(
        f"TLS 1.3 mTLS handshake, p50 of {args.count}: two SocketLinks on one uvloop loop "
        f"{statistics.median(on_loop):.2f} ms; blocking sockets in two threads "
        f"{statistics.median(blocking):.2f} ms"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
