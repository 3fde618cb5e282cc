"""Client commands of the resolver: `waygate resolve` and `waygate routes`.

`waygate routes --watch` keeps going across resolver restarts through the
resolver client (`waygate.resolver.client`): it resumes from the last version
it printed, or reprints the table when the resolver answers with a fresh
snapshot.

Exit codes: 0 ok; 3 `resolve` found the service but no endpoint is available;
2 usage error or resolver unreachable; 1 any other failure (one line on
stderr, never a traceback).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import sys
import time
from collections.abc import Callable, Sequence

import grpc

from waygate.core.backoff import Backoff
from waygate.core.clientcli import (
    EXIT_USAGE_OR_UNREACHABLE,
    ClientSettings,
    add_client_arguments,
    channel_for,
    fail,
    run_client,
)
from waygate.core.errors import Unavailable
from waygate.resolver import convert
from waygate.resolver.client import Kind, ResolverWatch, Route, RouteKey, View
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


def table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows, strict=False)]
    return "\n".join(
        "  ".join(str(cell).ljust(width) for cell, width in zip(row, widths, strict=False)).rstrip()
        for row in (header, *rows)
    )


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
        print(format_resolution(response))
        return 0

    return run_client(args, body)


def format_resolution(response: pb.ResolveResponse) -> str:
    service = response.service
    kind = convert.SERVICE_TYPE_NAMES.get(service.type, "?")
    ips = ",".join(service.cluster_ips)
    lines = [
        f"service {service.namespace}/{service.name} ({kind}{' ' + ips if ips else ''}); "
        f"version {response.version}, {_sync_text(response)}"
    ]
    rows = [
        (t.address, str(t.port), t.node_name or "-", t.zone or "-", "yes" if t.tunnel else "no")
        for t in response.targets
    ]
    lines.append(table(("ADDRESS", "PORT", "NODE", "ZONE", "TUNNEL"), rows))
    if response.HasField("picked"):
        lines.append(f"picked: {response.picked.address}:{response.picked.port}")
    return "\n".join(lines)


# ---------------------------------------------------------------- routes


def _configure_routes(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("-n", "--namespace", default="", help="only this namespace")
    parser.add_argument(
        "--watch", action="store_true", help="print the routes, then changes until Ctrl-C"
    )
    add_client_arguments(parser, DEFAULT_PORT)
    parser.set_defaults(func=_routes)


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


def _route_row(route: pb.Route) -> tuple[str, ...]:
    return (
        route.namespace,
        route.name,
        route.host,
        route.path or "/",
        _backends(route),
        route.target_port or "-",
        _tls(route),
    )


ROUTE_HEADER = ("NAMESPACE", "NAME", "HOST", "PATH", "BACKENDS", "PORT", "TLS")


def format_routes(routes: Sequence[pb.Route]) -> str:
    if not routes:
        return "no routes"
    return table(ROUTE_HEADER, [_route_row(r) for r in routes])


def format_route_change(route: pb.Route) -> str:
    return f"+ {route.namespace}/{route.name}  {route.host}{route.path or '/'} -> {_backends(route)}  tls={_tls(route)}"


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
            routes: list[pb.Route] = []
            token = ""
            while True:
                response = await stub.ListRoutes(
                    pb.ListRoutesRequest(namespace=args.namespace, page_token=token),
                    timeout=settings.timeout,
                )
                routes += response.routes
                token = response.next_page_token
                if not token:
                    break
            print(format_routes(routes))
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
    (wrong address, no resolver there).
    """
    shown: dict[RouteKey, Route] = {}

    def on_view(view: View) -> None:
        nonlocal shown
        routes = {k: r for k, r in view.routes.items() if not namespace or k[0] == namespace}
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
