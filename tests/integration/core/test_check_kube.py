"""`waygate check --kube-context`: a cluster checked through the Kubernetes API
(against the stand-in API server): workloads ready, Route statuses, the trust
bundle ConfigMap; a missing context or an unreachable server is one line."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.kubeapi import KubeAPI
from waygate import cli

NS = "waygate"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return int(code or 0), out, err


def workload(kind: str, name: str, desired: int, ready: int) -> dict:
    if kind == "DaemonSet":
        spec: dict = {}
        status = {"desiredNumberScheduled": desired, "numberReady": ready}
    else:
        spec = {"replicas": desired}
        status = {"readyReplicas": ready} if ready else {}
    return {
        "apiVersion": "apps/v1",
        "kind": kind,
        "metadata": {"name": name, "namespace": NS},
        "spec": spec,
        "status": status,
    }


def route(name: str, resolved: tuple[str, str, str] = ("True", "Resolved", "")) -> dict:
    status, reason, message = resolved
    return {
        "apiVersion": "waygate.io/v1",
        "kind": "Route",
        "metadata": {"name": name, "namespace": "demo"},
        "spec": {"host": f"{name}.example.com", "backends": [{"service": name}]},
        "status": {
            "conditions": [
                {"type": "Admitted", "status": "True", "reason": "Admitted", "message": ""},
                {"type": "ResolvedRefs", "status": status, "reason": reason, "message": message},
                {"type": "Conflicted", "status": "False", "reason": "NoConflict", "message": ""},
            ]
        },
    }


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[KubeAPI, Path]]:
    with KubeAPI() as api:
        api.bearer_token = "t0ken"
        api.register("waygate.io/v1", "Route", "routes", namespaced=True)
        api.create({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}})
        for kind, name, replicas in (
            ("Deployment", "waygate-resolver", 1),
            ("Deployment", "waygate-certs", 1),
            ("Deployment", "waygate-proxy", 2),
            ("StatefulSet", "waygate-tunnel-server", 2),
            ("DaemonSet", "waygate-tunnel-agent", 3),
        ):
            api.create(workload(kind, name, replicas, replicas))
        api.create(
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {"name": "waygate-trust-bundle", "namespace": NS},
                "data": {"ca.pem": "..."},
            }
        )
        api.create(route("echo"))
        yield api, api.kubeconfig(tmp_path / "kubeconfig", "t0ken")


def check(capsys: pytest.CaptureFixture[str], kubeconfig: Path, *more: str):
    return run(capsys, "check", "--kube-context", "c", "--kubeconfig", str(kubeconfig), *more)


def test_a_healthy_cluster_is_all_ticks(capsys, cluster):
    _, kubeconfig = cluster
    code, out, err = check(capsys, kubeconfig)
    assert code == 0, out + err
    assert "✖" not in out and "Status check results are ✔" in out
    assert "✔ Deployment waygate/waygate-proxy: 2/2 ready" in out
    assert "✔ DaemonSet waygate/waygate-tunnel-agent: 3/3 ready" in out
    assert "✔ all 1 Route objects admitted, their services resolved" in out
    assert "✔ trust bundle ConfigMap waygate/waygate-trust-bundle exists" in out


def test_a_route_to_a_missing_service_fails_naming_it(capsys, cluster):
    api, kubeconfig = cluster
    api.create(route("ghost", ("False", "ServiceNotFound", "service demo/ghost not found")))
    code, out, _ = check(capsys, kubeconfig)
    assert code == 1
    assert "✖ route demo/ghost: ServiceNotFound: service demo/ghost not found" in out
    assert "hint: create the service" in out


def test_a_workload_without_ready_replicas_fails(capsys, cluster):
    api, kubeconfig = cluster
    api.replace(workload("Deployment", "waygate-certs", 1, 0))
    code, out, _ = check(capsys, kubeconfig)
    assert code == 1
    assert "✖ Deployment waygate/waygate-certs: 0/1 ready" in out
    assert "kubectl -n waygate describe deployment waygate-certs" in out


def test_missing_optional_workload_warns_missing_bundle_fails(capsys, cluster):
    api, kubeconfig = cluster
    api.delete("apps/v1", "DaemonSet", "waygate-tunnel-agent", NS)
    api.delete("v1", "ConfigMap", "waygate-trust-bundle", NS)
    code, out, _ = check(capsys, kubeconfig)
    assert code == 1
    assert "‼ DaemonSet waygate/waygate-tunnel-agent not installed (optional)" in out
    assert "✖ trust bundle ConfigMap waygate/waygate-trust-bundle" in out


def test_an_unknown_context_is_one_line(capsys, cluster):
    _, kubeconfig = cluster
    code, out, err = run(capsys, "check", "--kube-context", "nope", "--kubeconfig", str(kubeconfig))
    assert code == 2
    assert "nope" in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err + out


def test_an_unreachable_api_server_is_one_line(capsys, tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\n"
        f'clusters: [{{name: x, cluster: {{server: "http://127.0.0.1:{port}"}}}}]\n'
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: x, user: u}}]\ncurrent-context: c\n"
    )
    code, out, err = check(capsys, kubeconfig, "--timeout", "2")
    assert code == 2
    assert "cannot reach the Kubernetes API" in err and len(err.strip().splitlines()) == 1, err
    assert "Traceback" not in err + out
