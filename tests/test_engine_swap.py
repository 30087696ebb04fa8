"""Swap-to-host preemption (EngineConfig.preemption_mode swap / auto; engine.core.swap_space, engine.runner.swap_store).

- Offline (LLM), a cache too small for the streams at their full lengths: with swap, preempted requests' KV goes to
  host slots and comes back into new blocks; every stream ends with exactly the tokens of an unpreempted run (greedy
  and seeded), nothing is computed twice (the tokens scheduled equal those of the unpreempted run, prefix cache off),
  and every block and host slot is accounted for afterwards.
- A swap space too small for every victim: those that find it full are recomputed (counted), still exact.
- Prefix-cache interplay: a swapped request resumes in new blocks; the blocks of its prefix still in the prefix cache
  are taken, not copied back; its swapped content never reaches another request (its blocks are copied out before
  the step that reuses them).
- Decode side (KV handed over from a prefill engine), with and without overlapped steps.
- auto: the cost model picks swap when the copy is cheaper than the recompute; bad settings are refused.
"""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.core.swap_space import SwapSpace
from engine.engine_config import EngineConfig
from tests.engine_helpers import prefill_then_hand_over, random_prompts

# The engine tests run on a GPU where there is one (pinned host slots, the copy stream), else the CPU
pytestmark = pytest.mark.gpu
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
VOCAB = 2000
PROMPTS = random_prompts((20, 25, 18, 30, 22, 27), VOCAB, seed=381)
PARAMS = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=26, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=50, seed=12, max_tokens=28, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=13, max_tokens=30, ignore_eos=True, repetition_penalty=1.2),
          SamplingParams(temperature=0.8, seed=14, max_tokens=29, ignore_eos=True)]


@pytest.fixture(scope="module")
def folder(checkpoints) -> str:
    return str(checkpoints.tiny())


@pytest.fixture(scope="module")
def expected(folder) -> tuple[list[list[int]], int]:
    """The unpreempted run's tokens, and the tokens it computed."""
    llm = LLM(folder, device=DEVICE, enable_prefix_caching=False)
    outs = llm.generate(PROMPTS, PARAMS)
    return [o.token_ids for o in outs], llm.engine.load().scheduled_tokens_total


def _run(folder: str, **kwargs):
    llm = LLM(folder, device=DEVICE, **kwargs)
    outs = llm.generate(PROMPTS, PARAMS)
    return [o.token_ids for o in outs], llm.engine


def test_swapped_streams_end_exactly_as_unpreempted_and_compute_nothing_twice(folder, expected):
    tokens, scheduled = expected
    # 12 blocks of 16 tokens: every prompt fits (2 blocks each), the six streams at full length (46-59 tokens,
    # 3-4 blocks each, 22 in all) do not
    got, engine = _run(folder, num_kv_blocks=12, enable_prefix_caching=False, preemption_mode="swap")
    assert got == tokens
    load = engine.load()
    assert load.preemptions_total > 0
    assert load.swapped_out_total == load.preemptions_total == load.swapped_in_total  # every victim swapped, back
    assert load.swap_full_total == 0 and load.swap_used_blocks == 0
    assert load.swap_out_bytes_total == load.swap_in_bytes_total > 0  # no prefix cache: every block copied back
    assert load.swap_out_bytes_total % engine.swap_store.block_bytes == 0
    assert load.scheduled_tokens_total == scheduled  # resumed where they stopped: no token recomputed
    counts = engine.check_integrity()
    assert counts["in_use"] == counts["pinned"] == 0


def test_recompute_mode_computes_again_what_swap_saves(folder, expected):
    tokens, scheduled = expected
    got, engine = _run(folder, num_kv_blocks=12, enable_prefix_caching=False)
    load = engine.load()
    assert got == tokens and load.preemptions_total > 0 and load.swapped_out_total == 0
    assert load.scheduled_tokens_total > scheduled


def test_a_full_swap_space_falls_back_to_recompute_and_stays_exact(folder, expected):
    tokens, _ = expected
    block_bytes = LLM(folder, device=DEVICE, num_kv_blocks=2).engine.kv_cache[0].nbytes
    # 4 host blocks: one victim of 3-4 blocks at a time, the others recompute
    got, engine = _run(folder, num_kv_blocks=12, enable_prefix_caching=False, preemption_mode="swap",
                       swap_space_bytes=4 * block_bytes)
    assert got == tokens
    load = engine.load()
    assert load.swap_full_total > 0 and load.swapped_out_total > 0
    assert load.preemptions_total == load.swapped_out_total + load.swap_full_total
    assert engine.check_integrity()["in_use"] == 0 and engine.swap_space.num_free == 4


def test_with_the_prefix_cache_a_swapped_request_resumes_in_new_blocks_taking_its_cached_prefix(folder, expected):
    tokens, _ = expected
    got, engine = _run(folder, num_kv_blocks=12, preemption_mode="swap")
    assert got == tokens
    load = engine.load()
    assert load.swapped_in_total == load.swapped_out_total > 0
    assert load.swap_in_bytes_total <= load.swap_out_bytes_total
    assert engine.check_integrity()["in_use"] == 0


def _request(rid: str, prompt: list[int]) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=20, ignore_eos=True), (0,), max_model_len=1024)


