"""The tunnel's bulk transfer alone, with CPU per GiB per process: the A/B probe for the data path.

Runs the sink, `waygate tunnel serve` and `waygate tunnel agent` as in
`python -m bench.tunnel` (mTLS on both hops), pushes `--mib` MiB through the
dial client `--rounds` times in `--chunk-kib` writes, and prints the throughput and the CPU seconds per
GiB of the dialer (this process), server, agent and sink. With `--profile DIR`
the server and the agent are recorded with py-spy during the transfers
(DIR/server.txt, DIR/agent.txt, collapsed stacks).

Run: .venv/bin/python -m bench.tunnel.bulk [--mib 256] [--rounds 3] [--profile DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import uvloop

from bench.tunnel.__main__ import cpu_seconds, gbps, sink_child
from bench.tunnel.tunnel import DIALER, RunningTunnel, _bulk, start_tunnel
from tests.support.pki import LocalCA


async def run(
    mib: int, rounds: int, chunk: int, profile: Path | None, native: bool = False
) -> None:
    total = mib * 1024 * 1024
    with tempfile.TemporaryDirectory(prefix="bench-tunnel-bulk-") as tmp:
        directory = Path(tmp)
        ca = LocalCA()
        server_files = ca.write_files(directory / "server", dns=["localhost"], ips=["127.0.0.1"])
        client_files = ca.write_files(directory / "client", uris=[DIALER])
        sink = sink_child(directory)
        spies: list[subprocess.Popen[bytes]] = []
        tunnel: RunningTunnel | None = None
        try:
            sink_port, http_port, _source = (int(p) for p in sink.first_line().split())
            tunnel = await start_tunnel(
                directory, ca, server_files, client_files, http_port, server_id="b-0"
            )
            server, agent, client = tunnel.server, tunnel.agent, tunnel.client
            if profile is not None:
                profile.mkdir(parents=True, exist_ok=True)
                spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
                for name, child in (("server", server), ("agent", agent)):
                    argv = [spy, "record", "--rate", "200", "--format", "raw", "--pid",
                            str(child.process.pid), "--output", str(profile / f"{name}.txt"),
                            *(["--native"] if native else [])]  # fmt: skip
                    spies.append(
                        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    )
                await asyncio.sleep(1.0)
            pids = [server.process.pid, agent.process.pid, sink.process.pid]
            before = [cpu_seconds([p]) - cpu_seconds([]) for p in pids], cpu_seconds([])
            load = os.getloadavg()[0]
            times = [await _bulk(client, sink_port, total, chunk) for _ in range(rounds)]
            after = [cpu_seconds([p]) - cpu_seconds([]) for p in pids], cpu_seconds([])
            gib = total * rounds / (1 << 30)
            split = [(a - b) / gib for a, b in zip(after[0], before[0], strict=True)]
            dialer = (after[1] - before[1]) / gib
            print(
                f"{mib} MiB x {rounds} in {chunk // 1024} KiB writes: best {gbps(total, min(times)):.3f} GB/s "
                f"(all: {', '.join(f'{gbps(total, t):.3f}' for t in times)}); load {load:.1f}\n"
                f"CPU s per GiB: dialer {dialer:.2f}, server {split[0]:.2f}, "
                f"agent {split[1]:.2f}, sink {split[2]:.2f}; total {dialer + sum(split):.2f}"
            )
        finally:
            for spy_process in spies:
                spy_process.send_signal(2)
            for spy_process in spies:
                spy_process.wait(30)
            if tunnel is not None:
                await tunnel.stop()
            sink.stop()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB per transfer [256]")
    parser.add_argument("--rounds", type=int, default=3, help="transfers [3]")
    parser.add_argument(
        "--chunk-kib", type=int, default=64, help="KiB per dialer write [64, as the benchmark]"
    )
    parser.add_argument("--profile", type=Path, help="record server and agent with py-spy here")
    parser.add_argument("--native", action="store_true", help="py-spy --native (C frames too)")
    args = parser.parse_args()
    uvloop.run(run(args.mib, args.rounds, args.chunk_kib * 1024, args.profile, args.native))
    return 0


if __name__ == "__main__":
    sys.exit(main())
