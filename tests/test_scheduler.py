"""Scheduler with faked model output: continuous batching, chunked prefill, preemption, abort, pinning."""

from engine.core.block_manager import BlockManager
from engine.core.request import Request, RequestStatus
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler

EOS = 0


def make(num_blocks=64, block_size=4, max_seqs=8, budget=64, prefix=True, clock=None, chunk=None):
    bm = BlockManager(num_blocks, block_size, prefix)
    kwargs = {"clock": clock} if clock else {}
    return Scheduler(bm, max_seqs, budget, max_prefill_chunk=chunk, **kwargs)


def req(rid, n_prompt, max_tokens=4, prefill_only=False, first=1):
    return Request(rid, list(range(first, first + n_prompt)), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   (EOS,), max_model_len=1024, prefill_only=prefill_only)


def run_step(s, token=7, lease=60.0):
    """One step with a fake model that always samples `token`."""
    out = s.schedule()
    sampled = {c.request_id: (token, None) for c in out.chunks if c.sample}
    return out, s.update(out, sampled, lease)


def drain(s, max_steps=1000):
    finished = {}
    for _ in range(max_steps):
        if not s.has_work:
            return finished
        _, outs = run_step(s)
        for o in outs:
            if o.finish_reason:
                finished[o.request_id] = o.finish_reason
        s.bm.check_integrity()
    raise AssertionError("scheduler did not finish: livelock")


def test_prefill_then_decode_one_token_per_step_batched():
    s = make()
    s.add(req("a", 5))
    s.add(req("b", 3))
    out, outs = run_step(s)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [("a", 5, True), ("b", 3, True)]
    assert len(outs) == 2
    out, _ = run_step(s)
    assert [len(c.token_ids) for c in out.chunks] == [1, 1]
    assert out.chunks[0].start_pos == 5 and out.chunks[0].token_ids == [7]
    assert drain(s) == {"a": "length", "b": "length"}
    assert s.bm.check_integrity()["used"] == 0


def test_long_prompt_is_chunked_under_the_token_budget_and_decodes_share_the_step():
    s = make(budget=8)
    s.add(req("short", 2))
    s.add(req("long", 20))
    out, _ = run_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("short", 2), ("long", 6)]
    assert not out.chunks[1].sample
    out, _ = run_step(s)  # the decode goes first, the long prompt fills the rest of the budget
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("short", 1), ("long", 7)]
    out, _ = run_step(s)
    assert [(c.request_id, len(c.token_ids), c.sample) for c in out.chunks] == [("short", 1, True), ("long", 7, True)]
    assert drain(s) == {"short": "length", "long": "length"}


def test_preemption_by_recompute_when_blocks_run_out_never_deadlocks():
    s = make(num_blocks=6, block_size=4, budget=64)
    for i in range(4):
        s.add(req(f"r{i}", 6, max_tokens=8, first=10 * i + 1))
    finished = drain(s)
    assert finished == {f"r{i}": "length" for i in range(4)}
    assert s.bm.check_integrity()["used"] == 0


def test_preempted_request_is_recomputed_with_its_generated_tokens():
    s = make(num_blocks=4, block_size=4)
    s.add(req("a", 4, max_tokens=8))
    s.add(req("b", 4, max_tokens=8, first=50))
    preempted = []
    for _ in range(50):
        if not s.has_work:
            break
        out, _ = run_step(s)
        preempted += out.preempted
        for c in out.chunks:
            if c.request_id in preempted and c.start_pos == 0:
                r = s.requests[c.request_id]
                assert c.token_ids == r.all_token_ids[:len(c.token_ids)]  # prompt + outputs, from the start
    assert preempted, "the pool is too small for both: one must have been preempted"
    assert not s.has_work and s.bm.check_integrity()["used"] == 0


def test_abort_in_every_state_frees_everything():
    s = make(budget=4)
    s.add(req("waiting", 3))
    s.add(req("running", 10))
    s.schedule()  # not updated: "running" is mid-prefill
    assert s.requests["running"].status == RequestStatus.RUNNING
    assert s.finish("running", "abort") and s.finish("waiting", "abort")
    assert not s.finish("unknown", "abort")
    assert s.bm.check_integrity()["used"] == 0 and not s.has_work


def test_prefill_only_request_is_pinned_until_released_or_its_lease_expires():
    now = [0.0]
    s = make(clock=lambda: now[0])
    s.add(req("p", 9, prefill_only=True))
    s.add(req("q", 5, prefill_only=True, first=40))
    _, outs = run_step(s, lease=10.0)
    pinned = {o.request_id: o.pinned_block_ids for o in outs}
    assert pinned["p"] == s.bm.table("p") and len(pinned["p"]) == 3
    assert not s.has_work and s.requests["p"].status == RequestStatus.PINNED
    assert s.expired_pins() == []
    assert s.finish("p", "stop")
    now[0] = 11.0
    assert s.expired_pins() == ["q"]
    s.finish("q", "expired")
    assert s.bm.check_integrity()["used"] == 0


