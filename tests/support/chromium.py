"""Headless Chromium driven over the DevTools protocol: load a page, evaluate
JavaScript in it while it runs, take a screenshot.

The real browser (Debian's `chromium`), not a stand-in: a page's script runs
as it would for a person. One page per instance; every call has a timeout; the
process and its profile directory are gone after `stop` (or the `async with`).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import re
import shutil
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from websockets.asyncio.client import ClientConnection, connect

CALL_TIMEOUT = 20.0


def chromium_path() -> str:
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    assert found, "chromium (Debian's chromium package) is needed; .ci/run installs it"
    return found


class Chromium:
    def __init__(self, url: str, *, width: int = 1600, height: int = 900) -> None:
        self.url = url
        self.width, self.height = width, height
        self._profile = tempfile.mkdtemp(prefix="waygate-chromium-")
        self._process: asyncio.subprocess.Process | None = None
        self._socket: ClientConnection | None = None
        self._ids = itertools.count(1)

    async def start(self) -> None:
        self._process = await asyncio.create_subprocess_exec(
            chromium_path(),
            "--headless=new",
            "--no-sandbox",  # tests run as root in containers
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--hide-scrollbars",
            f"--window-size={self.width},{self.height}",
            f"--user-data-dir={self._profile}",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            self.url,
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.PIPE,
        )
        assert self._process.stderr is not None
        port = 0
        async with asyncio.timeout(30):
            while not port:
                line = await self._process.stderr.readline()
                if not line:
                    raise AssertionError("chromium exited before its DevTools port was known")
                found = re.search(rb"DevTools listening on ws://[^:]+:(\d+)/", line)
                port = int(found.group(1)) if found else 0
        # Keep reading its stderr so a chatty browser never blocks on a full pipe.
        self._drain = asyncio.ensure_future(self._process.stderr.read())
        targets = await asyncio.to_thread(self._targets, port)
        page = next(t for t in targets if t["type"] == "page")
        self._socket = await asyncio.wait_for(
            connect(page["webSocketDebuggerUrl"], max_size=64 * 1024 * 1024), CALL_TIMEOUT
        )

    @staticmethod
    def _targets(port: int) -> list[dict[str, Any]]:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as answer:
            return json.load(answer)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        """One DevTools command; its result (events arriving meanwhile are skipped)."""
        assert self._socket is not None
        ident = next(self._ids)
        await self._socket.send(json.dumps({"id": ident, "method": method, "params": params}))
        async with asyncio.timeout(CALL_TIMEOUT):
            while True:
                message = json.loads(await self._socket.recv())
                if message.get("id") == ident:
                    if "error" in message:
                        raise AssertionError(f"{method}: {message['error']}")
                    return message["result"]

    async def evaluate(self, expression: str) -> Any:
        """The value of a JavaScript expression in the page (JSON-serialisable)."""
        result = await self.call(
            "Runtime.evaluate", expression=expression, returnByValue=True, awaitPromise=True
        )
        if "exceptionDetails" in result:
            raise AssertionError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    async def screenshot(self, path: Path) -> None:
        """A PNG of the whole page (as tall as its content)."""
        height = await self.evaluate("document.documentElement.scrollHeight")
        await self.call(
            "Emulation.setDeviceMetricsOverride",
            width=self.width,
            height=int(height),
            deviceScaleFactor=1,
            mobile=False,
        )
        shot = await self.call("Page.captureScreenshot", format="png")
        path.write_bytes(base64.b64decode(shot["data"]))

    async def stop(self) -> None:
        if self._socket is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._socket.close(), 5)
        if self._process is not None and self._process.returncode is None:
            self._process.terminate()
            try:
                await asyncio.wait_for(self._process.wait(), 10)
            except TimeoutError:
                self._process.kill()
                await self._process.wait()
        drain = getattr(self, "_drain", None)
        if drain is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(drain, 5)
        shutil.rmtree(self._profile, ignore_errors=True)

    async def __aenter__(self) -> Chromium:
        try:
            await self.start()
        except BaseException:
            await self.stop()
            raise
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.stop()
