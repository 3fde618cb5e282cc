"""Client commands of the resolver: `waygate resolve` and `waygate routes [get|apply|delete]`.

`waygate routes --watch` keeps going across resolver restarts through the
resolver client (`waygate.resolver.client`): it resumes from the last version
it printed, or reprints the table when the resolver answers with a fresh
snapshot.

Exit codes: 0 ok; 3 `resolve` found the service but no endpoint is available;
2 usage error or resolver unreachable; 1 any other failure (one line on
stderr, never a traceback), and `waygate routes` while the resolver rejects
its routes file.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
import yaml
from google.protobuf import json_format, timestamp_pb2

from waygate.core.backoff import Backoff
from waygate.core.clientcli import (
    EXIT_FAILED,
    EXIT_USAGE_OR_UNREACHABLE,
    ClientSettings,
    add_client_arguments,
    add_output_argument,
    channel_for,
    fail,
    printable,
    render,
    run_client,
    table,
)
from waygate.core.errors import InvalidArgument, Unavailable
from waygate.resolver import convert, schema
from waygate.resolver.client import (
    TCP_LISTENER,
    Kind,
    ResolverWatch,
    Route,
    RouteKey,
    SourceState,
    View,
)
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc
from waygate.resolver.validation import validate_route

DEFAULT_PORT = 7001
EXIT_NO_ENDPOINTS = 3
NO_ENDPOINTS = "no endpoints available for service"

_REFERENCE = re.compile(r"^(?P<ns>[^/:\s]+)/(?P<name>[^/:\s]+)(?::(?P<port>[^/:\s]+))?$")
_PICKS = {
    "random": pb.PICK_POLICY_RANDOM,
    "roundrobin": pb.PICK_POLICY_ROUND_ROBIN,
    "hash": pb.PICK_POLICY_HASH,
}


def _sync_text(message: pb.ResolveResponse | pb.WatchEvent) -> str:
    if not message.HasField("last_sync"):
        return "never synced"
    return "synced " + message.last_sync.ToDatetime().strftime("%Y-%m-%dT%H:%M:%SZ")


# ---------------------------------------------------------------- resolve


def _configure_resolve(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("reference", metavar="NS/NAME[:PORT]", help="service and optional port")
    parser.add_argument(
        "--pick", choices=sorted(_PICKS), help="also pick one endpoint by this policy"
    )
    parser.add_argument("--hash-key", default="", help="key for --pick hash (e.g. a client IP)")
    add_output_argument(parser)
    add_client_arguments(parser, DEFAULT_PORT)
    parser.set_defaults(func=_resolve)


def _resolve(args: argparse.Namespace) -> int:
    match = _REFERENCE.match(args.reference)
    if match is None:
        return fail(f"expected NS/NAME[:PORT], got {args.reference!r}", EXIT_USAGE_OR_UNREACHABLE)
    if args.pick == "hash" and not args.hash_key:
        return fail("--pick hash needs --hash-key", EXIT_USAGE_OR_UNREACHABLE)
    request = pb.ResolveRequest(
        namespace=match["ns"],
        name=match["name"],
        port=match["port"] or "",
        pick=_PICKS.get(args.pick, pb.PICK_POLICY_UNSPECIFIED),
        hash_key=args.hash_key,
    )

    async def body(settings: ClientSettings) -> int:
        async with channel_for(args, settings) as channel:
            stub = resolver_pb2_grpc.ResolverStub(channel)
            try:
                response = await stub.Resolve(request, timeout=settings.timeout)
            except grpc.aio.AioRpcError as exc:
                details = exc.details() or ""
                if exc.code() == grpc.StatusCode.UNAVAILABLE and details.startswith(NO_ENDPOINTS):
                    return fail(details, EXIT_NO_ENDPOINTS)
                raise
        document = json_format.MessageToDict(response)
        print(render(document, args.output, lambda _wide: format_resolution(response)))
        return 0

    return run_client(args, body)


def format_resolution(response: pb.ResolveResponse) -> str:
    service = response.service
    kind = convert.SERVICE_TYPE_NAMES.get(service.type, "?")
    ips = ",".join(service.cluster_ips)
    lines = [
        printable(
            f"service {service.namespace}/{service.name} ({kind}{' ' + ips if ips else ''}); "
            f"version {response.version}, {_sync_text(response)}"
        )
    ]
    rows = [
        (t.address, str(t.port), t.node_name or "-", t.zone or "-", "yes" if t.tunnel else "no")
        for t in response.targets
    ]
    lines.append(table(("ADDRESS", "PORT", "NODE", "ZONE", "TUNNEL"), rows))
    if response.HasField("picked"):
        lines.append(printable(f"picked: {response.picked.address}:{response.picked.port}"))
    return "\n".join(lines)


# ---------------------------------------------------------------- routes

ROUTES_HELP = """\
routes:        waygate routes [-o table|wide|json|yaml] [-n NS] [--watch]
one route:     waygate routes get NS/NAME [-o ...]   (NAME: all after the first '/',
               so routes made from Gateway API objects are named as listed)
