"""The monitoring component: it renders into the namespace beside the production
overlay, scrapes every Waygate pod, its alert rules pass `promtool check rules`
and `promtool test rules` (alerts_test.yaml: a unit test per alert), and its
dashboards are what their generator writes. That every metric named here is one
the services export is checked against real processes in
tests/system/test_monitoring_metrics.py (with `monitored_metric_names`)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.deploy.test_kustomize import (
    KUBERNETES_VERSION,
    ROOT,
    assert_every_namespaced_object_in_waygate,
    named,
    workloads,
)

COMPONENT = ROOT / "deploy/kustomize/components/monitoring"
ALERT_TESTS = Path(__file__).with_name("alerts_test.yaml")


def render_with_monitoring(tmp_path: Path) -> list[dict]:
    """The production overlay with the monitoring component, as a user's own overlay adds it."""
    overlay = tmp_path / "overlay"
    overlay.mkdir()
    up = os.path.relpath(ROOT / "deploy/kustomize", overlay)
    (overlay / "kustomization.yaml").write_text(
        "apiVersion: kustomize.config.k8s.io/v1beta1\nkind: Kustomization\n"
        "namespace: waygate\n"
        f"resources: [{up}/overlays/production]\ncomponents: [{up}/components/monitoring]\n"
    )
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the overlays (.ci/run installs it)"
    result = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 0, result.stderr
    (tmp_path / "rendered.yaml").write_text(result.stdout)
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def rule_groups() -> dict:
    """The PrometheusRule's groups, as a Prometheus rule file."""
    rule = yaml.safe_load((COMPONENT / "alerts.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    return {"groups": rule["spec"]["groups"]}


def _generator():
    spec = importlib.util.spec_from_file_location(
        "waygate_dashboards", COMPONENT / "dashboards/generate.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def dashboards() -> dict[str, dict]:
    return {p.name: json.loads(p.read_text()) for p in (COMPONENT / "dashboards").glob("*.json")}


def expressions() -> list[str]:
    """Every PromQL expression the alerts and the dashboards evaluate."""
    found = [rule["expr"] for g in rule_groups()["groups"] for rule in g["rules"]]
    for board in dashboards().values():
        found += [t["expr"] for panel in board["panels"] for t in panel["targets"]]
        found += [v["query"] for v in board["templating"]["list"] if v["type"] == "query"]
    return found


def monitored_metric_names() -> set[str]:
    """Metric names (as scraped: _total, _bucket...) the alerts and dashboards query."""
    return {name for expr in expressions() for name in re.findall(r"\bwaygate_\w+", expr)}


def promtool() -> str:
    found = shutil.which("promtool")
    assert found, "promtool (Debian's prometheus package) is needed; .ci/run installs it"
    return found


@pytest.fixture(scope="module")
def rendered(tmp_path_factory):
    path = tmp_path_factory.mktemp("monitoring")
    return path, render_with_monitoring(path)


def test_renders_valid_into_the_waygate_namespace(rendered):
    path, objects = rendered
    named(objects, "PrometheusRule", "waygate")
    board_map = named(objects, "ConfigMap", "waygate-dashboards")
    assert board_map["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert set(board_map["data"]) == set(dashboards())
    assert_every_namespaced_object_in_waygate(objects)
    validator = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run(
        [str(validator), "--strict", "-k", KUBERNETES_VERSION, str(path / "rendered.yaml")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_the_pod_monitor_scrapes_every_waygate_pod_on_its_admin_port(rendered):
    _, objects = rendered
    monitor = named(objects, "PodMonitor", "waygate")["spec"]
    (endpoint,) = monitor["podMetricsEndpoints"]
    assert endpoint["port"] == "admin" and endpoint["path"] == "/metrics"
    (expression,) = monitor["selector"]["matchExpressions"]
    assert expression["operator"] == "In"
    scraped = set(expression["values"])
    pods = [w for w in workloads(objects) if w["spec"]["template"]["metadata"]["labels"]]
    waygate = [w for w in pods if w["metadata"]["name"] != "waygate-jaeger"]
    assert len(waygate) == 5
    for workload in waygate:
        template = workload["spec"]["template"]
        assert template["metadata"]["labels"][expression["key"]] in scraped, workload["metadata"]
        ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", ())}
        assert "admin" in ports, workload["metadata"]["name"]


def test_promtool_checks_the_rules_and_passes_a_unit_test_for_every_alert(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(yaml.safe_dump(rule_groups(), sort_keys=False))
    check = subprocess.run(
        [promtool(), "check", "rules", str(rules)], capture_output=True, text=True, timeout=60
    )
    assert check.returncode == 0, check.stdout + check.stderr
    shutil.copy(ALERT_TESTS, tmp_path / ALERT_TESTS.name)
    result = subprocess.run(
        [promtool(), "test", "rules", ALERT_TESTS.name],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout
    # Every alert has a test that expects it to fire, and says how (its severity).
    alerts = {r["alert"] for g in rule_groups()["groups"] for r in g["rules"] if "alert" in r}
    firing: dict[str, set[str]] = {}
    for case in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for test in case["alert_rule_test"]:
            for expected in test.get("exp_alerts", ()):
                firing.setdefault(test["alertname"], set()).add(expected["exp_labels"]["severity"])
    assert set(firing) == alerts
    assert len(alerts) >= 9


def test_the_alerts_cover_what_operators_page_on():
    alerts = {r["alert"]: r for g in rule_groups()["groups"] for r in g["rules"] if "alert" in r}
    wanted = {
        "WaygateCertificateExpiringSoon": "waygate_certificate_expiry_timestamp_seconds",
        "WaygateCertificateRenewalsFailing": "waygate_certificate_renewals_total",
        "WaygateRoutesFileInvalid": "waygate_resolver_routes_file_valid",
        "WaygateResolverStale": "waygate_resolver_client_staleness_seconds",
        "WaygateRouteNoEndpoints": "waygate_resolver_route_ready_endpoints",
        "WaygateUpstreamTLSFailures": "waygate_proxy_upstream_tls_failures_total",
        "WaygateTunnelAgentsGone": "waygate_tunnel_server_agents",
        "WaygateProxy5xxRatio": "waygate_proxy_requests_total",
    }
    for alert, metric in wanted.items():
        assert metric in alerts[alert]["expr"], alert
        assert alerts[alert]["labels"]["severity"] in ("warning", "critical")
        assert alerts[alert]["annotations"]["summary"]


def test_dashboards_are_what_the_generator_writes():
    generated = _generator().render()
    on_disk = {p.name: p.read_text() for p in (COMPONENT / "dashboards").glob("*.json")}
    assert generated == on_disk, "run deploy/kustomize/components/monitoring/dashboards/generate.py"
    assert set(on_disk) == {
        "waygate-overview.json",
        "waygate-proxy.json",
        "waygate-resolver.json",
        "waygate-certs.json",
        "waygate-tunnel.json",
    }
    for name, board in dashboards().items():
        ids = [panel["id"] for panel in board["panels"]]
        assert len(ids) == len(set(ids)), name
        for panel in board["panels"]:
            assert panel["datasource"]["uid"] == "${datasource}", (name, panel["title"])
            assert panel["targets"], (name, panel["title"])
            assert panel["gridPos"]["w"] > 0
    # Braces and parentheses balance in every expression (a cheap syntax check;
    # promtool checks the alerts' fully).
    for expr in expressions():
        assert expr.count("(") == expr.count(")") and expr.count("{") == expr.count("}"), expr
    assert "waygate_proxy_requests_total" in monitored_metric_names()
