"""The DNAT rules `waygate tunnel iptables` generates, and the runner's apply/remove logic.

The runner is driven by a model of the nat table (chains of rule argv), so
every command it would run on a host is checked without touching one; the
rules themselves are applied for real inside a network namespace by
tests/system/test_tunnel_front.py.
"""

from __future__ import annotations

import ipaddress
import shlex
import signal
import subprocess

import pytest

from waygate.cli import main
from waygate.tunnel import iptables
from waygate.tunnel.iptables import COMMENT, Applied, PlanError, RunError, plan, render


def test_one_dnat_rule_per_node_address_and_port_in_a_dedicated_chain() -> None:
    (rules,) = plan(["10.0.0.5", "10.1.0.0/16"], [10250, 10255], "10.96.0.9:10263")
    assert rules.binary == "iptables"
    assert [shlex.join(c) for c in rules.apply_commands()] == [
        "iptables -w -t nat -N WAYGATE-TUNNEL",
        "iptables -w -t nat -A WAYGATE-TUNNEL -d 10.0.0.5/32 -p tcp --dport 10250 -j DNAT --to-destination 10.96.0.9:10263",
        "iptables -w -t nat -A WAYGATE-TUNNEL -d 10.0.0.5/32 -p tcp --dport 10255 -j DNAT --to-destination 10.96.0.9:10263",
        "iptables -w -t nat -A WAYGATE-TUNNEL -d 10.1.0.0/16 -p tcp --dport 10250 -j DNAT --to-destination 10.96.0.9:10263",
        "iptables -w -t nat -A WAYGATE-TUNNEL -d 10.1.0.0/16 -p tcp --dport 10255 -j DNAT --to-destination 10.96.0.9:10263",
        f"iptables -w -t nat -A OUTPUT -p tcp -m comment --comment '{COMMENT}' -j WAYGATE-TUNNEL",
        f"iptables -w -t nat -A PREROUTING -p tcp -m comment --comment '{COMMENT}' -j WAYGATE-TUNNEL",
    ]
    assert [shlex.join(c) for c in rules.remove_commands()] == [
        f"iptables -w -t nat -D OUTPUT -p tcp -m comment --comment '{COMMENT}' -j WAYGATE-TUNNEL",
        f"iptables -w -t nat -D PREROUTING -p tcp -m comment --comment '{COMMENT}' -j WAYGATE-TUNNEL",
        "iptables -w -t nat -F WAYGATE-TUNNEL",
        "iptables -w -t nat -X WAYGATE-TUNNEL",
    ]


def test_ipv6_uses_ip6tables_and_brackets_the_front() -> None:
    (rules,) = plan(["fd00::5"], [10250], "[fd00:1::9]:10263", hooks=["output"], chain="EDGE")
    assert rules.apply_commands()[1] == (
        "ip6tables", "-w", "-t", "nat", "-A", "EDGE", "-d", "fd00::5/128", "-p", "tcp",
        "--dport", "10250", "-j", "DNAT", "--to-destination", "[fd00:1::9]:10263",
    )  # fmt: skip
    assert [c[5] for c in rules.apply_commands() if c[4] == "-A" and c[5] != "EDGE"] == ["OUTPUT"]


def test_the_front_port_defaults_to_10263_and_duplicates_collapse() -> None:
    (rules,) = plan(["10.0.0.5", "10.0.0.5/32"], [10250, 10250], "10.96.0.9")
    assert rules.targets == ((ipaddress.ip_network("10.0.0.5/32"), 10250),)
    assert rules.front_port == 10263


@pytest.mark.parametrize(
    ("addresses", "ports", "front", "kwargs", "message"),
    [
        ([], [10250], "10.0.0.9", {}, "no node addresses"),
        (["10.0.0.5"], [], "10.0.0.9", {}, "no ports"),
        (["node-a"], [10250], "10.0.0.9", {}, "not an IP address or CIDR: 'node-a'"),
        (["10.0.0.5/8"], [10250], "10.0.0.9", {}, "not an IP address or CIDR"),
        (["10.0.0.5"], [70000], "10.0.0.9", {}, "node port must be 1..65535"),
        (["10.0.0.5"], [10250], "tunnel.example", {}, "front address must be IP[:PORT]"),
        (["10.0.0.5"], [10250], "10.0.0.9:0", {}, "front port must be 1..65535"),
        (["fd00::5"], [10250], "10.0.0.9", {}, "DNAT cannot change the address family"),
        (["10.0.0.0/24"], [10250], "10.0.0.9", {}, "inside the node addresses: it would loop"),
        (["10.0.0.5"], [10250], "10.0.0.9", {"chain": "OUTPUT"}, "dedicated chain"),
        (["10.0.0.5"], [10250], "10.0.0.9", {"chain": "a b"}, "chain name must be"),
        (["10.0.0.5"], [10250], "10.0.0.9", {"hooks": ["INPUT"]}, "hooks must be some of"),
    ],
)
def test_bad_input_is_one_clear_error(addresses, ports, front, kwargs, message) -> None:
    with pytest.raises(PlanError, match=message.replace("[", r"\[").replace("(", r"\(")):
        plan(addresses, ports, front, **kwargs)


def test_dry_run_text_lists_apply_then_remove_and_warns_about_loopback_prerouting() -> None:
    text = render(plan(["10.0.0.5"], [10250], "127.0.0.1:10263"))
    lines = text.splitlines()
    assert lines[0].startswith("# waygate tunnel iptables") and "nothing was changed" in lines[0]
    assert "route_localnet=1" in lines[1]
    assert lines.index("# removed on exit with:") == 2 + 4
    assert "route_localnet" not in render(
        plan(["10.0.0.5"], [10250], "127.0.0.1", hooks=["OUTPUT"])
    )


