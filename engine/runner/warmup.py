"""Start-up warm-up: compile every Triton kernel variant a config can hit before the engine reports ready.

Triton compiles one variant per distinct specialisation of a kernel's arguments (constexprs, integers equal to 1 or
divisible by 16, pointers aligned to 16 bytes), and each compile costs about a second of the step that meets it
first. Measured on an H100 (benchmarks/start.py engine, then warm_start.py; Llama-3.2-1B shape, 96 mixed
requests): 35 compiles made the first pass 19x slower than the same workload run again. So everything that varies
between steps is bounded to a few values, and this module runs each of them once at start:
- step metadata pointers: engine.runner.step_inputs aligns every part to 16 bytes (one variant);
- block-table row stride: not specialised (the attention kernels' `do_not_specialize`);
- decode splits, a constexpr of the eager decode kernel: a power of two (SPLIT_CHOICES), each run here directly;
- decode-only steps of graph buckets: compiled when DecodeGraphs captures them (and its input staging, both ways,
  right after: its integers are not specialised); prefill-only steps of its buckets
  likewise when PrefillGraphs does; the pieces of steps with prompt chunks when MixedGraphs does (their attention
  runs eagerly: the prefill and decode kernels below);
- prefill and mixed steps, rms_norm with and without residual, the fused decode GEMVs, the sampler's options
  (penalties, bias, top-k/p, min-p, logprobs, seeded): a few real requests through the engine.
Everything else is fixed by the model and the config. `plan()` names the variants; `step_variants()` says which ones
a scheduled step launches, so a test can show that the scheduler never emits a step outside the plan.
Warm-up requests are seeded (the sampler's RNG for unseeded requests is untouched), and the engine is left as it
was: no request, no cached prefix, zero step counters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import SchedulerOutput
from engine.kernels.decode_attention import decode_attention
from engine.kernels.decode_launch import SPLIT_CHOICES, launch_choices, num_splits_for
from engine.runner.cuda_graphs import bucket_sizes
from engine.runner.prefill_graphs import PrefillBuckets

SAMPLER_OPTIONS = (  # one warm-up request each: every sampler and logits-processing path
    dict(temperature=0.0),
    dict(temperature=0.8, top_p=0.9, top_k=20, seed=1),
    dict(temperature=0.9, min_p=0.05, seed=2, logprobs=2),
    dict(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1, seed=3),
    dict(temperature=0.0, logit_bias=((5, 2.0),), min_tokens=2),
)


@dataclass(frozen=True)
class WarmupPlan:
    """The kernel variants one engine config can launch: graph buckets, eager decode splits, prefill."""

    graph_buckets: tuple[int, ...]   # decode-only steps replayed as CUDA graphs (captured at start)
    decode_splits: tuple[int, ...]   # eager decode steps (mixed steps, steps with extras)
    prefill: bool = True
    prefill_graphs: tuple[tuple[int, int], ...] = ()  # (tokens, chunks) buckets of prefill-only steps' graphs

    def variants(self) -> set[tuple]:
        return ({("graph", b) for b in self.graph_buckets} | {("decode", s) for s in self.decode_splits}
                | ({("prefill",)} if self.prefill else set())
                | {("prefill_graph", t, n) for t, n in self.prefill_graphs})


def plan(max_num_seqs: int, max_blocks_per_seq: int, graphs: bool,
         prefill_buckets: PrefillBuckets | None = None) -> WarmupPlan:
    """`prefill_buckets`: those of the engine's PrefillGraphs (None: prefill steps run eagerly)."""
    cap = min(max_blocks_per_seq, SPLIT_CHOICES[-1])
    return WarmupPlan(tuple(bucket_sizes(max_num_seqs)) if graphs else (),
                      tuple(s for s in SPLIT_CHOICES if s <= cap),
                      prefill_graphs=tuple(prefill_buckets.all()) if graphs and prefill_buckets else ())


