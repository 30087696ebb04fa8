#!/usr/bin/env bash
# pdserve served against a reference server in one run, on the same machine, with the same load client: produces
# docs/benchmarks.md's "pdserve/vLLM" rows (`vllm`) and its "Restructuring check" table (`checkouts`).
#
# `bash benchmarks/compare_serving.sh checkouts BEFORE_DIR AFTER_DIR [CONFIG] [ROUNDS]`: the same serving config
# served from two checkouts, measured alternately in one run: did a change move the end-to-end figures?
# BEFORE_DIR / AFTER_DIR: checkouts (e.g. `git worktree add /tmp/before be32f89`); each server runs its own code
# (PYTHONPATH and working directory = its checkout), the load client is this checkout's `pdserve bench`. Each round
# starts `pdserve serve CONFIG` from one checkout, then the other, and measures each with the same closed loop
# (BENCH_ARGS); one JSON line per run, then a table: output tok/s, TTFT and TPOT p50 per checkout (medians over the
# rounds) and after/before. The reference is the before checkout, measured in the same run on the same machine.
#
# `VLLM=/tmp/vllmenv/bin/vllm bash benchmarks/compare_serving.sh vllm`: pdserve collocated (one worker, `tiny` on the
# CPU) against `vllm serve` on the same checkpoint, both driven by vLLM's own load client (`vllm bench serve`: random
# prompts of 256 tokens, 64 out, ignore_eos, 100 prompts, concurrency 16: issue 13's CPU comparison). Installs
# nothing: VLLM names a vllm command (e.g. one in a virtual environment of its own; see
# ../shared/reference/gpu-facts.md for the three steps vLLM's CPU build needs here); without one it says so and
# stops. Each server gets a discarded warm-up run, then RUNS measured runs (new prompts each: --seed); pdserve runs
# again after vLLM, so a drift of the shared machine shows. Prints each run and the ratio of the medians.
#
# (Until f1a5769 these were two programs: ab_serving.sh and vllm_cpu_compare.sh.)

against_checkout() {  # BEFORE_DIR AFTER_DIR [CONFIG] [ROUNDS]
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
}

against_vllm() {
set -uo pipefail
VLLM=${VLLM:-vllm}
RUNS=${RUNS:-2}
MODEL=${MODEL:-tiny}
# Both servers run one dtype: with "auto" vLLM downcasts a float32 checkpoint (tiny is one) to bfloat16 while pdserve
# keeps the checkpoint's dtype, which would compare two different computations. CPUS: the pdserve worker's cores.
DTYPE=${DTYPE:-bfloat16}
CPUS=${CPUS:-1}
command -v "$VLLM" >/dev/null || { echo "no vllm command ($VLLM): no comparison (this program installs nothing)"; exit 0; }
cd "$(dirname "$0")/.."
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
folder=$(python -c "from engine.tiny import resolve_model_path; print(resolve_model_path('$MODEL'))")
python - "$work/pdserve.yaml" "$MODEL" "$DTYPE" "$CPUS" <<'PY'
import sys, yaml
config = yaml.safe_load(open("configs/default.yaml"))
config.pop("ray_address", None)
config.update(model=sys.argv[2], mode="collocated", dtype=sys.argv[3])
config.setdefault("decode", {}).update(workers=1, num_gpus=0, num_cpus=float(sys.argv[4]))
config.setdefault("server", {}).update(host="127.0.0.1", port=18780)
yaml.safe_dump(config, open(sys.argv[1], "w"))
PY
export VLLM_TARGET_DEVICE=${VLLM_TARGET_DEVICE:-cpu} VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
wait_up() { for _ in $(seq 1 600); do curl -sf "$1/v1/models" >/dev/null && return 0; sleep 1; done; return 1; }
bench() {  # label url seed: prints "label tok/s tpot_ms ttft_ms"
  PYTHONPATH= "$VLLM" bench serve --backend openai --base-url "$2" --model "$MODEL" --tokenizer "$folder" \
    --dataset-name random --random-input-len 256 --random-output-len 64 --num-prompts 100 --max-concurrency 16 \
    --ignore-eos --seed "$3" >"$work/bench.log" 2>&1
  python - "$1" "$work/bench.log" <<'PY'
import re, sys
text = open(sys.argv[2]).read()
get = lambda label: re.search(label + r"[^:]*:\s+([\d.]+)", text)
if not get("Output token throughput"):
    sys.exit(f"{sys.argv[1]}: vllm bench serve failed:\n{text[-2000:]}")
print(sys.argv[1], *(get(k).group(1) for k in ("Output token throughput", "Median TPOT", "Median TTFT")))
PY
}
serve_and_bench() {  # label: start the server, warm it up, measure RUNS runs, stop it
  if [ "$1" = vllm ]; then
    PYTHONPATH= "$VLLM" serve "$folder" --host 127.0.0.1 --port 18781 --served-model-name "$MODEL" --dtype "$DTYPE" >"$work/$1.log" 2>&1 &
    url=http://127.0.0.1:18781
  else
    pdserve serve "$work/pdserve.yaml" >"$work/$1.log" 2>&1 &
    url=http://127.0.0.1:18780
  fi
  pid=$!
  wait_up $url || { tail -20 "$work/$1.log"; kill $pid; exit 1; }
  bench warmup $url 99 >/dev/null
  for i in $(seq 1 "$RUNS"); do bench "$1" $url "$i"; done
  kill -TERM $pid; wait $pid
}
echo "dtype $DTYPE, pdserve worker on $CPUS CPUs"
echo "label output_tok_s tpot_p50_ms ttft_p50_ms" > "$work/rows"
{ serve_and_bench pdserve; serve_and_bench vllm; serve_and_bench pdserve; } | tee -a "$work/rows"
python - "$work/rows" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1]).read().splitlines()[1:]]
tok = {name: [float(r[1]) for r in rows if r[0] == name] for name in ("pdserve", "vllm")}
if all(tok.values()):
    print(f"pdserve/vllm output tok/s (medians, vllm bench serve): {statistics.median(tok['pdserve']) / statistics.median(tok['vllm']):.3f}")
PY
}

case ${1:-} in
  checkouts) shift; against_checkout "$@" ;;
  vllm) shift; against_vllm "$@" ;;
  *) echo "usage: bash benchmarks/compare_serving.sh checkouts BEFORE_DIR AFTER_DIR [CONFIG] [ROUNDS]" >&2
     echo "       VLLM=PATH bash benchmarks/compare_serving.sh vllm" >&2
     exit 2 ;;
esac