# ---------------------------------------------------------------- the runner


class NatTable:
    """Models `iptables -t nat` for the commands the runner uses."""

    def __init__(self, fail_on: str | None = None) -> None:
        self.chains: dict[str, list[tuple[str, ...]]] = {"OUTPUT": [], "PREROUTING": []}
        self.commands: list[str] = []
        self.fail_on = fail_on

    def __call__(self, command: tuple[str, ...]) -> subprocess.CompletedProcess[str]:
        line = shlex.join(command)
        self.commands.append(line)
        assert command[1:4] == ("-w", "-t", "nat")
        action, chain, rule = command[4], command[5], command[6:]
        ok = True
        if self.fail_on is not None and self.fail_on in line:
            ok = False
        elif action == "-N":
            ok = chain not in self.chains
            self.chains.setdefault(chain, [])
        elif action == "-F":
            ok = chain in self.chains
            if ok:
                self.chains[chain] = []
        elif action == "-X":
            referenced = any(r[-1] == chain for rules in self.chains.values() for r in rules)
            ok = chain in self.chains and not self.chains[chain] and not referenced
            if ok:
                del self.chains[chain]
        elif action == "-A":
            ok = chain in self.chains and (
                rule[-1] not in ("WAYGATE-TUNNEL",) or rule[-1] in self.chains
            )
            if ok:
                self.chains[chain].append(rule)
        elif action == "-C":
            ok = rule in self.chains.get(chain, [])
        elif action == "-D":
            ok = rule in self.chains.get(chain, [])
            if ok:
                self.chains[chain].remove(rule)
        return subprocess.CompletedProcess(
            command,
            0 if ok else 1,
            "",
            "" if ok else "iptables: No chain/target/match by that name.",
        )


def test_apply_then_remove_leaves_the_table_as_it_was() -> None:
    table = NatTable()
    table.chains["OUTPUT"].append(("-j", "SOMEONE-ELSE"))
    applied = Applied(plan(["10.0.0.5"], [10250], "10.96.0.9"), table)
    applied.apply()
    assert len(table.chains["WAYGATE-TUNNEL"]) == 1
    assert table.chains["OUTPUT"][-1][-1] == "WAYGATE-TUNNEL"
    assert applied.remove() == []
    assert table.chains == {"OUTPUT": [("-j", "SOMEONE-ELSE")], "PREROUTING": []}


def test_apply_over_a_killed_run_refills_the_chain_and_adds_no_second_jump() -> None:
    table = NatTable()
    plans = plan(["10.0.0.5"], [10250], "10.96.0.9")
    Applied(plans, table).apply()  # then SIGKILLed: nothing removed
    table.chains["WAYGATE-TUNNEL"].append(("-d", "10.9.9.9/32", "-j", "DNAT"))  # stale
    again = Applied(plans, table)
    again.apply()
    assert len(table.chains["WAYGATE-TUNNEL"]) == 1
    assert [r[-1] for r in table.chains["OUTPUT"]] == ["WAYGATE-TUNNEL"]
    assert again.remove() == []
    assert "WAYGATE-TUNNEL" not in table.chains and table.chains["OUTPUT"] == []


def test_a_failure_half_way_removes_what_was_added() -> None:
    table = NatTable(fail_on="-A PREROUTING")
    with pytest.raises(RunError, match="-A PREROUTING .* failed: iptables: No chain"):
        Applied(plan(["10.0.0.5"], [10250], "10.96.0.9"), table).apply()
    assert table.chains == {"OUTPUT": [], "PREROUTING": []}


def test_hold_removes_the_rules_on_sigterm() -> None:
    table = NatTable()
    seen = []

    def wait() -> int | None:
        seen.append(dict(table.chains))
        # Raised before the wait starts (the race a check-then-pause loop lost):
        # blocked, it stays pending and the real wait still receives it.
        signal.raise_signal(signal.SIGTERM)
        return iptables.wait_for_signal()

    before = signal.getsignal(signal.SIGTERM)
    problems = iptables.hold(plan(["10.0.0.5"], [10250], "10.96.0.9"), table, wait=wait)
    assert problems == []
    assert "WAYGATE-TUNNEL" in seen[0]
    assert table.chains == {"OUTPUT": [], "PREROUTING": []}
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_missing_iptables_binary_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    def missing(*_args, **_kwargs):
        raise FileNotFoundError

    monkeypatch.setattr(subprocess, "run", missing)
    with pytest.raises(RunError, match="iptables is not installed"):
        Applied(plan(["10.0.0.5"], [10250], "10.96.0.9")).apply()


# ---------------------------------------------------------------- the command


def test_cli_dry_run_prints_the_rules_and_changes_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(
        [
            "tunnel",
            "iptables",
            "--dry-run",
            "--node-addresses",
            "10.0.0.5",
            "--front",
            "10.96.0.9:10263",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    assert "-d 10.0.0.5/32 -p tcp --dport 10250 -j DNAT --to-destination 10.96.0.9:10263" in out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--front", "10.96.0.9"], "no node addresses"),
        (["--node-addresses", "10.0.0.5", "--node-ports", "kubelet"], "node ports must be numbers"),
    ],
)
def test_cli_bad_input_exits_2_with_one_line(
    argv, message, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["tunnel", "iptables", *argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("waygate: ") and message in err and err.count("\n") == 1
