"""GPU benchmark of one engine: `python benchmarks/engine_bench.py --gpu --model /dev/shm/llama-3-8b`. Produces
docs/benchmarks.md's "Engine, one GPU" table (`bash benchmarks/gpu_run.sh engine`); its `Bench` and `ceilings`
are what fp8_gpu.py and tp_gpu.py time their engines with.

Prints one JSON line per case, each figure next to the ceiling measured in this run and the ratio:
- ceilings: device copy bandwidth (bytes read + written by a 2 GiB copy) and a bf16 8192^3 matmul's FLOP/s;
- decode steps (batch 1 at 1k context, batch 64 at 2k): median engine.step() wall time against its floor,
  (weights read per step + KV read and written per step) / copy bandwidth; weights exclude the embedding table
  (one row per token is read), include the LM head, and count each parameter's own bytes (FP8 linears: one);
- prefill (one 2k prompt; 8 x 512): FLOP/s against the matmul's, counting 2 x matmul parameters x tokens for
  the layers, 2 x LM-head parameters per sampled row, and 4 x heads x head_dim x (attended keys) per layer;
- the decode attention kernel alone (batch 64, 4k context): KV bytes read / time against copy bandwidth;
- transformers `generate` on the same weights and GPU (batch 1 and 16): wall time against ours, the speedup.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from dataclasses import replace

import torch

from engine.core.sampling_params import SamplingParams
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine


def _events_ms(fn, reps: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of fn() timed with CUDA events."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def ceilings() -> tuple[float, float]:
    """(copy bytes/s counting read + write, bf16 matmul FLOP/s), on random data."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)  # 2 GiB
    dst = torch.empty_like(src)
    copy_s = _events_ms(lambda: dst.copy_(src)) / 1e3
    n = 8192
    a, b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16), torch.randn(n, n, device="cuda",
                                                                               dtype=torch.bfloat16)
    mm_s = _events_ms(lambda: a @ b) / 1e3
    copied = 2 * src.numel() * src.element_size()  # read + written
    return copied / copy_s, 2 * n**3 / mm_s