create/update: waygate routes apply -f FILE|-   (routes-file entries, a `routes:` list,
               or waygate.io/v1 Route objects; several YAML documents allowed;
               `routes get -o yaml` output applies back, its status ignored)
delete:        waygate routes delete NS/NAME

The routes file's own state comes first; the exit code is 1 while the resolver
rejects the file (it then serves the last good content).
"""


def _configure_routes(parser: argparse.ArgumentParser) -> None:
    parser.description = ROUTES_HELP
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.add_argument("-n", "--namespace", default="", help="only this namespace")
    parser.add_argument(
        "--watch", action="store_true", help="print the routes, then changes until Ctrl-C"
    )
    add_output_argument(parser)
    add_client_arguments(parser, DEFAULT_PORT)
    parser.set_defaults(func=_routes)
    commands = parser.add_subparsers(dest="routes_command", metavar="COMMAND", required=False)
    get = commands.add_parser("get", help="one route with its conditions")
    get.add_argument("reference", metavar="NS/NAME")
    add_output_argument(get)
    add_client_arguments(get, DEFAULT_PORT)
    get.set_defaults(func=_get_route)
    apply = commands.add_parser(
        "apply", help="create or replace the routes of a YAML file (ApplyRoute)"
    )
    apply.add_argument(
        "-f", "--filename", required=True, type=Path, metavar="FILE", help="YAML file; - for stdin"
    )
    add_output_argument(apply)
    add_client_arguments(apply, DEFAULT_PORT)
    apply.set_defaults(func=_apply_routes)
    delete = commands.add_parser("delete", help="delete a route (DeleteRoute)")
    delete.add_argument("reference", metavar="NS/NAME")
    add_client_arguments(delete, DEFAULT_PORT)
    delete.set_defaults(func=_delete_route)


def _backends(route: pb.Route) -> str:
    if len(route.backends) == 1:
        return route.backends[0].service
    return ",".join(f"{b.service}({b.weight})" for b in route.backends)


def _tls(route: pb.Route) -> str:
    if not route.HasField("tls") or route.tls.termination == pb.TLS_TERMINATION_UNSPECIFIED:
        return "-"
    termination = convert.TERMINATION_NAMES[route.tls.termination].value
    policy = convert.INSECURE_POLICY_NAMES.get(route.tls.insecure_edge_termination_policy)
    if policy is not None and policy.value != "None":
        return f"{termination}/{policy.value}"
    return termination


def route_problem(route: pb.Route) -> tuple[str, str]:
    """(STATUS column, message): "Admitted" and "" when served and resolved, else the
    reason and message of the first condition that is wrong; "-" without status."""
    if not route.HasField("status"):
        return "-", ""
    status = convert.route_status_from_proto(route.status)
    for condition in status.conditions:
        wrong = (
            condition.status == "True"
            if condition.type == "Conflicted"
            else condition.status == "False"
        )
        if wrong:
            return condition.reason, condition.message
    return "Admitted", ""


_PATH_MARKS = {
    pb.PATH_MATCH_TYPE_UNSPECIFIED: "",
    pb.PATH_MATCH_TYPE_PREFIX: "",
    pb.PATH_MATCH_TYPE_EXACT: "=",
    pb.PATH_MATCH_TYPE_REGULAR_EXPRESSION: "~",
}


def _values(values: Sequence[pb.RouteValueMatch], kind: str) -> list[str]:
    sign = {pb.VALUE_MATCH_TYPE_REGULAR_EXPRESSION: "~"}
    return [f"{kind}:{v.name}{sign.get(v.type, '=')}{v.value}" for v in values]


def route_path(route: pb.Route) -> str:
    """What a route matches beyond its host: its path prefix, or each Gateway API
    match (`/api`, `=/exact`, `~regex`, then `header:N=V`, `query:N=V`, a method),
    the matches separated by ' | '."""
    if not route.matches:
        return route.path or "/"
    shown = []
    for match in route.matches:
        parts = [_PATH_MARKS.get(match.path_type, "") + (match.path or "/")]
        parts += _values(match.headers, "header")
        parts += _values(match.query_params, "query")
        if match.method:
            parts.append(match.method)
        shown.append(" ".join(parts))
    return " | ".join(shown)


def _route_row(route: pb.Route, wide: bool = False) -> tuple[str, ...]:
    status, message = route_problem(route)
    tcp = route.listener_protocol == TCP_LISTENER
    row = (
        route.namespace,
        route.name,
        f"TCP :{route.listener_port}" if tcp else route.host,
        "-" if tcp else route_path(route),
        _backends(route),
        route.target_port or "-",
        _tls(route),
        status,
    )
    return (*row, message or "-") if wide else row


ROUTE_HEADER = ("NAMESPACE", "NAME", "HOST", "PATH", "BACKENDS", "PORT", "TLS", "STATUS")


def format_routes(routes: Sequence[pb.Route], wide: bool = False) -> str:
    if not routes:
        return "no routes"
    header = (*ROUTE_HEADER, "MESSAGE") if wide else ROUTE_HEADER
    return table(header, [_route_row(r, wide) for r in routes])


def source_name(source: str) -> str:
    """A route source's name for people: "routes file PATH", "manifests PATH", "kubernetes"."""
    kind, _, path = source.partition(":")
    if kind == "file" and path:
        return f"routes file {path}"
    if kind == "manifests" and path:
        return f"manifests {path}"
    return source


