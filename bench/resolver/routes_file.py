"""The routes file's CPU costs: parsing it whole, and one ApplyRoute on it.

In process (no gRPC): `parse_routes_file` on a file of N routes (every route
read through the Route schema and validated), then `FileSource.apply_route`
of a new route (the edit of its entry, the re-parse of the result, the atomic
write). CPU seconds of this process (`time.process_time`), so a machine shared
with other work inflates them less than wall time would; median of the runs.

To compare with another commit, run this file from this tree against that
commit's package: `git archive COMMIT services | tar -x -C /tmp/base; ln -s
/tmp/base/services /tmp/base/waygate; PYTHONPATH=/tmp/base .venv/bin/python
bench/resolver/routes_file.py`.

Run: .venv/bin/python -m bench.resolver.routes_file [--routes 5000] [--runs 7]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import tempfile
import time
from pathlib import Path

from waygate.resolver import filesource
from waygate.resolver.model import Route, RouteBackend
from waygate.resolver.store import Store


def routes_text(count: int) -> str:
    lines = ["# A generated routes file.", "routes:"]
    for index in range(count):
        lines += [
            f"  # route {index}",
            "  - namespace: demo",
            f"    name: r{index}",
            f"    host: r{index}.example.com",
            "    path: /api",
            "    backends: [{service: a, weight: 3}, {service: b, weight: 1}]",
            "    targetPort: http",
            "    sticky: {cookieName: c, sameSite: Strict}",
            "    timeouts: {connect: 2s, server: 30s}",
        ]
    return "\n".join(lines) + "\n"


def parse_cpu(text: str, runs: int) -> list[float]:
    times = []
    for _ in range(runs):
        start = time.process_time()
        filesource.parse_routes_file(Path("routes.yaml"), text)
        times.append(time.process_time() - start)
    return times


async def apply_cpu(text: str, runs: int) -> list[float]:
    with tempfile.TemporaryDirectory() as directory:
        path = Path(directory) / "routes.yaml"
        path.write_text(text)
        source = filesource.FileSource(Store(), path)
        assert source.load(), source.last_error
        times = []
        for index in range(runs):
            route = Route(
                "demo", f"new{index}", f"new{index}.example.com", backends=(RouteBackend("a"),)
            )
            start = time.process_time()
            await source.apply_route(route)
            times.append(time.process_time() - start)
        return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--routes", type=int, default=5000)
    parser.add_argument("--runs", type=int, default=7)
    args = parser.parse_args()
    text = routes_text(args.routes)
    size = len(text.encode()) // 1024
    parse = parse_cpu(text, args.runs)
    apply = asyncio.run(apply_cpu(text, max(3, args.runs // 2)))
    print(f"package: {Path(filesource.__file__).parent.parent}")
    print(f"routes file: {args.routes} routes, {size} KiB")
    print(
        f"parse: CPU median {statistics.median(parse) * 1000:.0f} ms (min {min(parse) * 1000:.0f})"
    )
    print(
        f"apply: CPU median {statistics.median(apply) * 1000:.0f} ms (min {min(apply) * 1000:.0f})"
    )


if __name__ == "__main__":
    main()