def copy_bandwidth() -> float:
    """Copy bytes/s counting read + write (2 GiB of bf16), median of triton do_bench: the kernel benchmarks' floor."""
    src = torch.randn(1 << 30, device="cuda", dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    from triton.testing import do_bench
    ms = do_bench(lambda: dst.copy_(src), warmup=5, rep=50, return_mode="median")
    return 2 * src.numel() * 2 / (ms / 1e3)


class Bench:
    def __init__(self, model: str, bandwidth: float, flops: float, kv_bytes: int, profile: bool = False,
                 tensor_parallel_size: int = 1, load_format: str = "auto", tp_all_reduce: str = "nccl",
                 kv_cache_dtype: str = "auto", trace_dir: str | None = None, trace_tag: str = "",
                 events: bool = False, max_num_seqs: int = 64) -> None:
        """With TP, every figure is rank 0's: its shard of the weights and KV heads against one GPU's bandwidth.
        `trace_dir`: also write a chrome trace of live decode steps there, named by batch and `trace_tag`.
        `max_num_seqs`: the largest decode batch the engine takes (and captures graphs for)."""
        self.profile, self.tp = profile, tensor_parallel_size
        self.trace_dir, self.trace_tag, self.events = trace_dir, trace_tag, events
        self.engine = LLMEngine(EngineConfig(model=model, device="cuda", dtype="bfloat16", max_num_seqs=max_num_seqs,
                                             max_num_batched_tokens=8192, enable_prefix_caching=False,
                                             kv_cache_memory_bytes=kv_bytes, max_model_len=8192,
                                             tensor_parallel_size=tensor_parallel_size, load_format=load_format,
                                             tp_all_reduce=tp_all_reduce, kv_cache_dtype=kv_cache_dtype))
        self.bandwidth, self.flops = bandwidth, flops
        e = self.engine
        self.cfg = e.model_config
        self.kv_token_bytes = e.kv_spec.block_bytes // e.kv_spec.block_size  # all layers, K and V
        params = dict(e.model.named_parameters())
        self.embed_params = params["model.embed_tokens.weight"].numel()
        self.head_params = self.cfg.vocab_size * self.cfg.hidden_size // self.tp  # vocab-parallel
        total = sum(p.numel() for p in params.values())  # rank 0's shard
        if self.cfg.tie_word_embeddings:
            self.layer_params = total - self.embed_params
        else:
            self.layer_params = total - self.embed_params - self.head_params
        # bytes a decode step reads, by each parameter's own dtype (FP8 linears: 1 byte a value, plus their float32
        # scales): every parameter but the embedding table, whose rows are gathered; a tied one is the LM head
        nbytes = {n: p.numel() * p.element_size() for n, p in params.items()}
        embed_bytes = nbytes["model.embed_tokens.weight"]
        self.weight_bytes = sum(nbytes.values()) - (0 if self.cfg.tie_word_embeddings else embed_bytes)
        self.gen = torch.Generator().manual_seed(0)

    def _prompts(self, n: int, length: int) -> list[list[int]]:
        return [torch.randint(3, self.cfg.vocab_size, (length,), generator=self.gen).tolist() for _ in range(n)]

    def _add(self, tag: str, prompts: list[list[int]], max_tokens: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
        for i, p in enumerate(prompts):
            self.engine.add_request(f"{tag}{i}", p, params)

    def _drain(self) -> None:
        while self.engine.has_unfinished():
            self.engine.step()

    def decode(self, batch: int, context: int, steps: int = 48, overlap: bool = True) -> dict:
        # the engine's config object stays frozen; the bench swaps in a copy (and the switch it resolved at start)
        # to compare the two schedulings
        self.engine.config = replace(self.engine.config, async_scheduling=overlap)
        self.engine.overlap = overlap
        # + room for --profile, the trace and the event timelines
        self._add(f"d{batch}-{overlap}-", self._prompts(batch, context), steps + 48)
        while any(r.num_pending_tokens > 1 for r in self.engine.scheduler.running) or self.engine.scheduler.waiting:
            self.engine.step()  # prefill
        self.engine.step()
        running = len(self.engine.scheduler.running)
        if running != batch:  # a KV cache too small runs fewer rows and the figure would describe another batch
            raise ValueError(f"decode batch {batch} at {context} context: only {running} requests fit the KV "
                             f"cache ({self.engine.kv_cache.shape[0]} blocks); raise --kv-gib")
        torch.cuda.synchronize()
        times = []
        with HostPhases(self.engine) as phases:
            for _ in range(steps):
                start = time.perf_counter()
                self.engine.step()
                times.append(time.perf_counter() - start)
        graphs = self.engine.runner.graphs
        graph = graphs.graphs[graphs.bucket_for(batch)][0]
        print(json.dumps({"static_context_lens": graphs.context_lens[:4].tolist(),
                          "static_tables": graphs.block_tables[:2, :6].tolist()}), flush=True)
        if self.profile:  # the live steps' GPU time (kernels + copies) next to a bare replay's
            _print_kernel_profile(self.engine.step, f"live step, decode batch {batch}, overlap {overlap}")
        if self.events:  # the device's idle time between live steps, without a profiler attached
            for flush in (False, True):
                print(json.dumps(_event_timeline(self.engine, flush) | {"case": f"events, decode batch {batch}"}),
                      flush=True)
        if self.trace_dir:  # host and device timeline of live steps (chrome trace, summarised by trace_gaps)
            _export_trace(self.engine.step, f"{self.trace_dir}/decode{batch}-{self.trace_tag}.json.gz")
        # the same step on the GPU alone (it rewrites the same K/V); not with TP: a replay on rank 0 alone would
        # wait forever in its all-reduce for followers that replay only what rank 0's engine plans
        replay_ms = _events_ms(graph.replay) if self.tp == 1 else None  # null in the JSON (NaN is not JSON)
        if self.profile:
            _print_kernel_profile(graph.replay, f"bare replay, decode batch {batch}")
        self._drain()
        step_s = statistics.median(times)
        weight_bytes = self.weight_bytes
        mean_ctx = context + 1 + steps / 2
        kv_bytes = batch * (mean_ctx + 1) * self.kv_token_bytes  # read the context, write the new token
        floor_s = (weight_bytes + kv_bytes) / self.bandwidth
        return {"case": f"decode batch {batch}, {context} context", "overlap": overlap,
                "step_ms": round(step_s * 1e3, 3),
                "floor_ms": round(floor_s * 1e3, 3), "x_floor": round(step_s / floor_s, 3),
                "gpu_replay_ms": None if replay_ms is None else round(replay_ms, 3),
                "replay_x_floor": None if replay_ms is None else round(replay_ms / 1e3 / floor_s, 3),
                "tokens_per_s": round(batch / step_s, 1), "bytes_per_step": int(weight_bytes + kv_bytes),
                "copy_gb_per_s": round(self.bandwidth / 1e9, 1), "host_ms_per_step": phases.per_step(steps)}

    def prefill(self, lengths: list[int]) -> dict:
        prompts = [self._prompts(1, n)[0] for n in lengths]
        self._add("warm", prompts, 1)
        self._drain()
        self._add("p", prompts, 1)
        torch.cuda.synchronize()
        start = time.perf_counter()
        self.engine.step()  # every prompt fits one step's budget
        torch.cuda.synchronize()
        secs = time.perf_counter() - start
        self._drain()
        cfg, tokens = self.cfg, sum(lengths)
        attended = sum(n * (n + 1) // 2 for n in lengths)
        flop = 2 * self.layer_params * tokens + 2 * self.head_params * len(lengths) + \
            4 * cfg.num_heads * cfg.head_dim * attended * cfg.num_layers
        return {"case": f"prefill {len(lengths)} x {lengths[0]}", "ms": round(secs * 1e3, 2),
                "tflops": round(flop / secs / 1e12, 1), "matmul_tflops": round(self.flops / 1e12, 1),
                "ratio": round(flop / secs / self.flops, 3)}

    def attention_kernel(self, batch: int = 64, context: int = 4096) -> dict:
        from engine.kernels.decode_attention import decode_attention
        cfg, e = self.cfg, self.engine
        bs = e.kv_spec.block_size
        per_seq = context // bs
        tables = torch.randperm(e.num_kv_blocks)[: batch * per_seq].view(batch, per_seq).to(torch.int32).cuda()
        lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
        q = torch.randn(batch, cfg.num_heads, cfg.head_dim, device="cuda", dtype=torch.bfloat16)
        kv_layer = e.kv_cache[:, 0]
        kv_layer.normal_()  # random K/V, not zeros
        out = torch.empty_like(q)
        ms = _events_ms(lambda: decode_attention(q, kv_layer, tables, lens, cfg.head_dim ** -0.5, out=out))
        nbytes = batch * context * 2 * cfg.num_kv_heads * cfg.head_dim * 2
        return {"case": f"decode attention kernel batch {batch}, {context} context", "ms": round(ms, 4),
                "gb_per_s": round(nbytes / ms / 1e6, 1), "copy_gb_per_s": round(self.bandwidth / 1e9, 1),
                "ratio": round(nbytes / ms / 1e6 / (self.bandwidth / 1e9), 3)}

    def generate_seconds(self, batch: int, prompt_len: int, new_tokens: int) -> float:
        prompts = self._prompts(batch, prompt_len)
        self._add("gw", prompts, new_tokens)
        self._drain()
        self._add("g", prompts, new_tokens)
        torch.cuda.synchronize()
        start = time.perf_counter()
        self._drain()
        return time.perf_counter() - start


class HostPhases:
    """Host milliseconds per step spent in each phase of LLMEngine.step (wrapping the engine's own methods for the
    duration of a `with`): scheduling, building the inputs, launching the graph, sampling's launch, waiting for the
    tokens (the host idle while the GPU runs) and applying them. Where `wait` is near zero the step is host-bound."""

    def __init__(self, engine: LLMEngine) -> None:
        import engine.runner.model_runner as model_runner
        self.totals: dict[str, float] = {}
        self._patches = [(engine.scheduler, "schedule_after", "schedule"), (engine.scheduler, "update", "update"),
                         (model_runner, "build_step_inputs", "build_inputs"), (engine.runner, "launch", "launch"),
                         (engine.runner.sampler, "launch", "sampler_launch")]
        self._engine = engine

    def _wrap(self, owner, name: str, label: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[label] = self.totals.get(label, 0.0) + time.perf_counter() - start
        setattr(owner, name, timed)

    def __enter__(self) -> HostPhases:
        from engine.sampling.sampler import SampledTokens
        self._saved = [(owner, name, owner.__dict__.get(name)) for owner, name, _ in self._patches]
        for owner, name, label in self._patches:
            self._wrap(owner, name, label)
        self._result = SampledTokens.result
        phases = self

        def result(tokens):
            start = time.perf_counter()
            if tokens.copied is not None:
                tokens.copied.synchronize()
            phases.totals["wait"] = phases.totals.get("wait", 0.0) + time.perf_counter() - start
            return phases._result(tokens)
        SampledTokens.result = result
        return self

    def __exit__(self, *exc) -> None:
        from engine.sampling.sampler import SampledTokens
        SampledTokens.result = self._result
        for owner, name, value in self._saved:
            if value is None:
                delattr(owner, name)
            else:
                setattr(owner, name, value)

    def per_step(self, steps: int) -> dict[str, float]:
        return {label: round(total / steps * 1e3, 3) for label, total in sorted(self.totals.items())}


def _event_timeline(engine: LLMEngine, flush: bool, steps: int = 12) -> dict:
    """Live steps timed by CUDA events (no profiler, which can change how work reaches the device): each
    ModelRunner.launch and each graph replay bracketed by events; per step the device time from the launch's first
    command to its last, the replay's share, and the device's idle time between one launch's end and the next's
    start. `flush`: query the stream after each launch (makes the driver submit what it queued)."""
    runner, graphs = engine.runner, engine.runner.graphs
    launch, replay = runner.launch, graphs.run
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    replays: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def bracketed(fn, into):
        def call(*args, **kwargs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            if flush and fn is launch:
                torch.cuda.current_stream().query()
            into.append((start, end))
            return out
        return call

    runner.launch, graphs.run = bracketed(launch, marks), bracketed(replay, replays)
    times = []
    try:
        for _ in range(steps):
            begin = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - begin)
        torch.cuda.synchronize()
    finally:
        del runner.launch, graphs.run  # the instance attributes; the class's methods show through again
    busy = [s.elapsed_time(e) for s, e in marks[1:]]
    idle = [marks[i][1].elapsed_time(marks[i + 1][0]) for i in range(1, len(marks) - 1)]
    graph = [s.elapsed_time(e) for s, e in replays[1:]]
    return {"flush": flush, "step_ms": round(statistics.median(times) * 1e3, 3),
            "device_launch_ms": round(statistics.median(busy), 3),
            "device_replay_ms": round(statistics.median(graph), 3),
            "device_idle_between_ms": round(statistics.median(idle), 3), "steps": steps}


def _export_trace(fn, path: str, calls: int = 6) -> None:
    """A chrome trace (host ops and CUDA runtime calls, device kernels and copies) of `calls` calls of fn."""
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(path)
    print(json.dumps({"trace": path}), flush=True)
    for line in trace_gaps(path):
        print(json.dumps(line), flush=True)
    for line in kernel_front(path, calls):
        print(json.dumps(line), flush=True)


HOST_GAP_US = 300.0  # device idle longer than this in a trace of steps: the host between two calls, not a kernel's


def kernel_front(path: str, calls: int, top: int = 24) -> list[dict]:
    """Each kernel's (and copy's) share of a chrome trace of _export_trace, counted as how far it moves the device's
    completion front: its end past the latest end before it. A kernel launched early under programmatic dependent
    launch (engine.kernels.pdl) overlaps the one before and is charged only what it adds; device idle before a
    kernel is charged to it, except a gap over HOST_GAP_US (the kernel after it is charged its own duration). Per
    call of the traced function (`calls`), by name and launch grid (the trace's "grid": one GEMM kernel serving
    q/k/v, o, gate_up and down shows per projection where their grids differ)."""
    import gzip
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        events = [e for e in json.load(f)["traceEvents"]
                  if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    events.sort(key=lambda e: e["ts"] + e["dur"])
    charged: dict[str, list[float]] = {}
    front = None
    for e in events:
        end = e["ts"] + e["dur"]
        # from the front, or from its own start after a host gap (or as the trace's first)
        since = e["ts"] if front is None or e["ts"] - front > HOST_GAP_US else front
        grid = (e.get("args") or {}).get("grid")  # one kernel run as several GEMMs: apart by their grids
        entry = charged.setdefault(e["name"][:60] + (f" grid={grid}" if grid else ""), [0, 0.0])
        entry[0] += 1
        entry[1] += max(end - since, 0.0)
        front = end if front is None else max(front, end)
    total = sum(us for _, us in charged.values())
    out = [{"front": "summary", "us_per_call": round(total / calls, 1), "calls": calls}]
    for name, (count, us) in sorted(charged.items(), key=lambda kv: -kv[1][1])[:top]:
        out.append({"front": name, "per_call": round(count / calls, 2), "us_per_call": round(us / calls, 1),
                    "us_each": round(us / count, 2)})
    return out


def trace_gaps(path: str, min_gap_us: float = 30.0, top: int = 12) -> list[dict]:
    """Where the device idled in a chrome trace of _export_trace: its busy share, the longest gaps between device
    work, each with the host call that launched the work ending it (and the host op around that call), and the
    host's CUDA runtime calls by total time (a synchronising call shows up here)."""
    import gzip
    with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    device = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                    key=lambda e: e["ts"])
    runtime = [e for e in events if e.get("cat") == "cuda_runtime"]
    ops = [e for e in events if e.get("cat") == "cpu_op"]
    launcher = {e["args"].get("correlation"): e for e in runtime}
    out: list[dict] = []
    if not device:
        return [{"gaps": "no device events in the trace"}]
    start, end = device[0]["ts"], max(e["ts"] + e["dur"] for e in device)
    busy, gaps, reach = 0.0, [], device[0]["ts"]
    for e in device:
        if e["ts"] > reach:
            gaps.append((e["ts"] - reach, reach, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(reach, e["ts"]))
        reach = max(reach, e["ts"] + e["dur"])
    out.append({"gaps": "summary", "span_us": round(end - start, 1), "busy_us": round(busy, 1),
                "idle_us": round(end - start - busy, 1), "gaps_over_min": sum(g[0] >= min_gap_us for g in gaps)})
    for gap, at, e in sorted(gaps, key=lambda g: g[0], reverse=True)[:top]:
        call = launcher.get(e["args"].get("correlation"))
        around = None
        if call is not None:
            inside = [o for o in ops if o["ts"] <= call["ts"] and o["ts"] + o["dur"] >= call["ts"] + call["dur"]]
            around = min(inside, key=lambda o: o["dur"])["name"] if inside else None
        out.append({"gap_us": round(gap, 1), "at_us": round(at - start, 1), "next": e["name"][:60],
                    "launched_by": call["name"] if call else None,
                    "launch_us_before_gap_end": round(e["ts"] - call["ts"], 1) if call else None,
                    "host_op": around})
    totals: dict[str, list[float]] = {}
    for e in runtime:
        totals.setdefault(e["name"], []).append(e["dur"])
    for name, durs in sorted(totals.items(), key=lambda kv: -sum(kv[1]))[:top]:
        out.append({"runtime_call": name, "count": len(durs), "total_us": round(sum(durs), 1),
                    "max_us": round(max(durs), 1)})
    return out


def _print_kernel_profile(fn, label: str, top: int = 12) -> None:
    """The GPU kernels of 3 calls of fn, by total time (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: e.device_time_total, reverse=True)
    print(json.dumps({"profile": label, "device_us_per_call": round(sum(e.device_time_total for e in rows) / 3, 1)}),
          flush=True)
    for e in rows[:top]:
        print(json.dumps({"profile": label, "kernel": e.key[:90], "calls": e.count // 3,
                          "us_per_step": round(e.device_time_total / 3, 1)}), flush=True)


def transformers_seconds(model: str, batch: int, prompt_len: int, new_tokens: int) -> float:
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16).cuda().eval()
    ids = torch.randint(3, hf.config.vocab_size, (batch, prompt_len), device="cuda")
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        hf.generate(ids, **kwargs)
        torch.cuda.synchronize()
        start = time.perf_counter()
        hf.generate(ids, **kwargs)
        torch.cuda.synchronize()
    secs = time.perf_counter() - start
    del hf
    torch.cuda.empty_cache()
    return secs


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="a Llama-3-8B-shaped checkpoint folder")
    parser.add_argument("--kv-gib", type=float, default=40)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--cases", default="attention,decode1,decode64,prefill,generate")
    parser.add_argument("--profile", action="store_true", help="print the top GPU kernels of the decode steps")
    parser.add_argument("--stepwise", action="store_true", help="also time decode without overlapped scheduling")
    args = parser.parse_args(argv)
    cases = set(args.cases.split(","))
    bandwidth, flops = ceilings()
    print(json.dumps({"case": "ceilings", "device": torch.cuda.get_device_name(), "copy_gb_per_s":
                      round(bandwidth / 1e9, 1), "matmul_tflops": round(flops / 1e12, 1)}), flush=True)
    bench = Bench(args.model, bandwidth, flops, int(args.kv_gib * (1 << 30)), args.profile)
    if "attention" in cases:
        print(json.dumps(bench.attention_kernel()), flush=True)
    for overlap in (True, False) if args.stepwise else (True,):
        if "decode1" in cases:
            print(json.dumps(bench.decode(1, 1024, overlap=overlap)), flush=True)
        if "decode64" in cases:
            print(json.dumps(bench.decode(64, 2048, overlap=overlap)), flush=True)
    if "prefill" in cases:
        print(json.dumps(bench.prefill([2048])), flush=True)
        print(json.dumps(bench.prefill([512] * 8)), flush=True)
    if "generate" in cases:
        ours = {b: bench.generate_seconds(b, 512, 128) for b in (1, 16)}
        del bench
        torch.cuda.empty_cache()
        for b, secs in ours.items():
            line = {"case": f"generate batch {b}, 512 prompt + 128 new", "ours_s": round(secs, 3)}
            if not args.skip_transformers:
                theirs = transformers_seconds(args.model, b, 512, 128)
                line |= {"transformers_s": round(theirs, 3), "speedup": round(theirs / secs, 2)}
            print(json.dumps(line), flush=True)


if __name__ == "__main__":
    main()
