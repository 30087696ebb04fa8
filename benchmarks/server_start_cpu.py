"""What one end-to-end test server costs the machine's CPUs: `pdserve serve` with the embedded `tiny` model (the
end-to-end tests' server), started, sent a few requests, stopped, with the CPU time every process on the machine used
in each phase (/proc/stat) beside the ceiling of the same run: the machine's cores times the phase's wall time.

Why: CI runs two test processes on two cores (README's test command) and most of its time is end-to-end suites that
start servers; `cores_busy` near the core count says a start is CPU-bound, so more test processes only queue.
Run it on an otherwise idle machine (it counts every process):

    python benchmarks/server_start_cpu.py --layout 1p1d --repeats 3
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import httpx

from benchclient.launcher import launched_server

HALF_CPU = {"num_cpus": 0.5, "kv_cache_memory_bytes": 64 << 20}  # as tests/server_process.HALF_CPU
LAYOUTS = {
    "1p1d": {"mode": "disaggregated", "prefill": HALF_CPU, "decode": HALF_CPU},
    "collocated": {"mode": "collocated", "decode": {"kv_cache_memory_bytes": 64 << 20}},
}


def busy_cpu_s() -> float:
    """CPU seconds the whole machine has spent outside idle and iowait since boot."""
    with open("/proc/stat", encoding="ascii") as f:
        ticks = [int(v) for v in f.readline().split()[1:]]
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


def one_server(layout: str, requests: int, warm_processes: int) -> dict:
    config = {"model": "tiny", **LAYOUTS[layout], "recovery": {"warm_processes": warm_processes},
              "server": {"host": "127.0.0.1", "port": None}}
    marks = [(busy_cpu_s(), time.monotonic())]
    with tempfile.TemporaryDirectory() as workdir, launched_server(config, Path(workdir), 300, 90) as server:
        marks.append((busy_cpu_s(), time.monotonic()))
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
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="1p1d")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--warm-processes", type=int, default=1, help="recovery.warm_processes (the default 1)")
    args = ap.parse_args()
    for _ in range(args.repeats):
        print(json.dumps(one_server(args.layout, args.requests, args.warm_processes)), flush=True)


if __name__ == "__main__":
    main()
