"""sslyze finds the proxy's HTTPS listener compliant with Mozilla's "intermediate"
configuration (TLS 1.2+, its cipher suites and groups, the certificate's chain),
a real sslyze process scanning a real listener."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest

from tests.support.pki import LocalCA
from tests.support.proxyharness import running_proxy
from waygate.proxy.passthrough import TlsFront
from waygate.proxy.tls import DefaultCertificate, EdgeCertificates

pytestmark = pytest.mark.system


async def test_sslyze_finds_the_https_listener_mozilla_intermediate_compliant(
    tmp_path: Path,
) -> None:
    ca = LocalCA()
    files = ca.write_files(tmp_path, dns=["proxy.waygate.local"])
    async with running_proxy() as (server, _):
        certificates = EdgeCertificates(DefaultCertificate.from_files(files.cert, files.key))
        front = TlsFront(server, certificates, "127.0.0.1", 0)
        await front.start()
        try:
            scan = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "sslyze",
                "--mozilla_config=intermediate",
                "--certinfo_ca_file",
                str(files.ca),
                f"proxy.waygate.local:{front.bound_port}{{127.0.0.1}}",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
            )
            output, _ = await asyncio.wait_for(scan.communicate(), 240)
        finally:
            await front.drain(1.0)
    text = output.decode(errors="replace")
    assert scan.returncode == 0, text[-3000:]
    assert "OK - Compliant." in text, text[-3000:]
