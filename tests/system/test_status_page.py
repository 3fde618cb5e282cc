"""The status page under `waygate up`, as a person sees it: headless Chromium
loads the page `up` serves, its script fetches every service's status and keeps
it live, and what it shows follows what happens (traffic, a route to a service
that does not exist, a rejected routes-file edit) without a reload.

Set WAYGATE_STATUS_SCREENSHOT=PATH to keep the screenshot taken on the way
(docs/status-page.png is made that way).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import signal
from pathlib import Path

import pytest
import yaml

from tests.support.chromium import Chromium
from tests.support.poll import until
from tests.support.processes import proxy_get
from waygate.components import COMPONENTS
from waygate.supervisor import STATUS_PORT

from .test_up import Up

pytestmark = pytest.mark.system

PROXY = next(c for c in COMPONENTS if c.name == "proxy")


async def get_echo(port: int) -> int:
    return (await proxy_get(port, "echo.localtest.me"))[0]


def row_text(section: str, row: str) -> str:
    """JS: the cells' text of one row of one section, joined by ' | ' ('' when absent)."""
    return (
        f'(() => {{ const r = document.querySelector(\'[data-section="{section}"] '
        f'tr[data-row="{row}"]\'); return r ? [...r.children].map(c => c.textContent)'
        ".join(' | ') : ''; })()"
    )