def format_sources(sources: Sequence[pb.RouteSourceState]) -> str:
    """The route sources' own state, one line each (what `waygate routes` shows first)."""
    lines = []
    for state in sources:
        what = source_name(state.source)
        loaded = (
            f"version {state.loaded_version} loaded {_when(state.loaded_at)}"
            if state.loaded_version
            else "never loaded"
        )
        if state.valid:
            lines.append(printable(f"{what}: valid ({loaded})"))
        else:
            since = (
                f"; failing since {_when(state.error_since)}"
                if state.HasField("error_since")
                else ""
            )
            lines.append(
                printable(f"{what}: {source_failure(state.source).upper()}: {state.last_error}")
                + "\n"
                f"  serving the last good content ({loaded}{since}); {source_hint(state.source)}"
            )
    return "\n".join(lines)


def source_failure(source: str) -> str:
    """What an invalid source is: a file's content is "rejected", Kubernetes "failing"."""
    return "rejected" if source.startswith(("file:", "manifests:")) else "failing"


def source_hint(source: str) -> str:
    """What to do about a rejected or failing source."""
    if source.startswith(("file:", "manifests:")):
        return "fix that line and it reloads"
    return "see the resolver's log; it retries with backoff"


def _when(stamp: timestamp_pb2.Timestamp) -> str:
    return stamp.ToDatetime().strftime("%Y-%m-%dT%H:%M:%SZ")


def route_document(route: pb.Route) -> dict[str, Any]:
    """A route as `routes apply -f` takes it back: the routes file's spelling
    (`sameSite: Lax`, `termination: edge`, `timeouts: {connect: 5s}`), then
    `status` (the resolver's conditions, ignored on apply) and, for a route made
    from a Gateway API or Ingress object, `derived` (what it was made from and
    its matches: read-only, `routes apply` refuses it)."""
    document = schema.route_to_document(convert.route_from_proto(route))
    if route.origin:
        document[DERIVED_KEY] = _derived(route)
    if route.HasField("status"):
        document[STATUS_KEY] = {"conditions": [_condition(c) for c in route.status.conditions]}
    return document


