"""The prefill lane's split table (EngineConfig.sm_split_decode_sms as {decode rows up to: decode SMs}; issue 43):
its form, its refusals, and the engine's choice per job: which split a job takes, and where a row of 0 SMs leaves a
decode batch's prompts chunked into the steps. On the CPU the lane runs in order (engine.runner.prefill_lane), so
the choices are the same as on a GPU; tests/test_prefill_lane.py runs the table on green contexts."""

from __future__ import annotations

import pytest

from coordinator.config.serve_config import load_serve_config
from engine import LLM, SamplingParams
from engine.config_error import ConfigError
from engine.engine_config import EngineConfig
from engine.lane_splits import ANY_BATCH, decode_sms_for, fewest_lane_rows, split_table
from tests.engine_helpers import FixedStepBudget


@pytest.mark.parametrize("value", [-1, True, "64", 1.5, {}, {0: 32}, {32: -8}, {32: True}, {"a": 32},
                                   [(8, 32), (8, 64)], {32: 0}, {8: 0, 64: 0}])
def test_bad_sm_split_decode_sms_is_refused_by_name(value):
    with pytest.raises(ValueError, match="sm_split_decode_sms"):
        EngineConfig(model="tiny", sm_split_decode_sms=value)


def test_a_split_table_is_kept_sorted_and_looked_up_by_the_decode_batch():
    config = EngineConfig(model="tiny", sm_split_decode_sms={128: 64, 32: 32})
    assert config.sm_split_decode_sms == ((32, 32), (128, 64))  # frozen in one form, hashable
    table = split_table(config.sm_split_decode_sms)
    assert [decode_sms_for(table, rows) for rows in (1, 32, 33, 128, 500)] == [32, 32, 64, 64, 64]
    assert split_table(0) == () and split_table(48) == ((ANY_BATCH, 48),)
    assert decode_sms_for(split_table(48), 10_000) == 48


