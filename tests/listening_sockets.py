"""The listening TCP sockets (IPv4 and IPv6) of a set of processes, read from /proc as `ss -ltnp` does: which
address and port each listens on, for the tests that check where a server can be reached."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from pathlib import Path


def _processes() -> tuple[dict[int, int], dict[int, str]]:
    """(parent of each pid, its command line) of every process this namespace shows."""
    parent, command = {}, {}
    for entry in Path("/proc").iterdir():
        try:
            parent[int(entry.name)] = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            command[int(entry.name)] = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except (OSError, ValueError, IndexError):
            continue
    return parent, command


def descendants_of(root: int) -> Callable[[int], bool]:
    """A test for pids: `root` and its descendants, as the process tree stands now."""
    parent, _ = _processes()

    def descends(pid: int) -> bool:
        while pid > 1:
            if pid == root:
                return True
            pid = parent.get(pid, 0)
        return False
    return descends


def listening_sockets(include: Callable[[int], bool]) -> list[tuple[str, int, int, str]]:
    """(address, port, pid, command) of every listening TCP socket of the processes `include` accepts."""
    parent, command = _processes()
    owner = {}
    for pid in filter(include, parent):
        try:
            for fd in (Path("/proc") / str(pid) / "fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:["):
                    owner[link[8:-1]] = pid
        except OSError:
            continue
    found = []
    for table, family in (("/proc/net/tcp", socket.AF_INET), ("/proc/net/tcp6", socket.AF_INET6)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != "0A" or fields[9] not in owner:  # 0A: LISTEN
                continue
            raw, port = fields[1].split(":")
            packed = bytes.fromhex(raw)
            packed = b"".join(packed[i:i + 4][::-1] for i in range(0, len(packed), 4))  # per 32-bit word
            pid = owner[fields[9]]
            found.append((socket.inet_ntop(family, packed), int(port, 16), pid, command[pid][:80]))
    return found
