"""The kustomize overlays render, pass strict schema validation, run hardened pods,
and pass each container only flags that the real `waygate` CLI accepts.

Workloads are Deployments and DaemonSets (the tunnel agent runs on every edge
node). A workload exposes the contract ports of its component (components.py)
under their names (grpc, dial, http, https, admin): a proxy has no gRPC port,
an agent only an admin port; every one has admin, probed there."""

from __future__ import annotations

import base64
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from waygate.cli import build_parser
from waygate.components import COMPONENTS

ROOT = Path(__file__).resolve().parents[2]
OVERLAYS = ["dev", "production", "dev-gateway-api", "dev-ingress-nginx"]
KUBERNETES_VERSION = "1.32"


def render(overlay: str) -> str:
    """An overlay's render; "base" renders the base itself."""
    kubectl = shutil.which("kubectl")
    assert kubectl, "kubectl is needed to render the overlays (.ci/run installs it)"
    where = ROOT / "deploy/kustomize" / ("base" if overlay == "base" else f"overlays/{overlay}")
    result = subprocess.run(
        [kubectl, "kustomize", str(where)],
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


WORKLOADS = ("Deployment", "DaemonSet", "StatefulSet")


def workloads(objects):
    return [o for o in objects if o["kind"] in WORKLOADS]


def named(objects, kind, name):
    found = [o for o in objects if o["kind"] == kind and o["metadata"]["name"] == name]
    assert found, f"no {kind} {name}"
    return found[0]


def contract_ports(component) -> dict[str, int]:
    """Port name in a manifest -> contract number: grpc_port -> grpc, dial_port -> dial..."""
    return {field.removesuffix("_port"): port for field, port in component.ports}


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
    assert any(o["kind"] == "Deployment" for o in workloads(objects))
    for workload in workloads(objects):
        pod = workload["spec"]["template"]["spec"]
        name = f"{workload['kind']} {workload['metadata']['name']}"
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
    seen = set()
    for workload in workloads(objects):
        name = f"{workload['kind']} {workload['metadata']['name']}"
        for container in workload["spec"]["template"]["spec"]["containers"]:
            if not container["image"].startswith("waygate/waygate:"):
                continue
            args = container["args"]
            component = next((c for c in COMPONENTS if c.command == tuple(args[:2])), None)
            assert component is not None, f"{name}: not a waygate service command: {args[:2]}"
            assert component.implemented, f"{name}: {component.name} is not implemented"
            seen.add(component.name)
            # A fresh parser per container: argparse keeps state from the last parse.
            parsed, unknown = build_parser(args).parse_known_args(args)
            assert not unknown, f"{name}: flags the CLI does not know: {unknown}"
            assert not getattr(parsed, "accepts_any_arguments", False), name
            contract = contract_ports(component)
            ports = {p["name"]: p["containerPort"] for p in container.get("ports", [])}
            assert "admin" in ports, f"{name}: no admin port"
            for port_name, number in ports.items():
                if port_name in contract:
                    assert number == contract[port_name], f"{name}: {port_name} {number}"
            probe = container["readinessProbe"]["httpGet"]
            assert probe["port"] == "admin" and probe["path"] == "/readyz", name
            assert container["livenessProbe"]["httpGet"]["port"] == "admin", name
    assert {"certs", "resolver", "proxy", "tunnel-server", "tunnel-agent"} <= seen


def test_contract_ports_tell_a_workload_without_grpc_from_one_with_it():
    by_name = {c.name: c for c in COMPONENTS}
    assert "grpc" not in contract_ports(by_name["proxy"])
    assert contract_ports(by_name["proxy"]) == {"http": 8080, "https": 8443, "admin": 9004}
    assert contract_ports(by_name["resolver"])["grpc"] == 7001


def test_proxy_is_served_watches_the_resolver_over_tls_and_scales_in_ha():
    for overlay in OVERLAYS:
        objects = [doc for doc in yaml.safe_load_all(render(overlay)) if doc]
        proxy = named(objects, "Deployment", "waygate-proxy")
        args = proxy["spec"]["template"]["spec"]["containers"][0]["args"]
        assert "--resolver-address=waygate-resolver.waygate.svc:7001" in args
        # TLS to the resolver: the proxy takes its client certificate from certs,
        # under the identity the resolver sends route keys to.
        assert any(a.startswith("--certs-address=") for a in args)
        identity = "--cert-identity=spiffe://cluster.local/ns/waygate/sa/waygate-proxy"
        assert identity in args
        resolver = named(objects, "Deployment", "waygate-resolver")
        resolver_args = resolver["spec"]["template"]["spec"]["containers"][0]["args"]
        assert any(
            a.startswith("--route-readers=") and identity.split("=", 1)[1] in a
            for a in resolver_args
        )
        service = named(objects, "Service", "waygate-proxy")
        assert {p["targetPort"] for p in service["spec"]["ports"]} == {"http", "https"}
    production = [doc for doc in yaml.safe_load_all(render("production")) if doc]
    hpa = named(production, "HorizontalPodAutoscaler", "waygate-proxy")
    assert hpa["spec"]["scaleTargetRef"]["name"] == "waygate-proxy"
    assert hpa["spec"]["minReplicas"] >= 2
    # The HPA owns the replica count: the Deployment must not reset it on apply.
    assert "replicas" not in named(production, "Deployment", "waygate-proxy")["spec"]


def test_network_policies_allow_the_proxy_flows_and_nothing_into_admin_but_monitoring():
    objects = [doc for doc in yaml.safe_load_all(render("production")) if doc]
    policy = named(objects, "NetworkPolicy", "waygate-proxy")["spec"]
    open_ports = {
        p["port"] for rule in policy["ingress"] if "from" not in rule for p in rule["ports"]
    }
    assert open_ports == {8080, 8443}
    (admin,) = [rule for rule in policy["ingress"] if "from" in rule]
    assert admin["ports"] == [{"port": 9004, "protocol": "TCP"}]
    assert admin["from"] == [
        {"namespaceSelector": {"matchLabels": {"waygate.io/monitoring": "true"}}}
    ]
    egress_ports = {p["port"] for rule in policy["egress"] for p in rule.get("ports", [])}
    assert {7001, 7002, 7004, 53} <= egress_ports
    # Backends: every pod of the cluster, and outside addresses but the metadata service.
    assert any({"namespaceSelector": {}} in rule.get("to", []) for rule in policy["egress"])
    blocks = [
        t["ipBlock"] for rule in policy["egress"] for t in rule.get("to", []) if "ipBlock" in t
    ]
    assert blocks and all(b["except"] for b in blocks), "backends: all but the metadata service"
    assert "169.254.169.254/32" in blocks[0]["except"]
    # The proxy reaches the resolver through the resolver's own policy too.
    resolver = named(objects, "NetworkPolicy", "waygate-resolver")["spec"]
    grpc_rule = next(
        r for r in resolver["ingress"] if {"port": 7001, "protocol": "TCP"} in r["ports"]
    )
    assert {"podSelector": {}} in grpc_rule["from"]


def test_route_crd_and_rbac_are_part_of_every_overlay(rendered):
    _, objects = rendered
    kinds = {(o["kind"], o["metadata"]["name"]) for o in objects}
    assert ("CustomResourceDefinition", "routes.waygate.io") in kinds
    assert ("ClusterRole", "waygate-resolver") in kinds
    assert ("ClusterRole", "waygate-certs") in kinds
    assert all(o["metadata"].get("namespace") in (None, "waygate") for o in objects)


def _flag(args, name):
    values = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    assert len(values) == 1, f"--{name} given {len(values)} times"
    return values[0]


def test_tunnel_is_wired_agents_outside_dialers_inside_resolver_trusts_its_reports(rendered):
    _, objects = rendered
    server = named(objects, "StatefulSet", "waygate-tunnel-server")
    server_args = server["spec"]["template"]["spec"]["containers"][0]["args"]
    identity = _flag(server_args, "cert-identity")
    assert identity == "spiffe://cluster.local/ns/waygate/sa/waygate-tunnel-server"
    assert server["spec"]["template"]["spec"]["serviceAccountName"] == "waygate-tunnel-server"
    # The replica ids agents are told to hold are exactly the StatefulSet's pod names.
    replicas = server["spec"]["replicas"]
    assert _flag(server_args, "replicas").split(",") == [
        f"waygate-tunnel-server-{i}" for i in range(replicas)
    ]
    assert _flag(server_args, "server-id") == "$(POD_NAME)"
    # The resolver accepts presence reports from the tunnel server's identity.
    resolver = named(objects, "Deployment", "waygate-resolver")
    resolver_args = resolver["spec"]["template"]["spec"]["containers"][0]["args"]
    assert identity in _flag(resolver_args, "tunnel-reporters").split(",")
    # ...from every replica (each knows only what it is told): the reports go to every
    # address of a headless Service selecting the resolver pods, verified by a name
    # the resolvers' certificate carries, not through the load-balanced Service.
    assert not [a for a in server_args if a.startswith("--resolver-address=")]
    host, port = _flag(server_args, "resolver-replicas-service").rsplit(":", 1)
    name, namespace = host.split(".")[:2]
    headless = named(objects, "Service", name)["spec"]
    assert namespace == "waygate" and headless["clusterIP"] == "None"
    assert headless["selector"] == resolver["spec"]["selector"]["matchLabels"]
    assert {p["port"] for p in headless["ports"]} == {int(port)}
    server_name = _flag(server_args, "resolver-server-name")
    assert "dns:" + server_name in _flag(resolver_args, "cert-sans").split(",")
    # Only the proxy dials.
    assert _flag(server_args, "dialers") == "spiffe://cluster.local/ns/waygate/sa/waygate-proxy"
    # Agents' port outside the cluster; dialers' and the front inside.
    outside = named(objects, "Service", "waygate-tunnel-agents")["spec"]
    assert outside["type"] in ("LoadBalancer", "NodePort")
    # gRPC control streams and the data connections beside them (one per tunnelled connection).
    assert [p["port"] for p in outside["ports"]] == [7003, 7005]
    inside = named(objects, "Service", "waygate-tunnel-server")["spec"]
    assert inside.get("type", "ClusterIP") == "ClusterIP"
    assert {p["port"] for p in inside["ports"]} == {7004, 7005, 10263}

    agent = named(objects, "DaemonSet", "waygate-tunnel-agent")
    pod = agent["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"waygate.io/edge": "true"}
    assert not pod.get("hostNetwork"), "the agent runs under the restricted standard"
    (container,) = pod["containers"]
    agent_args = container["args"]
    assert _flag(agent_args, "cert-identity") == "$(NODE_NAME)"
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # The agent's projected token carries the audience certs checks.
    certs = named(objects, "Deployment", "waygate-certs")
    audience = _flag(certs["spec"]["template"]["spec"]["containers"][0]["args"], "token-audience")
    (token,) = [
        s["serviceAccountToken"]
        for v in pod["volumes"]
        for s in v.get("projected", {}).get("sources", [])
        if "serviceAccountToken" in s
    ]
    assert token["audience"] == audience
    assert token["path"] == _flag(agent_args, "certs-token-file").rsplit("/", 1)[1]
    # The servers' certificate carries the name agents verify.
    assert "dns:" + _flag(agent_args, "server-name") in _flag(server_args, "cert-sans").split(",")
    edge = named(objects, "ConfigMap", "waygate-tunnel-edge")["data"]
    assert edge["WAYGATE_SERVER_ADDRESS"].endswith(":7003")
    for account in ("waygate-tunnel-server", "waygate-tunnel-agent"):
        assert named(objects, "ServiceAccount", account)["automountServiceAccountToken"] is False


def test_network_policies_let_agents_in_from_outside_and_dialers_from_inside():
    objects = [doc for doc in yaml.safe_load_all(render("production")) if doc]
    policy = named(objects, "NetworkPolicy", "waygate-tunnel-server")["spec"]
    open_ports = {
        p["port"] for rule in policy["ingress"] if "from" not in rule for p in rule["ports"]
    }
    assert open_ports == {7003, 7005, 10263}
    dial = next(r for r in policy["ingress"] if {"port": 7004, "protocol": "TCP"} in r["ports"])
    assert dial["from"] == [
        {"podSelector": {"matchLabels": {"app.kubernetes.io/name": "waygate-proxy"}}}
    ]
    agent = named(objects, "NetworkPolicy", "waygate-tunnel-agent")["spec"]
    (admin,) = agent["ingress"]
    assert admin["ports"] == [{"port": 9005, "protocol": "TCP"}]


def test_certs_runs_two_replicas_with_a_budget_and_lease_rbac_in_ha():
    objects = [doc for doc in yaml.safe_load_all(render("production")) if doc]
    certs = named(objects, "Deployment", "waygate-certs")
    assert certs["spec"]["replicas"] == 2
    args = certs["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--leader-lease=waygate/waygate-certs-leader" in args
    budget = named(objects, "PodDisruptionBudget", "waygate-certs")
    assert budget["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "waygate-certs"}
    role = named(objects, "Role", "waygate-certs-ca")
    lease_rules = [r for r in role["rules"] if "coordination.k8s.io" in r["apiGroups"]]
    assert any(
        r.get("resourceNames") == ["waygate-certs-leader"] and {"get", "update"} <= set(r["verbs"])
        for r in lease_rules
    )
    assert any("create" in r["verbs"] and not r.get("resourceNames") for r in lease_rules)


def test_every_variable_a_container_refers_to_is_defined(rendered):
    # Kubernetes leaves an undefined $(VAR) in args as it is: certs would take the
    # literal "$(POD_NAME)" as its leader identity (what the tracing component's
    # whole-list env patch once did to every replica in the dev overlay).
    _, objects = rendered
    for workload in workloads(objects):
        namespace = workload["metadata"].get("namespace")
        for container in workload["spec"]["template"]["spec"]["containers"]:
            defined = {env["name"] for env in container.get("env", ())}
            for source in container.get("envFrom", ()):
                config_map = source["configMapRef"]["name"]
                found = [
                    o
                    for o in objects
                    if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"] == config_map
                    and o["metadata"].get("namespace") == namespace
                ]
                assert found, f"no ConfigMap {config_map} for {workload['metadata']['name']}"
                defined |= set(found[0].get("data", {}))
            used = set(re.findall(r"\$\((\w+)\)", " ".join(container.get("args", ()))))
            assert used <= defined, (workload["metadata"]["name"], used - defined)


def test_dev_overlay_exports_traces_from_every_waygate_workload():
    objects = [doc for doc in yaml.safe_load_all(render("dev")) if doc]
    waygate = [
        o
        for o in workloads(objects)
        if o["metadata"].get("labels", {}).get("app.kubernetes.io/part-of") == "waygate"
    ]
    assert {o["kind"] for o in waygate} == set(WORKLOADS)
    for workload in waygate:
        env = {
            e["name"]: e.get("value")
            for e in workload["spec"]["template"]["spec"]["containers"][0]["env"]
        }
        assert env["WAYGATE_OTLP_ENDPOINT"] == "http://waygate-jaeger:4317", workload["metadata"]
        assert env["WAYGATE_LOG_LEVEL"] == "debug"
        if workload["metadata"]["name"] == "waygate-proxy":
            assert 0 < float(env["WAYGATE_TRACE_SAMPLE_RATIO"]) <= 1


# Kinds that live outside any namespace (Kubernetes' own; a custom kind's scope is
# read from its CustomResourceDefinition in the same render).
CLUSTER_SCOPED = {
    "Namespace",
    "CustomResourceDefinition",
    "ClusterRole",
    "ClusterRoleBinding",
    "PriorityClass",
    "StorageClass",
    "IngressClass",
    "GatewayClass",
    "ValidatingWebhookConfiguration",
    "MutatingWebhookConfiguration",
    "ValidatingAdmissionPolicy",
    "ValidatingAdmissionPolicyBinding",
    "APIService",
}


def assert_every_namespaced_object_in_waygate(objects) -> None:
    cluster_scoped = set(CLUSTER_SCOPED) | {
        o["spec"]["names"]["kind"]
        for o in objects
        if o["kind"] == "CustomResourceDefinition" and o["spec"]["scope"] == "Cluster"
    }
    namespaced = [o for o in objects if o["kind"] not in cluster_scoped]
    assert len(namespaced) > 10
    outside = [
        f"{o['kind']} {o['metadata']['name']}: {o['metadata'].get('namespace')}"
        for o in namespaced
        if o["metadata"].get("namespace") != "waygate"
    ]
    assert not outside, outside
    for o in objects:
        if o["kind"] in cluster_scoped:
            assert "namespace" not in o["metadata"], f"{o['kind']} {o['metadata']['name']}"
        for subject in o.get("subjects", ()):
            if subject["kind"] == "ServiceAccount":
                assert subject["namespace"] == "waygate", o["metadata"]["name"]


@pytest.mark.parametrize("overlay", ["base", *OVERLAYS])
def test_every_namespaced_object_is_in_the_waygate_namespace(overlay):
    # kubectl apply -k puts an object without a namespace into the current
    # context's namespace: the deny-all policy or a budget would land elsewhere.
    assert_every_namespaced_object_in_waygate(
        [doc for doc in yaml.safe_load_all(render(overlay)) if doc]
    )


def _sticky_secret_name(objects) -> str:
    """The Secret the proxy's --sticky-key-file comes from (asserting the wiring on the way)."""
    proxy = named(objects, "Deployment", "waygate-proxy")
    pod = proxy["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    key_file = _flag(container["args"], "sticky-key-file")
    directory, _, file_name = key_file.rpartition("/")
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == directory]
    assert mount["readOnly"] is True
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    secret = volume["secret"]
    assert secret.get("optional", False) is False, "a replica without the key would pick its own"
    assert [item["path"] for item in secret["items"]] == [file_name]
    # Readable by the proxy's group only, and the files get that group.
    assert secret["defaultMode"] & 0o007 == 0
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]
    return secret["secretName"]


@pytest.mark.parametrize("overlay", ["base", "production"])
def test_proxy_replicas_share_one_sticky_key_secret_that_is_not_in_git(overlay):
    # Every replica (the HPA's too: they are pods of this one Deployment) mounts
    # the same Secret, so a cookie set by one picks the same endpoint on all.
    objects = [doc for doc in yaml.safe_load_all(render(overlay)) if doc]
    assert _sticky_secret_name(objects) == "waygate-proxy-sticky"
    # Created per cluster (base/proxy.yaml says how), never a key shipped in git.
    assert not [o for o in objects if o["kind"] == "Secret"]


def test_dev_overlay_generates_the_sticky_key_secret_the_proxy_mounts():
    objects = [doc for doc in yaml.safe_load_all(render("dev")) if doc]
    name = _sticky_secret_name(objects)
    secret = named(objects, "Secret", name)
    assert name.startswith("waygate-proxy-sticky")
    assert len(base64.b64decode(secret["data"]["key"])) >= 16  # the proxy's minimum


def test_gateway_api_component_gives_the_classes_the_flag_and_status_rbac():
    objects = [doc for doc in yaml.safe_load_all(render("dev-gateway-api")) if doc]
    gateway_class = named(objects, "GatewayClass", "waygate")
    assert gateway_class["spec"]["controllerName"] == "waygate.io/gateway-controller"
    ingress_class = named(objects, "IngressClass", "waygate")
    assert ingress_class["spec"]["controller"] == "waygate.io/ingress-controller"
    resolver = named(objects, "Deployment", "waygate-resolver")
    args = resolver["spec"]["template"]["spec"]["containers"][0]["args"]
    assert "--gateway-api" in args and any(a.startswith("--status-lease=") for a in args)
    role = named(objects, "ClusterRole", "waygate-resolver-gateway-api")
    granted = {
        (group, resource, verb)
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
        for verb in rule["verbs"]
    }
    # Every kind the resolver watches is granted list and watch, every kind it writes
    # the status of, update on /status (BackendTLSPolicy and its ConfigMaps included).
    from waygate.resolver.gateway.kube import KINDS
    from waygate.resolver.gateway.translate import STATUS_KINDS

    for kind, (prefix, plural, _) in KINDS.items():
        group = "" if prefix == "/api/v1" else prefix.split("/")[2]
        assert {(group, plural, "list"), (group, plural, "watch")} <= granted, kind
        if kind in STATUS_KINDS:
            assert (group, f"{plural}/status", "update") in granted, kind
    assert ("", "configmaps", "watch") in granted
    assert ("gateway.networking.k8s.io", "backendtlspolicies/status", "update") in granted
    binding = named(objects, "ClusterRoleBinding", "waygate-resolver-gateway-api")
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "waygate-resolver", "namespace": "waygate"}
    ]


def test_proxy_deployment_shows_every_http2_limit_at_its_default():
    """Every HTTP/2 limit `waygate proxy serve` exposes (the h2_* settings) is in the
    proxy's args in every overlay, where an operator tunes it, and the base
    value parses to the setting's own default (the manifest does not drift)."""
    import dataclasses

    from waygate.proxy.app import Settings

    limits = {f.name: f.default for f in dataclasses.fields(Settings) if f.name.startswith("h2_")}
    assert len(limits) >= 7
    for overlay in OVERLAYS:
        objects = [doc for doc in yaml.safe_load_all(render(overlay)) if doc]
        proxy = named(objects, "Deployment", "waygate-proxy")
        args = proxy["spec"]["template"]["spec"]["containers"][0]["args"]
        given = dict(a[2:].split("=", 1) for a in args if a.startswith("--h2-"))
        for name, default in limits.items():
            flag = name.replace("_", "-")
            assert flag in given, f"{overlay}: --{flag} not in the proxy's args"
            assert int(given[flag]) == default, f"{overlay}: --{flag}={given[flag]}"
