"""`make bench`: run every benchmark under bench/ and keep each report in bench/out/.

    python -m bench [NAME ...] [-- ARG ...]

With names, only those run; the arguments after `--` go to the one benchmark named
(`make bench BENCH=tunnel BENCH_ARGS="--mib 256"`).

Figures worth keeping are copied, with their command, machine and date, into
bench/RESULTS.md by whoever ran them.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
#: Under bench/ but not a benchmark `make bench` runs: the soak has `make soak`.
NOT_BENCH = frozenset({"soak"})


def main(argv: list[str]) -> int:
    names, options = argv, []
    if "--" in argv:
        split = argv.index("--")
        names, options = argv[:split], argv[split + 1 :]
        if len(names) != 1:
            print("bench: options after -- need exactly one benchmark named", file=sys.stderr)
            return 2
    available = sorted(
        p.name for p in HERE.iterdir() if (p / "__main__.py").is_file() and p.name not in NOT_BENCH
    )
    unknown = sorted(set(names) - set(available))
    if unknown:
        print(
            f"bench: no benchmark named {', '.join(unknown)}; have {', '.join(available)}",
            file=sys.stderr,
        )
        return 2
    out_dir = HERE / "out"
    out_dir.mkdir(exist_ok=True)
    failed = []
    for name in names or available:
        print(f"== bench {name}", flush=True)
        result = subprocess.run(
            [sys.executable, "-m", f"bench.{name}", *options],
            cwd=HERE.parent,
            capture_output=True,
            text=True,
        )
        sys.stderr.write(result.stderr[-4000:])
        print(result.stdout, flush=True)
        (out_dir / f"{name}.md").write_text(result.stdout)
        if result.returncode != 0:
            failed.append(name)
    if failed:
        print(f"bench: failed: {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