def test_prefix_cache_hit_skips_cached_tokens():
    s = make(block_size=4)
    s.add(req("a", 10))
    drain(s)
    s.add(req("b", 10))
    out, _ = run_step(s)
    assert out.chunks[0].start_pos == 8 and len(out.chunks[0].token_ids) == 2
    assert s.requests["b"].num_cached_tokens == 8


def test_prefill_chunk_size_caps_one_request_per_step_but_not_the_batch():
    s = make(budget=64, chunk=5)
    s.add(req("a", 12))
    s.add(req("b", 3))
    out, _ = run_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 5), ("b", 3)]
    out, _ = run_step(s)
    assert [(c.request_id, len(c.token_ids)) for c in out.chunks] == [("a", 5), ("b", 1)]
    assert drain(s) == {"a": "length", "b": "length"}


def test_schedule_after_continues_a_decode_step_before_its_tokens_are_known():
    s = make(num_blocks=64, block_size=4)
    s.add(req("a", 3, max_tokens=10))
    s.add(req("b", 5, max_tokens=2))  # its next token (output 1) is its last
    run_step(s)  # prefill: both sampled output 0
    decode = s.schedule()
    assert all(len(c.token_ids) == 1 and c.sample for c in decode.chunks)
    assert [c.output_index for c in decode.chunks] == [1, 1]
    nxt = s.schedule_after(decode)
    assert [(c.request_id, c.token_ids, c.start_pos, c.output_index) for c in nxt.chunks] == [("a", [-1], 4, 2)]
    assert s.bm.table("a") == nxt.chunks[0].block_table and len(s.bm.table("a")) == 2  # position 4: second block
    outs = s.update(decode, {"a": (7, None), "b": (7, None)}, 60.0)
    assert [(o.request_id, o.finish_reason) for o in outs] == [("a", None), ("b", "length")]
    assert s.update(nxt, {"a": (8, None)}, 60.0)[0].new_token_ids == [8]
    assert s.requests["a"].output_token_ids == [7, 7, 8] and s.requests["a"].num_computed_tokens == 5


def test_schedule_after_admits_a_waiting_prompt_and_continues_a_chunked_one():
    s = make(num_blocks=64, block_size=4, budget=6)
    s.add(req("a", 3, max_tokens=10))
    run_step(s)
    decode = s.schedule()
    s.add(req("late", 9))  # waiting, a slot free: its first chunk joins the step after (the budget leaves 5 tokens)
    nxt = s.schedule_after(decode)
    assert [(c.request_id, c.token_ids, c.start_pos, c.sample) for c in nxt.chunks] == [
        ("a", [-1], 4, True), ("late", [1, 2, 3, 4, 5], 0, False)]
    s.update(decode, {"a": (7, None)}, 60.0)
    then = s.schedule_after(nxt)  # nxt is not read yet: late's next chunk is known, it completes the prompt
    assert [(c.request_id, c.token_ids, c.start_pos, c.sample) for c in then.chunks] == [
        ("a", [-1], 5, True), ("late", [6, 7, 8, 9], 5, True)]
    s.update(nxt, {"a": (8, None)}, 60.0)
    s.update(then, {"a": (9, None), "late": (5, None)}, 60.0)
    assert s.requests["late"].output_token_ids == [5] and s.requests["a"].output_token_ids == [7, 7, 8, 9]
    s.bm.check_integrity()


def test_schedule_after_declines_when_only_schedule_may_plan():
    for late in (req("late", 2, prefill_only=True),
                 Request("late", [1, 2], SamplingParams(max_tokens=4, prompt_logprobs=1), (EOS,), max_model_len=64)):
        s = make(num_blocks=64, block_size=4)
        s.add(req("a", 3, max_tokens=10))
        run_step(s)
        decode = s.schedule()
        s.add(late)  # its steps are read before the next is planned (pinning, prompt logprobs)
        assert s.schedule_after(decode) is None
    s = make(num_blocks=1, block_size=4)  # position 4 needs a second block: only schedule() may preempt
    s.add(req("a", 3, max_tokens=10))
    run_step(s)
    assert s.schedule_after(s.schedule()) is None


def test_schedule_after_keeps_overlapping_while_every_slot_is_taken():
    s = make(num_blocks=64, block_size=4, max_seqs=2)
    s.add(req("a", 3, max_tokens=10))
    s.add(req("b", 3, max_tokens=3))
    run_step(s)
    s.add(req("late", 2))  # waits: both slots are taken and stay taken after the next step
    decode = s.schedule()
    assert [c.request_id for c in decode.chunks] == ["a", "b"] and [r.request_id for r in s.waiting] == ["late"]
    nxt = s.schedule_after(decode)
    assert [c.request_id for c in nxt.chunks] == ["a", "b"]
    s.update(decode, {"a": (7, None), "b": (7, None)}, 60.0)
    # b's next token (output 2) is its last: its slot opens, and the waiting request takes it in the step after
    after = s.schedule_after(nxt)
    assert [(c.request_id, c.token_ids, c.sample) for c in after.chunks] == [("a", [-1], True), ("late", [1, 2], True)]
    s.update(nxt, {"a": (7, None), "b": (7, None)}, 60.0)
    assert "b" not in s.requests and s.requests["late"].status == RequestStatus.RUNNING
    s.update(after, {"a": (8, None), "late": (9, None)}, 60.0)
    assert s.requests["late"].output_token_ids == [9] and s.requests["a"].output_token_ids[-1] == 8
    s.bm.check_integrity()


