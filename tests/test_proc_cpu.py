"""benchmarks.proc_cpu reads what the CPU-cost benchmarks report: one process's CPU time grows with its work, and a
tree's time counts a busy child under the child's label (Linux /proc)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.proc_cpu import busy_cpu_s, process_cpu_s, tree_cpu_s


def _spin(seconds: float) -> None:
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_one_process_and_the_machine_count_work_done():
    mine, machine = process_cpu_s(os.getpid()), busy_cpu_s()
    _spin(0.3)
    assert process_cpu_s(os.getpid()) - mine >= 0.2
    assert busy_cpu_s() - machine >= 0.2


def test_a_busy_child_is_counted_under_its_label():
    child = subprocess.Popen([sys.executable, "-c", "import time\nend = time.process_time() + 0.4\n"
                              "while time.process_time() < end: pass\ntime.sleep(30)"])
    try:
        deadline = time.monotonic() + 30
        while process_cpu_s(child.pid) < 0.4 and time.monotonic() < deadline:
            time.sleep(0.05)
        totals = tree_cpu_s(os.getpid(), lambda comm, args: "child" if args[:1] == [sys.executable] and
                            "-c" in args else "other")
        assert totals["child"] >= 0.35
        assert list(totals) == sorted(totals, key=lambda k: -totals[k])
    finally:
        child.kill()
        child.wait()
