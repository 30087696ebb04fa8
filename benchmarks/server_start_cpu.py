"""What one end-to-end test server costs the machine's CPUs: `pdserve serve` with the embedded `tiny` model (the
end-to-end tests' server), started, sent a few requests, stopped, with the CPU time every process on the machine used
in each phase (/proc/stat) beside the ceiling of the same run: the machine's cores times the phase's wall time.

Why: CI runs two test processes on two cores (README's test command) and most of its time is end-to-end suites that
start servers; `cores_busy` near the core count says a start is CPU-bound, so more test processes only queue.
Run it on an otherwise idle machine (it counts every process):

    python benchmarks/server_start_cpu.py --layout 1p1d --repeats 3

`--by-process` adds, once the server answers, the CPU seconds each of its live descendants has used so far (its own
and its reaped children's, /proc/PID/stat), summed by what the process is (Ray's daemons by name, the worker actors
together as ray::Worker, the spare processes as ray::IDLE, the server's own Python processes as python): where a
start's CPU time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchclient.launcher import launched_server  # noqa: E402
from benchmarks.proc_cpu import busy_cpu_s, tree_cpu_s  # noqa: E402

HALF_CPU = {"num_cpus": 0.5, "kv_cache_memory_bytes": 64 << 20}  # as tests/server_process.HALF_CPU
LAYOUTS = {
    "1p1d": {"mode": "disaggregated", "prefill": HALF_CPU, "decode": HALF_CPU},
    "collocated": {"mode": "collocated", "decode": {"kv_cache_memory_bytes": 64 << 20}},
}


def _label(comm: str, args: list[str]) -> str:
    """What a process is: Ray's worker title (ray::Worker, ray::IDLE), a Ray daemon's script or binary name, or comm."""
    if args and args[0].startswith("ray::"):
        return args[0].split()[0]
    for arg in args[:3]:
        name = Path(arg).name
        if name.endswith(".py") or name in ("raylet", "gcs_server", "pdserve"):
            return name
    return comm


def one_server(layout: str, requests: int, warm_processes: int, by_process: bool = False) -> dict:
    config = {"model": "tiny", **LAYOUTS[layout], "recovery": {"warm_processes": warm_processes},
              "server": {"host": "127.0.0.1", "port": None}}
    marks = [(busy_cpu_s(), time.monotonic())]
    with tempfile.TemporaryDirectory() as workdir, launched_server(config, Path(workdir), 300, 90) as server:
        marks.append((busy_cpu_s(), time.monotonic()))
        started_by_process = tree_cpu_s(server.pid, _label) if by_process else None
        for i in range(requests):
            r = httpx.post(f"{server.url}/v1/completions", timeout=120,
                           json={"model": "tiny", "prompt": f"request {i}", "max_tokens": 16})
            r.raise_for_status()
        marks.append((busy_cpu_s(), time.monotonic()))
    marks.append((busy_cpu_s(), time.monotonic()))
    cores = os.cpu_count() or 1
    row = {"layout": layout, "warm_processes": warm_processes, "cores": cores}
    for name, (c0, t0), (c1, t1) in zip(("start", "requests", "stop"), marks[:-1], marks[1:], strict=True):
        row |= {f"{name}_wall_s": round(t1 - t0, 2), f"{name}_cpu_s": round(c1 - c0, 2),
                f"{name}_cores_busy": round((c1 - c0) / (t1 - t0), 2)}
    if started_by_process is not None:
        row["start_cpu_s_by_process"] = started_by_process
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="1p1d")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--warm-processes", type=int, default=1, help="recovery.warm_processes (the default 1)")
    ap.add_argument("--by-process", action="store_true", help="the start's CPU seconds by process, once it answers")
    args = ap.parse_args()
    for _ in range(args.repeats):
        print(json.dumps(one_server(args.layout, args.requests, args.warm_processes, args.by_process)), flush=True)


if __name__ == "__main__":
    main()