def test_update_skips_chunks_of_requests_that_ended_while_on_the_device():
    s = make()
    s.add(req("a", 3, max_tokens=10))
    s.add(req("b", 3, max_tokens=10))
    run_step(s)
    decode = s.schedule()
    nxt = s.schedule_after(decode)
    s.finish("b", "abort")
    s.update(decode, {"a": (7, None), "b": (7, None)}, 60.0)
    outs = s.update(nxt, {"a": (8, None), "b": (8, None)}, 60.0)
    assert [o.request_id for o in outs] == ["a"] and "b" not in s.requests
    s.bm.check_integrity()


def resumed(rid, prompt, prior, max_tokens, **kw):
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens, **kw), (EOS,), max_model_len=1024,
                   prior_output_ids=tuple(prior))


def test_resumed_request_computes_its_prior_outputs_and_samples_from_their_count():
    s = make(block_size=4)
    r = resumed("r", [1, 2, 3, 4, 5], [9, EOS, 8], max_tokens=6, stop_token_ids=(9,))
    s.add(r)
    out, outs = run_step(s)
    c = out.chunks[0]
    assert (c.token_ids, c.start_pos, c.sample, c.output_index) == ([1, 2, 3, 4, 5, 9, EOS, 8], 0, True, 3)
    # the stop token and the eos among the prior outputs do not end it; StepOutputs carry new tokens only
    assert [(o.new_token_ids, o.finish_reason) for o in outs] == [([7], None)]
    assert [c.output_index for c in run_step(s)[0].chunks] == [4]
    assert drain(s) == {"r": "length"}  # max_tokens counts the prior outputs: 3 prior + 3 new
    assert r.output_token_ids == [9, EOS, 8, 7, 7, 7] and r.new_output_token_ids == [7, 7, 7]
    assert r.prompt_token_ids == [1, 2, 3, 4, 5]


def test_preempted_resumed_request_recomputes_prior_and_new_outputs_and_samples_each_index_once():
    s = make(num_blocks=4, block_size=4)
    a = resumed("a", [1, 2, 3], [11, 12], max_tokens=10, ignore_eos=True)
    s.add(req("b", 4, max_tokens=8, first=50))
    s.add(a)  # admitted last: the first to be preempted
    sampled_indices, preempted, recomputed = [], [], []
    while s.has_work:
        out, _ = run_step(s)
        preempted += out.preempted
        for c in out.chunks:
            if c.request_id != "a":
                continue
            if c.sample:
                sampled_indices.append(c.output_index)
            if c.start_pos == 0 and sampled_indices:
                recomputed.append(c.token_ids)
        s.bm.check_integrity()
    assert "a" in preempted, "the pool is too small for both: the resumed request must have been preempted"
    assert sampled_indices == list(range(2, 10))  # outputs 2..9, each once, in order
    assert recomputed and all(t[:5] == [1, 2, 3, 11, 12] and t[5:] == [7] * (len(t) - 5) for t in recomputed)
    assert a.output_token_ids == [11, 12] + [7] * 8 and s.num_preemptions == len(preempted)


def test_waiting_requests_start_in_priority_order_then_arrival_order():
    s = make(max_seqs=1)  # one at a time, so the start order is the waiting order
    for rid, priority in (("low-1", 3), ("normal-1", 2), ("low-2", 3), ("high-1", 1), ("normal-2", 2),
                          ("high-2", 1)):
        r = req(rid, 3, max_tokens=1)
        r.priority = priority
        s.add(r)
    started = []
    while s.has_work:
        out, _ = run_step(s)
        started += [c.request_id for c in out.chunks if c.start_pos == 0]
    assert started == ["high-1", "high-2", "normal-1", "normal-2", "low-1", "low-2"]


def test_a_preempted_request_goes_back_ahead_of_any_waiting_priority():
    s = make(num_blocks=4, block_size=4, max_seqs=2, budget=64)
    low = req("low", 6, max_tokens=8)
    low.priority = 3
    other = req("other", 6, max_tokens=8, first=100)
    other.priority = 3
    s.add(low)
    s.add(other)
    run_step(s)  # both prefilled: 2 blocks each, the cache is full
    high = req("high", 3, max_tokens=1, first=200)
    high.priority = 1
    s.add(high)
    for _ in range(4):  # the decodes soon need a third block each: the newest running request is preempted
        out, _ = run_step(s)
        if out.preempted:
            break
    assert out.preempted == ["other"]
    assert [r.request_id for r in s.waiting] == ["other", "high"]
