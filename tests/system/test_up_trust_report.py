"""`waygate up` itself is a trust consumer: the local user's client certificate is
renewed over TLS to certs with the trust bundle `up` follows, and `up` acknowledges
that bundle (ReportTrust), so a CA rotation waits for it as for every service."""

from __future__ import annotations

import asyncio
import json
import os
import signal

import pytest

from tests.support.poll import until
from tests.system.test_up_tls import UpTLS, up  # noqa: F401  (the fixture)

pytestmark = pytest.mark.system

USER = "spiffe://waygate.local/ns/local/sa/user"


async def test_up_acknowledges_the_bundle_it_follows(up: UpTLS) -> None:  # noqa: F811
    await up.start()
    assert up.process is not None
    instance = f"{os.uname().nodename}/{up.process.pid}"
    found: list[dict] = []
    everyone: list[dict] = []

    async def reported() -> bool:
        code, out, err = await up.waygate("cert", "status", "-o", "json")
        assert code == 0, err
        everyone[:] = json.loads(out)["consumers"]
        found[:] = [c for c in everyone if c["identity"] == USER]
        proxy_reported = any(c["identity"].endswith("/sa/proxy") for c in everyone)
        return proxy_reported and any(c["instance"] == instance for c in found)

    await until(reported, "up's own trust report", timeout=30)
    mine = next(c for c in found if c["instance"] == instance)
    proxy = next(c for c in everyone if c["identity"].endswith("/sa/proxy"))
    # The same bundle as the services hold (what certs publishes to ca.pem).
    assert (mine["generation"], mine["fingerprints"]) == (
        proxy["generation"],
        proxy["fingerprints"],
    )
    assert mine["live"]
    up.process.send_signal(signal.SIGTERM)
    assert await asyncio.wait_for(up.process.wait(), 60) == 0
