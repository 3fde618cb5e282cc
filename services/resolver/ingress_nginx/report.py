"""`waygate ingress-nginx check PATH | --kube-context CTX [-o table|json]`: the migration report.

Offline: reads what `kubectl apply -f PATH` takes (a file or a directory of YAML
or JSON, as the resolver's --manifests does), or lists Ingresses, IngressClasses
and ConfigMaps from a cluster (and reads the Secrets their auth-secret,
auth-tls-secret and proxy-ssl-secret annotations name), and says per Ingress of the ingress-nginx class and per annotation what Waygate does with it (the verdicts the resolver's
--ingress-nginx mode applies: the same `annotations.plan`), whether the Ingress
would be served, and the controller ConfigMap's keys that are not honoured.

Exit status: 0 when every annotation and key is honoured exactly (or a no-op)
and every Ingress would be served; 1 otherwise; 2 when the input cannot be read.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from waygate.core.clientcli import EXIT_USAGE_OR_UNREACHABLE, fail
from waygate.core.errors import WaygateError
from waygate.resolver.filesource import FileError
from waygate.resolver.ingress_nginx import annotations as planner
from waygate.resolver.ingress_nginx import tcpservices as tcp_entries
from waygate.resolver.ingress_nginx.catalogue import DEFAULT_PREFIX, Verdict
from waygate.resolver.ingress_nginx.config import (
    DEFAULT_CLASS,
    IngressNginx,
    KeyVerdict,
    class_of,
    classes,
    config_from,
    default_class,
    parse_reference,
)

JSON = dict[str, Any]
EXIT_EXACT, EXIT_DIFFERENT = 0, 1


@dataclass
class IngressReport:
    namespace: str
    name: str
    served: bool
    refusal: str
    findings: list[planner.Finding] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return self.served and all(
            f.verdict in (Verdict.HONOURED, Verdict.NOOP) for f in self.findings
        )


@dataclass
class Report:
    ingresses: list[IngressReport] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # Ingresses of other classes
    config: list[KeyVerdict] = field(default_factory=list)
    configmap: str = ""
    # The TCP and UDP services ConfigMaps' entries ("TCP 9000", value, verdict, note).
    streams: list[KeyVerdict] = field(default_factory=list)

    @property
    def exact(self) -> bool:
        return all(i.exact for i in self.ingresses) and all(
            k.verdict in (Verdict.HONOURED, Verdict.NOOP) for k in (*self.config, *self.streams)
        )

    def by_annotation(self) -> list[tuple[str, str, int]]:
        """(annotation, verdict, Ingresses using it) for every verdict not exact, most
        used first: what to look at before switching, across every Ingress."""
        counts: dict[tuple[str, str], int] = {}
        for item in self.ingresses:
            for f in item.findings:
                if f.verdict in (Verdict.DIFFERENT, Verdict.NOT_HONOURED):
                    key = (f.annotation, f.verdict.value)
                    counts[key] = counts.get(key, 0) + 1
        return sorted(((a, v, n) for (a, v), n in counts.items()), key=lambda x: (-x[2], x[0]))

    def as_json(self) -> JSON:
        return {
            "exact": self.exact,
            "byAnnotation": [
                {"annotation": a, "verdict": v, "ingresses": n} for a, v, n in self.by_annotation()
            ],
            "configMap": {
                "name": self.configmap,
                "keys": [
                    {"key": k.key, "value": k.value, "verdict": k.verdict.value, "note": k.note}
                    for k in self.config
                ],
            },
            "ingresses": [
                {
                    "namespace": i.namespace,
                    "name": i.name,
                    "served": i.served,
                    "refusal": i.refusal,
                    "exact": i.exact,
                    "annotations": [
                        {
                            "annotation": f.annotation,
                            "value": f.value,
                            "verdict": f.verdict.value,
                            "note": f.note,
                            "refuses": f.refuses,
                        }
                        for f in i.findings
                    ],
                }
                for i in self.ingresses
            ],
            "skipped": self.skipped,
            "streamServices": [
                {"entry": k.key, "value": k.value, "verdict": k.verdict.value, "note": k.note}
                for k in self.streams
            ],
        }

    def as_table(self) -> str:
        lines = []
        for item in self.ingresses:
            state = "served" if item.served else "NOT SERVED"
            exact = ", exactly" if item.exact else ""
            lines.append(f"Ingress {item.namespace}/{item.name}: {state}{exact}")
            if item.refusal:
                lines.append(f"  refused: {item.refusal}")
            for f in item.findings:
                note = f" -- {f.note}" if f.note else ""
                lines.append(f"  {f.annotation:<42} {f.verdict.value:<25}{note}")
        if self.config:
            lines.append(f"ConfigMap {self.configmap}:")
            for k in self.config:
                note = f" -- {k.note}" if k.note else ""
                lines.append(f"  {k.key:<42} {k.verdict.value:<25}{note}")
        if self.streams:
            lines.append("TCP and UDP services:")
        for k in self.streams:
            note = f" -- {k.note}" if k.note else ""
            lines.append(f"  {k.key:<10} {k.value:<31} {k.verdict.value:<25}{note}")
        for skipped in self.skipped:
            lines.append(f"skipped: {skipped}")
        summary = self.by_annotation()
        if summary:
            lines.append("Not honoured exactly, by annotation (Ingresses):")
            lines += [f"  {a:<42} {v:<25} {n}" for a, v, n in summary]
        total = len(self.ingresses)
        honoured = sum(1 for i in self.ingresses if i.exact)
        refused = sum(1 for i in self.ingresses if not i.served)
        lines.append(
            f"{total} Ingresses of the class: {honoured} honoured exactly, "
            f"{total - honoured - refused} served with differences, {refused} not served"
        )
        return "\n".join(lines)


def check(
    objects: list[JSON], settings: IngressNginx, udp_services: tuple[str, str] | None = None
) -> Report:
    """The report for a set of objects (Ingress, IngressClass, ConfigMap, Secret; others
    ignored):
    also the TCP services ConfigMap's entries (`settings.tcp_services`) and the UDP one's."""
    by_kind: dict[str, dict[tuple[str, str], JSON]] = {}
    for obj in objects:
        kind = obj.get("kind")
        meta = obj.get("metadata") or {}
        if not isinstance(kind, str) or not isinstance(meta, dict):
            continue
        namespace = "" if kind == "IngressClass" else str(meta.get("namespace") or "default")
        by_kind.setdefault(kind, {})[(namespace, str(meta.get("name") or ""))] = obj
    config_maps = by_kind.get("ConfigMap", {})
    config = config_from(config_maps.get(settings.configmap or ("", "")))
    ours = classes(by_kind.get("IngressClass", {}), settings)
    default = default_class(ours)
    report = Report(
        config=planner.config_verdicts(config, lambda ns, name: config_maps.get((ns, name))),
        configmap="/".join(settings.configmap) if settings.configmap else "",
        streams=stream_verdicts(config_maps, settings.tcp_services, udp_services),
    )
    for (namespace, name), obj in sorted(by_kind.get("Ingress", {}).items()):
        obj.setdefault("metadata", {}).setdefault("namespace", namespace)
        class_name = class_of(obj) or default
        if class_name not in ours:
            report.skipped.append(f"Ingress {namespace}/{name} (class {class_name or 'none'})")
            continue
        plan, _ = planner.judge(obj, settings, config_maps, by_kind.get("Secret", {}))
        served = not plan.refusal_reason
        report.ingresses.append(IngressReport(namespace, name, served, plan.refusal, plan.findings))
    return report


def stream_verdicts(
    config_maps: dict[tuple[str, str], JSON],
    tcp: tuple[str, str] | None,
    udp: tuple[str, str] | None,
) -> list[KeyVerdict]:
    """Each TCP services entry honoured or refused (why); each UDP entry not honoured."""
    out: list[KeyVerdict] = []
    for protocol, key in (("TCP", tcp), ("UDP", udp)):
        if key is None:
            continue
        data = (config_maps.get(key) or {}).get("data") or {}
        if not config_maps.get(key):
            out.append(
                KeyVerdict(f"{protocol} -", "/".join(key), Verdict.NOOP, "no such ConfigMap")
            )
        for port, value in sorted(data.items() if isinstance(data, dict) else ()):
            entry = f"{protocol} {port}"
            if protocol == "UDP":
                out.append(
                    KeyVerdict(
                        entry, str(value), Verdict.NOT_HONOURED, "Waygate relays no UDP: not served"
                    )
                )
                continue
            try:
                tcp_entries.parse_entry(str(port), str(value))
            except ValueError as exc:
                out.append(KeyVerdict(entry, str(value), Verdict.NOT_HONOURED, f"refused: {exc}"))
                continue
            out.append(KeyVerdict(entry, str(value), Verdict.HONOURED))
    return out


# ---------------------------------------------------------------- input


def read_path(path: Path) -> list[JSON]:
    """The objects of a file or a directory, as `kubectl apply -f` reads them."""
    from waygate.resolver.manifests import _documents, _files

    if not path.exists():
        raise OSError(f"{path} does not exist")
    files = _files(path) if path.is_dir() else [path]
    out: list[JSON] = []
    for file in files:
        out.extend(doc.obj for doc in _documents(file, file.read_text(encoding="utf-8")))
    return out


def read_cluster(kubeconfig: str, context: str) -> list[JSON]:
    # Imported here: the client library is heavy, and only this input needs it.
    from waygate.core.kube import KubeAPI, KubeError, load_api_client

    api = KubeAPI(load_api_client(Path(kubeconfig) if kubeconfig else None, context=context))
    try:
        out: list[JSON] = []
        for kind, path in (
            ("Ingress", "/apis/networking.k8s.io/v1/ingresses"),
            ("IngressClass", "/apis/networking.k8s.io/v1/ingressclasses"),
            ("ConfigMap", "/api/v1/configmaps"),
        ):
            try:
                items, _ = api.list(path)
            except KubeError as exc:
                raise ValueError(f"listing {kind}s: {exc}") from None
            for item in items:
                item.setdefault("kind", kind)
            out.extend(items)
        # Only the Secrets an annotation names (never every Secret of the cluster).
        for namespace, name in sorted(_auth_secrets(out)):
            try:
                secret = api.get(f"/api/v1/namespaces/{namespace}/secrets/{name}")
            except KubeError as exc:
                if exc.not_found:
                    continue  # judged as missing: the Ingress is refused, naming it
                raise ValueError(f"reading Secret {namespace}/{name}: {exc}") from None
            secret.setdefault("kind", "Secret")
            secret.setdefault("metadata", {}).setdefault("namespace", namespace)
            out.append(secret)
        return out
    finally:
        api.close()


_SECRET_ANNOTATIONS = ("/auth-secret", "/auth-tls-secret", "/proxy-ssl-secret")
DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?")


def _auth_secrets(objects: list[JSON]) -> set[tuple[str, str]]:
    """(namespace, name) of every Secret an Ingress's auth-secret, auth-tls-secret or
    proxy-ssl-secret names (any prefix)."""
    found = set()
    for obj in objects:
        meta = obj.get("metadata") or {}
        if obj.get("kind") != "Ingress" or not isinstance(meta.get("annotations"), dict):
            continue
        for key, value in meta["annotations"].items():
            if str(key).endswith(_SECRET_ANNOTATIONS) and isinstance(value, str):
                namespace, _, name = value.rpartition("/")
                if DNS_LABEL.fullmatch(name) and DNS_LABEL.fullmatch(namespace or "x"):
                    found.add((namespace or str(meta.get("namespace") or "default"), name))
    return found


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "path", nargs="?", type=Path, help="a manifest file or directory (as kubectl apply -f)"
    )
    parser.add_argument("--kube-context", default="", help="read from this cluster context")
    parser.add_argument("--kubeconfig", default="", help="kubeconfig for --kube-context")
    parser.add_argument("--ingress-nginx-class", default=DEFAULT_CLASS, help="as the resolver's")
    parser.add_argument("--annotations-prefix", default=DEFAULT_PREFIX, help="as ingress-nginx's")
    parser.add_argument(
        "--ingress-nginx-configmap", default="", help="NS/NAME of the controller ConfigMap"
    )
    parser.add_argument(
        "--tcp-services-configmap", default="", help="NS/NAME of the TCP services ConfigMap"
    )
    parser.add_argument(
        "--udp-services-configmap",
        default="",
        help="NS/NAME of the UDP services ConfigMap: its entries are reported as not "
        "honoured (Waygate relays no UDP)",
    )
    parser.add_argument("-o", "--output", choices=("table", "json"), default="table")
    parser.set_defaults(func=_run)


def _run(args: argparse.Namespace) -> int:
    if (args.path is None) == (not args.kube_context):
        return fail(
            "ingress-nginx check: give PATH or --kube-context, one of them",
            EXIT_USAGE_OR_UNREACHABLE,
        )
    try:
        configmap, tcp, udp = (
            parse_reference(value, flag) if value else None
            for value, flag in (
                (args.ingress_nginx_configmap, "--ingress-nginx-configmap"),
                (args.tcp_services_configmap, "--tcp-services-configmap"),
                (args.udp_services_configmap, "--udp-services-configmap"),
            )
        )
    except ValueError as exc:
        return fail(f"ingress-nginx check: {exc}", EXIT_USAGE_OR_UNREACHABLE)
    settings = IngressNginx(
        class_name=args.ingress_nginx_class,
        prefix=args.annotations_prefix,
        configmap=configmap,
        tcp_services=tcp,
    )
    try:
        if args.path is not None:
            objects = read_path(args.path)
        else:
            objects = read_cluster(args.kubeconfig, args.kube_context)
    except (OSError, ValueError, WaygateError, FileError) as exc:
        return fail(f"ingress-nginx check: {exc}", EXIT_USAGE_OR_UNREACHABLE)
    report = check(objects, settings, udp)
    if args.output == "json":
        json.dump(report.as_json(), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(report.as_table())
    return EXIT_EXACT if report.exact else EXIT_DIFFERENT


COMMANDS = {("ingress-nginx", "check"): _configure}
