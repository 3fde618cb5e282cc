"""The `waygate` command: one entry point for every service and client command.

Service commands (`waygate resolver serve`, ...) come from `components.py`;
client commands are contributed by each service's `commands` module, which
maps a command path to a function that adds its arguments and sets `func`.
A command whose code has not landed yet says so plainly and exits 2: no
pretend behaviour. Errors are one line on stderr, never a traceback; an
unknown subcommand or flag answers with the closest known ones ("did you mean").
`waygate completion bash|zsh|fish` prints a completion script built from this
same command tree, so it never lists a command that does not exist.
"""

from __future__ import annotations

import argparse
import asyncio
import difflib
import importlib
import importlib.util
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import Any, NoReturn

from waygate.components import COMPONENTS, Component
from waygate.core.clientcli import EXIT_USAGE_OR_UNREACHABLE, add_client_arguments, fail, run_client
from waygate.core.errors import WaygateError
from waygate.core.settings import SettingsError, add_settings_arguments, settings_from_args

# Client commands: path -> (module that implements it, one-line help).
CLIENT_COMMANDS: dict[tuple[str, ...], tuple[str, str]] = {
    ("resolve",): ("waygate.resolver.commands", "resolve NS/NAME[:PORT] to its ready endpoints"),
    ("routes",): ("waygate.resolver.commands", "list (or --watch) the routes the resolver serves"),
    ("gateways",): (
        "waygate.resolver.gateway.commands",
        "Gateway API and Ingress objects with their status (Accepted, Programmed, ...)",
    ),
    ("ingress-nginx", "check"): (
        "waygate.resolver.ingress_nginx.report",
        "the ingress-nginx migration report: each Ingress's annotations, honoured or not",
    ),
    ("cert", "issue"): (
        "waygate.certs.commands",
        "generate a key locally and get a certificate for it",
    ),
    ("cert", "bundle"): ("waygate.certs.commands", "print the CA trust bundle"),
    ("cert", "inspect"): (
        "waygate.certs.commands",
        "show a certificate file: names, key type, usages, how much life it has left",
    ),
    ("cert", "status"): (
        "waygate.certs.commands",
        "the CA generations and the certificates issued, with expiry (admin)",
    ),
    ("cert", "rotate-ca"): (
        "waygate.certs.commands",
        "start a CA rotation: new CA published now, signing after the propagation delay (admin)",
    ),
    ("tunnel", "agents"): ("waygate.tunnel.commands", "list the agents a tunnel server holds"),
    ("tunnel", "dial"): (
        "waygate.tunnel.commands",
        "bridge stdin/stdout to NODE[/HOST]:PORT through the tunnel, like nc",
    ),
    ("tunnel", "iptables"): (
        "waygate.tunnel.iptables",
        "print (or --apply, until Ctrl-C) DNAT rules steering node traffic to the tunnel front",
    ),
}

GROUP_HELP = {
    "resolver": "the resolver service",
    "certs": "the certificate authority service",
    "proxy": "the HTTP/TLS reverse proxy",
    "tunnel": "tunnel server and agent, and their client command",
    "cert": "certificates: issue, bundle, inspect, status, rotate-ca",
    "ingress-nginx": "coming from ingress-nginx: check",
}

Configure = Callable[[argparse.ArgumentParser], None]


def _not_implemented(what: str) -> Callable[[argparse.Namespace], int]:
    def run(_args: argparse.Namespace) -> int:
        return fail(f"`waygate {what}` is not implemented yet", EXIT_USAGE_OR_UNREACHABLE)

    return run


def _placeholder(parser: argparse.ArgumentParser, what: str) -> None:
    # Whatever arguments follow are accepted: the answer is "not implemented yet"
    # whichever flags the finished command will take.
    parser.set_defaults(func=_not_implemented(what), accepts_any_arguments=True)


def _client_configurer(path: tuple[str, ...]) -> Configure | None:
    module_name, _ = CLIENT_COMMANDS[path]
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name != module_name:
            raise
        return None
    commands: dict[tuple[str, ...], Configure] = getattr(module, "COMMANDS", {})
    return commands.get(path)