#: Keys of a route document that are the resolver's, not the route's.
STATUS_KEY = "status"
DERIVED_KEY = "derived"


def _condition(condition: pb.RouteCondition) -> dict[str, Any]:
    document: dict[str, Any] = {
        "type": condition.type,
        "status": condition.status,
        "reason": condition.reason,
        "message": condition.message,
    }
    if condition.HasField("last_transition_time"):
        document["lastTransitionTime"] = _when(condition.last_transition_time)
    if condition.observed_generation:
        document["observedGeneration"] = condition.observed_generation
    return document


def _derived(route: pb.Route) -> dict[str, Any]:
    document: dict[str, Any] = {"from": route.origin, "rule": route.rule_index}
    if route.gateway:
        document["gateway"] = route.gateway
        document["listenerPort"] = route.listener_port
    if route.listener_protocol == TCP_LISTENER:
        document["tcpPort"] = route.listener_port
        document["proxyProtocol"] = {
            "fromClient": route.proxy_protocol_from_client,
            "toBackend": route.proxy_protocol_to_backend,
        }
    if route.matches:
        document["matches"] = [_match(m) for m in route.matches]
    return document


def _match(match: pb.RouteMatch) -> dict[str, Any]:
    """One match in the Gateway API's spelling."""
    path_type = convert.PATH_MATCH_TYPE_NAMES[match.path_type].value
    document: dict[str, Any] = {"path": {"type": path_type, "value": match.path or "/"}}
    for key, values in (("headers", match.headers), ("queryParams", match.query_params)):
        if values:
            document[key] = [
                {
                    "type": convert.VALUE_MATCH_TYPE_NAMES[v.type].value,
                    "name": v.name,
                    "value": v.value,
                }
                for v in values
            ]
    if match.method:
        document["method"] = match.method
    return document


def format_route_change(route: pb.Route) -> str:
    status, message = route_problem(route)
    separator = " " if route.matches else ""
    text = (
        f"+ {route.namespace}/{route.name}  {route.host}{separator}{route_path(route)} -> "
        f"{_backends(route)}  tls={_tls(route)}  {status}"
    )
    return printable(f"{text}: {message}" if message else text)


async def list_routes(
    stub: resolver_pb2_grpc.ResolverStub, namespace: str, timeout: float
) -> tuple[list[pb.Route], list[pb.RouteSourceState], int]:
    """Every route (all pages), the sources' states and the version of the last page."""
    routes: list[pb.Route] = []
    token = ""
    while True:
        response = await stub.ListRoutes(
            pb.ListRoutesRequest(namespace=namespace, page_token=token), timeout=timeout
        )
        routes += response.routes
        token = response.next_page_token
        if not token:
            return routes, list(response.sources), response.version


def _routes(args: argparse.Namespace) -> int:
    async def body(settings: ClientSettings) -> int:
        if args.watch:
            return await _watch_routes(
                lambda: channel_for(args, settings),
                args.namespace,
                settings.timeout,
                print,
                lambda text: print(text, file=sys.stderr, flush=True),
            )
        async with channel_for(args, settings) as channel:
            stub = resolver_pb2_grpc.ResolverStub(channel)
            routes, sources, version = await list_routes(stub, args.namespace, settings.timeout)
        document = {
            "version": version,
            "sources": [json_format.MessageToDict(s) for s in sources],
            "routes": [route_document(r) for r in routes],
        }

        def text(wide: bool) -> str:
            head = format_sources(sources)
            body = format_routes(routes, wide)
            return f"{head}\n{body}" if head else body

        print(render(document, args.output, text))
        return EXIT_FAILED if any(not s.valid for s in sources) else 0

    return run_client(args, body)


