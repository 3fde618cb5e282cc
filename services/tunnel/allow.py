"""The agent's destination allow-list (sans-IO): which address and port it may dial.

An entry is `NET:PORTS`:
- NET is a CIDR (`10.0.0.0/8`, `fd00::/8`), an address (`127.0.0.1`), or
  `node` — every address of this host's interfaces (the node's own addresses);
- PORTS is a port, a comma-free `+`-joined list (`10250+10255`), or `*`.

The default is `node:10250`: the node's own addresses, the kubelet's port.
A destination is allowed when one entry contains its address and port; a
host name is resolved first and every address is checked, so a name cannot
smuggle a forbidden address past the list (the agent connects to the address
it checked, never re-resolves).
"""

from __future__ import annotations

import fcntl
import ipaddress
import socket
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

DEFAULT_ALLOW = ("node:10250",)
_SIOCGIFADDR = 0x8915

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


def node_addresses() -> tuple[Address, ...]:
    """Every address of this host's interfaces (IPv4 through ioctl, IPv6 from /proc)."""
    found: list[Address] = []
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        for _index, name in socket.if_nameindex():
            try:
                packed = fcntl.ioctl(
                    probe.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15])
                )
            except OSError:
                continue  # no IPv4 address on this interface
            found.append(ipaddress.IPv4Address(packed[20:24]))
    try:
        for line in Path("/proc/net/if_inet6").read_text().splitlines():
            found.append(ipaddress.IPv6Address(bytes.fromhex(line.split()[0])))
    except (OSError, ValueError, IndexError):
        pass
    return tuple(dict.fromkeys(found))


@dataclass(frozen=True)
class AllowEntry:
    networks: tuple[Network, ...]
    ports: frozenset[int] | None  # None: any port

    def allows(self, address: Address, port: int) -> bool:
        if self.ports is not None and port not in self.ports:
            return False
        return any(address in network for network in self.networks)


def parse_entry(text: str, own: Iterable[Address] = ()) -> AllowEntry:
    """`NET:PORTS` -> an entry; ValueError with a reason for anything else."""
    net, sep, ports_text = text.strip().rpartition(":")
    if not sep or not net:
        raise ValueError(f"{text!r}: write NET:PORTS, e.g. node:10250 or 10.0.0.0/8:*")
    if net.startswith("["):  # [fd00::1] or [fd00::]/8
        net = net.replace("[", "", 1).replace("]", "", 1)
    if net == "node":
        networks: tuple[Network, ...] = tuple(ipaddress.ip_network(a) for a in own)
    else:
        try:
            networks = (ipaddress.ip_network(net, strict=False),)
        except ValueError:
            raise ValueError(f"{text!r}: {net!r} is not an address, CIDR or 'node'") from None
    if ports_text == "*":
        return AllowEntry(networks, None)
    try:
        ports = frozenset(int(p) for p in ports_text.split("+"))
    except ValueError:
        raise ValueError(f"{text!r}: ports must be numbers joined by + or *") from None
    if not ports or not all(0 < p < 65536 for p in ports):
        raise ValueError(f"{text!r}: ports must lie in 1..65535")
    return AllowEntry(networks, ports)


def entries_problem(entries: Iterable[str]) -> str | None:
    """Settings check: why the list is invalid, or None."""
    for entry in entries:
        try:
            parse_entry(entry)
        except ValueError as exc:
            return str(exc)
    return None


# How many (address, port) verdicts an AllowList remembers: an agent dials few
# destinations, and ipaddress's parse and containment checks cost ~40 us a dial.
VERDICTS = 1024


class AllowList:
    def __init__(self, entries: Iterable[str], own: Iterable[Address] | None = None) -> None:
        own_addresses = tuple(node_addresses() if own is None else own)
        self.entries = tuple(parse_entry(e, own_addresses) for e in entries)
        # The entries never change once built, so a verdict never goes stale; the
        # table is bounded (cleared when full).
        self._verdicts: dict[tuple[str, int], bool] = {}

    def allows(self, address: str, port: int) -> bool:
        key = (address, port)
        verdict = self._verdicts.get(key)
        if verdict is None:
            if len(self._verdicts) >= VERDICTS:
                self._verdicts.clear()
            verdict = self._verdicts[key] = self._judge(address, port)
        return verdict

    def _judge(self, address: str, port: int) -> bool:
        try:
            parsed = ipaddress.ip_address(address.split("%", 1)[0])
        except ValueError:
            return False
        if isinstance(parsed, ipaddress.IPv6Address):
            # ::ffff:127.0.0.1 is 127.0.0.1: judged by the IPv4 entries.
            parsed = parsed.ipv4_mapped or parsed
        return any(entry.allows(parsed, port) for entry in self.entries)
