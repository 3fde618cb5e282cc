"""`waygate gateways`: the status of Gateway API and Ingress objects, as the resolver computed it.

One row per object (GatewayClass, Gateway, HTTPRoute, GRPCRoute, TLSRoute,
Ingress, BackendTLSPolicy) with its conditions in short; Gateways list their
listeners with attached routes; routes list their parents and policies the
Gateways they are used through. A condition that is not as it
should be is shown with its reason and message, so a misconfiguration is
read here, not in a log. `-o json|yaml` prints the objects' `status` as the
Kubernetes API spells it (kind, metadata, status). The route sources' own
state comes first (a rejected manifests file keeps its objects' last good
status, so the table alone would not show it).

Exit codes: 0 ok; 2 usage error or resolver unreachable; 1 any other failure.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from typing import Any

import yaml
from google.protobuf import json_format

from waygate.core.clientcli import (
    ClientSettings,
    add_client_arguments,
    channel_for,
    run_client,
    table,
)
from waygate.resolver import convert
from waygate.resolver.commands import format_sources
from waygate.resolver.gateway.translate import STATUS_KINDS
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

DEFAULT_PORT = 7001
KINDS = STATUS_KINDS
# Conditions whose healthy status is False.
_HEALTHY_FALSE = {"Conflicted"}


def _short(conditions: Sequence[pb.GatewayCondition]) -> str:
    """Healthy conditions by type; unhealthy ones as Type=Status(Reason: message)."""
    parts = []
    for c in conditions:
        healthy = (c.status == "False") if c.type in _HEALTHY_FALSE else (c.status == "True")
        if healthy:
            if c.type not in _HEALTHY_FALSE:
                parts.append(c.type)
        else:
            detail = f"{c.reason}: {c.message}" if c.message else c.reason
            parts.append(f"{c.type}={c.status}({detail})")
    return " ".join(parts) or "-"


def _row(item: pb.GatewayObjectStatus) -> tuple[str, ...]:
    if item.kind == "Gateway":
        detail = "; ".join(
            f"{listener.name}: {listener.attached_routes} routes, {_short(listener.conditions)}"
            for listener in item.listeners
        )
        status = _short(item.conditions)
    elif item.kind == "Ingress":
        status = _short(item.conditions) if item.conditions else "-"
        detail = "address " + ", ".join(item.addresses) if item.addresses else "no address"
    elif item.kind == "GatewayClass":
        status, detail = _short(item.conditions), ""
    elif item.kind == "BackendTLSPolicy" and not item.parents:
        status, detail = "-", "not used by a route of Waygate's Gateways"
    else:
        status = "; ".join(
            f"{p.gateway_namespace}/{p.gateway_name}"
            + (f"/{p.section_name}" if p.section_name else "")
            + f": {_short(p.conditions)}"
            for p in item.parents
        )
        detail = ""
    return (item.kind, item.namespace or "-", item.name, status, detail)


def format_gateways(objects: Sequence[pb.GatewayObjectStatus]) -> str:
    return table(("KIND", "NAMESPACE", "NAME", "STATUS", "LISTENERS"), [_row(o) for o in objects])


def as_documents(objects: Sequence[pb.GatewayObjectStatus]) -> list[dict[str, Any]]:
    out = []
    for item in objects:
        metadata: dict[str, Any] = {"name": item.name, "generation": item.generation}
        if item.namespace:
            metadata["namespace"] = item.namespace
        out.append(
            {
                "kind": item.kind,
                "metadata": metadata,
                "status": convert.gateway_status_from_proto(item),
            }
        )
    return out


def _configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", default="", help="only this namespace")
    parser.add_argument(
        "--kind", action="append", choices=KINDS, default=[], help="only this kind (repeatable)"
    )
    parser.add_argument(
        "-o", "--output", choices=("table", "json", "yaml"), default="table", help="output format"
    )
    add_client_arguments(parser, DEFAULT_PORT)
    parser.set_defaults(func=_gateways)


def _gateways(args: argparse.Namespace) -> int:
    async def body(settings: ClientSettings) -> int:
        async with channel_for(args, settings) as channel:
            reply = await resolver_pb2_grpc.ResolverStub(channel).ListGateways(
                pb.ListGatewaysRequest(namespace=args.namespace, kinds=args.kind),
                timeout=settings.timeout,
            )
        objects = list(reply.objects)
        document = {
            "sources": [json_format.MessageToDict(s) for s in reply.sources],
            "items": as_documents(objects),
            "ignored": [json_format.MessageToDict(i) for i in reply.ignored],
        }
        if args.output == "json":
            print(json.dumps(document, indent=2))
        elif args.output == "yaml":
            sys.stdout.write(yaml.safe_dump(document, sort_keys=False))
        else:
            if reply.sources:
                print(format_sources(reply.sources))
            if objects:
                print(format_gateways(objects))
            else:
                print("no Gateway API or Ingress objects")
            for item in reply.ignored:
                print(f"ignored: {item.kind} {item.namespace}/{item.name}: {item.reason}")
        return 0

    return run_client(args, body)


COMMANDS: dict[tuple[str, ...], Callable[[argparse.ArgumentParser], None]] = {
    ("gateways",): _configure,
}