def _reference(text: str) -> tuple[str, str] | None:
    """NS/NAME: the namespace is everything before the first '/', the name all
    after it. A namespace never holds '/', so a name that does (the routes made
    from Gateway API objects: `httproute:echo:r0:demo/demo:80:host`) needs no
    quoting: `routes get demo/httproute:echo:r0:demo/demo:80:host`."""
    namespace, _, name = text.partition("/")
    if not namespace or not name:
        return None
    return namespace, name


def _get_route(args: argparse.Namespace) -> int:
    key = _reference(args.reference)
    if key is None:
        return fail(f"expected NS/NAME, got {args.reference!r}", EXIT_USAGE_OR_UNREACHABLE)

    async def body(settings: ClientSettings) -> int:
        async with channel_for(args, settings) as channel:
            stub = resolver_pb2_grpc.ResolverStub(channel)
            routes, _, _ = await list_routes(stub, key[0], settings.timeout)
        found = [r for r in routes if r.name == key[1]]
        if not found:
            return fail(f"route {key[0]}/{key[1]} not found")
        route = found[0]

        def text(wide: bool) -> str:
            lines = [format_routes([route], wide), "", "CONDITIONS"]
            conditions = route.status.conditions
            lines.append(
                table(
                    ("TYPE", "STATUS", "REASON", "SINCE", "MESSAGE"),
                    [
                        (
                            c.type,
                            c.status,
                            c.reason,
                            _when(c.last_transition_time),
                            c.message or "-",
                        )
                        for c in conditions
                    ],
                )
                if conditions
                else "  (none: the resolver computes no status)"
            )
            return "\n".join(lines)

        print(render(route_document(route), args.output, text))
        return 0

    return run_client(args, body)


def load_route_documents(path: Path, text: str) -> list[Route]:
    """The routes of an `apply -f` file: routes-file entries (a `routes:` list, one
    entry, or a list of entries) or waygate.io/v1 Route objects, in any mix of
    YAML documents, read through the Route schema. `status` (what `routes get -o
    yaml` prints) is ignored; invalid content raises InvalidArgument naming
    `path:line`."""
    tree = schema.YamlTree()
    try:
        documents = list(yaml.compose_all(text, Loader=_Loader))
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{path}:{mark.line + 1}" if mark is not None else str(path)
        raise InvalidArgument(f"{where}: not YAML: {exc.problem or exc}") from None
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{path}: not YAML: {exc}") from None
    routes: list[Route] = []
    for node in documents:
        if node is None or (isinstance(node, yaml.ScalarNode) and node.tag == _NULL):
            continue
        try:
            routes += _document_routes(tree, node)
        except schema.SchemaError as exc:
            raise InvalidArgument(f"{path}:{schema.line_of(exc.node)}: {exc}") from None
        except _Refused as exc:
            raise InvalidArgument(f"{path}:{schema.line_of(exc.node)}: {exc.reason}") from None
        except _Invalid as exc:
            raise InvalidArgument(f"{path}:{schema.line_of(exc.node)}: {exc.error}") from None
        except InvalidArgument as exc:
            raise InvalidArgument(f"{path}:{schema.line_of(node)}: {exc}") from None
        except ValueError as exc:  # a scalar YAML cannot construct (a bad date)
            raise InvalidArgument(f"{path}:{schema.line_of(node)}: bad value: {exc}") from None
    if not routes:
        raise InvalidArgument(f"{path}: no routes in it")
    return routes


_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_NULL = "tag:yaml.org,2002:null"


class _Refused(Exception):
    def __init__(self, node: yaml.Node, reason: str) -> None:
        self.node, self.reason = node, reason


class _Invalid(Exception):
    """validation's error, with the node of the field it names."""

    def __init__(self, node: yaml.Node, error: InvalidArgument) -> None:
        self.node, self.error = node, error


def _checked(route: Route, node: yaml.Node) -> Route:
    """The route validated as the resolver will, its fields' lines named. A
    certificate without its key is how `routes get` shows a TLS route (keys are
    redacted): the resolver keeps the key it holds for that same certificate, or
    refuses, so here the rest is checked."""
    tls = route.tls
    redacted = tls is not None and bool(tls.certificate) and not tls.key
    try:
        if tls is not None and redacted:
            checked = validate_route(
                dataclasses.replace(route, tls=dataclasses.replace(tls, certificate=""))
            )
            assert checked.tls is not None
            return dataclasses.replace(
                checked, tls=dataclasses.replace(checked.tls, certificate=tls.certificate)
            )
        return validate_route(route)
    except InvalidArgument as exc:
        field = getattr(exc, "field", None)
        where = schema.key_path(field) if field else ()
        raise _Invalid(schema.node_at(node, where), exc) from None