def step_variants(sched: SchedulerOutput, block_size: int, num_kv_heads: int, sms: int,
                  graph_buckets: tuple[int, ...], prefill_buckets: PrefillBuckets | None = None,
                  fp8_cache: bool = False, tile_blocks: int = 1) -> set[tuple]:
    """The variants a scheduled step launches (mirrors ModelRunner's graph choices and attend()'s kernels;
    `tile_blocks`: the table blocks a decode tile spans, decode_launch.launch_config's block_n // block_size)."""
    decodes = [c for c in sched.chunks if len(c.token_ids) == 1]
    prefills = [c for c in sched.chunks if len(c.token_ids) > 1]
    sampling = sum(1 for c in sched.chunks if c.sample)
    if not prefills and decodes and sampling == len(decodes):
        bucket = next((b for b in graph_buckets if b >= len(decodes)), None)
        if bucket is not None:
            return {("graph", bucket)}
    if prefills and not decodes and prefill_buckets is not None:
        key = prefill_buckets.bucket_for(sum(len(c.token_ids) for c in prefills), len(prefills))
        if key is not None:
            return {("prefill_graph", *key)}
    out: set[tuple] = {("prefill",)} if prefills else set()
    if decodes:
        width = max(-(-(c.start_pos + 1) // block_size) for c in decodes)
        out.add(("decode", num_splits_for(len(decodes), num_kv_heads, width, sms, fp8_cache, tile_blocks)))
    return out


def warm_up(engine) -> float:
    """Runs the plan on `engine` (an LLMEngine using the Triton kernels); returns the seconds it took."""
    started = time.perf_counter()
    shape = (engine.config.max_num_seqs, engine.max_blocks_per_seq)
    if engine.followers is not None:  # tensor parallel: every rank compiles its own
        engine.followers.send(("warmup", shape))
    decode_variants(engine.model, engine.kv_cache, *shape)
    _requests(engine)
    engine.start_counting()  # the warm-up's blocks and counts are not the server's
    engine.check_integrity()
    if engine.device.type == "cuda":
        torch.cuda.synchronize(engine.device)
    return time.perf_counter() - started


@torch.inference_mode()
def decode_variants(model, kv_cache: torch.Tensor, max_num_seqs: int, max_blocks_per_seq: int) -> None:
    """One eager decode-attention launch per split count and launch choice (decode_launch.launch_choices: an fp8
    cache has one for few sequences and one for many), on block 0 of layer 0 (its contents are not read back).
    Every tensor-parallel rank runs it on its own shard (`model.config` holds the rank's local heads)."""
    kv_layer = kv_cache[:, 0]  # [NB, 2, bs, KVH, D]
    bs, kvh, d = kv_layer.shape[2], kv_layer.shape[3], kv_layer.shape[4]
    heads = model.config.num_heads
    dtype = model.model.embed_tokens.weight.dtype  # the activations' (an fp8 cache's is not q's)
    qkv = torch.zeros(1, (heads + 2 * kvh) * d, dtype=dtype, device=kv_cache.device)
    q = qkv[:, :heads * d].view(1, heads, d)  # a view of the qkv projection, as in the model
    for launch in launch_choices(dtype, d, kv_layer.dtype == torch.float8_e4m3fn):
        for splits in plan(max_num_seqs, max_blocks_per_seq, False).decode_splits:
            tables = torch.zeros(1, splits, dtype=torch.int32, device=kv_cache.device)
            lens = torch.full((1,), splits * bs, dtype=torch.int32, device=kv_cache.device)
            decode_attention(q, kv_layer, tables, lens, 1.0, model.config.sliding_window, num_splits=splits,
                             launch=launch)


def _requests(engine) -> None:
    """Prefill-only, mixed and decode steps with every sampler option, as short seeded requests."""
    vocab = engine.model_config.vocab_size
    bs = engine.config.block_size
    # a tiny cache (num_kv_blocks set low) still fits one request with its 4 tokens
    prompt_len = min(3 * bs + 1, engine.config.max_model_len - 8, engine.config.max_num_batched_tokens // 4,
                     engine.num_kv_blocks * bs - 5)

    def prompt(i: int) -> list[int]:
        return [(7 + 131 * i + 17 * j) % vocab for j in range(max(prompt_len, 2))]

    for i, options in enumerate(SAMPLER_OPTIONS):
        engine.add_request(f"warmup-{i}", prompt(i), SamplingParams(max_tokens=4, ignore_eos=True, **options))
    engine.step()  # prefill only
    engine.add_request("warmup-mixed", prompt(99), SamplingParams(max_tokens=3, ignore_eos=True, temperature=0))
    while engine.has_unfinished():  # a mixed step, then decode steps
        engine.step()
