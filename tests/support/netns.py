"""An edge host in its own network namespace, for system tests of the tunnel.

`edge_host()` creates a namespace joined to the test's (the "cloud side") by a
veth pair on a private /30, plus a private address inside the namespace (the
edge's LAN, on its loopback) that nothing on the cloud side has a route
to:

    cloud side (this process)            edge namespace
    veth  HOST_IP/30  <------------->    veth  EDGE_IP/30   (default route via HOST_IP)
                                         lo    PRIVATE_IP/32 (the edge's backend lives here)

So a process in the namespace can dial out to anything listening on HOST_IP
(the tunnel server's agent port), while the cloud side cannot reach
PRIVATE_IP (the cloud side gets an `unreachable` route to it): a backend
bound there is reachable only through a tunnel agent running in the
namespace. `cloud_reaches()` lets a test prove that.

The namespace, the veth pair and every process started with `EdgeHost.popen`
are removed on exit, also when the test fails. Where namespaces cannot be
created (no root, no CAP_SYS_ADMIN, no `ip`), the fixture skips with the
reason printed. Requires iproute2 (Debian: iproute2).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import random
import shutil
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pytest

# Parallel tests (and earlier crashed runs) must not collide: each edge host
# takes a random /30 out of this block and a random private address.
_LINK_BLOCK = ipaddress.ip_network("10.231.0.0/16")
_PRIVATE_BLOCK = ipaddress.ip_network("10.232.0.0/16")


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, timeout=10, check=check)


def _used_addresses() -> set[ipaddress.IPv4Address | ipaddress.IPv6Address]:
    out = _ip("-4", "-o", "addr", "show", check=False).stdout
    used = set()
    for line in out.splitlines():
        parts = line.split()
        if "inet" in parts:
            used.add(ipaddress.ip_interface(parts[parts.index("inet") + 1]).ip)
    return used


def namespaces_unavailable() -> str | None:
    """Why network namespaces cannot be used here, or None when they can."""
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed (Debian: apt-get install iproute2)"
    if os.geteuid() != 0:
        return "creating network namespaces needs root (CAP_SYS_ADMIN and CAP_NET_ADMIN)"
    probe = f"wgprobe{os.getpid()}"
    result = _ip("netns", "add", probe, check=False)
    if result.returncode != 0:
        return f"`ip netns add` is not permitted here: {result.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


@dataclass
class EdgeHost:
    name: str
    host_ip: str  # the cloud side's end of the veth: edge processes dial this
    edge_ip: str  # the namespace's end of the veth
    private_ip: str  # inside the namespace only; no route to it from the cloud side
    _processes: list[subprocess.Popen[Any]] = field(default_factory=list)

    def command(self, argv: Sequence[str]) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def run(self, argv: Sequence[str], timeout: float = 30) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            self.command(argv), capture_output=True, text=True, timeout=timeout, check=False
        )

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start a process inside the namespace; it is stopped when the host goes."""
        process = subprocess.Popen(self.command(argv), **kwargs)
        self._processes.append(process)
        return process

    def stop(self, process: subprocess.Popen[Any], timeout: float = 10) -> None:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout)

    def cloud_reaches(
        self, address: str, port: int, request: bytes, expect: bytes, timeout: float = 1.0
    ) -> bool:
        """Whether the cloud side gets `expect` back from address:port for `request`.

        A bare connect is no proof: some sandboxes answer every outbound SYN
        from a transparent proxy, so only the backend's own answer counts.
        """
        try:
            with socket.create_connection((address, port), timeout=timeout) as conn:
                conn.settimeout(timeout)
                conn.sendall(request)
                received = b""
                while expect not in received and len(received) < 65536:
                    chunk = conn.recv(4096)
                    if not chunk:
                        break
                    received += chunk
                return expect in received
        except OSError:
            return False

    def close(self) -> None:
        for process in self._processes:
            with contextlib.suppress(Exception):
                self.stop(process)
        self._processes.clear()
        # Deleting the namespace deletes its veth end, and with it the peer.
        _ip("netns", "del", self.name, check=False)


def _pick(used: set[ipaddress.IPv4Address | ipaddress.IPv6Address]) -> tuple[str, str, str]:
    rng = random.Random()
    for _ in range(100):
        link = ipaddress.ip_network(
            (
                int(_LINK_BLOCK.network_address)
                + 4 * rng.randrange(_LINK_BLOCK.num_addresses // 4),
                30,
            )
        )
        host, edge = list(link.hosts())
        private = _PRIVATE_BLOCK.network_address + rng.randrange(
            1, _PRIVATE_BLOCK.num_addresses - 1
        )
        if not {host, edge, private} & used:
            return str(host), str(edge), str(private)
    raise RuntimeError("no free address range for an edge host")


@contextlib.contextmanager
def edge_host() -> Iterator[EdgeHost]:
    """Create an edge host (see the module docstring); skip where it cannot exist."""
    reason = namespaces_unavailable()
    if reason is not None:
        print(f"skipped: {reason}")
        pytest.skip(reason)
    suffix = f"{os.getpid() % 10000}{random.randrange(10000):04d}"
    name = f"wgedge{suffix}"
    host_if, edge_if = f"wgh{suffix}", f"wge{suffix}"  # at most 15 characters
    host_ip, edge_ip, private_ip = _pick(_used_addresses())
    edge = EdgeHost(name, host_ip, edge_ip, private_ip)
    _ip("netns", "add", name)
    try:
        steps = [
            ("link", "add", host_if, "type", "veth", "peer", "name", edge_if),
            ("link", "set", edge_if, "netns", name),
            ("addr", "add", f"{host_ip}/30", "dev", host_if),
            ("link", "set", host_if, "up"),
            ("-n", name, "addr", "add", f"{edge_ip}/30", "dev", edge_if),
            ("-n", name, "link", "set", edge_if, "up"),
            ("-n", name, "link", "set", "lo", "up"),
            # On the namespace's loopback: the dummy link type is not always
            # available in containers, and a /32 there is just as unroutable
            # from outside.
            ("-n", name, "addr", "add", f"{private_ip}/32", "dev", "lo"),
            ("-n", name, "route", "add", "default", "via", host_ip),
            # The cloud side has no route to the edge's LAN: say so explicitly,
            # or the host's default route (and whatever sits behind it) is tried.
            ("route", "add", "unreachable", f"{private_ip}/32"),
        ]
        for step in steps:
            result = _ip(*step, check=False)
            if result.returncode != 0:
                raise RuntimeError(f"ip {' '.join(step)}: {result.stderr.strip()}")
        yield edge
    finally:
        edge.close()
        _ip("link", "del", host_if, check=False)
        _ip("route", "del", "unreachable", f"{private_ip}/32", check=False)