def _serve(component: Component) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        from waygate.core.runtime import ServiceProcess

        app = importlib.import_module(component.app_module)
        try:
            settings = settings_from_args(app.Settings, args)
            from waygate.certs.client import start_process_certificates

            process = ServiceProcess(
                component.name, settings, certificate_source=start_process_certificates
            )
            with asyncio.Runner(loop_factory=new_event_loop) as runner:
                return runner.run(process.run(lambda p: app.setup(p, settings)))
        except (SettingsError, WaygateError) as exc:
            return fail(f"{component.name}: {exc}")
        except OSError as exc:
            return fail(f"{component.name}: {exc.strerror or exc}")

    return run


def new_event_loop() -> asyncio.AbstractEventLoop:
    """The one event loop factory of every service process: uvloop (libuv), the
    data plane's speed depends on it; plain asyncio where uvloop is missing."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def _health(args: argparse.Namespace) -> int:
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from waygate.core.clientcli import channel_for

    args.addr = args.address

    async def body(settings: Any) -> int:
        async with channel_for(args, settings) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            reply = await stub.Check(
                health_pb2.HealthCheckRequest(service=args.service), timeout=settings.timeout
            )
        status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
        print(status)
        return 0 if reply.status == health_pb2.HealthCheckResponse.SERVING else 1

    return run_client(args, body)


def _up(args: argparse.Namespace) -> int:
    from waygate.supervisor import run_up

    return run_up(args)


def _module_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


class Parser(argparse.ArgumentParser):
    """argparse, answering an unknown subcommand with the closest known ones."""

    def error(self, message: str) -> NoReturn:
        match = re.search(r"invalid choice: '([^']*)' \(choose from (.*)\)", message)
        if match:
            choices = re.findall(r"'([^']*)'", match[2])
            message = f"unknown command '{match[1]}'" + did_you_mean(match[1], choices)
        super().error(message)


def did_you_mean(word: str, known: Sequence[str]) -> str:
    close = difflib.get_close_matches(word, known, n=3, cutoff=0.6)
    if not close and word.startswith("--"):
        close = [k for k in known if k.startswith(word)][:3]
    if not close:
        return ""
    return "; did you mean " + " or ".join(f"'{c}'" for c in close) + "?"


def _walk(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> Iterator[tuple[tuple[str, ...], argparse.ArgumentParser]]:
    """Every (command path, parser) of the tree, the root first."""
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, (*path, name))


def _subcommands(parser: argparse.ArgumentParser) -> list[str]:
    return [
        name
        for action in parser._actions
        if isinstance(action, argparse._SubParsersAction)
        for name in action.choices
    ]


def _options(parser: argparse.ArgumentParser) -> list[str]:
    return [o for action in parser._actions for o in action.option_strings if o.startswith("--")]


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("waygate")
    except PackageNotFoundError:
        return "unknown (not installed)"


# ---------------------------------------------------------------- completion


def completion_script(shell: str, parser: argparse.ArgumentParser) -> str:
    """A completion script for `shell` listing the subcommands and flags of every
    command path of `parser` (the whole tree, built once, here)."""
    tree = [(" ".join(path), _subcommands(p), _options(p)) for path, p in _walk(parser)]
    if shell == "fish":
        lines = ["# waygate completion for fish: waygate completion fish | source"]
        for path, subs, options in tree:
            words = path.split()
            if words:
                seen = " && ".join(f"__fish_seen_subcommand_from {w}" for w in words)
                condition = f"{seen}"
            else:
                condition = "__fish_use_subcommand"
            if subs:
                lines.append(f"complete -c waygate -f -n '{condition}' -a '{' '.join(subs)}'")
            for option in options:
                lines.append(f"complete -c waygate -n '{condition}' -l {option[2:]}")
        return "\n".join(lines) + "\n"
    cases_subs = "\n".join(f'    "{path}") echo "{" ".join(subs)}";;' for path, subs, _ in tree)
    cases_opts = "\n".join(
        f'    "{path}") echo "{" ".join(options)}";;' for path, _, options in tree
    )
    script = f"""# waygate completion for {shell}