def test_each_job_takes_the_split_its_decode_batch_asks_for():
    """A table {1: 8, 64: 16}: a prompt that starts beside one decoding row gets the 8-SM split, one beside two rows
    the 16-SM split (on the CPU both run in order; the choice is the same as on a GPU)."""
    llm = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=64, sm_split_decode_sms={1: 8, 64: 16})
    e = llm.engine
    assert sorted(e.lane.splits) == [8, 16]

    def run_until_held(rid: str) -> None:
        for _ in range(6):
            e.step()
            if rid in e.scheduler.held:
                return
        raise AssertionError(f"{rid} never went to the lane")

    e.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        e.step()
    e.add_request("p1", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    run_until_held("p1")  # beside "a" alone
    assert (e.lane.splits[8].jobs, e.lane.splits[16].jobs) == (1, 0)
    for _ in range(3):
        e.step()
    e.add_request("p2", list(range(9, 50)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    run_until_held("p2")  # beside "a" and "p1"
    assert (e.lane.splits[8].jobs, e.lane.splits[16].jobs) == (1, 1)
    while e.has_unfinished():
        e.step()
    assert e.check_integrity()["in_use"] == 0


def test_a_pool_takes_a_split_table_from_yaml(tmp_path):
    path = tmp_path / "serve.yaml"
    path.write_text("model: tiny\nmode: collocated\ndecode: {workers: 1, sm_split_decode_sms: {128: 64, 32: 32}}\n")
    config = load_serve_config(path)
    assert config.engine_config(config.decode).sm_split_decode_sms == ((32, 32), (128, 64))
    path.write_text("model: tiny\nmode: collocated\ndecode: {workers: 1, sm_split_decode_sms: {12: 0, 128: 64}}\n")
    assert load_serve_config(path).decode.sm_split_decode_sms == ((12, 0), (128, 64))
    path.write_text("model: tiny\nmode: collocated\ndecode: {workers: 1, sm_split_decode_sms: {32: -1}}\n")
    with pytest.raises(ConfigError, match="sm_split_decode_sms.*SMs must be integers >= 0"):
        load_serve_config(path)


def test_a_row_of_0_sms_chunks_beside_that_many_rows():
    table = split_table({12: 0, 128: 64})
    assert [decode_sms_for(table, rows) for rows in (0, 1, 12, 13, 500)] == [0, 0, 0, 64, 64]
    assert fewest_lane_rows(table) == 13
    assert fewest_lane_rows(split_table({4: 0, 8: 0, 16: 32})) == 9
    assert fewest_lane_rows(split_table({2: 32, 8: 0, 16: 32})) == fewest_lane_rows(split_table(48)) == 1


def _held_or_chunked(e, rid: str) -> str:
    """Step until `rid`'s prompt went to the lane ("lane") or was computed in the steps ("chunked")."""
    for _ in range(20):
        e.step()
        if rid in e.scheduler.held:
            return "lane"
        request = e.scheduler.requests.get(rid)
        if request is None or request.num_pending_tokens <= 1:
            return "chunked"
    raise AssertionError(f"{rid} is neither on the lane nor computed")


def _decoding(e, rid: str, prompt: list[int]) -> None:
    e.add_request(rid, prompt, SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(3):
        e.step()


def test_a_prompt_beside_a_batch_of_a_0_row_is_chunked_and_beside_more_goes_to_the_lane():
    """{1: 0, 64: 16}: a prompt arriving beside one decoding row rides in the steps (no job, never held, the step
    loop keeps overlapping: nothing waits for schedule()); one beside two rows is a lane job; no lane figure is
    reported beside one row (the placement model then prices a local prompt as chunked)."""
    llm = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=64, sm_split_decode_sms={1: 0, 64: 16},
              async_scheduling=True)
    e = llm.engine
    assert sorted(e.lane.splits) == [16]
    _decoding(e, "a", [5, 6, 7, 8])
    e.add_request("p1", list(range(3, 100)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    assert not e._prompts_pending()  # beside one row: the engine need not stop overlapping for it
    assert _held_or_chunked(e, "p1") == "chunked" and e.lane.jobs == 0
    _decoding(e, "b", [9, 10, 11])  # (its prompt, beside two rows, is a lane job)
    jobs = e.lane.jobs
    e.add_request("p2", list(range(9, 90)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    assert _held_or_chunked(e, "p2") == "lane" and e.lane.splits[16].jobs == e.lane.jobs == jobs + 1
    while e.has_unfinished():
        e.step()
    assert e.check_integrity()["in_use"] == 0
    e.lane.token_s = 1e-4  # as measured
    assert e.load().lane_token_s == 0  # no row decodes: the table chunks beside 0 rows too
    _decoding(e, "c", [5, 6])
    assert e.load().lane_token_s == 0
    _decoding(e, "d", [7, 8])
    assert e.load().lane_token_s == 1e-4


def test_the_start_probe_decodes_as_many_rows_as_the_lane_needs():
    """With a step target the start probe measures the lane: beside {2: 0, 64: 16}'s three decoding rows, so its
    prompt goes to the lane; nothing is left behind."""
    engine = LLM("tiny", max_num_batched_tokens=512, max_num_seqs=8, decode_step_target_s=0.5,
                 sm_split_decode_sms={2: 0, 64: 16}).engine
    assert engine.lane.token_s > 0 and engine.load().prefill_token_s > 0
    load = engine.load()
    assert load.steps == load.lane_jobs_total == 0 and load.free_blocks == load.total_blocks
    assert not engine.has_unfinished() and not engine.scheduler.held
    few_seqs = LLM("tiny", max_num_batched_tokens=512, max_num_seqs=3, decode_step_target_s=0.5,
                   sm_split_decode_sms={2: 0, 64: 16}).engine
    assert few_seqs.lane.token_s == 0 and not few_seqs.has_unfinished()  # 3 rows + the prompt do not fit 3 seqs


def test_the_start_probe_fits_a_cache_smaller_than_the_model_length():
    """A lane engine with a step target on a cache of 640 tokens (max_model_len 2,048): the probe's decoding rows ask
    for what the cache holds (they asked for max_model_len, and the engine refused to start); a table whose rows
    and prompt cannot fit beside each other skips the lane's figures at once (its cut prompt was once longer than
    the cache, and the probe stepped 10,000 times waiting for it)."""
    engine = LLM("tiny", device="cpu", decode_step_target_s=0.5, num_kv_blocks=40, max_num_batched_tokens=512,
                 sm_split_decode_sms=16).engine
    assert engine.lane.token_s > 0 and not engine.has_unfinished()
    engine = LLM("tiny", device="cpu", decode_step_target_s=0.5, num_kv_blocks=40, max_num_batched_tokens=512,
                 max_num_seqs=40, max_model_len=600, sm_split_decode_sms={29: 0, 64: 16}).engine
    assert engine.lane.token_s == 0 and not engine.has_unfinished() and not engine.lane.busy
    assert not engine.scheduler.held and engine.check_integrity()["in_use"] == 0


def test_prompts_chunked_beside_a_0_row_batch_keep_the_step_budget_in_planned_ahead_steps():
    """A decode step target and {1: 0, 64: 16}: a prompt arriving beside one decoding row while the engine overlaps
    its steps is chunked into the steps it plans ahead, at most the budget's tokens each (it was uncapped when the
    last plan had found nothing waiting)."""
    llm = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=512, sm_split_decode_sms={1: 0, 64: 16},
              decode_step_target_s=0.1, warmup=False, async_scheduling=True)
    e = llm.engine
    e.step_budget = FixedStepBudget(16, 0.1)
    carried = []
    launch = e.runner.launch

    def spy(sched, params, **options):
        rows = [len(c.token_ids) for c in sched.chunks]
        if 1 in rows:
            carried.append(sum(n for n in rows if n > 1))
        return launch(sched, params, **options)
    e.runner.launch = spy
    _decoding(e, "a", [5, 6, 7, 8])
    assert e._in_flight is not None  # overlapping
    e.scheduler.prefill_cap = None  # as a plan beside two rows with nothing waiting leaves it (lane jobs: uncapped)
    e.add_request("p", list(range(3, 200)), SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    assert e.lane.jobs == 0 and sum(carried) >= 190 and max(carried) <= 16, carried
