"""Memory freed after a flood goes back to the OS (issue 18 item 6, "memory kept
after attacks"), over real TLS sockets.

A gRPC server with mTLS (as the tunnel server's agent port) is flooded by a
child process with thousands of garbage connections, a thousand at once. gRPC
core and OpenSSL free what those connections used, but glibc kept the pages
(tracemalloc sees no Python object left): the process stayed far above its
baseline, for good. With the `MemoryTrimmer` every process runs, the resident
size comes back near the baseline within a few intervals.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from pathlib import Path

import grpc

from tests.support import demo_server
from tests.support.pki import LocalCA
from waygate.core.grpcserver import GrpcServer, ServiceRegistration
from waygate.core.memory import MemoryTrimmer

FLOOD = r"""
import asyncio, os, sys
port, total, at_once = (int(a) for a in sys.argv[1:4])
async def one(gate):
    async with gate:
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 5)
            writer.write(os.urandom(200))
            await writer.drain()
            await asyncio.sleep(0.05)
            writer.close()
        except (OSError, asyncio.TimeoutError):
            pass
async def main():
    gate = asyncio.Semaphore(at_once)
    await asyncio.gather(*(one(gate) for _ in range(total)))
asyncio.run(main())
"""
MIB = 1024 * 1024


def rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


async def test_a_garbage_connection_flood_leaves_no_memory_behind(tmp_path: Path) -> None:
    ca = LocalCA()
    files = ca.write_files(tmp_path, ips=["127.0.0.1"])
    credentials = grpc.ssl_server_credentials(
        [(files.key.read_bytes(), files.cert.read_bytes())],
        root_certificates=ca.pem,
        require_client_auth=True,
    )
    server = GrpcServer(
        host="127.0.0.1",
        port=0,
        registrations=[ServiceRegistration(demo_server.SERVICE, demo_server._add, None)],
        credentials=credentials,
    )
    port = await server.start()
    trimmer = asyncio.ensure_future(MemoryTrimmer(interval=0.5).run())
    try:
        await asyncio.sleep(1.5)  # the server's own start-up garbage trimmed first
        baseline = rss()
        flood = await asyncio.create_subprocess_exec(
            sys.executable, "-c", FLOOD, str(port), "6000", "1000"
        )
        peak = baseline
        async with asyncio.timeout(120):
            while flood.returncode is None:
                peak = max(peak, rss())
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(flood.wait(), 0.2)
        grown = peak - baseline
        # Back near the baseline: at most a third of what the flood took, and 16 MiB.
        allowed = max(16 * MIB, grown // 3)
        settled = rss()
        async with asyncio.timeout(30):
            while (settled := rss()) > baseline + allowed:
                await asyncio.sleep(0.5)
        print(f"baseline {baseline // MIB} MiB, peak {peak // MIB} MiB, after {settled // MIB} MiB")
    finally:
        trimmer.cancel()
        await asyncio.gather(trimmer, return_exceptions=True)
        await server.stop(0)
