"""StepBudget (engine.core.step_budget) and the scheduler's cap on prompt tokens in steps that also decode: fed
made-up step times, the budget is what fits the target; the scheduler never gives a decoding step more prompt
tokens than the cap, and gives a step without decodes the whole token budget."""

import pytest

from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import Scheduler
from engine.core.step_budget import StepBudget


def test_budget_is_what_fits_the_target_between_floor_and_ceiling():
    b = StepBudget(target_s=0.040, floor_tokens=64, ceiling_tokens=2048)
    assert b.tokens == 64  # nothing measured: the floor
    for _ in range(50):
        b.observe(decode_rows=32, prompt_tokens=0, seconds=0.010)  # decode-only steps: base 10 ms
        b.observe(decode_rows=32, prompt_tokens=1000, seconds=0.030)  # 20 us per prompt token above the base
    assert b.base_s == pytest.approx(0.010, rel=1e-3)
    assert b.per_token_s == pytest.approx(20e-6, rel=1e-2)
    assert b.tokens == pytest.approx(1500, abs=20)  # (40 - 10) ms / 20 us
    for _ in range(50):
        b.observe(decode_rows=256, prompt_tokens=0, seconds=0.039)  # a big batch leaves almost no room
    assert b.tokens == 64
    for _ in range(50):
        b.observe(decode_rows=1, prompt_tokens=0, seconds=0.001)
        b.observe(decode_rows=0, prompt_tokens=100, seconds=0.0001)  # cheap tokens: capped at the ceiling
    assert b.tokens == 2048


def test_bad_budgets_are_refused():
    with pytest.raises(ValueError, match="target_s"):
        StepBudget(0.0, 16, 32)
    with pytest.raises(ValueError, match="floor"):
        StepBudget(0.01, 64, 32)


def _scheduler(cap: int | None) -> Scheduler:
    s = Scheduler(BlockManager(num_blocks=256, block_size=16), max_num_seqs=8, max_num_batched_tokens=512)
    s.prefill_cap = cap
    return s


def _request(rid: str, n: int) -> Request:
    return Request(rid, list(range(1, n + 1)), SamplingParams(max_tokens=50, ignore_eos=True), (), 4096)


def _run_prompt_to_decode(s: Scheduler, rid: str) -> None:
    while s.requests[rid].num_pending_tokens > 1 or s.requests[rid].num_computed_tokens == 0:
        out = s.schedule()
        for c in out.chunks:
            req = s.requests[c.request_id]
            req.num_computed_tokens += len(c.token_ids)
            if c.sample:
                req.append_token(7, None)


@pytest.mark.parametrize("cap", [None, 48])
def test_a_step_that_decodes_carries_at_most_the_cap_of_prompt_tokens(cap):
    s = _scheduler(cap)
    s.add(_request("a", 40))
    _run_prompt_to_decode(s, "a")  # "a" now decodes, one token a step
    s.add(_request("b", 1000))
    steps = []
    while s.requests["b"].num_pending_tokens > 1 or s.requests["b"].num_computed_tokens == 0:
        out = s.schedule()
        steps.append({c.request_id: len(c.token_ids) for c in out.chunks})
        for c in out.chunks:
            req = s.requests[c.request_id]
            req.num_computed_tokens += len(c.token_ids)
            if c.sample:
                req.append_token(7, None)
    assert all(step.get("a") == 1 for step in steps)  # the stream is never left out
    prompt = [step.get("b", 0) for step in steps]
    assert sum(prompt) == 1000
    assert max(prompt) == (511 if cap is None else cap)  # uncapped: the whole token budget beside the decode


def test_without_decodes_a_prompt_takes_the_whole_token_budget():
    s = _scheduler(48)
    s.add(_request("b", 400))
    out = s.schedule()
    assert [len(c.token_ids) for c in out.chunks] == [400]


def test_an_engine_with_a_decode_step_target_gives_the_same_tokens_and_reports_its_budget():
    from engine import LLM

    prompts = [list(range(3, 3 + n)) for n in (20, 300, 90)]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    plain = LLM("tiny", max_num_batched_tokens=256).generate(prompts, params)
    llm = LLM("tiny", max_num_batched_tokens=256, decode_step_target_s=0.0005)  # far below a CPU step: the floor
    budgeted = llm.generate(prompts, params)
    assert [o.token_ids for o in budgeted] == [o.token_ids for o in plain]
    load = llm.engine.load()
    assert load.prefill_budget_tokens == 64 and load.decode_step_s > 0 and load.prefill_token_s > 0


def test_a_few_slow_small_steps_do_not_make_prompt_tokens_look_dear():
    b = StepBudget(target_s=0.040, floor_tokens=64, ceiling_tokens=8192)
    for i in range(200):
        b.observe(decode_rows=0, prompt_tokens=2048, seconds=0.060)  # 29 us per token
        if i % 10 == 0:
            b.observe(decode_rows=0, prompt_tokens=5, seconds=0.050)  # a last chunk of 5 tokens, mostly fixed cost
            b.observe(decode_rows=0, prompt_tokens=100, seconds=0.055)
    assert b.per_token_s == pytest.approx(0.060 / 2048, rel=0.15)


def test_an_engine_with_a_step_target_knows_its_rates_before_its_first_request():
    """engine.step_rates: a probe request at start gives the step budget its figures (the adaptive placement reads
    them from the first request on: with none, both sides of a burst right after start read "unknown"), and leaves
    nothing behind: no cached or held block, counters at zero."""
    from engine import LLM

    engine = LLM("tiny", max_num_batched_tokens=256, decode_step_target_s=0.5, kv_host_cache_bytes=1 << 20).engine
    load = engine.load()
    assert load.prefill_token_s > 0 and load.decode_step_s > 0, load
    assert load.steps == load.scheduled_tokens_total == load.sampled_tokens_total == 0
    assert load.prefix_query_tokens_total == load.iteration_tokens_total == load.host_tier_miss_blocks_total == 0
    assert load.free_blocks == load.total_blocks and load.cached_blocks == 0
    assert engine.check_integrity()["host_cached"] == 0
    assert "step_rates" in dict(engine.startup_s)
    plain = LLM("tiny", max_num_batched_tokens=256).engine.load()  # no step target: no probe, no figures
    assert plain.prefill_token_s == plain.decode_step_s == 0


def test_an_engine_with_a_prefill_lane_knows_the_lanes_rate_before_its_first_request():
    """With sm_split_decode_sms (on the CPU the lane runs in order: same steps, no streams) the probe at start also
    runs a prompt beside a decoding request, which the lane takes: EngineLoad.lane_token_s (what the placement model
    and the planner price the lane's prefills at) is known before the first request, and nothing is left behind."""
    from engine import LLM

    engine = LLM("tiny", max_num_batched_tokens=512, decode_step_target_s=0.5, sm_split_decode_sms=8).engine
    load = engine.load()
    assert load.lane_token_s > 0 and load.prefill_token_s > 0, load
    assert load.steps == load.lane_jobs_total == load.sampled_tokens_total == 0, load
    assert load.free_blocks == load.total_blocks and load.cached_blocks == 0 and not engine.has_unfinished()
    assert not engine.scheduler.held
    no_lane = LLM("tiny", max_num_batched_tokens=512, decode_step_target_s=0.5).engine.load()
    assert no_lane.lane_token_s == 0
