"""Who listens on a local TCP port: free or taken, and by which process.

Linux /proc only (a listening socket's inode in /proc/net/tcp{,6}, found among
a process's fds); elsewhere, or for another user's process whose fds cannot
be read, the holder is unknown (None) and callers say only that the port is
taken. Reading is bounded by the number of processes and their fds; nothing
here waits.
"""

from __future__ import annotations

import contextlib
import errno
import socket
from dataclasses import dataclass
from pathlib import Path

_LISTEN = "0A"
PROC = Path("/proc")


@dataclass(frozen=True)
class Holder:
    pid: int
    command: str  # the command line, spaces between arguments, cut to 200 characters

    def __str__(self) -> str:
        return f"pid {self.pid} ({self.command})"


def port_free(host: str, port: int) -> bool:
    """True when a listener could bind host:port now (SO_REUSEADDR, as servers do)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            if exc.errno in (errno.EADDRINUSE, errno.EACCES):
                return False
            raise
    return True


def _listening_inodes(port: int) -> set[str]:
    inodes = set()
    for name in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (PROC / "net" / name).read_text().splitlines()[1:]:
                fields = line.split()
                if len(fields) < 10 or fields[3] != _LISTEN:
                    continue
                if int(fields[1].rsplit(":", 1)[1], 16) == port:
                    inodes.add(fields[9])
    return inodes


def listeners(port: int) -> list[Holder]:
    """The processes holding a listening socket on `port` (empty: none found)."""
    inodes = {f"socket:[{inode}]" for inode in _listening_inodes(port)}
    if not inodes:
        return []
    found = []
    for proc in PROC.iterdir():
        if not proc.name.isdigit():
            continue
        try:
            fds = list((proc / "fd").iterdir())
        except OSError:
            continue
        for fd in fds:
            try:
                target = fd.readlink()
            except OSError:
                continue
            if str(target) in inodes:
                found.append(Holder(int(proc.name), _command(proc)))
                break
    return sorted(found, key=lambda h: h.pid)


def _command(proc: Path) -> str:
    try:
        raw = (proc / "cmdline").read_bytes()
    except OSError:
        return "?"
    return raw.replace(b"\0", b" ").decode("utf-8", "replace").strip()[:200] or "?"


def parent_of(pid: int) -> int | None:
    """The parent pid from /proc/PID/stat; None when unknown."""
    try:
        stat = (PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: split after it.
    fields = stat[stat.rfind(")") + 2 :].split()
    return int(fields[1]) if len(fields) > 1 else None


def descends_from(pid: int, ancestor: int, depth: int = 8) -> bool:
    """`pid` is `ancestor` or one of its descendants (within `depth` generations)."""
    current: int | None = pid
    for _ in range(depth):
        if current is None or current <= 1:
            return False
        if current == ancestor:
            return True
        current = parent_of(current)
    return False
