"""CPU seconds read from Linux /proc, for the benchmarks that weigh what a server costs the machine: one process's
own time, the whole machine's busy time, and a process tree's time summed by what each process is."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds one process has used so far (its own, not its reaped children's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent outside idle and iowait since boot."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def tree_cpu_s(root_pid: int, label: Callable[[str, list[str]], str]) -> dict[str, float]:
    """CPU seconds (user + system, with reaped children's) of `root_pid` and its live descendants, summed by
    `label(comm, argv)`, largest first."""
    tick = os.sysconf("SC_CLK_TCK")
    parent, cpu, labels = {}, {}, {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            args = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue  # exited meanwhile
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        pid = int(entry.name)
        parent[pid] = int(fields[1])
        cpu[pid] = sum(int(v) for v in fields[11:15]) / tick  # utime stime cutime cstime
        labels[pid] = label(stat[stat.index("(") + 1:stat.rindex(")")], [a.decode(errors="replace") for a in args])
    totals: dict[str, float] = {}
    for pid in cpu:
        up = pid
        while up not in (root_pid, 0, 1) and up in parent:
            up = parent[up]
        if up == root_pid:
            totals[labels[pid]] = round(totals.get(labels[pid], 0.0) + cpu[pid], 2)
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))
