"""`waygate ingress-nginx check` over the example Ingresses (real-world annotation mixes).

Runs the real command (a subprocess) on services/resolver/examples/ingress-nginx:
44 Ingresses of the annotations users rely on most, the controller ConfigMap and
an IngressClass. The report must give every Ingress its verdicts, refuse the
ones an access annotation or an unparseable snippet guards, and exit 1 (not
everything is honoured exactly); a directory honoured exactly exits 0.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import yaml

import waygate.resolver

EXAMPLES = Path(waygate.resolver.__file__).parent / "examples" / "ingress-nginx"
CONFIGMAP = "ingress-nginx/ingress-nginx-controller"


def check(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "waygate", "ingress-nginx", "check", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_the_examples_are_at_least_thirty_real_world_ingresses():
    ingresses = [
        doc
        for path in sorted(EXAMPLES.glob("*.yaml"))
        for doc in yaml.safe_load_all(path.read_text())
        if doc and doc["kind"] == "Ingress"
    ]
    assert len(ingresses) >= 30
    annotated = {key for doc in ingresses for key in doc["metadata"].get("annotations", {})}
    assert len(annotated) >= 50


def test_the_json_report_over_the_examples():
    result = check(str(EXAMPLES), "--ingress-nginx-configmap", CONFIGMAP, "-o", "json")
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    assert report["exact"] is False
    by_name = {i["name"]: i for i in report["ingresses"]}
    assert len(by_name) >= 30
    # Access annotations not honoured: not served, the reason names the annotation.
    for name, annotation in (("waf", "modsecurity"),):
        assert by_name[name]["served"] is False, name
        assert annotation in by_name[name]["refusal"], (name, by_name[name]["refusal"])
    # Source ranges and basic authentication (its Secret beside it) are honoured exactly.
    assert by_name["admin-allowlist"]["exact"] is True
    assert by_name["basic-auth"]["exact"] is True
    # Digest (nginx-http-auth-digest's rules) and auth-url to https:// (its certificate
    # verified, where nginx does not): served, each with its named difference.
    for name, annotation in (("digest-auth", "auth-type"), ("oauth2-dashboard", "auth-url")):
        assert by_name[name]["served"] is True and by_name[name]["exact"] is False, name
        verdicts = {a["annotation"]: a["verdict"] for a in by_name[name]["annotations"]}
        assert verdicts[annotation] == "honoured-with-difference", (name, verdicts)
    # Client certificates, the partners' CA certificate in a Secret beside it: exactly.
    assert by_name["mtls-partners"]["served"] is True and by_name["mtls-partners"]["exact"] is True
    # An HTTPS backend verified against proxy-ssl-secret's ca.crt (a Secret beside it),
    # proxy-ssl-verify on, proxy-ssl-name: exactly.
    assert by_name["https-backend"]["exact"] is True
    # limit-rps, -burst-multiplier, -connections: honoured per replica, served exactly.
    assert by_name["rate-limited"]["served"] is True and by_name["rate-limited"]["exact"] is True
    # service-upstream (Linkerd's set-up): the Service's cluster IP, exactly.
    assert by_name["meshed-web"]["served"] is True and by_name["meshed-web"]["exact"] is True
    # A snippet outside the literal subset is refused, naming why; the subset is served.
    assert by_name["snippet-lua"]["served"] is False
    assert "blocks" in by_name["snippet-lua"]["refusal"]
    assert by_name["snippet-headers"]["exact"] is True
    # Honoured exactly, with differences, and not honoured but served.
    assert by_name["web-main"]["exact"] is True
    assert by_name["vhost"]["exact"] is True
    verdicts = {a["annotation"]: a["verdict"] for a in by_name["shop-api"]["annotations"]}
    assert verdicts["rewrite-target"] == "honoured-with-difference"
    verdicts = {a["annotation"]: a["verdict"] for a in by_name["capture-groups"]["annotations"]}
    assert verdicts["rewrite-target"] == "honoured-with-difference"  # $uri: decoded there
    verdicts = {a["annotation"]: a["verdict"] for a in by_name["keycloak"]["annotations"]}
    assert set(verdicts.values()) == {"no-op"}
    assert by_name["cors-api"]["served"] is True and by_name["cors-api"]["exact"] is False
    assert by_name["web-canary"]["exact"] is True  # folded into web-main by weight
    # permanent-redirect, temporal-redirect and a server-snippet's `return 301 URL`:
    # nginx's `return CODE URL`, exactly.
    for name in ("moved", "maintenance", "server-snippet-redirect"):
        assert by_name[name]["served"] is True and by_name[name]["exact"] is True, name
    summary = {(a["annotation"], a["verdict"]): a["ingresses"] for a in report["byAnnotation"]}
    assert summary[("affinity", "honoured-with-difference")] == 2
    assert summary[("auth-url", "honoured-with-difference")] == 1
    keys = {k["key"]: k["verdict"] for k in report["configMap"]["keys"]}
    assert keys["allow-snippet-annotations"] == "honoured"
    assert keys["worker-processes"] == "no-op"
    assert keys["use-forwarded-headers"] == "honoured"
    assert keys["proxy-body-size"] == "honoured"
    for key in ("server-tokens", "ssl-protocols", "ssl-ciphers"):
        assert keys[key] == "honoured", key


def test_the_table_report_and_snippets_refused_without_the_configmap():
    result = check(str(EXAMPLES))
    assert result.returncode == 1, result.stderr
    assert "Ingress apps/snippet-headers: NOT SERVED" in result.stdout
    assert "snippets are not allowed by the ConfigMap" in result.stdout
    assert "Ingresses of the class:" in result.stdout.splitlines()[-1]


def test_the_readme_quotes_the_reports_counts():
    # README "Coming from ingress-nginx" quotes the examples' count and the summary
    # line of their report, with and without the ConfigMap: the figures people read
    # are the ones the command gives.
    readme = " ".join((Path(__file__).parents[3] / "README.md").read_text().split())
    with_configmap = check(str(EXAMPLES), "--ingress-nginx-configmap", CONFIGMAP)
    summary = with_configmap.stdout.splitlines()[-1]
    count = summary.split(" ", 1)[0]
    assert f"holds {count} real-world Ingresses" in readme
    assert f"the report ends `{summary}`" in readme
    alone = check(str(EXAMPLES)).stdout.splitlines()[-1]
    exact, differing, refused = [int(word) for word in alone.split() if word.isdigit()][1:]
    assert f"(without it: {exact}, {differing} and {refused})" in readme


def test_exit_0_only_when_everything_is_honoured_exactly(tmp_path: Path):
    exact = [
        doc
        for doc in yaml.safe_load_all((EXAMPLES / "40-traffic.yaml").read_text())
        if doc["metadata"]["name"] == "web-main"
    ] + [
        doc
        for doc in yaml.safe_load_all((EXAMPLES / "20-redirects.yaml").read_text())
        if doc["metadata"]["name"] == "vhost"
    ]
    (tmp_path / "exact.yaml").write_text(yaml.safe_dump_all(exact))
    result = check(str(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    assert "2 honoured exactly" in result.stdout


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path):
    result = check(str(tmp_path / "missing"))
    assert result.returncode == 2
    assert (
        result.stderr.startswith("waygate: ingress-nginx check:")
        and "Traceback" not in result.stderr
    )
    (tmp_path / "bad.yaml").write_text("kind: [unclosed\n")
    result = check(str(tmp_path / "bad.yaml"))
    assert result.returncode == 2 and "Traceback" not in result.stderr
    result = check()
    assert result.returncode == 2


def test_the_report_from_a_cluster(tmp_path: Path):
    """--kube-context: the objects listed from the STAND-IN API server
    (tests/support/kubeapi.py; no real API server runs here) through a kubeconfig."""
    from tests.support.kubeapi import KubeAPI

    with KubeAPI() as api:
        api.bearer_token = "reader"
        api.register("networking.k8s.io/v1", "Ingress", "ingresses", namespaced=True)
        api.register("networking.k8s.io/v1", "IngressClass", "ingressclasses", namespaced=False)
        for path in sorted(EXAMPLES.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc and doc["kind"] in ("Ingress", "IngressClass", "ConfigMap", "Secret"):
                    if doc["kind"] != "IngressClass":
                        namespace = doc["metadata"]["namespace"]
                        if not any(
                            n["metadata"]["name"] == namespace for n in api.list("v1", "Namespace")
                        ):
                            api.create(
                                {
                                    "apiVersion": "v1",
                                    "kind": "Namespace",
                                    "metadata": {"name": namespace},
                                }
                            )
                    api.create(doc)
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            f"""
apiVersion: v1
kind: Config
clusters: [{{name: stand-in, cluster: {{server: "{api.url}"}}}}]
users: [{{name: reader, user: {{token: reader}}}}]
contexts: [{{name: prod, context: {{cluster: stand-in, user: reader}}}}]
current-context: prod
"""
        )
        result = check(
            "--kube-context",
            "prod",
            "--kubeconfig",
            str(kubeconfig),
            "--ingress-nginx-configmap",
            CONFIGMAP,
            "-o",
            "json",
        )
    assert result.returncode == 1, result.stderr
    report = json.loads(result.stdout)
    by_name = {i["name"]: i for i in report["ingresses"]}
    assert len(by_name) >= 30
    assert by_name["admin-allowlist"]["exact"] is True
    # The Secret an auth-secret names is read (and only it): basic-auth is served.
    assert by_name["basic-auth"]["exact"] is True
    # Client certificates, the partners' CA certificate in a Secret beside it: exactly.
    assert by_name["mtls-partners"]["served"] is True and by_name["mtls-partners"]["exact"] is True
    assert by_name["oauth2-dashboard"]["served"] is True  # (an https:// auth-url)
    assert by_name["digest-auth"]["served"] is True  # its Secret read too
    assert by_name["https-backend"]["exact"] is True  # its proxy-ssl-secret read too
    assert by_name["web-main"]["exact"] is True
    keys = {k["key"] for k in report["configMap"]["keys"]}
    assert "allow-snippet-annotations" in keys