async def test_the_status_page_shows_every_service_live_in_chromium(tmp_path: Path) -> None:
    up = Up(tmp_path)
    try:
        await up.start()
        assert any(f":{STATUS_PORT + up.offset}/" in line for line in up.lines), up.lines
        http_port = PROXY.port("http_port") + up.offset

        async def routed() -> bool:
            return await get_echo(http_port) == 200

        await until(routed, "the proxy to route echo.localtest.me", timeout=30, interval=0.2)

        async with Chromium(f"http://127.0.0.1:{STATUS_PORT + up.offset}/") as page:

            async def shown(section: str, row: str, *words: str) -> bool:
                text = await page.evaluate(row_text(section, row))
                return bool(text) and all(word in text for word in words)

            async def requests_shown() -> int:
                text = await page.evaluate(row_text("proxy/Routes", "demo/echo"))
                return int(text.split(" | ")[4]) if text else -1

            await until(
                lambda: page.evaluate("!!document.body && document.body.dataset.state === 'live'"),
                "the page's first status.json",
                timeout=30,
                interval=0.2,
            )
            # Every service has its part, each from its own admin port.
            services = await page.evaluate(
                "[...document.querySelectorAll('[data-service]')].map(e => e.dataset.service)"
            )
            # (A process that did not answer in time shows its error; it shows its
            # sections again on the next poll, so every check below waits.)
            assert set(services) == {c.name for c in COMPONENTS if c.implemented} | {"up"}
            assert services[:2] == ["up", "proxy"]  # up's processes, then traffic first
            # Routes with traffic, endpoints with health, agents and where they are held.
            await until(lambda: _at_least(requests_shown(), 1), "demo/echo's requests", timeout=15)
            await until(
                lambda: shown("proxy/Routes", "demo/echo", "echo.localtest.me/", "1/1"),
                "proxy/Routes",
                timeout=15,
            )
            await until(
                lambda: shown("proxy/Endpoints", "demo/hello", "via tunnel to edge-local", "ok"),
                "proxy/Endpoints",
                timeout=15,
            )
            await until(
                lambda: shown("tunnel-server/Tunnel agents", "edge-local", "tunnel-server-0"),
                "the agent on the tunnel server's page",
                timeout=30,
                interval=0.2,
            )
            await until(
                lambda: shown("resolver/Tunnel presence", "edge-local", "tunnel-server-0"),
                "the agent's presence in the resolver",
                timeout=30,
                interval=0.2,
            )
            await until(
                lambda: shown("resolver/Routes", "demo/echo", "admitted", "refs resolved"),
                "resolver/Routes",
                timeout=15,
            )
            await until(
                lambda: shown("proxy/Resolver view", "version"), "proxy/Resolver view", timeout=15
            )
            # Certificates with expiry bars: the CA for a year, leaves for a day.
            await until(
                lambda: shown("certs/Certificate authorities", "ACTIVE", "364d"),
                "certs/Certificate authorities",
                timeout=15,
            )
            width = (
                '(document.querySelector(\'[data-section="proxy/Certificates"] '
                "tr[data-row=\"own\"] .bar > span') || {style: {}}).style.width || ''"
            )
            await until(lambda: page.evaluate(width), "the proxy certificate's bar", timeout=15)
            bar = await page.evaluate(width)
            assert bar.endswith("%") and 90 < float(bar[:-1]) <= 100

            # Live: more traffic shows up without a reload.
            before = await requests_shown()
            updates = await page.evaluate("Number(document.body.dataset.updates)")
            for _ in range(3):
                assert await get_echo(http_port) == 200
            await until(
                lambda: _at_least(requests_shown(), before + 3),
                "the new requests on the page",
                timeout=15,
                interval=0.2,
            )
            assert await page.evaluate("Number(document.body.dataset.updates)") > updates
            latency = (await page.evaluate(row_text("proxy/Routes", "demo/echo"))).split(" | ")
            assert latency[6].endswith(" ms") and latency[7].endswith(" ms"), latency

            # A route to a service that does not exist says so, in red.
            routes_file = up.state_dir / "routes.yaml"
            good = routes_file.read_text()
            document = yaml.safe_load(good)
            document["routes"].append(
                {"namespace": "demo", "name": "ghost", "host": "ghost.localtest.me", "to": "nope"}
            )
            routes_file.write_text(yaml.safe_dump(document))
            await until(
                lambda: shown("resolver/Routes", "demo/ghost", "service demo/nope not found"),
                "demo/ghost's condition on the page",
                timeout=20,
                interval=0.2,
            )
            state = await page.evaluate(
                'document.querySelector(\'[data-section="resolver/Routes"] '
                'tr[data-row="demo/ghost"] td:last-child\').className'
            )
            assert state == "bad"

            await summary_processes_gateway_objects_and_unrouted(page, up, http_port)
            screenshot = tmp_path / "status-page.png"
            await page.screenshot(screenshot)
            assert screenshot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
            keep = os.environ.get("WAYGATE_STATUS_SCREENSHOT")
            if keep:
                shutil.copy(screenshot, keep)

            # A rejected routes-file edit: the page names the file and line.
            routes_file.write_text(good + "routes: [oops\n")
            await until(
                lambda: shown(
                    "resolver/Route sources",
                    f"file:{routes_file}",
                    "rejected",
                    f"{routes_file}:",
                    "the last good state is kept",
                ),
                "the rejected edit on the page",
                timeout=20,
                interval=0.2,
            )
    finally:
        if up.process is not None and up.process.returncode is None:
            up.process.terminate()
            await asyncio.wait_for(up.process.wait(), 60)


