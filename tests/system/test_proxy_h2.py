"""`waygate proxy serve` speaking HTTP/2 as a real process: curl over h2 (TLS,
ALPN) and h2c (prior knowledge), and the h2spec conformance suite (146 cases)
against both listeners.

h2spec is built by `.ci/run` (../shared/tools/build-h2spec.sh, to
/tmp/h2spec/h2spec); outside CI a machine without it skips the h2spec test
with that reason, and in CI its absence fails the test.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path

import pytest

from tests.support.processes import RunningService, start_service
from tests.support.proxyharness import RecordingUpstream
from tests.system.test_proxy_system import start_resolver, wait_ready

pytestmark = pytest.mark.system

H2SPEC = Path(os.environ.get("WAYGATE_H2SPEC", "/tmp/h2spec/h2spec"))

ROUTES = """
services:
  - namespace: demo
    name: echo
    ports:
      - {{name: http, port: 80, targetPort: {port}}}
    endpoints:
      - address: 127.0.0.1
routes:
  - namespace: demo
    name: echo
    host: echo.test
    to: echo
  - namespace: demo
    name: h2spec
    host: localhost
    to: echo
"""


async def start_proxy(resolver_address: str) -> tuple[RunningService, int, int]:
    proxy = await start_service(
        [
            "waygate", "proxy", "serve", "--http-port", "0", "--https-port", "0",
            "--admin-port", "0", "--resolver-address", resolver_address,
        ]
    )  # fmt: skip
    logs = [e for e in proxy.logs if e.get("msg") == "proxy listening"]
    http_port = next(e["http_port"] for e in logs if "http_port" in e)
    https_port = next(e["https_port"] for e in logs if "https_port" in e)
    return proxy, int(http_port), int(https_port)


async def run(*argv: str, timeout: float = 120) -> tuple[int, str]:
    process = await asyncio.create_subprocess_exec(
        *argv, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT
    )
    try:
        out, _ = await asyncio.wait_for(process.communicate(), timeout)
    except TimeoutError:
        process.kill()
        await process.wait()
        raise
    return process.returncode or 0, out.decode(errors="replace")


@pytest.fixture
async def proxy(tmp_path: Path):
    upstream = await RecordingUpstream().start()
    routes = tmp_path / "routes.yaml"
    routes.write_text(ROUTES.format(port=upstream.port))
    resolver = await start_resolver(routes)
    proxy, http_port, https_port = await start_proxy(resolver.grpc_address)
    try:
        await wait_ready(proxy)
        yield http_port, https_port, upstream
    finally:
        await proxy.stop()
        await resolver.stop()
        await upstream.stop()


async def test_curl_http2_over_tls_and_prior_knowledge(proxy):
    http_port, https_port, upstream = proxy
    code, out = await run(
        "curl", "-sS", "--http2", "-k", "-o", "/dev/null", "-w", "%{http_version} %{http_code}",
        "--resolve", f"echo.test:{https_port}:127.0.0.1", f"https://echo.test:{https_port}/tls",
    )  # fmt: skip
    assert (code, out) == (0, "2 200")
    code, out = await run(
        "curl", "-sS", "--http2-prior-knowledge", "-o", "/dev/null",
        "-w", "%{http_version} %{http_code}",
        "--resolve", f"echo.test:{http_port}:127.0.0.1", f"http://echo.test:{http_port}/h2c",
    )  # fmt: skip
    assert (code, out) == (0, "2 200")
    # curl --http2 on plain HTTP asks to upgrade to h2c: refused, the answer is HTTP/1.1.
    code, out = await run(
        "curl", "-sS", "--http2", "-o", "/dev/null", "-w", "%{http_version} %{http_code}",
        "--resolve", f"echo.test:{http_port}:127.0.0.1", f"http://echo.test:{http_port}/up",
    )  # fmt: skip
    assert (code, out) == (0, "1.1 200")
    assert [r["target"] for r in upstream.requests] == ["/tls", "/h2c", "/up"]


async def test_h2spec_passes_every_case_on_both_listeners(proxy, tmp_path: Path):
    if not H2SPEC.is_file():
        if os.environ.get("CI"):
            pytest.fail(f"{H2SPEC} is missing: .ci/run builds it with build-h2spec.sh")
        pytest.skip(f"{H2SPEC} is not built here (.ci/run builds it; CI fails without it)")
    http_port, https_port, _ = proxy
    for name, port, tls in (("h2c", http_port, ()), ("h2", https_port, ("-t", "-k"))):
        report = tmp_path / f"{name}.xml"
        code, out = await run(
            str(H2SPEC), "-h", "localhost", "-p", str(port), "-o", "5", *tls, "-j", str(report)
        )
        summary = out.strip().splitlines()[-1]
        assert code == 0, f"h2spec over {name}: {summary}\n{out[-3000:]}"
        assert summary == "146 tests, 146 passed, 0 skipped, 0 failed", (name, summary)
    assert shutil.which("curl")
