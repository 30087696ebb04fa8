"""EngineLoad on the tiny model (issue 16, truthful metrics): exact counters for scripted runs, checked against what
the scheduler itself planned and recorded (preemptions, prefix-cache lookups and hits, tokens scheduled and
sampled, steps), and the gauges in each request state."""

from __future__ import annotations

import dataclasses
import subprocess
import sys

import pytest

from engine import LLM, SamplingParams
from engine.load import ITERATION_TOKEN_BUCKETS, EngineLoad
from tests.engine_helpers import random_prompts

VOCAB = 2000


@pytest.fixture(scope="module")
def folder(checkpoints) -> str:
    return str(checkpoints.tiny())


def drain(engine) -> None:
    while engine.has_unfinished():
        engine.step()


def record_plans(engine) -> list:
    """Every SchedulerOutput the engine's scheduler hands out (schedule and schedule_after)."""
    plans: list = []
    s = engine.scheduler
    schedule, schedule_after = s.schedule, s.schedule_after

    def spy_schedule():
        plans.append(schedule())
        return plans[-1]

    def spy_after(prev):
        out = schedule_after(prev)
        if out is not None:
            plans.append(out)
        return out
    s.schedule, s.schedule_after = spy_schedule, spy_after
    return plans


@pytest.mark.parametrize("overlap", [False, True])
def test_counters_and_gauges_of_a_scripted_run(folder, overlap):
    engine = LLM(folder, async_scheduling=overlap).engine
    prompt = random_prompts((33,), VOCAB, seed=1)[0]
    greedy = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    tier = engine.host_tier  # on by default on the CPU, sized from the machine's memory: its capacity, nothing used
    assert tier is not None and tier.num_slots > 0
    assert engine.load() == EngineLoad(0, 0, 0, 0, engine.num_kv_blocks, engine.num_kv_blocks,
                                       iteration_token_counts=(0,) * (len(ITERATION_TOKEN_BUCKETS) + 1),
                                       host_tier_total_blocks=tier.num_slots,
                                       host_tier_capacity_bytes=tier.num_slots * tier.block_bytes)
    engine.add_request("a", prompt[:32], greedy)  # two full blocks
    load = engine.load()
    assert (load.num_waiting, load.num_running, load.queued_prompt_tokens) == (1, 0, 32)
    engine.step()
    load = engine.load()
    # overlapped, the prefill step is still in flight: its tokens count as queued until it is read
    assert (load.num_waiting, load.num_running, load.queued_prompt_tokens, load.steps) == (0, 1, 32 * overlap, 1)
    drain(engine)
    load = engine.load()
    # 1 prefill + 4 decodes; overlapped, the step that queues the first decode returns no token: one more call
    assert load.steps == 5 + overlap
    assert (load.scheduled_tokens_total, load.sampled_tokens_total) == (32 + 4, 5)
    # vLLM's tokens per step: the prompt with its first token (33: bucket le=64), then 4 steps of one token (le=1);
    # overlapped, the call that returned no token is no step of it
    assert load.iteration_tokens_total == 32 + 5
    assert load.iteration_token_counts == (4, 0, 0, 0, 1) + (0,) * (len(ITERATION_TOKEN_BUCKETS) - 4)
    assert (load.prefix_query_tokens_total, load.prefix_hit_tokens_total, load.preemptions_total) == (32, 0, 0)
    assert load.cached_blocks == 2 and load.free_blocks == load.total_blocks  # the prompt's blocks, evictable
    assert load.step_time_total_s >= load.step_time_last_s > 0
    engine.add_request("b", prompt[:32], greedy)  # the same prompt: 1 block hits (the last token is computed)
    engine.add_request("c", prompt, greedy)       # one token longer: both blocks hit
    drain(engine)
    load = engine.load()
    assert (load.prefix_query_tokens_total, load.prefix_hit_tokens_total) == (32 + 32 + 33, 16 + 32)
    assert load.scheduled_tokens_total == 36 + (32 - 16) + 4 + (33 - 32) + 4
    assert load.sampled_tokens_total == 15 and load.steps >= 10
    engine.add_request("p", prompt, greedy, prefill_only=True)
    drain(engine)
    engine.reserve_blocks("r", 40)
    load = engine.load()
    assert (load.num_pinned, load.num_reserved, load.num_running, load.num_waiting) == (1, 1, 0, 0)
    assert engine.release("p") and engine.abort("r")
    assert (engine.load().num_pinned, engine.load().num_reserved) == (0, 0)


@pytest.mark.parametrize("overlap", [False, True])
def test_preemptions_and_tokens_match_the_schedulers_own_records(folder, overlap):
    # 6 blocks of 16 tokens and no prefix cache: four requests growing to 3-4 blocks each preempt one another
    engine = LLM(folder, num_kv_blocks=6, enable_prefix_caching=False, async_scheduling=overlap).engine
    plans = record_plans(engine)
    prompts = random_prompts((21, 32, 17, 40), VOCAB, seed=2)
    requests = []
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, SamplingParams(temperature=0.7, seed=i, max_tokens=16, ignore_eos=True))
        requests.append(engine.scheduler.requests[f"r{i}"])
    waiting_after_preemption = []
    while engine.has_unfinished():
        seen = len(plans)
        engine.step()
        preempted = [rid for plan in plans[seen:] for rid in plan.preempted]
        if preempted and not overlap:  # a preempting step admits nobody: they all still wait
            waiting_after_preemption.append(engine.load().num_waiting >= len(preempted))
    load = engine.load()
    recorded = [rid for plan in plans for rid in plan.preempted]
    assert load.preemptions_total == len(recorded) == sum(r.num_preemptions for r in requests) > 0
    assert all(waiting_after_preemption)
    admissions = [c for plan in plans for c in plan.chunks if c.start_pos == 0]  # each (re)admission computes all
    assert load.prefix_query_tokens_total == sum(len(c.token_ids) for c in admissions)
    assert len(admissions) == len(prompts) + len(recorded) and load.prefix_hit_tokens_total == 0
    assert load.scheduled_tokens_total == sum(plan.num_tokens for plan in plans)
    assert load.sampled_tokens_total == 4 * 16
    # vLLM's tokens per step: every prompt once (with its first token), recomputes after preemptions not again
    assert load.iteration_tokens_total == sum(len(p) for p in prompts) + 4 * 16
    assert sum(load.iteration_token_counts) <= load.steps
    assert (load.num_waiting, load.num_running, load.queued_prompt_tokens) == (0, 0, 0)
    assert engine.check_integrity()["in_use"] == 0


def test_engine_load_is_numbers_with_defaults_and_imports_without_torch():
    old = EngineLoad(10, 1, 2, 0, 90, 100, 7)  # what existing callers construct
    assert (old.steps, old.preemptions_total, old.prefix_hit_tokens_total, old.step_time_total_s) == (7, 0, 0, 0.0)
    values = dataclasses.asdict(old)
    assert values.pop("iteration_token_counts") == ()  # a histogram's counts (coordinator.observability.vllm_engine)
    assert all(isinstance(v, int | float) for v in values.values())  # every other field can be exported as a metric
    with pytest.raises(dataclasses.FrozenInstanceError):
        old.steps = 8
    code = "import sys, engine.load; assert 'torch' not in sys.modules, 'engine.load imported torch'"
    subprocess.run([sys.executable, "-c", code], check=True)