_waygate_subcommands() {{
  case "$1" in
{cases_subs}
  esac
}}
_waygate_flags() {{
  case "$1" in
{cases_opts}
  esac
}}
_waygate() {{
  local cur="${{COMP_WORDS[COMP_CWORD]}}" path="" word i
  for ((i = 1; i < COMP_CWORD; i++)); do
    word="${{COMP_WORDS[i]}}"
    case " $(_waygate_subcommands "$path") " in
      *" $word "*) path="${{path:+$path }}$word";;
    esac
  done
  if [[ "$cur" == -* ]]; then
    COMPREPLY=($(compgen -W "$(_waygate_flags "$path")" -- "$cur"))
  else
    COMPREPLY=($(compgen -W "$(_waygate_subcommands "$path")" -- "$cur"))
    [[ ${{#COMPREPLY[@]}} -eq 0 ]] && COMPREPLY=($(compgen -f -- "$cur"))
  fi
}}
complete -F _waygate waygate
"""
    if shell == "zsh":
        # zsh runs bash completion functions through bashcompinit.
        script = "autoload -U +X bashcompinit && bashcompinit\n" + script
    return script


def _completion(args: argparse.Namespace) -> int:
    print(completion_script(args.shell, build_parser()), end="")
    return 0


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The whole command tree. With `argv`, only the command it names imports its
    service's code: one service failing to import never breaks the others' commands."""

    def wanted(path: tuple[str, ...]) -> bool:
        return argv is None or tuple(argv[: len(path)]) == path

    parser = Parser(
        prog="waygate",
        description="Waygate: traffic into, across and out of Kubernetes clusters.",
    )
    parser.add_argument("--version", action="version", version=f"waygate {_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    groups: dict[str, Any] = {}

    def subparsers_for(path: tuple[str, ...]) -> Any:
        """The subparsers object under which the last element of `path` goes."""
        if len(path) == 1:
            return commands
        group = path[0]
        if group not in groups:
            group_parser = commands.add_parser(group, help=GROUP_HELP[group])
            groups[group] = group_parser.add_subparsers(
                dest=f"{group}_command", metavar="COMMAND", required=True
            )
        return groups[group]

    from waygate.supervisor import UpSettings

    up = commands.add_parser("up", help="run every service locally, each in its own process")
    add_settings_arguments(up, UpSettings)
    up.set_defaults(func=_up)

    for component in COMPONENTS:
        what = " ".join(component.command)
        sub = subparsers_for(component.command).add_parser(
            component.command[-1],
            help=f"run the {component.name} process"
            + ("" if component.implemented else " (not implemented yet)"),
        )
        if not wanted(component.command):
            continue
        if component.implemented:
            app = importlib.import_module(component.app_module)
            add_settings_arguments(sub, app.Settings)
            sub.set_defaults(func=_serve(component))
        else:
            _placeholder(sub, what)

    for path, (module_name, help_text) in CLIENT_COMMANDS.items():
        if not wanted(path):
            missing = "" if _module_exists(module_name) else " (not implemented yet)"
            subparsers_for(path).add_parser(path[-1], help=help_text + missing)
            continue
        configure = _client_configurer(path)
        sub = subparsers_for(path).add_parser(
            path[-1], help=help_text + ("" if configure else " (not implemented yet)")
        )
        if configure is None:
            _placeholder(sub, " ".join(path))
        else:
            configure(sub)

    health = commands.add_parser(
        "health", help="ask a gRPC server's grpc.health.v1.Health whether it serves"
    )
    health.add_argument("address", help="host:port")
    health.add_argument(
        "service", nargs="?", default="", help="service name; empty: the whole server"
    )
    add_client_arguments(health, default_port=None)
    health.set_defaults(func=_health)

    check = commands.add_parser(
        "check",
        help="check every service of a local `up`, given addresses, or a cluster by "
        "--kube-context: ✔/✖ with a hint each",
    )
    if wanted(("check",)):
        from waygate.check import configure as configure_check

        configure_check(check)

    completion = commands.add_parser(
        "completion", help="print a shell completion script: . <(waygate completion bash)"
    )
    completion.add_argument("shell", choices=("bash", "zsh", "fish"))
    completion.set_defaults(func=_completion)

    # Each leaf knows itself: an unknown flag is answered with that command's flags.
    for _, sub in _walk(parser):
        sub.set_defaults(leaf_parser=sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args, unknown = parser.parse_known_args(argv)
    if unknown and not getattr(args, "accepts_any_arguments", False):
        leaf = getattr(args, "leaf_parser", parser)
        flag = next((u for u in unknown if u.startswith("-")), unknown[0]).split("=")[0]
        leaf.error(
            f"unrecognized arguments: {' '.join(unknown)}" + did_you_mean(flag, _options(leaf))
        )
    try:
        return int(args.func(args))
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
