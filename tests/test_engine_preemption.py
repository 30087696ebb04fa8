"""Preemption when requests outgrow the blocks they started with (issue 38: decode workers book the prompt and a
small reserve, then grow).

- The victim is the running request of the worst priority, the most recently started within it, even one already
  planned in the step (its tokens go back to the step's budget): scheduler with a fake model.
- On the decode side, requests whose KV came from a prefill engine (reserve_blocks + add_prefilled_request, the KV
  copied in as kvtransfer does) on a cache too small for all of them at full length are preempted and recompute
  their prompt and outputs locally; every stream ends with exactly the uncontended run's tokens (greedy and seeded),
  the preemptions are counted by cause, and every block is accounted for.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from tests.engine_helpers import prefill_then_hand_over, random_prompts

VOCAB = 2000


def _request(rid: str, prompt_len: int, priority: int, first: int) -> Request:
    return Request(rid, list(range(first, first + prompt_len)), SamplingParams(max_tokens=6, ignore_eos=True),
                   (0,), max_model_len=1024, priority=priority)


def _step(s: Scheduler):
    out = s.schedule()
    s.update(out, {c.request_id: (7, None) for c in out.chunks if c.sample}, 60.0)
    return out


def test_the_victim_is_the_worst_priority_even_when_planned_earlier_in_the_step():
    s = Scheduler(BlockManager(4, 4, enable_prefix_caching=False), max_num_seqs=8, max_num_batched_tokens=64)
    s.add(_request("low", 5, priority=3, first=1))
    _step(s)  # low: 5 prompt tokens, 2 blocks
    s.add(_request("high", 7, priority=1, first=100))
    _step(s)  # high: 7 prompt tokens, 2 blocks; the cache is full
    _step(s)  # low at 7 tokens, high at 8: both still fit their 2 blocks
    out = _step(s)  # low plans its 8th token first; then high's 9th needs a third block
    assert out.preempted == ["low"]  # not the newest ("high"), as before: the worse priority
    assert s.has_paused  # a reservation from outside now waits for it (LLMEngine.reserve_blocks' leave_room)
    assert [c.request_id for c in out.chunks] == ["high"]  # low's planned row went back to the budget
    assert s.preemptions_by_cause == {"decode": 1, "prompt": 0}
    for _ in range(100):  # each fits the cache alone (11 and 13 tokens of 16): both end
        if not s.has_work:
            break
        _step(s)
    assert not s.has_work and s.bm.check_integrity()["used"] == 0 and not s.has_paused


@pytest.fixture(scope="module")
def folder(checkpoints) -> str:
    return str(checkpoints.tiny())


PROMPTS = random_prompts((20, 25, 18, 30, 22), VOCAB, seed=380)
PARAMS = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=30, ignore_eos=True),
          SamplingParams(temperature=0, max_tokens=26, ignore_eos=True),
          SamplingParams(temperature=1.0, top_k=50, seed=12, max_tokens=28, ignore_eos=True),
          SamplingParams(temperature=0.7, seed=13, max_tokens=30, ignore_eos=True, repetition_penalty=1.2)]


@pytest.mark.parametrize("overlap", [False, True])
def test_handed_over_requests_outgrowing_a_small_cache_are_recomputed_locally_and_exact(folder, overlap):
    expected = [o.token_ids for o in LLM(folder, enable_prefix_caching=False).generate(PROMPTS, PARAMS)]
    # 10 blocks of 16 tokens: every prompt's KV fits (2 blocks each), their full lengths (48-60 tokens, 3-4 blocks
    # each, 18 in all) do not
    decode = LLM(folder, num_kv_blocks=10, async_scheduling=overlap).engine
    got = prefill_then_hand_over(LLM(folder).engine, decode, PROMPTS, PARAMS)
    assert [got[f"r{i}"] for i in range(len(PROMPTS))] == expected
    load = decode.load()
    assert load.preemptions_total > 0
    assert load.preemptions_total == load.preemptions_decode_total + load.preemptions_prompt_total
    assert load.preemptions_decode_total > 0  # decodes outgrew their blocks
    counts = decode.check_integrity()
    assert counts["in_use"] == counts["pinned"] == 0


def test_a_handed_over_request_of_a_better_priority_is_not_the_victim_though_newest(folder):
    prompts, params = PROMPTS[:2], PARAMS[:2]
    expected = [o.token_ids for o in LLM(folder, enable_prefix_caching=False).generate(prompts, params)]
    prefill = LLM(folder).engine
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params[i], prefill_only=True)
    firsts = {}
    while prefill.has_unfinished():
        firsts.update({o.request_id: o for o in prefill.step()})
    # 6 blocks: both prompts' KV fits (2 blocks each), their full lengths (50 and 55 tokens: 4 blocks each) do not
    decode = LLM(folder, num_kv_blocks=6, enable_prefix_caching=False).engine
    got = {}
    for i, (rid, priority) in enumerate((("r0", 3), ("r1", 1))):  # the newest has the better priority
        first = firsts[rid]
        blocks = decode.reserve_blocks(rid, len(prompts[i]))
        decode.kv_cache[blocks] = prefill.kv_cache[first.pinned_block_ids]
        decode.add_prefilled_request(rid, prompts[i], first.new_token_ids[0], params[i], priority=priority)
        got[rid] = list(first.new_token_ids)
    requests = dict(decode.scheduler.requests)
    while decode.has_unfinished():
        for out in decode.step():
            got[out.request_id] += out.new_token_ids
    assert [got["r0"], got["r1"]] == expected
    assert requests["r0"].num_preemptions >= 1 and requests["r1"].num_preemptions == 0
    assert decode.reserve_blocks("r9", len(prompts[0])) is not None
    with pytest.raises(ValueError, match="priority must be an int"):
        decode.add_prefilled_request("r9", prompts[0], 5, params[0], priority="high")
    assert decode.abort("r9") and decode.check_integrity()["in_use"] == 0


def test_a_reservation_taking_the_blocks_running_streams_grow_into_preempts_one_unless_it_leaves_room(folder):
    """3 handed-over streams of 31 prompt tokens hold 2 blocks each of 10; a 20-token reservation (2 blocks) fits the
    4 free ones, but the streams' third blocks then do not: taken anyway, the next steps preempt a stream; with
    leave_room (what decode_pool.reservations asks for) it is refused until there is room for both."""
    prompts = random_prompts((31, 31, 31), VOCAB, seed=3803)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prefill = LLM(folder).engine
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", prompt, params, prefill_only=True)
    firsts = {}
    while prefill.has_unfinished():
        firsts.update({o.request_id: o for o in prefill.step()})
    preemptions = {}
    for leave_room in (False, True):
        decode = LLM(folder, num_kv_blocks=10, enable_prefix_caching=False).engine
        for i, prompt in enumerate(prompts):
            blocks = decode.reserve_blocks(f"r{i}", len(prompt))
            decode.kv_cache[blocks] = prefill.kv_cache[firsts[f"r{i}"].pinned_block_ids]
            decode.add_prefilled_request(f"r{i}", prompt, firsts[f"r{i}"].new_token_ids[0], params)
        got = decode.reserve_blocks("x", 20, leave_room=leave_room)
        assert (got is None) == leave_room and decode.block_manager.num_free_blocks >= 2
        while decode.has_unfinished():
            decode.step()
        preemptions[leave_room] = decode.load().preemptions_total
        assert decode.reserve_blocks("y", 20, leave_room=True) is not None  # room once the streams ended
    assert preemptions == {False: 1, True: 0}
    for i in range(3):
        prefill.release(f"r{i}")


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_second_turns_sharing_cached_blocks_outgrowing_a_small_cache_end_exact(folder, mode):
    """Decode-side prefix reuse (decode_pool.reservations): five conversations' first turns are handed over and
    decoded here; their second turns (first prompt + answer + more) are booked with their prefix hashes, so each
    table starts with the cached blocks of its first turn (shared), and only the rest is copied in. On 24 blocks
    they outgrow the cache and are preempted (their KV recomputed, or swapped out and back): every stream ends with
    the single engine's tokens, the shared blocks are counted and accounted for at every step."""
    firsts_p = random_prompts((20, 25, 18, 30, 22), VOCAB, seed=3404)
    extras = random_prompts((9, 12, 7, 14, 10), VOCAB, seed=3405)
    params = PARAMS
    reference = LLM(folder)
    answers1 = [o.token_ids for o in reference.generate(firsts_p, params)]
    seconds = [[*p, *a, *x] for p, a, x in zip(firsts_p, answers1, extras, strict=True)]
    answers2 = [o.token_ids for o in reference.generate(seconds, params)]
    prefill = LLM(folder).engine
    decode = LLM(folder, num_kv_blocks=24, preemption_mode=mode, swap_space_bytes=8 << 20).engine
    got1 = prefill_then_hand_over(prefill, decode, firsts_p, params, "a", reuse_prefix=True)
    assert [got1[f"a{i}"] for i in range(5)] == answers1 and decode.load().handoff_hit_blocks_total == 0
    before = decode.load().preemptions_total
    got2 = prefill_then_hand_over(prefill, decode, seconds, params, "b", reuse_prefix=True)
    assert [got2[f"b{i}"] for i in range(5)] == answers2
    load = decode.load()
    assert load.handoff_hit_blocks_total > 0 and load.preemptions_total > before
    if mode == "swap":
        assert load.swapped_out_total > 0
    counts = decode.check_integrity()
    assert counts["in_use"] == counts["pinned"] == 0
