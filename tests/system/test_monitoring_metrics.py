"""Every metric the shipped alerts and dashboards query is one the services really
export: read from the /metrics of every process `waygate up` runs, after a
request through the proxy (so per-route series exist too).

Metrics only a Kubernetes-mode process registers (the certs leader election and
CSR controller, the Kubernetes reflector) cannot appear under `up`, which runs
on files; for those the modules that define them are imported here and this
process's own exposition is read instead: the same registry code, not a live pod.
"""

from __future__ import annotations

import asyncio
import importlib
import re

import pytest
from prometheus_client import REGISTRY, generate_latest

from tests.deploy.test_monitoring import monitored_metric_names
from tests.support.poll import until
from tests.support.processes import http_get, proxy_get
from waygate.components import COMPONENTS

from .test_up import Up

pytestmark = pytest.mark.system

PROXY = next(c for c in COMPONENTS if c.name == "proxy")
KUBERNETES_ONLY = {
    "waygate_certs_leader": "waygate.certs.leader",
    "waygate_certs_leader_transitions_total": "waygate.certs.leader",
    "waygate_certs_csr_decisions_total": "waygate.certs.kube_csr",
    "waygate_kube_relists_total": "waygate.core.kube",
    "waygate_kube_watch_restarts_total": "waygate.core.kube",
}
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "summary": ("_sum", "_count", "_created"),
}


def exposed_names(text: str) -> set[str]:
    """Every series name a scrape of this exposition can return (with or without samples)."""
    names = set(re.findall(r"^(waygate_\w+)[{ ]", text, re.MULTILINE))
    for name, kind in re.findall(r"^# TYPE (waygate_\w+) (\w+)$", text, re.MULTILINE):
        names.add(name)
        names.update(name + suffix for suffix in _SUFFIXES.get(kind, ()))
    return names


async def test_every_metric_the_alerts_and_dashboards_name_is_exported(tmp_path):
    wanted = monitored_metric_names()
    assert len(wanted) > 25
    up = Up(tmp_path)
    try:
        await up.start()
        http_port = PROXY.port("http_port") + up.offset

        async def routed() -> bool:
            return (await proxy_get(http_port, "echo.localtest.me"))[0] == 200

        await until(routed, "the proxy to route echo.localtest.me", timeout=30, interval=0.2)
        exposed: set[str] = set()
        for component in COMPONENTS:
            if component.implemented:
                status, text = await http_get(up.admin_port(component), "/metrics")
                assert status == 200, component.name
                exposed |= exposed_names(text)
    finally:
        if up.process is not None and up.process.returncode is None:
            up.process.terminate()
            await asyncio.wait_for(up.process.wait(), 60)
    # The per-route series are there with their labels, not only the family.
    assert "waygate_proxy_requests_total" in exposed
    for module in set(KUBERNETES_ONLY.values()):
        importlib.import_module(module)
    in_process = exposed_names(generate_latest(REGISTRY).decode())
    for name in KUBERNETES_ONLY:
        assert name in in_process, name
    missing = sorted(wanted - exposed - set(KUBERNETES_ONLY))
    assert not missing, f"queried by the alerts or dashboards but exported by no service: {missing}"
