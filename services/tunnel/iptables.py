"""`waygate tunnel iptables`: DNAT rules that steer node-bound traffic to the tunnel front.

On a cloud-side host (a control-plane node, say) the kube-apiserver connects
to an edge node's kubelet at NODE-IP:10250, an address it cannot route to.
These rules rewrite such connections (locally originated: nat OUTPUT; routed
through the host: nat PREROUTING) to the tunnel server's HTTPS front
(`waygate.tunnel.front`, port 10263), which forwards each request through the
node's agent. The same job as yurttunnel's iptables manager.

Two halves:
- `plan(...)` is sans-IO: from the node addresses, ports and the front's
  address it builds a `RulePlan` whose `apply_commands()` and
  `remove_commands()` are argv lists for iptables/ip6tables. Tests check
  these exactly.
- `run(...)` is the thin runner: prints the plan (`--dry-run`, the default),
  or with `--apply` runs it, waits for SIGINT/SIGTERM and removes every rule
  it added (also when applying fails half-way).

Invariants: every rule lives in one dedicated chain (`WAYGATE-TUNNEL` by
default) reached by one jump rule per hook, so removal is exact and never
touches anyone else's rules; applying is idempotent (a chain left by a killed
run is flushed and refilled, a jump rule already present is not added twice);
nothing is changed without `--apply`.
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import re
import shlex
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import ClassVar

from waygate.core.clientcli import EXIT_USAGE_OR_UNREACHABLE, fail
from waygate.core.settings import (
    SettingsError,
    add_settings_arguments,
    setting,
    settings_from_args,
)

DEFAULT_CHAIN = "WAYGATE-TUNNEL"
DEFAULT_FRONT_PORT = 10263
KUBELET_PORT = 10250
HOOKS = ("OUTPUT", "PREROUTING")
COMMENT = "waygate tunnel: node traffic to the tunnel front"
# iptables chain names: at most 28 characters, no spaces; we also keep to a
# plain alphabet so a name never needs quoting.
_CHAIN_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,28}$")

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Command = tuple[str, ...]


class PlanError(ValueError):
    """The rules cannot be built from these inputs; the message is one line."""


def parse_network(text: str) -> Network:
    """'10.0.0.5' -> 10.0.0.5/32; '10.1.0.0/16' as is (host bits are refused)."""
    try:
        return ipaddress.ip_network(text.strip(), strict=True)
    except ValueError:
        raise PlanError(f"not an IP address or CIDR: {text!r}") from None


def parse_front(text: str) -> tuple[Address, int]:
    """'10.0.0.9:10263', '[fd00::9]:10263' or a bare address (port 10263)."""
    text = text.strip()
    match = re.fullmatch(
        r"\[(?P<v6>[^\]]+)\](?::(?P<port6>\d+))?|(?P<host>[^:]+)(?::(?P<port>\d+))?", text
    )
    if match is None:
        # A bare IPv6 address without brackets.
        host, port_text = text, None
    else:
        host = match.group("v6") or match.group("host")
        port_text = match.group("port6") or match.group("port")
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        raise PlanError(f"front address must be IP[:PORT] or [IPv6]:PORT, not {text!r}") from None
    port = int(port_text) if port_text else DEFAULT_FRONT_PORT
    if not 1 <= port <= 65535:
        raise PlanError(f"front port must be 1..65535, not {port}")
    return address, port


@dataclasses.dataclass(frozen=True)
class RulePlan:
    """The rules for one address family (iptables for IPv4, ip6tables for IPv6)."""

    binary: str
    chain: str
    hooks: tuple[str, ...]
    # One DNAT rule per (destination network, port), in the order given.
    targets: tuple[tuple[Network, int], ...]
    front: Address
    front_port: int

    def _front_text(self) -> str:
        host = f"[{self.front}]" if self.front.version == 6 else str(self.front)
        return f"{host}:{self.front_port}"

    def dnat_rules(self) -> list[Command]:
        return [
            (
                self.binary, "-w", "-t", "nat", "-A", self.chain,
                "-d", str(network), "-p", "tcp", "--dport", str(port),
                "-j", "DNAT", "--to-destination", self._front_text(),
            )
            for network, port in self.targets
        ]  # fmt: skip

    def jump_rule(self, action: str, hook: str) -> Command:
        """`action` is -A (append), -C (check) or -D (delete) on nat HOOK."""
        return (
            self.binary, "-w", "-t", "nat", action, hook, "-p", "tcp",
            "-m", "comment", "--comment", COMMENT, "-j", self.chain,
        )  # fmt: skip

    def create_chain(self) -> list[Command]:
        """New chain, or flush the one a killed earlier run left (the runner tries -N
        first and falls back to -F when the chain exists)."""
        return [(self.binary, "-w", "-t", "nat", "-N", self.chain)]

    def flush_chain(self) -> Command:
        return (self.binary, "-w", "-t", "nat", "-F", self.chain)

    def apply_commands(self) -> list[Command]:
        """What --apply runs, in order (jump rules last: the chain is complete
        before any packet reaches it)."""
        return [
            *self.create_chain(),
            *self.dnat_rules(),
            *(self.jump_rule("-A", hook) for hook in self.hooks),
        ]

    def remove_commands(self) -> list[Command]:
        """What removal runs: jumps first (no packet enters a half-removed chain)."""
        return [
            *(self.jump_rule("-D", hook) for hook in self.hooks),
            self.flush_chain(),
            (self.binary, "-w", "-t", "nat", "-X", self.chain),
        ]


def plan(
    node_addresses: Sequence[str],
    ports: Sequence[int],
    front: str,
    *,
    chain: str = DEFAULT_CHAIN,
    hooks: Sequence[str] = HOOKS,
) -> list[RulePlan]:
    """The rule plans (one per address family present) or PlanError."""
    if not node_addresses:
        raise PlanError("no node addresses: give --node-addresses ADDR[,ADDR|CIDR...]")
    if not ports:
        raise PlanError("no ports: give --node-ports PORT[,PORT...]")
    for port in ports:
        if not 1 <= port <= 65535:
            raise PlanError(f"node port must be 1..65535, not {port}")
    if not _CHAIN_NAME.match(chain):
        raise PlanError(f"chain name must be 1..28 of A-Z a-z 0-9 _ . -, not {chain!r}")
    if chain in HOOKS or chain in ("INPUT", "POSTROUTING", "FORWARD"):
        raise PlanError(f"chain must be a dedicated chain, not the built-in {chain}")
    hooks = tuple(dict.fromkeys(h.upper() for h in hooks))
    unknown = [h for h in hooks if h not in HOOKS]
    if unknown or not hooks:
        raise PlanError(
            f"hooks must be some of {', '.join(HOOKS)}, not {', '.join(hooks) or 'none'}"
        )
    front_address, front_port = parse_front(front)
    networks = list(dict.fromkeys(parse_network(a) for a in node_addresses))
    if any(n.version != front_address.version for n in networks):
        other = next(n for n in networks if n.version != front_address.version)
        raise PlanError(
            f"node address {other} is IPv{other.version} but the front {front_address} is "
            f"IPv{front_address.version}: DNAT cannot change the address family"
        )
    if any(front_address in n for n in networks):
        raise PlanError(f"the front {front_address} lies inside the node addresses: it would loop")
    binary = "iptables" if front_address.version == 4 else "ip6tables"
    targets = tuple((n, p) for n in networks for p in dict.fromkeys(ports))
    return [RulePlan(binary, chain, hooks, targets, front_address, front_port)]


def warnings_for(plans: Sequence[RulePlan]) -> list[str]:
    """What an operator should know before applying (printed as comments)."""
    notes = []
    for rule_plan in plans:
        if "PREROUTING" in rule_plan.hooks and rule_plan.front.is_loopback:
            notes.append(
                f"the front {rule_plan.front} is a loopback address: routed traffic (PREROUTING) "
                "reaches it only with sysctl net.ipv4.conf.all.route_localnet=1"
            )
    return notes


def render(plans: Sequence[RulePlan]) -> str:
    """The dry-run text: shell lines that apply the rules, then those that remove them."""
    lines = ["# waygate tunnel iptables: rules --apply would add (nothing was changed)"]
    lines += [f"# note: {note}" for note in warnings_for(plans)]
    for rule_plan in plans:
        lines += [shlex.join(c) for c in rule_plan.apply_commands()]
    lines.append("# removed on exit with:")
    for rule_plan in plans:
        lines += [shlex.join(c) for c in rule_plan.remove_commands()]
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------- the runner


class RunError(RuntimeError):
    """An iptables command failed; the message names it and what it said."""


Runner = Callable[[Command], "subprocess.CompletedProcess[str]"]


def _run_command(command: Command) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(command, capture_output=True, text=True, timeout=30, check=False)
    except FileNotFoundError:
        raise RunError(
            f"{command[0]} is not installed (Debian: apt-get install iptables)"
        ) from None
    except subprocess.TimeoutExpired:
        raise RunError(f"{shlex.join(command)} did not finish within 30 s") from None


def _must(runner: Runner, command: Command) -> None:
    result = runner(command)
    if result.returncode != 0:
        said = (result.stderr or result.stdout).strip().splitlines()
        raise RunError(
            f"{shlex.join(command)} failed: {said[-1] if said else f'exit {result.returncode}'}"
        )


class Applied:
    """Rules in place; `remove()` takes out exactly what `apply()` added."""

    def __init__(self, plans: Sequence[RulePlan], runner: Runner = _run_command) -> None:
        self._plans = list(plans)
        self._runner = runner
        self._done: list[RulePlan] = []

    def apply(self) -> None:
        try:
            for rule_plan in self._plans:
                self._done.append(rule_plan)
                self._apply_one(rule_plan)
        except RunError:
            self.remove()
            raise

    def _apply_one(self, rule_plan: RulePlan) -> None:
        (create,) = rule_plan.create_chain()
        if self._runner(create).returncode != 0:
            # Left by a run that was killed with SIGKILL: refill it from scratch.
            _must(self._runner, rule_plan.flush_chain())
        for command in rule_plan.dnat_rules():
            _must(self._runner, command)
        for hook in rule_plan.hooks:
            if self._runner(rule_plan.jump_rule("-C", hook)).returncode != 0:
                _must(self._runner, rule_plan.jump_rule("-A", hook))

    def remove(self) -> list[str]:
        """Best effort, every step tried; returns what failed (empty: all gone)."""
        problems = []
        for rule_plan in reversed(self._done):
            for hook in rule_plan.hooks:
                # Every copy of the jump goes (a killed earlier run may have left one).
                while self._runner(rule_plan.jump_rule("-C", hook)).returncode == 0:
                    delete = rule_plan.jump_rule("-D", hook)
                    if self._runner(delete).returncode != 0:
                        problems.append(shlex.join(delete))
                        break
            for command in rule_plan.remove_commands()[len(rule_plan.hooks) :]:
                if self._runner(command).returncode != 0:
                    problems.append(shlex.join(command))
        self._done.clear()
        return problems


# ---------------------------------------------------------------- the command


@dataclasses.dataclass(frozen=True, kw_only=True)
class IptablesSettings:
    CONFIG_ENV: ClassVar[str] = "WAYGATE_CLIENT_CONFIG"

    node_addresses: tuple[str, ...] = setting(
        (),
        env="WAYGATE_IPTABLES_NODE_ADDRESSES",
        help="edge node addresses or CIDRs whose traffic goes to the front, comma-separated",
    )
    node_ports: tuple[str, ...] = setting(
        (str(KUBELET_PORT),),
        env="WAYGATE_IPTABLES_NODE_PORTS",
        help="destination ports to steer, comma-separated",
    )
    front: str = setting(
        f"127.0.0.1:{DEFAULT_FRONT_PORT}",
        env="WAYGATE_IPTABLES_FRONT",
        help="the tunnel server's HTTPS front, IP[:PORT] ([IPv6]:PORT)",
    )
    chain: str = setting(
        DEFAULT_CHAIN,
        env="WAYGATE_IPTABLES_CHAIN",
        help="the dedicated nat chain holding the rules",
    )
    hooks: tuple[str, ...] = setting(
        HOOKS,
        env="WAYGATE_IPTABLES_HOOKS",
        help="nat chains that jump to it: OUTPUT (local traffic), PREROUTING (routed)",
    )


def settings_plans(settings: IptablesSettings) -> list[RulePlan]:
    try:
        ports = [int(p) for p in settings.node_ports]
    except ValueError:
        raise PlanError(
            f"node ports must be numbers, not {','.join(settings.node_ports)}"
        ) from None
    return plan(
        settings.node_addresses, ports, settings.front, chain=settings.chain, hooks=settings.hooks
    )


_HOLD_SIGNALS = frozenset({signal.SIGINT, signal.SIGTERM})


def wait_for_signal() -> int | None:
    """The next SIGINT or SIGTERM (blocked by `hold`, so none slips in before the wait),
    or None after a second (then `hold` checks what its handlers saw, if another
    thread took the signal)."""
    info = signal.sigtimedwait(_HOLD_SIGNALS, 1.0)
    return None if info is None else info.si_signo


def hold(
    plans: Sequence[RulePlan],
    runner: Runner = _run_command,
    wait: Callable[[], int | None] = wait_for_signal,
    on_applied: Callable[[], None] = lambda: None,
) -> list[str]:
    """Apply the rules, keep them until SIGINT or SIGTERM, then remove them.

    The signals are blocked and handled before the first rule goes in, so one
    that arrives while applying, or between a check and the wait, still ends in
    removal (a check-then-pause loop could miss it and hold forever). Returns
    what could not be removed; raises RunError (with everything removed) when
    applying fails.
    """
    received: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        received.append(signum)

    previous = {s: signal.signal(s, on_signal) for s in _HOLD_SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, _HOLD_SIGNALS)
    applied = Applied(plans, runner)
    try:
        applied.apply()
        on_applied()
        while not received:
            signum = wait()
            if signum is not None:
                received.append(signum)
        return applied.remove()
    finally:
        # Unblocked while our handler is still in place: a pending signal is absorbed.
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(IptablesSettings, args)
        plans = settings_plans(settings)
    except (SettingsError, PlanError) as exc:
        return fail(str(exc), EXIT_USAGE_OR_UNREACHABLE)
    if not args.apply:
        sys.stdout.write(render(plans))
        return 0
    total = sum(len(p.targets) for p in plans)

    def announce() -> None:
        print(
            f"waygate: {total} DNAT rule(s) applied in chain {settings.chain}; "
            "SIGINT/SIGTERM removes them",
            flush=True,
        )

    try:
        problems = hold(plans, on_applied=announce)
    except RunError as exc:
        return fail(f"iptables: {exc} (nothing left applied)")
    if problems:
        return fail("could not remove: " + "; ".join(problems))
    print("waygate: rules removed", flush=True)
    return 0


def _configure(parser: argparse.ArgumentParser) -> None:
    # Applying is a flag only (no environment variable or config key): nothing
    # changes the host's rules unless the command line says so.
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument(
        "--apply",
        action="store_true",
        help="apply the rules, hold them until SIGINT/SIGTERM, then remove them",
    )
    mode.add_argument("--dry-run", action="store_true", help="only print the rules (the default)")
    add_settings_arguments(parser, IptablesSettings)
    parser.set_defaults(func=run)


COMMANDS: dict[tuple[str, ...], Callable[[argparse.ArgumentParser], None]] = {
    ("tunnel", "iptables"): _configure,
}
