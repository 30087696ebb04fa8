#!/usr/bin/env bash
# One lent-GPU session step: `bash benchmarks/gpu_run.sh tests|transfer|engine` (logs under $OUT). Each step runs a
# program of benchmarks/ (named below where the step's name does not say it); docs/benchmarks.md names, per figure,
# the step that printed it.
# tests: every test marked gpu (kernels compiled, FP8 weights and KV, CUDA graphs, sampler, CUDA-only tests);
#   lists by name the tests that need more GPUs than the machine has.
# peer: peer-copy options (benchmarks/design_choices.py peer-copy); transfer: the kvtransfer Ray benchmark (both
#   need 2 GPUs).
# kernels: small-batch decode kernels vs cuBLAS (design_choices.py decode-kernels; KERNEL_ARGS=--sweep to time launch
#   configurations).
# engine: a random Llama-3-8B checkpoint, then python benchmarks/engine_bench.py --gpu.
# fp8 (1 GPU): the 8B shape with FP8 weights (per-channel, dummy) vs bfloat16: decode steps against their floors,
#   prefill; the fp8 KV cache's capacity and 8k-context decode vs bf16 KV (benchmarks/fp8_gpu.py decode).
# fp8_70b (1 GPU): the 70B shape in FP8 served collocated on one GPU, 4 x 1k prompts, a cold round then a warm one:
#   TPOT and the median chunk gap against the decode floor measured first (benchmarks/serve_load.py smoke --floor).
#   FP8_70B_ARGS adds serve_load.py arguments (an 80 GB card: "--set decode.kv_cache_memory_bytes=4000000000",
#   room for the 4 streams' KV beside ~67.7 GiB of weights where 0.9 of the card leaves too little).
# fp8_70b_layers (1 GPU, issue 42): FP8_70B_LAYERS (20) of the 70B shape's layers in FP8 (an 80 GB card holds them):
#   decode at FP8_70B_CASES (1x1024,4x1024) against the floor, traced: each kernel's share of a step by grid
#   (benchmarks/fp8_gpu.py decode --only fp8 --cases; the whole 70B's step is fp8_70b's).
# fp8serve (1 GPU, issue 42): the 8B shape served collocated, bf16 then FP8 weights + fp8 KV (one server each):
#   64 x 1k prompts, 256 tokens, cold and warm rounds; TPOT over each floor, FP8's TPOT and tokens/s over bf16's.
# pdl (1 GPU): the 8B decode steps (bf16; FP8 weights + fp8 KV) with programmatic dependent launch vs without.
# attnstages (1 GPU, issue 42): the 8B decode steps (FP8 weights + fp8 KV; STAGES_ARGS="--stages fp8:5,bf16:5" adds
#   bf16) with the decode attention's launches on more pipeline stages against the engine's own, one process
#   (benchmarks/attention_stages.py). STAGES_ARGS="--early-kv off": both engines' steps without the attention's early
#   first tile (decode_attention.EARLY_KV) against with it; "--max-splits 16,8,4": with batch 1's splits capped near
#   its 1k context's 16 tiles instead of the graph table's width, an engine each.
#   STAGES_ARGS="--lazy on": both engines' steps with the lazy online softmax against the exact one (the default).
# stepab (1 GPU, issue 42): the 8B decode steps (bf16; FP8 weights + fp8 KV) with engine module constants changed
#   against as they are, one process (benchmarks/step_ab.py; STEPAB_ARGS="--set engine.kernels.fp8_quant.SPLIT_ROWS=64").
#   STEPAB_70B_LAYERS=20: that many of the 70B shape's layers instead (an 80 GB card holds 20 in FP8).
# attnncu (1 GPU, issue 42): Nsight Compute over the decode attention's launches (benchmarks/attention_counters.py;
#   ATTNNCU_ARGS="--cases 64x2048 --launches fp8:32x1x5 --splits 2"): each launch's duration, DRAM throughput,
#   occupancy and warp stalls, the raw counters in $OUT/attn_ncu_raw.csv.
# fp8sweep (1 GPU): one 8B layer's GEMMs and the LM head at each M, every way (benchmarks/fp8_gpu.py gemm-sweep).
# attnlayout (1 GPU, issue 42): the decode attention kernel alone at 64 / 2k, 16 / 8k and 1 / 1k, bf16 and fp8 caches:
#   the engine's token-major blocks against head-major ones, the exact softmax against the lazy one
#   (benchmarks/attention_layout.py; LAYOUT_ARGS="--cases 64x2048").
# fp8attn (1 GPU): the decode attention kernel alone on bf16 and fp8 caches at batch 1 / 1k, 64 / 2k and 16 / 8k,
#   each launch configuration and split count (benchmarks/fp8_gpu.py attention; ATTN_ARGS=--cases ...).
# recovery: 1P+1D on the Llama-3.2-1B shape; kill decode-0 then prefill-0 under load, time each recovery
#   (benchmarks/recovery.py kill).
# recovery1 (1 GPU, issue 45): the same with both workers sharing GPU 0 (num_gpus 0.5, 8 GiB of KV each), decode-0
#   then prefill-0 killed: the replacement's time to /health 200 and its phases (warm processes on: the default).
#   Each kill comes SETTLE_S (10) seconds into the load: the process started ahead after the pools' start needs ~7 s
#   on an H200 (Ray's worker boot and pool_worker.preload); a kill at 5 s found it still importing (handover 3.4 s).
# tenants: the same layout; a high-priority tenant's TTFT alone and under a low-priority flood, preemptions.
# tp (2 GPUs) = tpcuda (TP=2 kernel/graph tests) + tptransfer (P TP=2 <-> D TP=1 over NCCL + cuda_ipc) + allreduce
#   (NCCL vs one-shot all-reduce at batch 1) + tpscale (the 8B decode step at TP=1 vs TP=2): benchmarks/tp_gpu.py.
# oneshot (2 GPUs): allreduce, then the 8B shape's TP=2 decode step with the one-shot all-reduce vs NCCL only.
# pullpath (2 GPUs): a cuda_ipc pull awaited on an actor's loop, stage by stage, with and without a busy thread
#   (benchmarks/kvtransfer_bench.py --pull-path).
# handoff (2 GPUs): 1P+1D on the 8B shape: KV handoff vs raw transfer, decode slowdown while transfers land.
# handoff1 (1 GPU): the same 1P+1D sharing GPU 0 (num_gpus 0.5 each): a 2k prompt's handoff with bf16 then fp8 KV,
#   bytes (the transfer counter) and time against a same-device copy; no slowdown windows (issue 42).
# x4 (4 GPUs, issue 15): the 70B shape P TP=2 + D TP=2 vs collocated TP=2 x2 sweep, then a decode rank killed.
# sampling (1 GPU): the per-step cost of penalties, logit bias and a JSON-schema mask at batch 64, 8B shape
#   (benchmarks/sampling_costs.py overhead).
# tp70b (2 GPUs): the Llama-3-70B shape (dummy weights) at TP=2: decode step vs floor, then served collocated.
# sweep1b (2 GPUs): the committed pool-sizing sweep (docs/sweeps/gpu-2x-llama1b), written to $OUT/sweep.
# adaptive2 (2 GPUs): mode adaptive against 1P+1D and collocated x2, 8B shape, 3 rates, 2 SLO pairs (issue 34;
#   docs/sweeps/gpu-2x-llama3-8b-adaptive), packed into $OUT/sweep.tgz with its log (report: $OUT/report-sweep.md).
# adaptive2x2 (4 GPUs): adaptive2's sweep on GPUs 0,1 beside the -mix sweep (a tight TPOT target: where a mix
#   should beat both pure layouts) on GPUs 2,3; each packed into $OUT/<name>.tgz with its log.
# adaptive2mix (2 GPUs): the -mix sweep alone, packed into $OUT/sweepmix.tgz.
# adaptive4 (4 GPUs): mode adaptive (from 2P+2D) against 2P+2D, 3P+1D and collocated x4 at 24 req/s, 8B shape.
# shift (2 GPUs): mode adaptive under a load that changes (short prompts, then long ones), roles over time
#   (benchmarks/serve_load.py shift).
# shift4 (4 GPUs): the same from 1P+3D, 8 req/s of short prompts then 24 req/s of long ones.
# coldstart (2 GPUs): first vs second 18 s window after /health, 8B shape (dummy weights), 1P+1D and collocated x2
#   (benchmarks/start.py serving).
# coldstart1 (1 GPU, issue 45): the 8B shape (dummy weights) collocated on GPU 0: `pdserve serve` to /health 200, to
#   the first streamed token and the first windows' goodput, with each worker's start phases (benchmarks/start.py
#   serving): an empty Triton cache, then a second start, then a second start capturing every graph at start.
# structured1 (1 GPU, issue 45): the same server alone, first and second start: the first json_schema request's
#   stall on 8 running streams (their longest gap while it is served, against before it).
# drift (1 GPU): the offline engine over fresh prompts run after run in one process: does it slow down, and why
#   (benchmarks/engine_host.py drift).
# prefill (1 GPU): a 64-token prompt's prefill on the engine alone (1B shape), beside the same engine's decode step
#   (engine_host.py prefill).
# overhead (1 GPU): pdserve collocated (1 worker) against LLM.generate, the 1B then the 8B shape (issue 13's load).
# multiturn1 / multiturn1p1d (1 GPU, issue 44): multi-turn conversations on the 8B shape, the host tier on against
#   off, collocated / 1P+1D sharing the GPU (configs/sweeps/gpu-1x-llama3-8b-multiturn-*.yaml), packed into $OUT.
# multiturnquick (1 GPU, issue 44): the same on one collocated worker with 8 GiB of device KV, ~4 minutes.
# multiturnbusy (1 GPU, issue 44): one collocated worker, 16 GiB of device KV, twice quick's load, ~5 minutes.
# multiturnagents (1 GPU, issue 44): the same worker, short replies and 10 s of think time (many idle histories for
#   each decoding stream), ~5 minutes.
# multiturnagents1p1d (1 GPU, issue 44): the agents load on a prefill and a decode worker sharing the GPU, host
#   tiers on against off, 5 new conversations/s, ~7 minutes.
# smsplit (1 GPU, issue 43): a decode step beside a prefill, the SMs split between them (engine.runner.sm_lanes:
#   green contexts, default or balanced work queues) or not; cuBLAS GEMMs of one 8B layer, then the engine's own
#   decode graph and prefill layers (benchmarks/sm_split.py micro; SMSPLIT_ARGS=--decode-sms 32,64 ...).
# smsplitlong (1 GPU, issue 43): the engine with 32 streams decoding, then one 7,000-token prompt: the streams'
#   token gaps before and while it prefills and its TTFT, chunked prefill (2,048) against the prefill lane
#   (EngineConfig.sm_split_decode_sms; benchmarks/sm_split.py long-prompt).
# smsplitserve (1 GPU, issue 43): pdserve serve with one collocated worker, the chat workload at 4, 8, 12 req/s:
#   chunked prefill against the prefill lane, decode on 64 and on 32 SMs
#   (configs/sweeps/gpu-1x-llama3-8b-sm-split.yaml), packed into $OUT.
# smsplittable (1 GPU, issue 43): the same load, chunked prefill against the lane whose split follows the decode
#   batch (decode.sm_split_decode_sms: {32: 32, 128: 64}, and {12: 0, 32: 32, 128: 64}: chunked beside few rows;
#   configs/sweeps/gpu-1x-llama3-8b-sm-split-table.yaml; 350 s on an H100 at 463d3a7: a call of its own).
# treeab (1 GPU): this tree's decode steps against another commit's, engine by engine in turns (base, new, new, base):
#   `bash benchmarks/gpu_run.sh base-tree REF` first, on the development machine (writes REF's engine and benchmarks
#   to .base, which .git/info/exclude should list), then carry .base; TREEAB_ONLY="fp8 bf16" (FP8 weights + fp8 KV,
#   bf16), TREEAB_CASES=decode1,decode64 (benchmarks/fp8_gpu.py decode --only ... --cases).
# base-tree REF (alone, on the development machine): REF's engine, kvtransfer, coordinator, benchmarks and configs
#   into .base, for treeab.
# extra-bundle (alone, on the development machine, not a lent one; from the project root): writes
#   .devbundle/extra.tar.xz, wheels for the lent GPU machines' CPython 3.12 that ../shared/device/make-bundle.sh
#   does not fetch (httptools, prometheus-client, grpcio) or cannot (llguidance is manylinux_2_31 only, beyond its
#   platform list); every later step unpacks it next to the shared bundle.
if [ "${1:-}" = base-tree ]; then  # on the development machine (see the header): treeab's reference tree
  set -euo pipefail
  rev=$(git rev-parse --short "${2:?base-tree needs a commit}")
  rm -rf .base && mkdir .base
  git archive "$rev" engine kvtransfer coordinator benchmarks configs | tar x -C .base
  echo "$rev" > .base/COMMIT
  echo "wrote $rev's tree to .base ($(du -sh .base | cut -f1)); carry it: \"carry\": [\".devbundle\", \".base\"]"
  exit 0
