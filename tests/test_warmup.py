"""Start-up warm-up (engine.runner.warmup): the plan covers every step the scheduler emits, step inputs are aligned
so pointer alignment never adds a kernel variant, and warming up leaves the engine exactly as it was."""

import random

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.kernels.decode_launch import SPLIT_CHOICES, num_splits_for
from engine.runner.prefill_graphs import PrefillBuckets
from engine.runner.step_inputs import build_step_inputs
from engine.runner.warmup import plan, step_variants, warm_up

pytestmark = pytest.mark.gpu  # runs its GPU path on a CUDA device when there is one (tests/conftest.py)

BLOCK = 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("max_seqs,budget,max_len,sms,kv_heads,graphs", [
    (8, 256, 2048, 132, 8, True), (32, 512, 8192, 132, 2, True), (4, 64, 512, 4, 1, False),
    (64, 2048, 1024, 16, 8, True),
])
def test_the_plan_covers_every_step_the_scheduler_emits(max_seqs, budget, max_len, sms, kv_heads, graphs):
    rng = random.Random(max_seqs)
    bm = BlockManager(max_seqs * max_len // BLOCK // 2, BLOCK)
    sched = Scheduler(bm, max_seqs, budget)
    prefill_buckets = PrefillBuckets(min(512, budget), max_seqs) if graphs else None
    expected = plan(max_seqs, -(-max_len // BLOCK), graphs, prefill_buckets)
    allowed = expected.variants()
    seen: set[tuple] = set()
    for step in range(3000):
        if rng.random() < 0.3:  # arrivals at random steps: prefills mix with running decodes
            n = int(2 * (max_len / 4) ** rng.random())
            params = SamplingParams(max_tokens=rng.randint(1, max_len // 4), ignore_eos=True)
            sched.add(Request(f"r{step}", [rng.randrange(3, 1000) for _ in range(n)], params, (0,), max_len))
        out = sched.schedule()
        if out.chunks:
            shapes = step_variants(out, BLOCK, kv_heads, sms, expected.graph_buckets, prefill_buckets)
            assert shapes <= allowed, f"step {step} launches {shapes - allowed}, not in the warm-up plan"
            seen |= shapes
        sched.update(out, {c.request_id: (rng.randrange(3, 1000), None) for c in out.chunks if c.sample}, 60.0)
    assert ("prefill",) in seen and any(v[0] == "decode" for v in seen)  # the workload exercised mixed steps
    assert any(v[0] == "prefill_graph" for v in seen) == graphs  # and prefill-only steps short enough for a graph


def test_decode_splits_are_always_one_of_the_planned_choices():
    for sms in (4, 78, 132):
        for batch in (1, 2, 3, 7, 64, 255):
            for kv_heads in (1, 2, 8):
                for blocks in (0, 1, 2, 3, 5, 17, 64, 100, 513):
                    for fp8_cache in (False, True):
                        for tile_blocks in (1, 2, 4, 8):
                            splits = num_splits_for(batch, kv_heads, blocks, sms, fp8_cache, tile_blocks)
                            assert splits in SPLIT_CHOICES and splits <= max(blocks, 1)
                            assert splits == 1 or (splits - 1) * tile_blocks < blocks  # each split has a tile


def test_every_step_input_starts_16_byte_aligned():
    rng = random.Random(0)
    bm = BlockManager(512, BLOCK)
    sched = Scheduler(bm, 16, 128)
    for step in range(200):
        if rng.random() < 0.4:
            n = rng.randint(1, 90)
            sched.add(Request(f"r{step}", list(range(3, 3 + n)), SamplingParams(max_tokens=rng.randint(1, 20),
                                                                                  ignore_eos=True), (0,), 512))
        out = sched.schedule()
        if out.chunks:
            step_in = build_step_inputs(out, BLOCK, torch.device("cpu"), None)
            m = step_in.meta
            tensors = [step_in.input_ids, step_in.positions, step_in.sample_index, m.slots, m.decode_block_tables,
                       m.decode_context_lens, m.prefill_block_tables, m.prefill_query_start, m.prefill_context_lens]
            base = step_in.input_ids.data_ptr()
            assert all((t.data_ptr() - base) % 16 == 0 for t in tensors)
        sched.update(out, {c.request_id: (5, None) for c in out.chunks if c.sample}, 60.0)


def test_warm_up_leaves_the_engine_as_it_was(checkpoints):
    """On the Triton kernels (interpreted on the CPU): counters, blocks and the unseeded RNG are untouched, and
    generation after a warm-up equals generation without one. One layer of two heads: the interpreter runs every
    program of every kernel in Python, and the property does not depend on the model's size."""
    llama = checkpoints.get("LlamaForCausalLM", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64)
    prompts = [[5, 9, 13, 200, 7, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [42, 43, 44]]
    params = [SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
              SamplingParams(temperature=1.0, max_tokens=5, ignore_eos=True)]  # unseeded: the engine's own RNG
    # a 64-token step budget keeps the warm-up prompts at 16 tokens (the interpreter runs every kernel)
    # two engines alive at once: a fixed KV budget (on a GPU the first would take 90% of the memory); a host tier
    # set (on a GPU it is off unless set)
    options = dict(device=DEVICE, kernels="triton", max_num_seqs=4, max_model_len=64, max_num_batched_tokens=64,
                   warmup=False, kv_cache_memory_bytes=64 << 20, kv_host_cache_bytes=8 << 20)
    cold = LLM(str(llama), **options)
    expected = [o.token_ids for o in cold.generate(prompts, params)]
    warm = LLM(str(llama), **options)
    assert warm_up(warm.engine) > 0
    counts = warm.engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0 and warm.engine.block_manager.num_cached_blocks == 0
    load = warm.engine.load()
    assert load.steps == 0 and load.scheduled_tokens_total == 0 and load.sampled_tokens_total == 0
    assert load.iteration_tokens_total == 0 and not any(load.iteration_token_counts)
    tier = warm.engine.host_tier
    assert tier is not None and tier.num_used == 0 and tier.stored == 0  # nothing of the warm-up's kept
    assert [o.token_ids for o in warm.generate(prompts, params)] == expected


def test_warm_up_fits_an_engine_whose_cache_holds_two_blocks(checkpoints):
    """A deliberately tiny cache (num_kv_blocks 2 = 32 tokens) starts: the warm-up's prompts shrink to fit it (a CUDA
    engine warms up at start; at 49 tokens it had refused its own warm-up request)."""
    llama = checkpoints.get("LlamaForCausalLM", num_hidden_layers=1, hidden_size=32, num_attention_heads=2,
                            num_key_value_heads=1, intermediate_size=64)
    llm = LLM(str(llama), device=DEVICE, kernels="triton", max_num_seqs=4, max_model_len=256,
              max_num_batched_tokens=256, warmup=False, num_kv_blocks=2)
    assert warm_up(llm.engine) > 0
    assert llm.engine.check_integrity()["in_use"] == 0
