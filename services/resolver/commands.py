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
from waygate.resolver import convert
from waygate.resolver.client import Kind, ResolverWatch, Route, RouteKey, SourceState, View
from waygate.resolver.v1 import resolver_pb2 as pb
from waygate.resolver.v1 import resolver_pb2_grpc

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
one route:     waygate routes get NS/NAME [-o ...]
create/update: waygate routes apply -f FILE   (routes-file entries, a `routes:` list,
               or waygate.io/v1 Route objects; several YAML documents allowed)
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


def _route_row(route: pb.Route, wide: bool = False) -> tuple[str, ...]:
    status, message = route_problem(route)
    row = (
        route.namespace,
        route.name,
        route.host,
        route.path or "/",
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
    return json_format.MessageToDict(route)


def format_route_change(route: pb.Route) -> str:
    status, message = route_problem(route)
    text = (
        f"+ {route.namespace}/{route.name}  {route.host}{route.path or '/'} -> "
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
    namespace, _, name = text.partition("/")
    if not namespace or not name or "/" in name:
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
    YAML documents. Invalid content raises InvalidArgument naming where."""
    from waygate.resolver.filesource import FileError, parse_routes_file
    from waygate.resolver.kube_convert import route_from

    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"{path}: not YAML: {exc}") from None
    routes: list[Route] = []
    for index, document in enumerate(documents):
        where = f"{path} (document {index + 1})"
        if isinstance(document, dict) and document.get("kind") == "Route":
            meta = document.setdefault("metadata", {})
            if isinstance(meta, dict):
                meta.setdefault("namespace", "default")
            routes.append(route_from(document))
            continue
        if isinstance(document, dict) and set(document) <= {"routes"}:
            entries = document.get("routes") or []
        elif isinstance(document, dict):
            entries = [document]
        elif isinstance(document, list):
            entries = document
        else:
            raise InvalidArgument(f"{where}: expected routes, found {type(document).__name__}")
        wrapped = yaml.safe_dump({"routes": entries}, sort_keys=False)
        try:
            routes += parse_routes_file(path, wrapped).routes
        except FileError as exc:
            raise InvalidArgument(f"{where}: {exc.reason}") from None
    if not routes:
        raise InvalidArgument(f"{path}: no routes in it")
    return routes


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
