"""One GPU, both phases (issue 43): does splitting the SMs between decode and prefill keep decode steps fast while a
prompt prefills beside them? Produces docs/benchmarks.md's "One GPU, both phases" rows M and L (row S is the sweep
configs/sweeps/gpu-1x-llama3-8b-sm-split.yaml).

`python benchmarks/sm_split.py COMMAND --model /tmp/l8bd [options]` (`bash benchmarks/gpu_run.sh smsplit` /
`smsplitlong` write the 8B-shaped folder and run these):

- `micro [--levels engine,gemm] [--decode-sms 64,80,96] [--batches 32,64]`: a decode step timed from launch to
  completion (as a stream sees it) while a 2,048-token prompt's forward runs beside it, against the same decode
  alone on the whole GPU measured in the same run, and the prefill's layers/s against the prefill alone on the whole
  GPU. `engine` level: the engine's own decode graph (512-token contexts) and its prefill layers; `gemm`: cuBLAS
  GEMMs of one 8B layer. Variants: chunked prefill (the decode rows and the chunk in one forward); no split, prefill
  issued in 1- or 4-layer blocks 1, 2 or all deep, decode at normal or high stream priority; split (SmLanes: decode
  lane of N SMs, prefill lane the rest) with the prefill issued one block at a time or all queued. A split the
  driver refuses prints its error and the rest go on.
- `long-prompt [--variants 0:2048,64:8192,96:8192]`: the issue's experiment on the engine: 32 greedy streams
  decoding (64-token prompts), then one 7,000-token prompt; the streams' gaps between tokens before it and while it
  prefills, its TTFT, and the longest steps meanwhile (with what the lane did in them), per DECODE_SMS:CHUNK variant
  (0: chunked prefill in CHUNK-token chunks; else EngineConfig.sm_split_decode_sms), then each lane variant against
  chunked prefill.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from engine.runner.sm_lanes import SmLanes, split_sms  # noqa: E402

HIDDEN, FFN, QKV = 4096, 14336, 6144  # Llama-3-8B: q 4096 + k 1024 + v 1024
LAYERS = 32
PREFILL_TOKENS = 2048


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def capture(fn: Callable[[], object], stream: torch.cuda.Stream, pool) -> torch.cuda.CUDAGraph:
    """fn() once on `stream` (compiles, settles the allocator), then captured there."""
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream):
        fn()
    stream.synchronize()
    return graph


class PrefillLane:
    """Keeps up to `depth` prefill layer blocks queued on `stream`; counts the layers finished."""

    def __init__(self, blocks: Callable[[], Iterator[int]], stream: torch.cuda.Stream, depth: int) -> None:
        self.make, self.stream, self.depth = blocks, stream, depth
        self.blocks = blocks()
        self.pending: list[tuple[torch.cuda.Event, int]] = []
        self.layers_done = 0

    def poll(self) -> None:
        while self.pending and self.pending[0][0].query():
            self.layers_done += self.pending.pop(0)[1]

    def feed(self) -> None:
        self.poll()
        while len(self.pending) < self.depth:
            with torch.cuda.stream(self.stream):
                try:
                    layers = next(self.blocks)
                except StopIteration:
                    self.blocks = self.make()
                    layers = next(self.blocks)
                done = torch.cuda.Event()
                done.record(self.stream)
            self.pending.append((done, layers))

    def drain(self) -> None:
        self.stream.synchronize()
        self.pending.clear()


def time_decode(graph: torch.cuda.CUDAGraph, stream: torch.cuda.Stream, steps: int,
                lane: PrefillLane | None) -> dict:
    """Replays `graph` on `stream` `steps` times (the prefill lane fed before each); per step, host launch to
    completion; with a lane, the prefill layers it finished a second meanwhile."""
    times = []
    for i in range(steps + 5):
        if i == 5:
            if lane is not None:
                lane.poll()
                lane.layers_done = 0
            began = time.perf_counter()
        if lane is not None:
            lane.feed()
        t0 = time.perf_counter()
        with torch.cuda.stream(stream):
            graph.replay()
            done = torch.cuda.Event()
            done.record(stream)
        done.synchronize()
        if i >= 5:
            times.append((time.perf_counter() - t0) * 1e3)
    row = {"p50_ms": round(pct(times, 0.5), 4), "p99_ms": round(pct(times, 0.99), 4),
           "mean_ms": round(sum(times) / len(times), 4)}
    if lane is not None:
        lane.poll()
        row["prefill_layers_s"] = round(lane.layers_done / (time.perf_counter() - began), 1)
        lane.drain()
    return row


def prefill_rate(lane_stream: torch.cuda.Stream, blocks: Callable[[], Iterator[int]], seconds: float = 1.0) -> float:
    """Prefill layers a second on `lane_stream` alone."""
    lane = PrefillLane(blocks, lane_stream, depth=4)
    lane.feed()
    lane.stream.synchronize()
    lane.poll()
    lane.layers_done = 0
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        lane.feed()
        lane.pending[0][0].synchronize()
    lane.poll()
    return lane.layers_done / (time.perf_counter() - t0)


def gemm_work(batch: int, device: torch.device):
    """(decode step fn, prefill blocks factory): cuBLAS only."""
    w = [torch.randn(n, k, device=device, dtype=torch.bfloat16) * 0.02
         for n, k in ((QKV, HIDDEN), (HIDDEN, HIDDEN), (2 * FFN, HIDDEN), (HIDDEN, FFN))]
    # separate weights per layer so L2 (60 MB) never holds them: 32 layers x 0.44 GB
    layers = [[t.clone() for t in w] for _ in range(LAYERS)]
    xd = torch.randn(batch, HIDDEN, device=device, dtype=torch.bfloat16)
    xp = torch.randn(PREFILL_TOKENS, HIDDEN, device=device, dtype=torch.bfloat16)
    hp = torch.randn(PREFILL_TOKENS, FFN, device=device, dtype=torch.bfloat16)
    hd = torch.randn(batch, FFN, device=device, dtype=torch.bfloat16)

    def decode() -> None:
        for qkv, o, gu, down in layers:
            torch.mm(xd, qkv.t())
            torch.mm(xd, o.t())
            torch.mm(xd, gu.t())
            torch.mm(hd, down.t())

    def blocks(per_block: int) -> Callable[[], Iterator[int]]:
        def make() -> Iterator[int]:
            for lo in range(0, LAYERS, per_block):
                for qkv, o, gu, down in layers[lo:lo + per_block]:
                    torch.mm(xp, qkv.t())
                    torch.mm(xp, o.t())
                    torch.mm(xp, gu.t())
                    torch.mm(hp, down.t())
                yield len(layers[lo:lo + per_block])
        return make

    return decode, blocks


def make_engine(model_dir: str):
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine

    return LLMEngine(EngineConfig(model=model_dir, device="cuda", dtype="bfloat16", max_num_seqs=64,
                                  max_num_batched_tokens=8192, enable_prefix_caching=False,
                                  kv_cache_memory_bytes=16 << 30, max_model_len=8192, load_format="dummy",
                                  cuda_graphs=False))


def engine_work(engine, batch: int, device: torch.device):
    """(decode step fn, prefill blocks factories by block size, chunked-prefill step fn): the engine's model over
    its own KV cache."""
    from engine.model.attention_metadata import AttentionMetadata
    from engine.model.decoder_layer import RopeInputs

    model, kv = engine.model, engine.kv_cache
    bs, ctx = engine.kv_spec.block_size, 512
    per_row = ctx // bs
    i32 = dict(dtype=torch.int32, device=device)
    tables = torch.arange(batch * per_row, **i32).view(batch, per_row)
    ids = torch.randint(3, 1000, (batch,), **i32)
    positions = torch.full((batch,), ctx - 1, **i32)
    slots = tables[:, -1] * bs + (ctx - 1) % bs
    empty = torch.zeros(0, **i32)
    dmeta = AttentionMetadata(slots=slots, num_decode=batch, decode_block_tables=tables,
                              decode_context_lens=torch.full((batch,), ctx, **i32),
                              prefill_block_tables=empty.view(0, 0), prefill_query_start=torch.zeros(1, **i32),
                              prefill_context_lens=empty, prefill_lens=(), sliding_window=None,
                              decode_semaphores=torch.zeros(batch, model.config.num_kv_heads, **i32))
    first = batch * per_row
    p_blocks = torch.arange(first, first + PREFILL_TOKENS // bs, **i32)
    p_pos = torch.arange(PREFILL_TOKENS, **i32)
    pmeta = AttentionMetadata(slots=p_blocks.repeat_interleave(bs) * bs + p_pos % bs, num_decode=0,
                              decode_block_tables=empty.view(0, 0), decode_context_lens=empty,
                              prefill_block_tables=p_blocks.view(1, -1),
                              prefill_query_start=torch.tensor([0, PREFILL_TOKENS], **i32),
                              prefill_context_lens=torch.tensor([PREFILL_TOKENS], **i32),
                              prefill_lens=((PREFILL_TOKENS, PREFILL_TOKENS),), sliding_window=None)
    p_ids = torch.randint(3, 1000, (PREFILL_TOKENS,), **i32)

    @torch.inference_mode()
    def decode() -> None:
        model.compute_logits(model(ids, positions, kv, dmeta))

    def blocks(per_block: int) -> Callable[[], Iterator[int]]:
        @torch.inference_mode()
        def make() -> Iterator[int]:
            x, residual = model.model.embed_tokens(p_ids), None
            rope = RopeInputs(p_pos, model.rope.cos, model.rope.sin)
            layers = model.model.layers
            for lo in range(0, len(layers), per_block):
                for i in range(lo, min(lo + per_block, len(layers))):
                    x, residual = layers[i](x, residual, rope, kv[:, i], pmeta)
                yield min(per_block, len(layers) - lo)
        return make

    # chunked prefill: the decode rows first, then the chunk, in one step (as engine.runner.step_inputs orders them)
    m_ids, m_pos = torch.cat([ids, p_ids]), torch.cat([positions, p_pos])
    mmeta = AttentionMetadata(slots=torch.cat([slots, pmeta.slots]), num_decode=batch, decode_block_tables=tables,
                              decode_context_lens=dmeta.decode_context_lens,
                              prefill_block_tables=pmeta.prefill_block_tables,
                              prefill_query_start=pmeta.prefill_query_start,
                              prefill_context_lens=pmeta.prefill_context_lens, prefill_lens=pmeta.prefill_lens,
                              sliding_window=None, decode_semaphores=dmeta.decode_semaphores)

    @torch.inference_mode()
    def mixed() -> None:
        hidden = model(m_ids, m_pos, kv, mmeta)
        model.compute_logits(hidden[:batch])

    return decode, blocks, mixed


def run_cases(level: str, decode: Callable[[], None], blocks: Callable[[int], Callable[[], Iterator[int]]],
              batch: int, decode_sms: list[int], steps: int, device: torch.device,
              mixed: Callable[[], None] | None = None) -> None:
    """Every variant for one decode batch; `blocks(layers_per_block)` makes a prefill blocks factory; `mixed`: the
    chunked-prefill step (the decode rows and one 2,048-token chunk in one forward), timed as the reference."""
    pool = torch.cuda.graph_pool_handle()
    plain = torch.cuda.Stream(device)
    high = torch.cuda.Stream(device, priority=-10)  # mapped to the device's highest priority
    low = torch.cuda.Stream(device, priority=0)
    graph = capture(decode, plain, pool)
    alone = time_decode(graph, plain, steps, None)
    full_rate = prefill_rate(low, blocks(4))

    def emit(case: str, row: dict, **extra) -> None:
        row = {"level": level, "batch": batch, "case": case, **row, **extra,
               "x_alone_p50": round(row["p50_ms"] / alone["p50_ms"], 3),
               "x_alone_p99": round(row["p99_ms"] / alone["p99_ms"], 3)}
        if "prefill_layers_s" in row:
            row["x_prefill_whole"] = round(row["prefill_layers_s"] / full_rate, 3)
        print(json.dumps(row), flush=True)

    emit("alone, whole GPU", alone, prefill_layers_s_alone=round(full_rate, 1))
    if mixed is not None:  # chunked prefill: every decode step carries the chunk
        times = []
        for i in range(12):
            t0 = time.perf_counter()
            mixed()
            torch.cuda.synchronize()
            if i >= 2:
                times.append((time.perf_counter() - t0) * 1e3)
        row = {"p50_ms": round(pct(times, 0.5), 4), "p99_ms": round(pct(times, 0.99), 4),
               "mean_ms": round(sum(times) / len(times), 4)}
        row["prefill_layers_s"] = round(LAYERS / (row["mean_ms"] / 1e3), 1)
        emit("chunked prefill (2,048-token chunk in every step, eager)", row)
    for layers, depth, prio in ((4, 1, False), (1, 1, False), (4, 1, True), (1, 1, True), (1, 2, True),
                                (4, 64, True)):
        decode_stream = high if prio else plain
        g = graph if not prio else capture(decode, high, pool)
        lane = PrefillLane(blocks(layers), low, depth)
        row = time_decode(g, decode_stream, steps, lane)
        emit(f"no split, {'decode high priority, ' if prio else ''}prefill {layers}-layer blocks {depth} deep", row)
    for n in decode_sms:
        lanes: SmLanes | None = None
        try:
            lanes = split_sms(device, n)
            g = capture(decode, lanes.decode, pool)
            tag = f"split {lanes.decode_sms}/{lanes.prefill_sms} SMs"
            lane_rate = prefill_rate(lanes.prefill, blocks(4))
            emit(f"{tag}, alone", time_decode(g, lanes.decode, steps, None),
                 prefill_layers_s_alone=round(lane_rate, 1), x_prefill_whole=round(lane_rate / full_rate, 3))
            for layers, depth in ((4, 1), (1, 2), (4, 64)):
                lane = PrefillLane(blocks(layers), lanes.prefill, depth)
                emit(f"{tag}, prefill {layers}-layer blocks {depth} deep", time_decode(g, lanes.decode, steps, lane))
            del g
        except Exception as exc:  # the driver refuses a split: say so, go on
            print(json.dumps({"level": level, "batch": batch, "case": f"split {n} SMs",
                              "error": f"{type(exc).__name__}: {exc}",
                              "where": traceback.format_exc().strip().splitlines()[-3:]}), flush=True)
        finally:
            torch.cuda.synchronize()
            if lanes is not None:
                lanes.close()


def long_prompt(model_dir: str, decode_sms: int, chunk: int, streams: int = 32, prompt_len: int = 7000,
                steps_before: int = 60, device: str = "cuda") -> dict:
    """The issue's experiment on the engine itself: `streams` greedy streams decoding (64-token prompts), then one
    `prompt_len`-token prompt arrives. The streams' gaps between tokens (one step each) before it and while it
    prefills (until its first token), and its time to first token; `decode_sms` 0: chunked prefill (`chunk`-token
    chunks), else the prefill lane beside decode lanes of that many SMs."""
    from engine.core.sampling_params import SamplingParams
    from engine.engine_config import EngineConfig
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(EngineConfig(model=model_dir, device=device, dtype="bfloat16", max_num_seqs=64,
                                    max_num_batched_tokens=8192, max_prefill_chunk=chunk,
                                    enable_prefix_caching=False, kv_cache_memory_bytes=16 << 30,
                                    max_model_len=8192 if device == "cuda" else 2048, load_format="dummy",
                                    sm_split_decode_sms=decode_sms))
    try:
        gen = torch.Generator().manual_seed(0)
        vocab = engine.model_config.vocab_size
        params = SamplingParams(temperature=0, max_tokens=4000, ignore_eos=True)
        for i in range(streams):
            engine.add_request(f"s{i}", torch.randint(3, vocab, (64,), generator=gen).tolist(), params)
        last: dict[str, float] = {}
        gaps_before: list[float] = []
        gaps_during: list[float] = []
        step = 0
        sent = first = None
        worst: list[tuple[float, int, str]] = []  # the longest steps while it prefills: ms, step, what the lane did
        while first is None:
            jobs, busy = (engine.lane.jobs, engine.lane.busy) if engine.lane else (0, False)
            t0 = time.perf_counter()
            outs = engine.step()
            now = time.perf_counter()
            if sent is not None:
                lane_did = "" if engine.lane is None else (
                    "start" if engine.lane.jobs > jobs else "finish" if busy and not engine.lane.busy else
                    "busy" if busy else "idle")
                worst.append((round((now - t0) * 1e3, 3), step - 2 * steps_before, lane_did))
            for o in outs:
                if o.request_id == "long":
                    first = now
                elif o.request_id in last and o.new_token_ids:
                    (gaps_during if sent is not None else gaps_before).append((now - last[o.request_id]) * 1e3)
                if o.new_token_ids:
                    last[o.request_id] = now
            step += 1
            if step == steps_before:
                gaps_before.clear()  # the prompts' own steps are behind: keep only decode gaps
            if step == 2 * steps_before and sent is None:
                engine.add_request("long", torch.randint(3, vocab, (prompt_len,), generator=gen).tolist(),
                                   SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))
                sent = time.perf_counter()
        lane = engine.lane
        used = [split for split in (lane.splits.values() if lane else ()) if split.jobs and split.lanes]
        return {"case": "long prompt", "decode_sms": ",".join(str(split.lanes.decode_sms) for split in used) or 0,
                "chunk": chunk, "streams": streams, "prompt_len": prompt_len,
                "gap_p50_before_ms": round(pct(gaps_before, 0.5), 3),
                "gap_p99_before_ms": round(pct(gaps_before, 0.99), 3),
                "gap_p50_during_ms": round(pct(gaps_during, 0.5), 3),
                "gap_p99_during_ms": round(pct(gaps_during, 0.99), 3),
                "p99_during_x_before": round(pct(gaps_during, 0.99) / pct(gaps_before, 0.99), 3),
                "ttft_ms": round((first - sent) * 1e3, 1), "lane_jobs": lane.jobs if lane else 0,
                "lane_launch_ms": round(lane.launch_s * 1e3, 2) if lane else None,  # the job's launches (its thread)
                "steps_during": len(worst), "longest_steps": sorted(worst, reverse=True)[:4]}
    finally:
        engine.close()


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("command", choices=["micro", "long-prompt"])
    ap.add_argument("--model", help="an 8B-shaped checkpoint folder (engine level; without it only the GEMM level)")
    ap.add_argument("--decode-sms", default="64,80,96")
    ap.add_argument("--batches", default="32,64")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--levels", default="engine")
    ap.add_argument("--variants", default="0:2048,64:8192,96:8192",
                    help="long-prompt: DECODE_SMS:CHUNK pairs (0: chunked prefill, no lane)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: this benchmark splits a GPU's SMs")
    device = torch.device("cuda", 0)
    sms = [int(s) for s in args.decode_sms.split(",")]
    props = torch.cuda.get_device_properties(device)
    print(json.dumps({"device": props.name, "sms": props.multi_processor_count, "torch": torch.__version__}),
          flush=True)
    if args.command == "long-prompt":
        rows = []
        for variant in args.variants.split(","):
            n, chunk = (int(x) for x in variant.split(":"))
            rows.append(long_prompt(args.model, n, chunk))
            print(json.dumps(rows[-1]), flush=True)
            torch.cuda.empty_cache()
        base = next((r for r in rows if r["decode_sms"] == 0), None)
        for r in rows:
            if base is not None and r is not base:
                print(json.dumps({"case": "lane against chunked prefill", "decode_sms": r["decode_sms"],
                                  "ttft_x_chunked": round(r["ttft_ms"] / base["ttft_ms"], 3),
                                  "p99_during_x_before": r["p99_during_x_before"],
                                  "chunked_p99_during_x_before": base["p99_during_x_before"]}), flush=True)
        return
    levels = args.levels.split(",")
    for batch in (int(b) for b in args.batches.split(",")):
        if "gemm" in levels:
            decode, blocks = gemm_work(batch, device)
            run_cases("gemm", decode, blocks, batch, sms, args.steps, device)
            del decode, blocks
            torch.cuda.empty_cache()
    if "engine" in levels and args.model:
        engine = make_engine(args.model)
        try:
            for batch in (int(b) for b in args.batches.split(",")):
                decode, blocks, mixed = engine_work(engine, batch, device)
                run_cases("engine", decode, blocks, batch, sms, args.steps, device, mixed)
        finally:
            engine.close()


if __name__ == "__main__":
    main()
