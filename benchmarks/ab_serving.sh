#!/usr/bin/env bash
# The same serving config served from two checkouts, measured alternately in one run: did a change move the
# end-to-end figures? `bash benchmarks/ab_serving.sh BEFORE_DIR AFTER_DIR [CONFIG] [ROUNDS]`
# BEFORE_DIR / AFTER_DIR: checkouts (e.g. `git worktree add /tmp/before be32f89`); each server runs its own code
# (PYTHONPATH and working directory = its checkout), the load client is this checkout's `pdserve bench`. Each round
# starts `pdserve serve CONFIG` from one checkout, then the other, and measures each with the same closed loop
# (BENCH_ARGS); one JSON line per run, then a table: output tok/s, TTFT and TPOT p50 per checkout (medians over the
# rounds) and after/before. The reference is the before checkout, measured in the same run on the same machine.
set -euo pipefail
BEFORE=$(cd "$1" && pwd); AFTER=$(cd "$2" && pwd)
CONFIG=${3:-configs/default.yaml}; ROUNDS=${4:-2}
BENCH_ARGS=${BENCH_ARGS:---concurrency 8 --duration 30 --warmup 5 --input-len 256 --output-len 64 --ignore-eos}
PORT=${PORT:-8619}
HERE=$(cd "$(dirname "$0")/.." && pwd)
WORK=$(mktemp -d)
trap 'kill $(jobs -p) 2>/dev/null || true; rm -rf "$WORK"' EXIT

serve_and_bench() {  # $1: label, $2: checkout
  local log="$WORK/$1.serve.log"
  (cd "$2" && PYTHONPATH="$2" exec python -m coordinator.cli serve "$CONFIG" --port "$PORT" >"$log" 2>&1) &
  local pid=$!
  for _ in $(seq 300); do
    curl -sf "http://127.0.0.1:$PORT/health" >/dev/null 2>&1 && break
    kill -0 $pid 2>/dev/null || { tail -20 "$log"; exit 1; }
    sleep 1
  done
  (cd "$HERE" && python -m coordinator.cli bench --url "http://127.0.0.1:$PORT" $BENCH_ARGS --no-progress \
    --out "$WORK/$1.json" >/dev/null)
  kill -INT $pid; wait $pid 2>/dev/null || true
  python - "$1" "$WORK/$1.json" <<'EOF'
import json, os, sys
s = json.load(open(sys.argv[2]))["summary"]
print(json.dumps({"run": sys.argv[1], "output_tok_s": s["output_token_throughput"], "ttft_p50_ms": s["ttft_p50_ms"],
                  "tpot_p50_ms": s["tpot_p50_ms"], "failed": s["failed"], "load_1m": os.getloadavg()[0]}))
EOF
}

for round in $(seq "$ROUNDS"); do
  serve_and_bench "before-$round" "$BEFORE" | tee -a "$WORK/lines"
  serve_and_bench "after-$round" "$AFTER" | tee -a "$WORK/lines"
done
python - "$WORK/lines" "$BEFORE" "$AFTER" <<'EOF'
import json, statistics, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
def med(side, key):
    return statistics.median(r[key] for r in rows if r["run"].startswith(side))
print(f"before: {sys.argv[2]}\nafter:  {sys.argv[3]}")
print("| figure | before | after | after / before |\n|---|---:|---:|---:|")
for key in ("output_tok_s", "ttft_p50_ms", "tpot_p50_ms"):
    b, a = med("before", key), med("after", key)
    print(f"| {key} | {b:.1f} | {a:.1f} | {a / b:.3f} |")
EOF
