"""The decode steps of this tree against another commit's (`bash benchmarks/gpu_run.sh treeab`): prints each run's
rows, then per engine and case both trees' step times and their ratio.

`python3 benchmarks/tree_ab.py row LABEL` reads benchmarks/fp8_gpu.py decode's JSON rows on stdin and prints one line
each; `python3 benchmarks/tree_ab.py summary DIR` reads DIR/treeab-{base,new}-{fp8,bf16}.log (every run appended,
the runs interleaved base, new, new, base) and prints one JSON line per engine and case: the mean step of each tree,
the runs it came from, and base / new (> 1: this tree is faster).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path


def decode_rows(lines) -> list[dict]:
    """fp8_gpu.py decode's decode-case rows among `lines`."""
    return [json.loads(line) for line in lines if line.startswith('{"case": "decode')]


def summary(folder: Path) -> list[dict]:
    out = []
    for engine in ("fp8", "bf16"):
        runs = {}
        for tree in ("base", "new"):
            path = folder / f"treeab-{tree}-{engine}.log"
            if path.exists():
                runs[tree] = decode_rows(path.read_text().splitlines())
        if len(runs) < 2:
            continue
        for case in dict.fromkeys(r["case"] for r in runs["base"]):
            base = [r["step_ms"] for r in runs["base"] if r["case"] == case]
            new = [r["step_ms"] for r in runs["new"] if r["case"] == case]
            if not base or not new:
                continue
            out.append({"engine": engine, "case": case, "base_ms": round(statistics.mean(base), 3),
                        "new_ms": round(statistics.mean(new), 3), "base_runs": base, "new_runs": new,
                        "speedup": round(statistics.mean(base) / statistics.mean(new), 4)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("row").add_argument("label")
    sub.add_parser("summary").add_argument("folder", type=Path)
    args = parser.parse_args()
    if args.command == "row":
        for r in decode_rows(sys.stdin):
            print(args.label, r["case"], r["step_ms"], f"x_floor {r['x_floor']}", f"replay {r.get('gpu_replay_ms')}",
                  f"host {r.get('host_ms_per_step')}", flush=True)
    else:
        for row in summary(args.folder):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
