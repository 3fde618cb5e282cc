"""Client commands of the tunnel: `waygate tunnel agents` and `waygate tunnel dial`.

`waygate tunnel dial NODE[/HOST]:PORT` bridges stdin and stdout to a TCP
connection opened from the node's agent, like `nc`: end of stdin half-closes
the connection, and the command exits once the remote side has closed too.
It dials the tunnel server at `--addr`, or with `--resolver` any replica
that holds the node (`waygate.tunnel.client`). With certificates its TLS
session runs end to end, to the agent, the replica copying ciphertext (the
cheapest path for a bulk copy, one handshake more per dial; `--no-end-to-end`
has the replica relay it as the proxy's dials are); where that cannot be had
the dial is relayed anyway.

Exit codes: 0 ok; 2 usage error, server unreachable, or a dial refused for a
reason another try could change (no agent, draining); 1 any other failure
(not allowed, unreachable destination), one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import re
import stat
import sys

import grpc
from google.protobuf import json_format

from waygate.core.clientcli import (
    EXIT_USAGE_OR_UNREACHABLE,
    ClientSettings,
    add_client_arguments,
    add_output_argument,
    channel_for,
    fail,
    render,
    resolve_address,
    run_client,
    table,
)
from waygate.core.errors import WaygateError
from waygate.tunnel.v1 import tunnel_pb2 as pb
from waygate.tunnel.v1 import tunnel_pb2_grpc

DEFAULT_DIAL_PORT = 7004
_TARGET = re.compile(
    r"^(?P<node>[A-Za-z0-9.-]+)(?:/(?P<host>\[[0-9A-Fa-f:.]+\]|[^/:\s]+))?:(?P<port>\d+)$"
)


# ---------------------------------------------------------------- agents


def _configure_agents(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--node", default="", help="only this node")
    add_output_argument(parser)
    add_client_arguments(parser, DEFAULT_DIAL_PORT)
    parser.set_defaults(func=_agents)


def _agents(args: argparse.Namespace) -> int:
    async def body(settings: ClientSettings) -> int:
        async with channel_for(args, settings) as channel:
            reply = await tunnel_pb2_grpc.TunnelStub(channel).ListAgents(
                pb.ListAgentsRequest(node=args.node), timeout=settings.timeout
            )
        rows = [
            (
                a.node,
                a.agent_id,
                a.remote_address,
                a.connected_since.ToDatetime().strftime("%Y-%m-%dT%H:%M:%SZ"),
                str(a.open_connections),
                "yes" if a.draining else "no",
            )
            for a in reply.agents
        ]
        header = ("NODE", "AGENT", "REMOTE", "CONNECTED SINCE", "CONNECTIONS", "DRAINING")

        def text(_wide: bool) -> str:
            title = f"tunnel server {reply.server_id}: {len(rows)} agent(s)"
            return f"{title}\n{table(header, rows)}" if rows else title

        print(render(json_format.MessageToDict(reply), args.output, text))
        return 0

    return run_client(args, body)


# ---------------------------------------------------------------- dial


def _configure_dial(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "target", metavar="NODE[/HOST]:PORT", help="edge node, host as seen from it, port"
    )
    parser.add_argument(
        "--resolver",
        default=None,
        metavar="ADDR",
        help="find the replicas holding NODE through this resolver instead of dialing --addr",
    )
    parser.add_argument(
        "--traceparent",
        default=None,
        metavar="W3C",
        help="continue this W3C trace (00-TRACEID-SPANID-FLAGS); needs --otlp-endpoint to export",
    )
    parser.add_argument(
        "--end-to-end",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TLS from here to the agent, the tunnel server copying ciphertext (default: on)",
    )
    add_client_arguments(parser, DEFAULT_DIAL_PORT)
    parser.set_defaults(func=_dial)


def _dial(args: argparse.Namespace) -> int:
    from waygate.tunnel.client import DialFailed, StaticPresence, TunnelClient, ViewPresence
    from waygate.tunnel.relay import client_context

    match = _TARGET.match(args.target)
    if match is None or not 0 < int(match["port"]) < 65536:
        return fail(f"expected NODE[/HOST]:PORT, got {args.target!r}", EXIT_USAGE_OR_UNREACHABLE)
    host = (match["host"] or "").strip("[]")

    async def body(settings: ClientSettings) -> int:
        tls = settings.tls()
        credentials = tls.credentials() if tls is not None else None
        watch: asyncio.Task[None] | None = None
        presence: StaticPresence | ViewPresence
        if args.resolver:
            from waygate.resolver.client import Kind, ResolverWatch

            resolver = ResolverWatch(
                lambda: channel_for(args, settings, args.resolver), kinds=(Kind.TUNNELS,)
            )
            watch = asyncio.ensure_future(resolver.run())
            try:
                await resolver.wait_synced(settings.timeout)
            except WaygateError as exc:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
                return fail(f"resolver at {args.resolver}: {exc}", EXIT_USAGE_OR_UNREACHABLE)
            presence = ViewPresence(resolver)
        else:
            presence = StaticPresence([resolve_address(args, settings)])
        # Raw dials on the replica's data listener (its own TLS connection), with the
        # same certificate; Tunnel.Dial where a replica has none.
        context = (
            client_context(
                tls.ca_file.read_bytes() if tls.ca_file else None,
                tls.cert_file.read_bytes() if tls.cert_file else None,
                tls.key_file.read_bytes() if tls.key_file else None,
            )
            if tls is not None
            else None
        )
        client = TunnelClient(
            presence,
            credentials=lambda: credentials,
            server_name=settings.server_name,
            dial_timeout=settings.timeout,
            ssl_context=lambda: context,
        )
        try:
            try:
                stream = await client.dial(
                    match["node"],
                    int(match["port"]),
                    host,
                    trace_context=args.traceparent,
                    end_to_end=args.end_to_end,
                )
            except DialFailed as failed:
                return fail(str(failed), EXIT_USAGE_OR_UNREACHABLE if failed.retryable else 1)
            return await _bridge_stdio(stream)
        finally:
            await client.close()
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)

    return run_client(args, body)


async def _bridge_stdio(stream: object) -> int:
    from waygate.tunnel.client import DataStream, TunnelLost, TunnelStream

    assert isinstance(stream, TunnelStream | DataStream)
    loop = asyncio.get_running_loop()
    stdin, stdout = sys.stdin.fileno(), sys.stdout.fileno()

    reader = asyncio.StreamReader(limit=65536)
    mode = os.fstat(stdin).st_mode
    # A pipe, socket or terminal is read without a thread, so a still-open stdin
    # never keeps the command alive after the remote side closed; files and
    # devices like /dev/null (which epoll refuses) never block for long.
    pipe = stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or os.isatty(stdin)
    if pipe:
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)

    async def upload() -> None:
        while True:
            if pipe:
                data = await reader.read(65536)
            else:
                data = await loop.run_in_executor(None, os.read, stdin, 65536)
            if not data:
                break
            await stream.write(data)
        await stream.write_eof()

    async def download() -> None:
        while data := await stream.read():
            view = memoryview(data)
            try:
                while view:
                    view = view[os.write(stdout, view) :]
            except BrokenPipeError:  # the reader of stdout is gone (`| head`): we are done
                stream.close()
                return

    uploading = asyncio.ensure_future(upload())
    try:
        with contextlib.suppress(TunnelLost):  # a broken data connection: wait_closed says so
            await download()
    finally:
        # stdin may stay open (a terminal): the remote side closing ends the command.
        if not uploading.done():
            uploading.cancel()
            await asyncio.gather(uploading, return_exceptions=True)
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                await stream.write_eof()
    code = await asyncio.wait_for(stream.wait_closed(), 30)
    if code not in (grpc.StatusCode.OK, grpc.StatusCode.CANCELLED):
        print(f"waygate: the tunnelled connection ended: {code.name}", file=sys.stderr)
        return 1
    return 0


COMMANDS = {
    ("tunnel", "agents"): _configure_agents,
    ("tunnel", "dial"): _configure_dial,
}
