"""Route authors' attacks (issue 31, findings 6-8), run longer than the tests run them.

    python -m bench.attacks.routes [--duration 30] [--attackers 3]

One resolver (--manifests) and one proxy, as tests/system/test_hostile_routes.py
starts them, and a bystander client on its own host the whole time. Phases:
1. redos: attackers send `/redos/` + 28 a's + "!" to a RegularExpression route
   `/redos/(a+)+$` (a backtracking engine took 2.4-4.8 s per request; three at
   once hung the proxy);
2. amplification: a 9 KB manifest whose aliases amount to 1,000 rules of 1,000
   matches is applied (then the good one again); the resolver must refuse it
   and keep serving;
3. takeover: an Ingress and a Gateway of namespace evil claim demo's host; every
   path of it must stay demo's.
Per phase: the bystander's requests, success rate and p50/p99, the attackers'
request count and slowest answer, and the proxy's and resolver's RSS.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import tempfile
import time
from pathlib import Path

from tests.support.gatewayapi import INFRA, Conformance
from tests.system.test_hostile_routes import REDOS_ROUTES, takeover_manifests
from tests.unit.resolver.test_hostile_manifests import amplified_route


def rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def phase(
    conformance: Conformance, name: str, duration: float, attack: object, attackers: int
) -> None:
    stop = asyncio.Event()
    bystander: list[tuple[int, float]] = []
    attacks: list[float] = []

    async def bystander_client() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            try:
                status = (await conformance.request("/", host="bystander.example")).status
            except (OSError, TimeoutError):
                status = 0
            bystander.append((status, time.perf_counter() - started))
            await asyncio.sleep(0.01)

    async def attacker() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            with contextlib.suppress(OSError, TimeoutError):
                await attack()  # type: ignore[operator]
            attacks.append(time.perf_counter() - started)

    tasks = [asyncio.create_task(bystander_client())]
    tasks += [asyncio.create_task(attacker()) for _ in range(attackers)]
    await asyncio.sleep(duration)
    stop.set()
    await asyncio.gather(*tasks)
    latencies = sorted(latency for _, latency in bystander)
    ok = sum(1 for status, _ in bystander if status == 200)
    assert conformance.proxy is not None and conformance.resolver is not None
    print(
        f"{name:14} bystander {ok}/{len(bystander)} ok "
        f"({100 * ok / max(1, len(bystander)):.1f}%), "
        f"p50 {1000 * statistics.median(latencies):.1f} ms, "
        f"p99 {1000 * latencies[int(0.99 * (len(latencies) - 1))]:.1f} ms; "
        f"attacks {len(attacks)}, slowest {1000 * max(attacks, default=0):.1f} ms; "
        f"RSS proxy {rss_mib(conformance.proxy.process.pid):.0f} MiB, "
        f"resolver {rss_mib(conformance.resolver.process.pid):.0f} MiB"
    )


async def main(duration: float, attackers: int) -> None:
    with tempfile.TemporaryDirectory() as directory:
        conformance = await Conformance(Path(directory)).start()
        try:
            good = REDOS_ROUTES + "---\n" + takeover_manifests(conformance, evil=False)
            await conformance.apply(extra=good)
            redos_path = "/redos/" + "a" * 28 + "!"
            await phase(
                conformance,
                "redos",
                duration,
                lambda: conformance.request(redos_path, host="redos.example"),
                attackers,
            )

            async def amplify() -> None:
                await conformance.apply(extra=good + "---\n" + amplified_route(), wait=False)
                await asyncio.sleep(0.5)
                await conformance.apply(extra=good, wait=False)
                await asyncio.sleep(0.5)

            await phase(conformance, "amplification", duration, amplify, 1)
            await conformance.apply(
                extra=REDOS_ROUTES + "---\n" + takeover_manifests(conformance, evil=True)
            )
            demo = f"{INFRA}/infra-backend-v1"
            taken: list[str] = []

            async def takeover() -> None:
                for path in ("/", "/api", "/api/users"):
                    response = await conformance.request(path, host="echo.localtest.me")
                    if response.backend != demo:
                        taken.append(path)

            await phase(conformance, "takeover", duration, takeover, attackers)
            print(f"{'':14} evil's paths served: {len(taken)}")
        finally:
            await conformance.stop()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds per phase")
    parser.add_argument("--attackers", type=int, default=3, help="attacking clients")
    args = parser.parse_args()
    asyncio.run(main(args.duration, args.attackers))