def _fields(tree: schema.YamlTree, node: yaml.Node) -> dict[str, yaml.Node]:
    if not isinstance(node, yaml.MappingNode):
        raise _Refused(node, "expected a mapping")
    return {str(key): value for key, _, value in tree.entries(node)}


def _text(tree: schema.YamlTree, node: yaml.Node | None, default: str = "") -> str:
    if node is None or not isinstance(node, yaml.ScalarNode):
        return default
    value = tree.value(node)
    return default if value is None else str(value)


def _without(node: yaml.MappingNode, *keys: str) -> yaml.MappingNode:
    kept = [
        (k, v) for k, v in node.value if not (isinstance(k, yaml.ScalarNode) and k.value in keys)
    ]
    return yaml.MappingNode(node.tag, kept, node.start_mark, node.end_mark, node.flow_style)


def _document_routes(tree: schema.YamlTree, node: yaml.Node) -> list[Route]:
    if isinstance(node, yaml.MappingNode):
        fields = _fields(tree, node)
        if _text(tree, fields.get("kind")) == "Route":
            return [_route_object(tree, node, fields)]
        entries: list[yaml.Node] = [node]
        if set(fields) == {"routes"}:
            listed = fields["routes"]
            if isinstance(listed, yaml.SequenceNode):
                entries = tree.elements(listed)
            elif isinstance(listed, yaml.ScalarNode) and listed.tag == _NULL:
                entries = []
            else:
                raise _Refused(listed, "routes: must be a list")
    elif isinstance(node, yaml.SequenceNode):
        entries = tree.elements(node)
    else:
        raise _Refused(node, "expected routes (a mapping or a list)")
    routes = []
    for entry in entries:
        if isinstance(entry, yaml.MappingNode):
            derived = _fields(tree, entry).get(DERIVED_KEY)
            if derived is not None:
                raise _Refused(derived, _read_only(tree, derived))
            entry = _without(entry, STATUS_KEY)
        routes.append(_checked(schema.read_route(tree, entry, validate=False), entry))
    return routes


def _read_only(tree: schema.YamlTree, derived: yaml.Node) -> str:
    made_from = ""
    if isinstance(derived, yaml.MappingNode):
        made_from = _text(tree, _fields(tree, derived).get("from"))
    return (
        f"this route is made from {made_from or 'another object'} and is read-only here; "
        "change that object instead"
    )


def _route_object(
    tree: schema.YamlTree, node: yaml.MappingNode, fields: dict[str, yaml.Node]
) -> Route:
    """A waygate.io/v1 Route object; its status is the resolver's and ignored."""
    unknown = set(fields) - {"apiVersion", "kind", "metadata", "spec", STATUS_KEY}
    if unknown:
        raise _Refused(node, f"a Route has no key {', '.join(sorted(unknown))}")
    meta = _fields(tree, fields["metadata"]) if "metadata" in fields else {}
    namespace = _text(tree, meta.get("namespace"), "default")
    name = _text(tree, meta.get("name"))
    if "spec" not in fields:
        raise _Refused(node, f"route {namespace}/{name}: spec: is required")
    spec = fields["spec"]
    return _checked(schema.read_route(tree, spec, identity=(namespace, name), validate=False), spec)