fi
if [ "${1:-}" = extra-bundle ]; then  # on the development machine (see the header), before a lent one's set-up
  set -euo pipefail
  work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
  plat=(--platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64)
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp "${plat[@]}" \
    -d "$work/wheels" "llguidance>=1.9.1,<2" "prometheus-client>=0.20" "httptools>=0.6" "grpcio>=1.60"
  python3 -m pip install -q --target "$work/site" --no-deps --no-compile --only-binary=:all: --python-version 3.12 \
    --implementation cp "${plat[@]}" "$work"/wheels/*.whl
  mkdir -p .devbundle
  tar cJf .devbundle/extra.tar.xz -C "$work/site" .
  ls -la .devbundle/extra.tar.xz
  exit 0
fi
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p .devsite "$OUT"
[ -f .devsite/.unpacked ] || { tar xf .devbundle/site.tar.xz -C .devsite && touch .devsite/.unpacked; }
# extra.tar.xz (optional, bash benchmarks/gpu_run.sh extra-bundle): llguidance, prometheus-client and httptools, which
# the shared bundle lacks
[ ! -f .devbundle/extra.tar.xz ] || [ -f .devsite/.extra ] || { tar xf .devbundle/extra.tar.xz -C .devsite && touch .devsite/.extra; }
# py-spy.xz (optional: `xz -c $(which py-spy) > .devbundle/py-spy.xz`, a static binary): tenants' --profile
[ ! -f .devbundle/py-spy.xz ] || [ -x .devsite/bin/py-spy ] || { mkdir -p .devsite/bin && xz -dc .devbundle/py-spy.xz \
  > .devsite/bin/py-spy && chmod +x .devsite/bin/py-spy; }
export PATH=$PWD/.devsite/bin:$PATH
export PYTHONPATH=$PWD:$PWD/.devsite PYTHONUNBUFFERED=1 PDSERVE_CACHE=/tmp/pdc
python3 -c "import llguidance, prometheus_client, httptools" || echo "warning: llguidance, prometheus_client or httptools missing"
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv | tee "$OUT/gpu.txt"
checkpoint8b() {  # the Llama-3-8B shape without weights (load_format dummy draws them on the GPU)
  [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
}
# sweep NAME CONFIG TIMEOUT: `pdserve sweep configs/sweeps/CONFIG.yaml` into $OUT/NAME, its report beside it
# ($OUT/report-NAME.md) and the folder packed into $OUT/NAME.tgz (a call brings back at most 8 files)
sweep() {
  checkpoint8b
  mkdir -p "$OUT/$1"
  timeout "$3" python3 -m coordinator.cli sweep "configs/sweeps/$2.yaml" --out "$OUT/$1" > "$OUT/$1/sweep.log" 2>&1
  grep -v "^(" "$OUT/$1/sweep.log" | tail -8
  cp "$OUT/$1/report.md" "$OUT/report-$1.md" 2>/dev/null
  tar czf "$OUT/$1.tgz" -C "$OUT" "$1" && rm -rf "${OUT:?}/$1"
}
for step in "$@"; do
  case $step in
    tests)  # every test marked gpu (tests/conftest.py): kernels compiled, FP8, CUDA graphs, the CUDA-only tests; the
      # summary names the tests that need more devices than this machine has. TESTS: other files or -k filters.
      # (only the modules that mark tests gpu are collected: the others import what this machine lacks, e.g. openai;
      # the FP8 ones first: tests/gpu_test_files.py; a failure's traceback is printed when it happens).
      # TESTS_PART=1/2, then 2/2 in the next call (same warm machine): every other file, when the whole suite would
      # outrun one call (more than 470 s on a fresh H100 at 54da3ff)
      files=$(python3 -m tests.gpu_test_files ${TESTS_PART:+--part "$TESTS_PART"}) || exit 2
      PDSERVE_TESTS_INSTAFAIL=1 timeout ${TESTS_TIMEOUT:-540} python3 -m pytest -v -m gpu -p no:cacheprovider \
        --timeout ${TEST_TIMEOUT:-150} --durations=20 -rs ${TESTS:-$files} > "$OUT/tests.log" 2>&1
      grep -E "passed|failed|error|need more CUDA|  tests/|^FAILED" "$OUT/tests.log" | tail -40 ;;
    fp8_70b)  # the Llama-3-70B shape in FP8 (per-channel, dummy weights) served collocated on one GPU, 4 streams
      [ -d /tmp/l70b-fp8 ] || python3 benchmarks/make_random_checkpoint.py llama-3-70b /tmp/l70b-fp8 --no-weights \
        --fp8 channel
      timeout ${FP8_70B_TIMEOUT:-400} python3 benchmarks/serve_load.py smoke configs/gpu-1p1d-llama3-8b.yaml \
        --model /tmp/l70b-fp8 --mode collocated --set load_format=dummy --set decode.max_num_seqs=16 --requests 4 \
        --prompt-len 1024 --max-tokens 128 --graphs-timeout-s 180 --rounds 2 --floor ${FP8_70B_ARGS:-} 2>&1 \
        | tee "$OUT/fp8_70b.log" \
        | grep "^{" ;;
    fp8_70b_layers)  # issue 42: the 70B shape's layers, fewer of them, in FP8: decode steps traced by kernel
      layers=${FP8_70B_LAYERS:-20}
      for kind in bf16 fp8; do
        [ -d /tmp/l70b-$layers-$kind ] || python3 benchmarks/make_random_checkpoint.py llama-3-70b \
          /tmp/l70b-$layers-$kind --no-weights --layers "$layers" $([ $kind = fp8 ] && echo --fp8 channel)
      done
      timeout ${FP8_70B_LAYERS_TIMEOUT:-300} python3 benchmarks/fp8_gpu.py decode --bf16 /tmp/l70b-$layers-bf16 \
        --fp8 /tmp/l70b-$layers-fp8 --load-format dummy --kv-gib 8 --skip-attention --only fp8 \
        --cases ${FP8_70B_CASES:-1x1024,4x1024} --trace-dir "$OUT/traces70b" 2>&1 | tee "$OUT/fp8_70b_layers.log" \
        | grep "^{" | grep -v static_context | cut -c1-400 ;;
    peer)
      timeout 90 python3 benchmarks/design_choices.py peer-copy 2>&1 | tee "$OUT/peer.log"
      timeout 120 python3 benchmarks/design_choices.py peer-copy --ipc 2>&1 | tee -a "$OUT/peer.log" ;;
    transfer)
      timeout 200 python3 benchmarks/kvtransfer_bench.py --mode ray --device cuda --configs ${KV_CONFIGS:-ipc-all,ipc-all} --repeat 10 2>&1 \
        | tee "$OUT/kvtransfer.log" | grep -v "^(" | tail -20 ;;
    pullpath)
      timeout 240 python3 benchmarks/kvtransfer_bench.py --pull-path ${PULL_ARGS:-} 2>&1 | tee "$OUT/pull_path.log" | grep "^{" ;;
    kernels)
      timeout 300 python3 benchmarks/design_choices.py decode-kernels ${KERNEL_ARGS:-} 2>&1 | tee "$OUT/kernels.log" ;;
    recovery)
      [ -d /tmp/l1b ] || python3 benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --device cuda
      timeout 420 python3 benchmarks/recovery.py kill configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b \
        --workdir "$OUT/recovery" --recovery-timeout-s 150 --kill ${KILL:-decode-0 prefill-0} 2>&1 | tee "$OUT/recovery.log" \
        | grep -v "^(" | tail -30 ;;
    recovery1)
      [ -d /tmp/l1b ] || python3 benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --device cuda
      timeout 420 python3 benchmarks/recovery.py kill configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b \
        --set prefill.num_gpus=0.5 --set decode.num_gpus=0.5 --set prefill.kv_cache_memory_bytes=8589934592 \
        --set decode.kv_cache_memory_bytes=8589934592 --workdir "$OUT/recovery1" --recovery-timeout-s 150 \
        --settle-s ${SETTLE_S:-10} --kill ${KILL:-decode-0 prefill-0} ${RECOVERY_ARGS:-} 2>&1 | tee "$OUT/recovery1.log" | grep -v "^(" | tail -30 ;;
    tenants)
      [ -d /tmp/l1b ] || python3 benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --device cuda
      timeout 400 python3 benchmarks/tenant_priority.py --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b \
        --prompt-format ids --decode-blocks 0 ${TENANT_ARGS:-} 2>&1 | tee "$OUT/${TENANT_LOG:-tenants}.log" | grep "^{" ;;
    tp) bash "$0" tpcuda tptransfer allreduce tpscale ;;
    tpcuda)  # on a hang pytest-timeout (thread method: even inside C calls) dumps every thread's stack
      # the log goes straight to $OUT (no pipe), so a run cut short still brings back what it printed
      timeout ${TPCUDA_TIMEOUT:-480} python3 -m pytest -v -s -x --timeout $(( ${TPCUDA_TIMEOUT:-480} - 30 )) \
        --timeout-method=thread tests/test_tp_cuda.py -rs > "$OUT/tp_tests.log" 2>&1; tail -40 "$OUT/tp_tests.log" ;;
    tptransfer)
      # exactness needs float32 (bf16 sums in another order under TP flip near-tied greedy choices): tests' tiny Llama
      [ -d /tmp/tinyl ] || python3 -c "from pathlib import Path; from tests.hf_checkpoints import make_hf_checkpoint; \
        make_hf_checkpoint('LlamaForCausalLM', Path('/tmp/tinyl'))" >/dev/null 2>&1
      timeout 200 python3 benchmarks/tp_gpu.py transfer --model /tmp/tinyl --kv-gib 0.25 --prompt-len 200 2>&1 \
        | tee "$OUT/tp_transfer.log" | grep "^{" ;;
    allreduce)
      timeout 120 python3 benchmarks/tp_gpu.py scaling --all-reduce-only --hidden ${HIDDEN:-4096} --layers ${LAYERS:-32} \
        2>&1 | tee "$OUT/all_reduce.log" | grep "^{" ;;
    oneshot)  # the one-shot all-reduce against NCCL: alone, then in the 8B shape's TP=2 decode step (dummy weights)
      bash "$0" allreduce
      [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
      timeout 300 python3 benchmarks/tp_gpu.py scaling --model /tmp/l8bd --load-format dummy --only-tp 2 \
        --compare-one-shot 2>&1 | tee "$OUT/oneshot.log" | grep "^{" ;;
    sampling)  # issue 14: penalties, logit bias and a JSON-schema mask at batch 64 on the 8B shape (128k vocabulary)
      [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
      CUDA_VISIBLE_DEVICES=${SAMPLING_GPU:-0} timeout 300 python3 benchmarks/sampling_costs.py overhead --model /tmp/l8bd \
        --load-format dummy --device cuda 2>&1 | tee "$OUT/sampling.log" | grep "^{" ;;
    tpscale)  # random weights made on the GPUs (no 16 GB checkpoint to write)
      [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
      timeout 360 python3 benchmarks/tp_gpu.py scaling --model /tmp/l8bd --load-format dummy 2>&1 \
        | tee "$OUT/tp_scaling.log" | grep "^{" ;;
    tp70b)
      [ -d /tmp/l70b ] || python3 benchmarks/make_random_checkpoint.py llama-3-70b /tmp/l70b --no-weights
      timeout 300 python3 benchmarks/tp_gpu.py scaling --model /tmp/l70b --only-tp 2 --load-format dummy \
        --kv-gib 4 --cases 1:1024,8:2048 2>&1 | tee "$OUT/tp70b.log" | grep "^{"
      timeout 300 python3 benchmarks/serve_load.py smoke configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l70b --mode collocated \
        --set decode.tensor_parallel_size=2 --set load_format=dummy --set decode.max_num_seqs=16 --requests 1 \
        --prompt-len 1024 --max-tokens 128 2>&1 | tee "$OUT/tp70b_serve.log" | grep "^{" ;;
    handoff)  # random weights made on the GPUs: the handoff moves KV, whatever the weights
      [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
      timeout ${HANDOFF_TIMEOUT:-400} python3 benchmarks/handoff_serving.py --config configs/gpu-1p1d-llama3-8b.yaml \
        --model /tmp/l8bd --set load_format=dummy ${HANDOFF_ARGS:-} 2>&1 | tee "$OUT/handoff.log" | grep "^{" ;;
    handoff1)  # both workers on GPU 0, one server per KV dtype; HANDOFF1_ARGS="--set transfer.push=false": the pull
      checkpoint8b
      timeout ${HANDOFF1_TIMEOUT:-230} python3 benchmarks/handoff_serving.py --config configs/gpu-1p1d-llama3-8b.yaml \
        --model /tmp/l8bd --set load_format=dummy --one-gpu --kv-dtypes auto,fp8 --no-streams ${HANDOFF1_ARGS:-} 2>&1 \
        | tee "$OUT/handoff1.log" | grep "^{" ;;
    coldstart)
      [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
      timeout ${COLD_TIMEOUT:-400} python3 benchmarks/start.py serving configs/gpu-1p1d-llama3-8b.yaml \
        --model /tmp/l8bd --rate 4 --layout "1P+1D:load_format=dummy" \
        --layout "collocated x2:mode=collocated,decode.workers=2,load_format=dummy" 2>&1 \
        | tee "$OUT/coldstart.log" | grep -v "^(" | tail -20 ;;
    structured1)  # issue 45: the 8B shape collocated on GPU 0, this checkout alone (benchmarks/start.py server):
      # /health 200 on a first and a second start, then the first json_schema request with 8 streams running
      checkpoint8b
      timeout ${STRUCT_TIMEOUT:-300} python3 benchmarks/start.py server --config configs/gpu-1p1d-llama3-8b.yaml \
        --as-is --rounds 1 --streams 8 --kill none --set model=/tmp/l8bd --set mode=collocated \
        --set decode.workers=1 --set load_format=dummy 2>&1 | tee "$OUT/structured1.log" | grep "^{" ;;
    coldstart1)  # a new machine's first start, then the second (graphs deferred: the default), then the second
      # with every graph captured at start (graph_capture start: the reference); their server logs into $OUT
      [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
      one="mode=collocated,decode.workers=1,load_format=dummy"
      rm -rf /tmp/cs1; timeout ${COLD_TIMEOUT:-400} python3 benchmarks/start.py serving configs/gpu-1p1d-llama3-8b.yaml \
        --model /tmp/l8bd --rate 4 --window ${COLD_WINDOW:-12} --shared-triton-cache --workdir /tmp/cs1 \
        --layout "first:$one" --layout "second:$one" --layout "second-start:$one,decode.graph_capture=start" 2>&1 \
        | tee "$OUT/coldstart1.log" | grep -v "^(" | tail -20
      for d in /tmp/cs1/*/; do cp "$d/server.log" "$OUT/coldstart1-$(basename "$d").server.log" 2>/dev/null; done ;;
    overhead)
      [ -d /tmp/l1b ] || python3 benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --device cuda
      [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
      models=(/tmp/l1b "/tmp/l8bd --set load_format=dummy"); [ -z "${OVERHEAD_1B_ONLY:-}" ] || models=(/tmp/l1b)
      for model in "${models[@]}"; do
        timeout ${OVERHEAD_TIMEOUT:-280} python3 benchmarks/serving_overhead.py --config configs/gpu-1p1d-llama3-8b.yaml \
          --model $model --device cuda --num-prompts 256 --input-len 1024 --output-len 256 --concurrency 64 \
          ${OVERHEAD_ARGS:-} 2>&1 | tee -a "$OUT/overhead.log" | grep -v "^(" | tail -8
      done ;;
    drift)  # (1 GPU) the offline engine run after run in one process (issue 13's 1B load): default, no prefix cache, frozen heap
      [ -d /tmp/l1b ] || python3 benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --device cuda
      nvidia-smi dmon -i 0 -s pc -d 2 > "$OUT/dmon.log" 2>&1 & dmon=$!
      # DRIFT_VARIANTS: one word per run of the program (an explicit default, e.g. --max-num-seqs=64, for none)
      for variant in ${DRIFT_VARIANTS:-"" --no-prefix-cache --freeze}; do
        timeout ${DRIFT_TIMEOUT:-200} python3 benchmarks/engine_host.py drift --model /tmp/l1b --device cuda \
          --repeats ${DRIFT_REPEATS:-4} $variant 2>&1 | tee -a "$OUT/drift.log" | grep "^{"
      done
      kill $dmon ;;
    prefill)  # (1 GPU) a short prompt's prefill on the engine alone, 1B shape, against its decode step
      [ -d /tmp/l1b ] || python3 benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --device cuda
      timeout 200 python3 benchmarks/engine_host.py prefill --config configs/gpu-1p1d-llama3-8b.yaml --model /tmp/l1b \
        --device cuda 2>&1 | tee "$OUT/prefill.log" | grep "^{" ;;
    multiturn1)
      sweep multiturn1 gpu-1x-llama3-8b-multiturn-collocated "${SWEEP_TIMEOUT:-590}" ;;
    multiturn1p1d)
      sweep multiturn1p1d gpu-1x-llama3-8b-multiturn-1p1d "${SWEEP_TIMEOUT:-590}" ;;
    multiturnquick)
      sweep multiturnquick gpu-1x-llama3-8b-multiturn-quick "${SWEEP_TIMEOUT:-300}" ;;
    multiturnbusy)
      sweep multiturnbusy gpu-1x-llama3-8b-multiturn-busy "${SWEEP_TIMEOUT:-360}" ;;
    multiturnagents)  # AGENT_RATES=5: other arrival rates (new conversations/s) than the YAML's 3
      agents=gpu-1x-llama3-8b-multiturn-agents
      if [ -n "${AGENT_RATES:-}" ]; then
        sed "s/^  rates: \[3\]/  rates: [$AGENT_RATES]/" "configs/sweeps/$agents.yaml" > configs/sweeps/agents-rates.yaml
        agents=agents-rates
      fi
      sweep multiturnagents "$agents" "${SWEEP_TIMEOUT:-450}" ;;
    multiturnagents1p1d)  # the agents load on 1P+1D sharing the GPU, 5 new conversations/s
      sweep multiturnagents1p1d gpu-1x-llama3-8b-multiturn-agents-1p1d "${SWEEP_TIMEOUT:-480}" ;;
    adaptive2)
      sweep sweep gpu-2x-llama3-8b-adaptive "${SWEEP_TIMEOUT:-575}" ;;
    adaptive2x2)  # two sweeps side by side, one pair of GPUs each
      checkpoint8b
      CUDA_VISIBLE_DEVICES=0,1 sweep sweep gpu-2x-llama3-8b-adaptive "${SWEEP_TIMEOUT:-575}" &
      CUDA_VISIBLE_DEVICES=2,3 sweep sweepmix gpu-2x-llama3-8b-adaptive-mix "${SWEEP_TIMEOUT:-575}" &
      wait ;;
    adaptive2mix)
      sweep sweepmix gpu-2x-llama3-8b-adaptive-mix "${SWEEP_TIMEOUT:-500}" ;;
    adaptive4)
      sweep sweep4 gpu-4x-llama3-8b-adaptive "${SWEEP_TIMEOUT:-420}" ;;
    shift4)
      checkpoint8b
      timeout ${SHIFT_TIMEOUT:-200} python3 benchmarks/serve_load.py shift configs/gpu-1p1d-llama3-8b.yaml \
        --set model=/tmp/l8bd --set load_format=dummy --set mode=adaptive --set slo.ttft_ms=500 \
        --set slo.tpot_ms=40 --set prefill.workers=1 --set decode.workers=3 --set prefill.max_num_seqs=256 \
        --set decode.chunk_size=2048 --set decode.max_num_batched_tokens=8192 \
        ${SHIFT_ARGS:---phase short:8:256:128:30 --phase long:24:2048:256:45} \
        --out "$OUT/shift4" 2>&1 | tee "$OUT/shift4.log" | grep -v "^(" | grep "^{" ;;
    shift)
      [ -d /tmp/l8bd ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd --no-weights
      timeout ${SHIFT_TIMEOUT:-300} python3 benchmarks/serve_load.py shift configs/gpu-1p1d-llama3-8b.yaml \
        --set model=/tmp/l8bd --set load_format=dummy --set mode=adaptive --set slo.ttft_ms=500 \
        --set slo.tpot_ms=40 --set prefill.max_num_seqs=256 --set decode.chunk_size=2048 \
        --set decode.max_num_batched_tokens=8192 ${SHIFT_ARGS:---phase short:8:256:128:30 --phase long:16:2048:256:45} \
        --out "$OUT/shift" 2>&1 | tee "$OUT/shift.log" | grep -v "^(" | grep "^{" ;;
    sweep1b)
      [ -d /tmp/l1b ] || python3 benchmarks/make_random_checkpoint.py llama-3.2-1b /tmp/l1b --device cuda
      timeout 450 python3 -m coordinator.cli sweep configs/sweeps/gpu-2x-llama1b.yaml --out "$OUT/sweep" 2>&1 \
        | tee "$OUT/sweep.log" | grep -v "^(" | tail -15 ;;
    x4)
      [ -d /tmp/l70b ] || python3 benchmarks/make_random_checkpoint.py llama-3-70b /tmp/l70b --no-weights
      timeout 590 python3 -m coordinator.cli sweep configs/sweeps/gpu-4x-llama3-70b-tp2.yaml 2>&1 \
        | tee "$OUT/sweep70b.log" | tail -20 ;;
    x4kill)
      [ -d /tmp/l70b ] || python3 benchmarks/make_random_checkpoint.py llama-3-70b /tmp/l70b --no-weights
      timeout 590 python3 benchmarks/recovery.py kill configs/gpu-1p1d-llama3-70b-tp2.yaml --model /tmp/l70b \
        --set load_format=dummy --kill decode-0:1 --recovery-timeout-s 400 2>&1 | tee "$OUT/recovery70b.log" \
        | grep -v "^(" | tail -10 ;;
    treeab)  # this tree against .base (base-tree REF), each engine's decode steps in turns: base, new, new, base
      checkpoint8b
      [ -d /tmp/l8bd-fp8 ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd-fp8 --no-weights --fp8 channel
      [ -f .base/COMMIT ] || { echo "treeab: no .base (bash benchmarks/gpu_run.sh base-tree REF, then carry .base)"; continue; }
      echo "treeab: this tree against $(cat .base/COMMIT)"
      for only in ${TREEAB_ONLY:-fp8 bf16}; do
        for tree in base new new base; do
          dir=$PWD; [ $tree = base ] && dir=$PWD/.base
          (cd "$dir" && PYTHONPATH=$dir:${PYTHONPATH#*:} timeout ${TREEAB_TIMEOUT:-150} python3 benchmarks/fp8_gpu.py \
            decode --bf16 /tmp/l8bd --fp8 /tmp/l8bd-fp8 --load-format dummy --skip-attention --only "$only" \
            --cases "${TREEAB_CASES:-decode1,decode64}" $([ "$only" = fp8 ] && echo --only-kv fp8)) 2>&1 \
            | tee -a "$OUT/treeab-$tree-$only.log" | python3 benchmarks/tree_ab.py row "$tree $only"
        done
      done
      python3 benchmarks/tree_ab.py summary "$OUT" ;;
    fp8)
      checkpoint8b
      [ -d /tmp/l8bd-fp8 ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd-fp8 --no-weights --fp8 channel
      timeout ${FP8_TIMEOUT:-420} python3 benchmarks/fp8_gpu.py decode --bf16 /tmp/l8bd --fp8 /tmp/l8bd-fp8 \
        --load-format dummy ${FP8_ARGS:-} 2>&1 | tee "$OUT/fp8.log" | grep "^{" | grep -v static_context ;;
    fp8serve)  # issue 42: the 8B shape served collocated as users run it, bf16 then FP8 weights + fp8 KV, one server
      # each: FP8SERVE_REQUESTS (64) streams of 1k prompts and 256 tokens at once, a cold round then a warm one,
      # TPOT over each model's own floor, and the FP8 server's figures over bf16's (benchmarks/serve_load.py smoke);
      # the streams from FP8SERVE_CLIENTS (2) client processes: one parses ~10,000 chunks/s (benchmarks/client_ceiling.py)
      checkpoint8b
      [ -d /tmp/l8bd-fp8 ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd-fp8 --no-weights --fp8 channel
      for kind in bf16 fp8; do
        model=/tmp/l8bd; kv=auto; [ $kind = fp8 ] && { model=/tmp/l8bd-fp8; kv=fp8; }
        timeout ${FP8SERVE_TIMEOUT:-240} python3 benchmarks/serve_load.py smoke configs/gpu-1p1d-llama3-8b.yaml \
          --model $model --mode collocated --set load_format=dummy --set kv_cache_dtype=$kv \
          --requests ${FP8SERVE_REQUESTS:-64} --prompt-len 1024 --max-tokens 256 --graphs-timeout-s 180 --rounds 2 \
          --client-processes ${FP8SERVE_CLIENTS:-2} --floor 2>&1 | tee "$OUT/fp8serve_$kind.log" | grep "^{" | cut -c1-900
      done
      python3 - "$OUT" <<'PY'
import json, sys
rows = {k: [json.loads(l) for l in open(f"{sys.argv[1]}/fp8serve_{k}.log") if l.startswith("{")] for k in ("bf16", "fp8")}
for b, f in zip(rows["bf16"], rows["fp8"]):
    print(json.dumps({"round": b["round"], "tpot_ms_p50": [b["tpot_ms_p50"], f["tpot_ms_p50"]],
                      "fp8_tpot_speedup": round(b["tpot_ms_p50"] / f["tpot_ms_p50"], 3),
                      "output_tokens_per_s": [b["output_tokens_per_s"], f["output_tokens_per_s"]],
                      "fp8_throughput_ratio": round(f["output_tokens_per_s"] / b["output_tokens_per_s"], 3),
                      "ttft_ms_p50": [b["ttft_ms_p50"], f["ttft_ms_p50"]],
                      "tpot_x_floor": [b.get("tpot_x_floor"), f.get("tpot_x_floor")]}))
PY
      ;;
    pdl)  # decode steps with programmatic dependent launch against ordinary launches (fp8_gpu.py pdl)
      checkpoint8b
      [ -d /tmp/l8bd-fp8 ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd-fp8 --no-weights --fp8 channel
      timeout ${PDL_TIMEOUT:-400} python3 benchmarks/fp8_gpu.py pdl --bf16 /tmp/l8bd --fp8 /tmp/l8bd-fp8 \
        --load-format dummy ${PDL_ARGS:-} 2>&1 | tee "$OUT/pdl.log" | grep "^{" | grep -v static_context ;;
    attnstages)  # issue 42: decode steps with the attention on more pipeline stages vs the engine's (attention_stages.py)
      checkpoint8b
      [ -d /tmp/l8bd-fp8 ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd-fp8 --no-weights --fp8 channel
      timeout ${STAGES_TIMEOUT:-400} python3 benchmarks/attention_stages.py --bf16 /tmp/l8bd --fp8 /tmp/l8bd-fp8 \
        --load-format dummy ${STAGES_ARGS:-} 2>&1 | tee "$OUT/attention_stages.log" | grep "^{" | grep -v static_context ;;
    stepab)  # issue 42: the decode steps with engine constants changed vs as they are (step_ab.py, STEPAB_ARGS)
      if [ -n "${STEPAB_70B_LAYERS:-}" ]; then  # that many of the 70B shape's layers instead of the 8B shape
        dirs=(/tmp/l70b-$STEPAB_70B_LAYERS-bf16 /tmp/l70b-$STEPAB_70B_LAYERS-fp8) kv=(--kv-gib 8)
        for dir in "${dirs[@]}"; do
          [ -d "$dir" ] || python3 benchmarks/make_random_checkpoint.py llama-3-70b "$dir" --no-weights \
            --layers "$STEPAB_70B_LAYERS" $([ "${dir##*-}" = fp8 ] && echo --fp8 channel)
        done
      else
        checkpoint8b
        [ -d /tmp/l8bd-fp8 ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8bd-fp8 --no-weights --fp8 channel
        dirs=(/tmp/l8bd /tmp/l8bd-fp8) kv=()
      fi
      timeout ${STEPAB_TIMEOUT:-400} python3 benchmarks/step_ab.py --bf16 "${dirs[0]}" --fp8 "${dirs[1]}" \
        --load-format dummy "${kv[@]}" ${STEPAB_ARGS:-} 2>&1 | tee "$OUT/step_ab.log" | grep "^{" | grep -v static_context ;;
    attnncu)  # issue 42: Nsight Compute's counters of the decode attention's launches (attention_counters.py)
      ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
      [ -n "$ncu" ] || { echo "attnncu: no ncu on this machine"; continue; }
      timeout ${ATTNNCU_TIMEOUT:-240} "$ncu" --clock-control none -k regex:_decode_split_kernel --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats --section Occupancy \
        --section LaunchStats -o "$OUT/attn" --force-overwrite python3 benchmarks/attention_counters.py \
        ${ATTNNCU_ARGS:-} > "$OUT/attn_ncu.log" 2>&1
      grep "^variant" "$OUT/attn_ncu.log"
      "$ncu" --import "$OUT/attn.ncu-rep" --page raw --csv > "$OUT/attn_ncu_raw.csv" 2>&1
      "$ncu" --import "$OUT/attn.ncu-rep" --page details 2>&1 | grep -E "_decode_split_kernel|Duration|DRAM Through|\
Registers Per|Achieved Occupancy|Warp Cycles Per Issued|No Eligible" ;;
    fp8sweep)
      timeout ${SWEEP_TIMEOUT:-300} python3 benchmarks/fp8_gpu.py gemm-sweep --out "$OUT/fp8_sweep.json" ${SWEEP_ARGS:-} 2>&1 \
        | tee "$OUT/fp8_sweep.log" | grep -E '"layer_m"|"gemm"|"qkv_rope"|"gate_up_activation"' | cut -c1-400 ;;
    attnlayout)  # issue 42: the decode attention alone, token- vs head-major cache blocks, exact vs lazy softmax
      timeout ${LAYOUT_TIMEOUT:-180} python3 benchmarks/attention_layout.py ${LAYOUT_ARGS:-} 2>&1 \
        | tee "$OUT/attention_layout.log" | grep -E '^\{|Error|error' | cut -c1-300 ;;
    fp8attn)  # the decode attention kernel alone, bf16 and fp8 caches: launches and split counts per case
      timeout ${ATTN_TIMEOUT:-240} python3 benchmarks/fp8_gpu.py attention ${ATTN_ARGS:-} 2>&1 \
        | tee "$OUT/fp8_attention.log" | grep -E '"attention_best"|"attention_vs_before"|error' | cut -c1-300 ;;
    smsplit)  # issue 43: decode beside prefill with the SMs split (green contexts) or not, GEMMs then the engine
      checkpoint8b
      timeout ${SMSPLIT_TIMEOUT:-300} python3 benchmarks/sm_split.py micro --model /tmp/l8bd ${SMSPLIT_ARGS:-} 2>&1 \
        | tee "$OUT/sm_split.log" | grep "^{" | cut -c1-400 ;;
    smsplitserve)  # issue 43: pdserve serve, one collocated worker: chunked prefill vs the prefill lane, 3 rates
      sweep smsplitserve gpu-1x-llama3-8b-sm-split "${SWEEP_TIMEOUT:-580}" ;;
    smsplittable)  # issue 43: the same, chunked prefill vs the lane's split chosen by the decode batch
      sweep smsplittable gpu-1x-llama3-8b-sm-split-table "${SWEEP_TIMEOUT:-580}" ;;
    smsplitlong)  # issue 43: 32 streams, then a 7,000-token prompt: chunked prefill vs the prefill lane (engine)
      checkpoint8b
      timeout ${SMSPLIT_TIMEOUT:-400} python3 benchmarks/sm_split.py long-prompt --model /tmp/l8bd ${SMSPLIT_ARGS:-} \
        2>&1 | tee "$OUT/sm_split_long.log" | grep "^{" | cut -c1-500 ;;
    engine)
      [ -d /tmp/l8b ] || python3 benchmarks/make_random_checkpoint.py llama-3-8b /tmp/l8b --device cuda
      python3 benchmarks/engine_bench.py --gpu --model /tmp/l8b ${BENCH_ARGS:-} 2>&1 | tee "$OUT/engine.log" | tail -20 ;;
  esac
done
