"""The replica's copy between two plain TCP sockets, two ways: relay.splice vs kernel splice(2).

    python -m bench.tunnel.splice_probe [--mib 1024] [--rounds 2]

For issue 19's TLS end to end mode, where the replica only copies ciphertext
between two plain sockets. The same `--mib` MiB (1 MiB writes, from this process,
`push_tcp`) go through a relay process (uvloop, as the replica runs) to the sink
process (`bench.tunnel.peers sink`, which answers the byte count after EOF):

- `relay.splice`: the relay over two `relay.plain_link` SocketLinks (recv into
  Python, send), what the replica would use without the kernel path;
- `kernel_splice`: `waygate.tunnel.kernelsplice`, socket -> pipe -> socket in
  the kernel, the bytes never in user space;
- `direct`: no relay, this process to the sink (the ceiling).

The modes are taken in turn, `--rounds` times each; printed per mode: the best
GB/s and the relay process's CPU seconds per GiB over all its rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import tempfile
from pathlib import Path

import uvloop

from bench.tunnel.__main__ import Child, cpu_seconds, gbps, push_tcp, sink_child

MODES = ("relay.splice", "kernel_splice")


async def _serve(mode: str, sink_port: int, pipe_size: int) -> None:
    """Relay every connection accepted on a free port to the sink with `mode`; the port is
    printed first. Until stdin closes (Child.stop)."""
    from waygate.tunnel import kernelsplice, relay

    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    print(listener.getsockname()[1], flush=True)
    stop: asyncio.Future[None] = loop.create_future()

    def stdin_closed() -> None:
        loop.remove_reader(sys.stdin.fileno())
        if not stop.done():
            stop.set_result(None)

    loop.add_reader(sys.stdin.fileno(), stdin_closed)
    relays: set[asyncio.Future[None]] = set()

    async def one(inbound: socket.socket) -> None:
        outbound = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        outbound.setblocking(False)
        await loop.sock_connect(outbound, ("127.0.0.1", sink_port))
        for sock in (inbound, outbound):
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if mode == "kernel_splice":
            await kernelsplice.kernel_splice(inbound, outbound, pipe_size=pipe_size).done
        else:
            await relay.splice(relay.plain_link(inbound), relay.plain_link(outbound))

    async def accept() -> None:
        while True:
            inbound, _address = await loop.sock_accept(listener)
            task = asyncio.ensure_future(one(inbound))
            relays.add(task)
            task.add_done_callback(relays.discard)

    accepting = asyncio.ensure_future(accept())
    await stop
    accepting.cancel()
    listener.close()


def main() -> int:
    if sys.argv[1:2] == ["relay"]:
        uvloop.run(_serve(sys.argv[2], int(sys.argv[3]), int(sys.argv[4])))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=1024, help="MiB per transfer [1024]")
    parser.add_argument("--rounds", type=int, default=2, help="transfers per mode [2]")
    parser.add_argument(
        "--pipe-kib", type=int, default=1024, help="kernel_splice's pipe size asked, KiB [1024]"
    )
    args = parser.parse_args()
    total = args.mib << 20
    with tempfile.TemporaryDirectory(prefix="bench-splice-probe-") as tmp:
        directory = Path(tmp)
        sink = sink_child(directory)
        relays: dict[str, Child] = {}
        try:
            sink_port = int(sink.first_line().split()[0])
            for mode in MODES:
                relays[mode] = Child(
                    [sys.executable, "-m", "bench.tunnel.splice_probe", "relay", mode,
                     str(sink_port), str(args.pipe_kib << 10)],
                    directory / f"{mode}.log",
                )  # fmt: skip
            ports = {mode: int(child.first_line()) for mode, child in relays.items()}
            times: dict[str, list[float]] = {mode: [] for mode in (*MODES, "direct")}
            spent = dict.fromkeys(MODES, 0.0)
            load = os.getloadavg()[0]
            for _ in range(args.rounds):
                for mode in (*MODES, "direct"):
                    if mode == "direct":
                        times[mode].append(push_tcp(sink_port, total))
                        continue
                    pid = relays[mode].process.pid
                    before = cpu_seconds([pid]) - cpu_seconds([])
                    times[mode].append(push_tcp(ports[mode], total))
                    spent[mode] += cpu_seconds([pid]) - cpu_seconds([]) - before
            best = {mode: min(seconds) for mode, seconds in times.items()}
            gib = total * args.rounds / (1 << 30)
            print(
                f"splice probe: {args.mib} MiB per transfer, 1 MiB writes, best of "
                f"{args.rounds}; kernel_splice pipes of {args.pipe_kib} KiB asked; load {load:.1f}"
            )
            for mode in MODES:
                print(
                    f"- {mode}: {gbps(total, best[mode]):.2f} GB/s "
                    f"(all: {', '.join(f'{gbps(total, t):.2f}' for t in times[mode])}); "
                    f"relay CPU s per GiB {spent[mode] / gib:.3f}"
                )
            print(f"- direct (no relay): {gbps(total, best['direct']):.2f} GB/s")
            cpu = spent["relay.splice"] / max(spent["kernel_splice"], 1e-9)
            speed = best["relay.splice"] / best["kernel_splice"]
            print(f"kernel_splice vs relay.splice: {speed:.2f}x the speed, 1/{cpu:.1f} the CPU")
        finally:
            for child in relays.values():
                child.stop()
            sink.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