def _step(s: Scheduler):
    out = s.schedule()
    s.update(out, {c.request_id: (7, None) for c in out.chunks if c.sample}, 60.0)
    return out


def test_scheduler_swaps_out_computed_blocks_and_back_into_new_ones_skipping_the_cached_prefix():
    bm = BlockManager(6, 4)
    swap = SwapSpace(8, "swap", block_bytes=1)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, swap=swap)
    s.add(_request("a", list(range(1, 10))))  # 9 tokens: 3 blocks
    _step(s)
    s.add(_request("b", list(range(100, 109))))
    _step(s)  # a and b hold 3 blocks each: the cache is full
    b = s.requests["b"]
    for _ in range(4):  # until a's 13th token needs a 4th block
        b_table, computed = list(bm.table("b")), b.num_computed_tokens
        out = _step(s)
        if out.preempted:
            break
    assert out.preempted == ["b"]  # the newest
    assert b.swap_slots is not None and b.num_computed_tokens == computed == 11  # it resumes where it stopped
    assert out.swap_out == list(zip(b_table, b.swap_slots, strict=True))  # all 3 computed blocks, to the host
    assert not bm.has_table("b") and swap.num_free == 5
    s.finish("a", "abort")  # a's blocks free: b comes back
    out = _step(s)
    assert [c.request_id for c in out.chunks] == ["b"] and out.chunks[0].start_pos == 11
    # b's two full blocks were hashed when computed and are still in the prefix cache: taken, not copied; its
    # partial third block comes back from the host
    assert len(out.swap_in) == 1 and out.swap_in[0][1] == bm.table("b")[2]
    assert b.swap_slots is None and swap.num_free == 8 and swap.num_swapped_in == 1 and swap.blocks_in == 1
    bm.check_integrity()


def test_an_aborted_swapped_request_gives_its_host_slots_back():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    swap = SwapSpace(8, "swap", block_bytes=1)
    s = Scheduler(bm, max_num_seqs=8, max_num_batched_tokens=64, swap=swap)
    s.add(_request("a", list(range(1, 7))))
    s.add(_request("b", list(range(50, 56))))
    for _ in range(10):
        if _step(s).preempted:
            break
    assert swap.num_free < 8
    swapped = next(r for r in s.requests.values() if r.swap_slots is not None)
    s.finish(swapped.request_id, "abort")
    assert swap.num_free == 8 and swap.check_integrity([]) == 0


def test_auto_swaps_when_the_copy_is_cheaper_than_the_recompute():
    space = SwapSpace(16, "auto", block_bytes=1 << 20)
    assert space.wants_swap(100, 7)  # nothing measured yet: swap
    space.copy_bytes_per_s = 10e9   # 2 * 7 MiB / 10 GB/s: ~1.5 ms
    space.observe_prefill(1000, 0.1)  # 100 us a token: 100 tokens 10 ms
    assert space.wants_swap(100, 7)
    space.copy_bytes_per_s = 1e9    # ~15 ms
    assert not space.wants_swap(100, 7) and space.num_chose_recompute == 1
    space.observe_prefill(8, 100.0)  # too short a prompt step to time: ignored
    assert space.prefill_token_s == pytest.approx(1e-4)
    assert space.take(17) is None and space.num_full == 1


def test_auto_mode_measures_the_copy_and_stays_exact(folder, expected):
    tokens, _ = expected
    got, engine = _run(folder, num_kv_blocks=12, enable_prefix_caching=False, preemption_mode="auto")
    assert got == tokens
    assert engine.swap_space.copy_bytes_per_s > 0
    load = engine.load()
    assert load.preemptions_total > 0
    assert load.preemptions_total == load.swapped_out_total + engine.swap_space.num_chose_recompute
    assert engine.check_integrity()["in_use"] == 0


@pytest.mark.parametrize("overlap", [False, True])
def test_handed_over_requests_outgrowing_a_small_cache_are_swapped_and_exact(folder, expected, overlap):
    tokens, _ = expected
    decode = LLM(folder, device=DEVICE, num_kv_blocks=12, async_scheduling=overlap, preemption_mode="swap").engine
    got = prefill_then_hand_over(LLM(folder, device=DEVICE).engine, decode, PROMPTS, PARAMS)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == tokens
    load = decode.load()
    assert load.swapped_out_total == load.preemptions_total > 0 and load.swapped_in_total == load.swapped_out_total


@pytest.mark.parametrize("kwargs, field", [({"preemption_mode": "spill"}, "preemption_mode"),
                                           ({"preemption_mode": "swap", "tensor_parallel_size": 2},
                                            "preemption_mode"),
                                           ({"swap_space_bytes": 0}, "swap_space_bytes"),
                                           ({"swap_space_bytes": 1.5}, "swap_space_bytes")])
def test_bad_swap_settings_are_refused_naming_the_field(kwargs, field):
    with pytest.raises(ValueError, match=f"EngineConfig.{field}"):
        EngineConfig(**kwargs)


def test_a_swap_space_smaller_than_a_block_is_refused(folder):
    with pytest.raises(ValueError, match="swap_space_bytes 100 holds no KV block"):
        LLM(folder, device=DEVICE, preemption_mode="swap", swap_space_bytes=100)
