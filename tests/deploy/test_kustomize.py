"""The kustomize overlays render, pass strict schema validation, run hardened pods,
and pass each container only flags that the real `waygate` CLI accepts."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from waygate.cli import build_parser
from waygate.components import COMPONENTS

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["dev", "production"]
KUBERNETES_VERSION = "1.32"


def render(overlay: str) -> str:
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the overlays (.ci/run installs it)"
    result = subprocess.run(
        [kubectl, "kustomize", str(ROOT / "deploy/kustomize/overlays" / overlay)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request, tmp_path_factory):
    text = render(request.param)
    path = tmp_path_factory.mktemp(request.param) / "rendered.yaml"
    path.write_text(text)
    return path, [doc for doc in yaml.safe_load_all(text) if doc]


def deployments(objects):
    return [o for o in objects if o["kind"] == "Deployment"]


def test_passes_strict_schema_validation(rendered):
    path, _ = rendered
    validator = Path(sys.executable).parent / "kubernetes-validate"
    result = subprocess.run(
        [str(validator), "--strict", "-k", KUBERNETES_VERSION, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_pod_is_hardened_and_probed(rendered):
    _, objects = rendered
    for deployment in deployments(objects):
        pod = deployment["spec"]["template"]["spec"]
        name = deployment["metadata"]["name"]
        assert pod["securityContext"]["runAsNonRoot"] is True, name
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault", name
        for container in pod["containers"]:
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True, name
            assert security["allowPrivilegeEscalation"] is False, name
            assert security["capabilities"]["drop"] == ["ALL"], name
            assert container["readinessProbe"] and container["livenessProbe"], name
            assert container["resources"]["limits"], name


def test_waygate_containers_use_real_flags_and_contract_ports(rendered):
    _, objects = rendered
    parser = build_parser()
    seen = set()
    for deployment in deployments(objects):
        for container in deployment["spec"]["template"]["spec"]["containers"]:
            if not container["image"].startswith("waygate/waygate:"):
                continue
            args = container["args"]
            _, unknown = parser.parse_known_args(args)
            assert not unknown, (
                f"{deployment['metadata']['name']}: flags the CLI does not know: {unknown}"
            )
            component = next(c for c in COMPONENTS if c.command == tuple(args[:2]))
            seen.add(component.name)
            assert component.implemented, component.name
            ports = {p["name"]: p["containerPort"] for p in container["ports"]}
            assert ports["admin"] == component.port("admin_port")
            assert ports["grpc"] == component.port("grpc_port")
            probe_port = container["readinessProbe"]["httpGet"]["port"]
            assert (
                probe_port == "admin"
                and container["readinessProbe"]["httpGet"]["path"] == "/readyz"
            )
    assert {"certs", "resolver"} <= seen


def test_route_crd_and_rbac_are_part_of_every_overlay(rendered):
    _, objects = rendered
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("CustomResourceDefinition", "routes.waygate.io") in kinds
    assert ("ClusterRole", "waygate-resolver") in kinds
    assert ("ClusterRole", "waygate-certs") in kinds
    assert all(o["metadata"].get("namespace") in (None, "waygate") for o in objects)