async def summary_processes_gateway_objects_and_unrouted(page: Chromium, up: Up, port: int) -> None:
    """Issue 29 deliverable 5: the summary line, up's processes with restarts, the
    Gateway API objects with their conditions, the unrouted row; all rendered from
    /status.json (numbers as numbers, times as RFC 3339)."""
    # A request no route takes (an unknown host: 404 on up's Gateway listener).
    assert (await proxy_get(port, "nowhere.localtest.me"))[0] == 404

    async def unrouted_shown() -> bool:
        text = await page.evaluate(row_text("proxy/Routes", "unrouted"))
        return bool(text) and int(text.split(" | ")[4]) >= 1

    await until(unrouted_shown, "the unrouted row", timeout=15, interval=0.2)
    summary = "document.querySelector('#summary [data-summary=\"%s\"] b')?.textContent"
    await until(
        lambda: page.evaluate(f"Number({summary % 'unrouted'}) >= 1"),
        "the summary line's unrouted count",
        timeout=15,
        interval=0.2,
    )
    # The page shows what the document says: compare once traffic is quiet.
    document = await page.evaluate("fetch('status.json').then(r => r.json())")
    assert isinstance(document["summary"]["requests"], int)
    assert isinstance(document["summary"]["unrouted"], int) and document["summary"]["unrouted"] >= 1
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", document["generated"])
    await until(
        lambda: page.evaluate(
            f"Number({summary % 'requests'}) === {document['summary']['requests']}"
        ),
        "the summary's requests as in status.json",
        timeout=15,
        interval=0.2,
    )
    rate = await page.evaluate(summary % "per_second")
    assert rate == "-" or float(rate) >= 0, rate

    # up's processes: each with its pid and restarts; a killed one restarts, counted.
    (own,) = [s for s in document["services"] if s["service"] == "up"]
    (processes,) = [s for s in own["sections"] if s["title"] == "Processes"]
    rows = {row[0]: row for row in processes["rows"]}
    assert {"proxy", "resolver", "certs", "demo-backend"} <= set(rows)
    _, pid, state, restarts, started = rows["demo-backend"]
    # Restarts so far: 0 on a quiet machine; a loaded one can fail a start-up probe once.
    before = restarts["text"]
    assert isinstance(pid, int) and state["text"] == "ready" and isinstance(before, int)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", started["time"])
    os.kill(pid, signal.SIGKILL)
    # At least one restart more (a loaded machine may see the new process fail its first
    # readiness check and be restarted again), within up's restart back-off.
    await until(
        lambda: page.evaluate(
            "Number("
            + row_text("up/Processes", "demo-backend")
            + ".split(' | ')[3]) >= "
            + str(before + 1)
        ),
        "the demo backend's restart on the page",
        timeout=60,
        interval=0.2,
    )
    started_text = await page.evaluate(row_text("up/Processes", "demo-backend"))
    assert started_text.split(" | ")[4].endswith(" ago"), started_text

    # Gateway API objects with their conditions (up's example Gateway and HTTPRoute).
    await until(
        lambda: page.evaluate(
            row_text("resolver/Gateway API objects", "HTTPRoute demo/echo")
            + ".includes('Accepted')"
        ),
        "the example HTTPRoute's conditions",
        timeout=15,
        interval=0.2,
    )


async def test_a_failing_routes_503s_count_under_its_own_name_on_the_page(
    tmp_path: Path,
) -> None:
    """Issue 29 finding 6, against the metrics contract: a request a route took counts
    under that route whatever its answer; only requests no route took are unrouted."""
    up = Up(tmp_path)
    try:
        await up.start()
        http_port = PROXY.port("http_port") + up.offset
        routes_file = up.state_dir / "routes.yaml"
        document = yaml.safe_load(routes_file.read_text())
        document["routes"].append(
            {"namespace": "demo", "name": "ghost", "host": "ghost.localtest.me", "to": "nope"}
        )
        routes_file.write_text(yaml.safe_dump(document))

        async def ghost_503() -> bool:
            return (await proxy_get(http_port, "ghost.localtest.me"))[0] == 503

        await until(ghost_503, "the proxy to serve demo/ghost (503)", timeout=30, interval=0.2)
        async with Chromium(f"http://127.0.0.1:{STATUS_PORT + up.offset}/") as page:

            async def ghost_counted() -> bool:
                text = await page.evaluate(row_text("proxy/Routes", "demo/ghost"))
                cells = text.split(" | ") if text else []
                return len(cells) > 5 and int(cells[4]) >= 1 and int(cells[5]) >= 1

            await until(ghost_counted, "demo/ghost's 503s under its name", timeout=20)
            # The polls above may reach the proxy before demo/ghost loads (unknown host:
            # a 404, rightly unrouted); none of the route's 503s may land there.
            unrouted = await page.evaluate(row_text("proxy/Routes", "unrouted"))
            assert unrouted.split(" | ")[5] == "0", unrouted
    finally:
        if up.process is not None and up.process.returncode is None:
            up.process.terminate()
            await asyncio.wait_for(up.process.wait(), 60)


async def _at_least(value, floor: int) -> bool:
    return await value >= floor