def _apply_routes(args: argparse.Namespace) -> int:
    try:
        text = sys.stdin.read() if str(args.filename) == "-" else args.filename.read_text()
        routes = load_route_documents(args.filename, text)
    except OSError as exc:
        return fail(f"{args.filename}: {exc.strerror or exc}", EXIT_USAGE_OR_UNREACHABLE)
    except (InvalidArgument, UnicodeDecodeError) as exc:
        return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)

    async def body(settings: ClientSettings) -> int:
        applied: list[pb.Route] = []
        async with channel_for(args, settings) as channel:
            stub = resolver_pb2_grpc.ResolverStub(channel)
            for route in routes:
                reply = await stub.ApplyRoute(
                    pb.ApplyRouteRequest(route=convert.route_to_proto(route)),
                    timeout=settings.timeout,
                )
                applied.append(reply.route)

        def text(wide: bool) -> str:
            lines = []
            for route in applied:
                status, message = route_problem(route)
                line = f"route {route.namespace}/{route.name} applied"
                if status not in ("Admitted", "-"):
                    line += f"; {status}: {message}"
                lines.append(line)
            return "\n".join(lines)

        print(render({"routes": [route_document(r) for r in applied]}, args.output, text))
        return 0

    return run_client(args, body)


def _delete_route(args: argparse.Namespace) -> int:
    key = _reference(args.reference)
    if key is None:
        return fail(f"expected NS/NAME, got {args.reference!r}", EXIT_USAGE_OR_UNREACHABLE)

    async def body(settings: ClientSettings) -> int:
        async with channel_for(args, settings) as channel:
            stub = resolver_pb2_grpc.ResolverStub(channel)
            await stub.DeleteRoute(
                pb.DeleteRouteRequest(ref=pb.RouteRef(namespace=key[0], name=key[1])),
                timeout=settings.timeout,
            )
        print(f"route {key[0]}/{key[1]} deleted")
        return 0

    return run_client(args, body)


async def _watch_routes(
    channel_factory: Callable[[], grpc.aio.Channel],
    namespace: str,
    timeout: float,
    emit: Callable[..., None],
    warn: Callable[[str], None],
) -> int:
    """Print the routes, then each change as it arrives, until interrupted.

    The resolver client keeps the stream: a lost one is resumed from the last
    version seen after a backoff, and a fresh snapshot (another replica, or a
    restarted one) reprints the table. No view within `timeout` is an error
    (wrong address, no resolver there). A change of the routes file's own state
    (rejected, valid again) is printed when it arrives (with the next event or
    heartbeat).
    """
    shown: dict[RouteKey, Route] = {}
    health: tuple[tuple[str, bool, str], ...] | None = None

    def on_view(view: View) -> None:
        nonlocal shown, health
        routes = {k: r for k, r in view.routes.items() if not namespace or k[0] == namespace}
        # Printed when a source turns valid or invalid (not for every good reload).
        now = tuple((s.source, s.valid, s.error) for s in view.sources)
        if now != health:
            health = now
            states: list[SourceState] = list(view.sources)
            if states:
                emit(format_sources([convert.source_state_to_proto(s) for s in states]), flush=True)
        if view.from_snapshot:
            emit(f"# version {view.version}, {_view_sync_text(view)} ({view.source})")
            emit(
                format_routes([convert.route_to_proto(routes[k]) for k in sorted(routes)]),
                flush=True,
            )
        else:
            for key in sorted(routes):
                if shown.get(key) != routes[key]:
                    emit(format_route_change(convert.route_to_proto(routes[key])), flush=True)
            for key in sorted(set(shown) - set(routes)):
                emit(f"- {key[0]}/{key[1]}", flush=True)
        shown = routes

    watch = ResolverWatch(
        channel_factory,
        kinds=[Kind.ROUTES],
        on_view=on_view,
        backoff=Backoff(initial=0.5, maximum=10.0),
        on_disconnect=lambda reason, delay: warn(
            f"waygate: {reason}; reconnecting in {delay:.1f}s"
        ),
    )
    task = asyncio.create_task(watch.run(), name="routes-watch")
    try:
        try:
            await watch.wait_synced(timeout)
        except Unavailable as exc:
            return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
        await task
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
    return 0


def _view_sync_text(view: View) -> str:
    if view.last_sync is None:
        return "never synced"
    return "synced " + time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(view.last_sync))


COMMANDS: dict[tuple[str, ...], Callable[[argparse.ArgumentParser], None]] = {
    ("resolve",): _configure_resolve,
    ("routes",): _configure_routes,
}
