"""Many proxy-style downloads through the tunnel, each checked whole: the reproduction of
round 6's truncation.

    python -m bench.tunnel.pull_stress [--count 2000] [--mib 16] [--seconds 300]

Starts the sink, `waygate tunnel serve` and `waygate tunnel agent` as `bench.tunnel`
does (separate processes, mTLS on both hops) and downloads `--mib` MiB from the sink's
source port `--count` times (or until `--seconds` pass), each received as the proxy
receives (a protocol on the data connection: `tunnel._pull_transport`), which raises
when fewer bytes than sent arrive or the connection ends without a clean EOF. Prints
each failure and the total. The socket-BIO data path tried in round 6 (163134c,
176f66b; reverted in 84d86c1) failed 8 of 243 16 MiB downloads here, the memory-BIO
`Link` 0 of 5,751. The cause was the agent's plain destination link: its last bytes and
FIN read while the splice had paused it, then resumed, read the EOF again as a peer gone
and aborted the splice with the data connection's unsent tail. Fixed, the same path ran
2,000 of 2,000. Not a test (separate processes, minutes of transfers);
test_socket_link.py holds the mechanism in-process.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from bench.tunnel import tunnel
from bench.tunnel.__main__ import Child
from tests.support.pki import LocalCA


async def run(count: int, mib: int, seconds: float) -> int:
    with tempfile.TemporaryDirectory(prefix="bench-pull-stress-") as tmp:
        directory = Path(tmp)
        ca = LocalCA()
        server_files, client_files = tunnel.identities(directory, ca)
        sink = Child(
            [sys.executable, "-m", "bench.tunnel.peers", "sink", "127.0.0.1"],
            directory / "sink.log",
        )
        try:
            _bulk, http_port, source_port = (int(p) for p in sink.first_line().split())
            running = await tunnel.start_tunnel(
                directory, ca, server_files, client_files, http_port, "stress"
            )
            failures = done = 0
            try:
                stop_at = time.monotonic() + seconds
                while done < count and time.monotonic() < stop_at:
                    try:
                        await tunnel._pull_transport(running.client, source_port, mib << 20)
                    except Exception as exc:  # every failure is the finding
                        failures += 1
                        print(f"{done}: {type(exc).__name__}: {exc}", flush=True)
                    done += 1
            finally:
                await running.stop()
        finally:
            sink.stop()
    print(f"{done} downloads of {mib} MiB, {failures} failed")
    return 1 if failures else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--count", type=int, default=2000)
    parser.add_argument("--mib", type=int, default=16)
    parser.add_argument("--seconds", type=float, default=300)
    args = parser.parse_args()
    return uvloop.run(run(args.count, args.mib, args.seconds))


if __name__ == "__main__":
    sys.exit(main())
