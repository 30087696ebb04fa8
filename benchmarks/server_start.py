"""Seconds from launching `pdserve serve` to /health 200, against another checkout's, interleaved.

    python benchmarks/server_start.py --against /tmp/base --rounds 2     # base: git worktree add /tmp/base <commit>

Each round starts this checkout's server and the other checkout's (same config: `--config`, the CPU default with
half a CPU per worker unless given) one after the other, so slow spells of a shared machine hit both; prints
every start and the ratio of the means (this / other). The other checkout runs with its own directory first on
PYTHONPATH (its coordinator and workers import its code).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent
ONE_START = """
import json, sys, tempfile, time, yaml
from pathlib import Path
from tests.server_process import running_server
config = yaml.safe_load(Path(sys.argv[1]).read_text())
if sys.argv[2] == "half":
    for pool in ("prefill", "decode"):
        config.setdefault(pool, {})["num_cpus"] = 0.5
with tempfile.TemporaryDirectory() as tmp:
    t = time.perf_counter()
    with running_server(Path(tmp), config):
        print(json.dumps(time.perf_counter() - t))
"""


def one_start(checkout: Path, config: Path, half: bool) -> float:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(checkout), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", ONE_START, str(config), "half" if half else "as-is"], cwd=checkout,
                         env=env, capture_output=True, text=True, timeout=600)
    if out.returncode != 0:
        raise SystemExit(f"a start in {checkout} failed:\n{out.stderr[-3000:]}")
    return float(out.stdout.strip().splitlines()[-1])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--against", type=Path, required=True, help="another checkout (e.g. a git worktree)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--config", type=Path, default=HERE / "configs/default.yaml")
    p.add_argument("--as-is", action="store_true", help="keep the config's num_cpus (default: half a CPU each)")
    args = p.parse_args()
    mine, other = [], []
    for _ in range(args.rounds):
        other.append(one_start(args.against.resolve(), args.config.resolve(), not args.as_is))
        mine.append(one_start(HERE, args.config.resolve(), not args.as_is))
    print(json.dumps({"this_s": [round(x, 2) for x in mine], "other_s": [round(x, 2) for x in other],
                      "this_mean_s": round(statistics.mean(mine), 2), "other_mean_s": round(statistics.mean(other), 2),
                      "ratio": round(statistics.mean(mine) / statistics.mean(other), 3)}))


if __name__ == "__main__":
    main()
