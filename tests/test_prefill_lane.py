"""The prefill lane (EngineConfig.sm_split_decode_sms, issue 43): prompts computed beside the decode steps.

On the CPU the lane runs in order (no SM split), which still exercises everything the engine does around it: the
prompt chunks handed to the lane, the scheduler holding their requests, the decode-only steps in between, the job
applied later. On a CUDA device of compute capability 9.0+ (`gpus(1)`), the same with real green contexts: outputs
equal the plain engine's, greedy and seeded."""

from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams
from engine.core.block_manager import BlockManager
from engine.core.request import Request
from engine.core.scheduler import Scheduler
from engine.engine_config import EngineConfig
from tests.engine_helpers import FixedStepBudget


def _workload(n: int = 6):
    prompts = [[(7 * k + i) % 90 + 3 for i in range(30 + 9 * k)] for k in range(n)]
    params = [SamplingParams(temperature=0, max_tokens=10, ignore_eos=True) if k % 2 == 0 else
              SamplingParams(temperature=0.9, seed=100 + k, max_tokens=10, ignore_eos=True) for k in range(n)]
    return prompts, params


def _generate(device: str, model: str, **options):
    llm = LLM(model, device=device, max_num_seqs=4, max_num_batched_tokens=64, **options)
    prompts, params = _workload()
    return [o.token_ids for o in llm.generate(prompts, params)], llm.engine


def test_lane_outputs_equal_the_plain_engine_on_the_cpu():
    expected, _ = _generate("cpu", "tiny")
    got, engine = _generate("cpu", "tiny", sm_split_decode_sms=64)
    assert got == expected
    assert engine.lane is not None and engine.lane.jobs > 0  # prompts did go to the lane
    assert not engine.scheduler.held and not engine.lane.busy
    counts = engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0


def _scheduler(blocks: int) -> Scheduler:
    return Scheduler(BlockManager(num_blocks=blocks, block_size=4, enable_prefix_caching=False), max_num_seqs=4,
                     max_num_batched_tokens=64)


def _request(rid: str, prompt: list[int], max_tokens: int) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), (), 64)


def test_held_requests_get_no_prompt_tokens_and_are_never_preempted():
    s = _scheduler(6)
    s.add(_request("long", list(range(3, 19)), 4))
    first = s.schedule()
    assert [c.request_id for c in first.chunks] == ["long"]
    s.held.add("long")  # the lane took its chunk: nothing about it is planned until the engine applies it
    s.add(_request("late", [5, 6, 7], 4))
    assert s.schedule().chunks == []  # no prompt tokens while held: "late" waits, "long" is not re-planned
    s.held.clear()
    s.update(first, {"long": (9, None)}, 60.0)
    nxt = s.schedule()
    assert {c.request_id for c in nxt.chunks} == {"long", "late"}


def test_a_held_request_is_not_the_victim_when_blocks_run_short():
    s = _scheduler(5)
    s.add(_request("a", list(range(3, 10)), 20))
    step = s.schedule()
    s.update(step, {"a": (9, None)}, 60.0)
    s.add(_request("b", list(range(3, 14)), 4))
    step = s.schedule()  # b's prompt beside a's decode row
    assert {c.request_id for c in step.chunks} == {"a", "b"}
    s.held.add("b")
    s.update(type(step)(chunks=[c for c in step.chunks if c.request_id == "a"]), {"a": (9, None)}, 60.0)
    for _ in range(8):  # a grows until the blocks run short: a itself is preempted, never the held b
        out = s.schedule()
        assert "b" not in out.preempted
        if out.preempted:
            break
        s.update(out, {c.request_id: (9, None) for c in out.chunks}, 60.0)
    assert "b" in s.requests and s.requests["b"] in s.running


def test_aborting_a_request_on_the_lane_frees_its_blocks():
    llm = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=64, sm_split_decode_sms=64)
    e = llm.engine
    e.add_request("short", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(3):
        e.step()
    e.add_request("long", list(range(3, 60)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    for _ in range(3):
        e.step()
        if e.scheduler.held:
            break
    assert e.scheduler.held == {"long"}  # on the CPU the job is done at once, and applied by the next step
    assert e.abort("long")
    while e.has_unfinished():
        e.step()
    assert not e.scheduler.held and e.check_integrity()["in_use"] == 0


@pytest.mark.parametrize("table", [{1: 8, 2: 16, 64: 24}, {1: 0, 2: 16, 64: 24}, {2: 16, 3: 0, 64: 24}])
def test_a_split_table_gives_the_plain_engines_outputs_on_the_cpu(table):
    expected, _ = _generate("cpu", "tiny")
    got, engine = _generate("cpu", "tiny", sm_split_decode_sms=table)
    assert got == expected and engine.lane.jobs > 0
    assert not engine.scheduler.held and engine.check_integrity()["in_use"] == 0


def test_sm_split_needs_one_rank():
    with pytest.raises(ValueError, match="sm_split_decode_sms"):
        EngineConfig(model="tiny", tensor_parallel_size=2, sm_split_decode_sms=64)


def _hopper_llama(checkpoints):
    """A small Llama checkpoint for the GPU tests of SM lanes; skips where lanes cannot be made (before CC 9.0, or
    without cuda-bindings)."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("SM lanes need compute capability 9.0+")
    pytest.importorskip("cuda.bindings", reason="SM lanes need cuda-bindings")
    return checkpoints.get("LlamaForCausalLM", num_hidden_layers=2, hidden_size=128, num_attention_heads=4,
                           num_key_value_heads=2, intermediate_size=256)


@pytest.mark.gpus(1)
def test_lane_on_green_contexts_equals_the_plain_engine(checkpoints):
    """Real SM lanes on a Hopper GPU: the prompts' forward on one green context, the decode graphs on the other."""
    llama = _hopper_llama(checkpoints)
    options = dict(kv_cache_memory_bytes=256 << 20, warmup=False)
    expected, _ = _generate("cuda", str(llama), **options)
    got, engine = _generate("cuda", str(llama), sm_split_decode_sms=64, **options)
    assert got == expected
    split = engine.lane.splits[64]
    assert split.lanes is not None and split.lanes.decode_sms >= 64 and engine.lane.jobs > 0
    assert split.graphs is not None and split.graphs.replays > 0  # decode steps on the lane's graphs


@pytest.mark.gpus(1)
def test_a_split_table_on_green_contexts_equals_the_plain_engine(checkpoints):
    """A table of two splits and a row of 0 on a Hopper GPU: each split's green contexts and decode graphs; prompts
    beside one decoding row are chunked, jobs beside two take 32 decode SMs, beside more 64; outputs as the plain
    engine's."""
    llama = _hopper_llama(checkpoints)
    options = dict(kv_cache_memory_bytes=256 << 20, warmup=False)
    expected, _ = _generate("cuda", str(llama), **options)
    got, engine = _generate("cuda", str(llama), sm_split_decode_sms={1: 0, 2: 32, 64: 64}, **options)
    assert got == expected
    splits = engine.lane.splits
    assert sorted(splits) == [32, 64]
    assert splits[32].lanes.decode_sms >= 32 and splits[64].lanes.decode_sms >= 64
    assert splits[32].lanes.decode_sms < splits[64].lanes.decode_sms
    assert splits[32].jobs + splits[64].jobs == engine.lane.jobs > 0
    assert all(split.graphs.replays > 0 for split in splits.values() if split.jobs)


@pytest.mark.gpus(1)
def test_a_decode_lane_as_large_as_the_gpu_is_refused_by_name(checkpoints):
    llama = _hopper_llama(checkpoints)
    total = torch.cuda.get_device_properties(0).multi_processor_count
    with pytest.raises(ValueError, match=f"sm_split_decode_sms.*{total} SMs.*leaves none of this GPU's"):
        LLM(str(llama), device="cuda", sm_split_decode_sms={1: 32, 64: total}, kv_cache_memory_bytes=256 << 20,
            warmup=False)


@pytest.mark.gpus(1)
def test_a_request_aborted_while_the_lanes_thread_launches_frees_its_blocks(checkpoints):
    """On CUDA the lane's own thread queues a job's forward: aborting its request at once (the launch may still be
    running) waits for the launch and the forward, then frees the blocks; the engine goes on and leaks nothing."""
    llama = _hopper_llama(checkpoints)
    llm = LLM(str(llama), device="cuda", max_num_seqs=4, max_num_batched_tokens=512, sm_split_decode_sms=64,
              kv_cache_memory_bytes=256 << 20, warmup=False)
    e = llm.engine
    try:
        e.add_request("short", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
        for _ in range(3):
            e.step()
        e.add_request("long", [(i * 7) % 90 + 3 for i in range(400)],
                      SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
        for _ in range(5):
            e.step()
            if e.scheduler.held:
                break
        assert e.scheduler.held == {"long"} and e.lane.busy
        assert e.abort("long")
        while e.has_unfinished():
            e.step()
        assert not e.lane.busy and not e.scheduler.held and e.check_integrity()["in_use"] == 0
        assert e.lane.launch_s > 0  # its launches ran (on the lane's thread)
    finally:
        e.close()


@pytest.mark.gpus(1)
@pytest.mark.parametrize("split", [64, {1: 0, 64: 64}], ids=["64 SMs", "chunked beside 1 row"])
def test_the_start_probe_measures_the_lane_on_green_contexts(checkpoints, split):
    """engine.step_rates with a lane on a Hopper GPU: the probe's second prompt runs on the prefill lane beside
    decoding requests (one; two where the table chunks beside one), its launches on the lane's thread, so the lane's
    rate is known at start, and nothing is left."""
    llama = _hopper_llama(checkpoints)
    llm = LLM(str(llama), device="cuda", max_num_seqs=4, max_num_batched_tokens=512, sm_split_decode_sms=split,
              decode_step_target_s=0.5, kv_cache_memory_bytes=256 << 20)
    e = llm.engine
    try:
        load = e.load()
        assert e.lane.token_s > 0 and load.prefill_token_s > 0 and load.lane_jobs_total == 0, load
        assert not e.has_unfinished() and not e.lane.busy and e.check_integrity()["in_use"] == 0
    finally:
        e.close()


def test_a_collocated_server_with_the_lane_gives_the_engines_outputs(llama, reference, tmp_path):
    """`pdserve serve` with decode.sm_split_decode_sms as a table (in order on the CPU): prompts arriving while others
    decode go to the lane, and every output equals the offline engine's, streamed or not."""
    import asyncio

    import httpx

    from tests.engine_helpers import random_prompts
    from tests.server_process import HALF_CPU, complete, metric_values, running_server, wait_for_idle_workers

    config = {"model": str(llama), "mode": "collocated",
              "decode": {**HALF_CPU, "workers": 1, "sm_split_decode_sms": {2: 32, 64: 64}, "chunk_size": 512}}
    prompts = random_prompts([40, 90, 7, 300, 64, 150], 2000, seed=43)
    expected = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
    with running_server(tmp_path, config) as server:
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                async def one(i, p):
                    await asyncio.sleep(0.05 * i)  # later prompts arrive while earlier ones decode
                    return await complete(client, server.url, {"model": str(llama), "prompt": p, "max_tokens": 200,
                                                               "temperature": 0, "ignore_eos": True,
                                                               "stream": i % 2 == 1})
                return await asyncio.gather(*[one(i, p) for i, p in enumerate(prompts)])
        assert [r["text"] for r in asyncio.run(run())] == [e.text for e in expected]
        wait_for_idle_workers(server.url)
        jobs = metric_values(server.url, "pdserve_worker_engine_lane_jobs_total")
        assert sum(jobs.values()) > 0  # prompts did run on the lane


def test_a_lane_job_does_not_teach_the_step_budget():
    """With a decode step target (the adaptive layout's workers), each step's time teaches the StepBudget what a
    prompt token costs inside a step; a lane job's prompt ran beside the steps, so no step's time is its cost."""
    llm = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=64, sm_split_decode_sms=64,
              decode_step_target_s=0.5, warmup=False, async_scheduling=True)  # overlapped, as on a GPU
    e = llm.engine
    seen = []
    observe = e.step_budget.observe
    e.step_budget.observe = lambda rows, tokens, s: (seen.append((rows, tokens)), observe(rows, tokens, s))[1]
    e.add_request("short", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=30, ignore_eos=True))
    for _ in range(3):
        e.step()
    e.add_request("long", list(range(3, 50)), SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    assert e.lane.jobs == 1
    assert not any(tokens == 47 for _, tokens in seen), seen  # the long prompt's 47 tokens taught no step


def test_the_lane_takes_a_prompt_whole_and_reports_its_rate():
    """The step budget caps the prompt tokens that ride in a decoding step; a lane's prompts do not ride in the
    steps, so a lane engine's jobs are not capped (one job for the whole prompt), and its measured seconds per
    prompt token reach the engine's load (what the placement model prices a local prefill at)."""
    llm = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=512, sm_split_decode_sms=64,
              decode_step_target_s=1e-6, warmup=False)  # a target no step meets: the budget is its floor (64)
    e = llm.engine
    assert e.load().lane_token_s == 0  # nothing measured yet
    e.add_request("short", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        e.step()
    e.add_request("long", [(i * 7) % 90 + 3 for i in range(300)],
                  SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while e.has_unfinished():
        e.step()
    assert e.lane.jobs == 1 and e.load().lane_token_s > 0


def test_lane_pays_by_the_engines_figures():
    from engine.core.lane_policy import FIGURE_TTL_S, lane_pays

    # no decode step target, or no lane figures yet: the lane
    assert lane_pays(5000, None, None, 50e-6, 0.012)
    assert lane_pays(5000, 256, 0.015, 0.0, 0.0)
    # a decode step beside the lane misses the target: chunk under the budget, which meets it
    assert not lane_pays(5000, 256, 0.015, 50e-6, 0.016)
    assert not lane_pays(5000, 256, 0.015, 50e-6, 0.016, lane_step_age_s=FIGURE_TTL_S / 2)
    # ... but not for ever: once that figure is older than FIGURE_TTL_S the lane gets a job, which measures it anew
    assert lane_pays(5000, 256, 0.015, 50e-6, 0.016, lane_step_age_s=FIGURE_TTL_S + 1)
    # 5,000 tokens: chunked 20 steps x 15 ms = 300 ms; the lane 5,000 x 50 us = 250 ms -> the lane
    assert lane_pays(5000, 256, 0.015, 50e-6, 0.012)
    # a roomy budget (1,024 a step): chunked 5 x 15 ms = 75 ms -> chunk
    assert not lane_pays(5000, 1024, 0.015, 50e-6, 0.012)
    # nothing waits: the lane (nothing to chunk either)
    assert lane_pays(0, 256, 0.015, 50e-6, 0.012)


def _long_beside_short(e) -> dict[str, list[int]]:
    """A 300-token prompt arrives while a short one decodes; every request's tokens."""
    tokens: dict[str, list[int]] = {}

    def step():
        for o in e.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    e.add_request("short", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        step()
    e.add_request("long", [(i * 7) % 90 + 3 for i in range(300)],
                  SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))
    while e.has_unfinished():
        step()
    return tokens


def test_prompts_are_chunked_where_the_lane_does_not_pay():
    """With a decode step target, the engine asks lane_pays before each step: by the lane's figures (set here) a
    prompt goes to the lane or is chunked under the budget; outputs are the same either way. A figure that keeps the
    lane passed over is measured anew once it is stale."""
    import math
    import time

    runs = {}
    for name, (token_s, step_s, step_at) in {
            "lane quicker": (1e-6, 0.001, math.inf), "chunks quicker": (1.0, 0.001, math.inf),
            "lane misses the target": (1e-6, 0.5, math.inf),  # measured "now" for the whole run
            "lane missed it long ago": (1e-6, 0.5, time.perf_counter() - 60)}.items():
        llm = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=512, sm_split_decode_sms=64,
                  decode_step_target_s=0.1, warmup=False)
        e = llm.engine
        e.step_budget = FixedStepBudget(64, 0.1)
        e.lane.token_s, e.lane.step_s, e.lane.step_at = token_s, step_s, step_at
        e.lane.observe_step = lambda s: None  # the figures stay as set
        tokens = _long_beside_short(e)
        runs[name] = e.lane.jobs, tokens
    assert runs["lane quicker"][0] == 1 and runs["lane missed it long ago"][0] == 1
    assert runs["chunks quicker"][0] == 0 and runs["lane misses the target"][0] == 0
    assert len({str(tokens) for _, tokens in runs.values()}) == 1


def test_streams_cut_off_while_prompts_are_on_the_lane_leak_nothing(llama, reference, tmp_path):
    """Clients that leave mid-stream or before their first token, while other prompts run on the lane (in order on
    the CPU): the rest get the engine's outputs, and once idle nothing is booked or held (the lane's held requests
    freed with their aborts)."""
    import asyncio

    import httpx

    from tests.engine_helpers import random_prompts
    from tests.server_process import HALF_CPU, assert_nothing_booked, complete, metric_values, running_server

    config = {"model": str(llama), "mode": "collocated", "server": {"admin_api": True},
              "decode": {**HALF_CPU, "workers": 1, "sm_split_decode_sms": 64, "chunk_size": 512}}
    prompts = random_prompts([200, 20, 300, 64, 250, 30, 330, 12], 2000, seed=47)
    kept = [i for i in range(len(prompts)) if i % 2 == 1]  # the long prompts are cut off, on the lane or after
    expected = reference.generate([prompts[i] for i in kept],
                                  SamplingParams(temperature=0, max_tokens=120, ignore_eos=True))
    with running_server(tmp_path, config) as server:
        async def run():
            # every prompt but stream 1's arrives once stream 1 decodes, so that the lane takes them beside its
            # decode steps (sent all at once, on a busy machine they could all be prefilled before any decoding)
            decoding = asyncio.Event()

            async def arrive(i):
                if i != 1:
                    await decoding.wait()
                await asyncio.sleep(0.03 * i)

            async with httpx.AsyncClient(timeout=120) as client:
                async def cut(i, p):  # leaves after a few chunks (or before any, for some)
                    await arrive(i)
                    body = {"model": str(llama), "prompt": p, "max_tokens": 150, "ignore_eos": True,
                            "stream": True}
                    async with client.stream("POST", f"{server.url}/v1/completions", json=body) as r:
                        seen = 0
                        async for line in r.aiter_lines():
                            seen += line.startswith("data:")
                            if seen >= i % 3:
                                break

                async def keep(i, p):
                    await arrive(i)
                    return await complete(client, server.url, {"model": str(llama), "prompt": p,
                                                               "max_tokens": 120, "temperature": 0,
                                                               "ignore_eos": True, "stream": True},
                                          on_chunk=lambda _: decoding.set())
                return await asyncio.gather(*[(keep if i in kept else cut)(i, p) for i, p in enumerate(prompts)])
        results = asyncio.run(run())
        assert [results[i]["text"] for i in kept] == [e.text for e in expected]
        assert_nothing_booked(server.url)
        assert sum(metric_values(server.url, "pdserve_worker_engine_lane_jobs_total").values()) > 0


def test_mode_adaptive_with_lanes_gives_the_engines_outputs(tmp_path):
    """Mode adaptive with the lane on both pools (in order on the CPU; the lane policy runs, under the SLO's decode
    step target): a flood of long prompts beside short ones, greedy and seeded, every output the offline engine's;
    nothing booked or held afterwards. (Where prompts go depends on timing: in the run that wrote this, 4 of 12 were
    prefilled locally, in 2 lane jobs; the test asserts only what holds wherever they go.)"""
    import asyncio

    import httpx

    from tests.engine_helpers import random_prompts
    from tests.server_process import HALF_CPU, assert_nothing_booked, complete, running_server

    pool = {**HALF_CPU, "max_num_seqs": 64, "max_num_batched_tokens": 1024, "sm_split_decode_sms": 64}
    config = {"model": "tiny", "dtype": "float32", "mode": "adaptive", "slo": {"ttft_ms": 300, "tpot_ms": 40},
              "planner": {"enabled": False}, "prefill": pool, "decode": pool, "transfer": {"backends": ["ucx"]},
              "admission": {"timeout_s": 120}, "server": {"admin_api": True}}
    prompts = random_prompts([900 - 37 * i if i % 2 == 0 else 20 + i for i in range(12)], 1000, seed=49)
    sampling = [{"temperature": 0} if i % 2 == 0 else {"temperature": 0.9, "seed": i} for i in range(12)]
    engine = LLM("tiny", dtype="float32")
    expected = [engine.generate([p], SamplingParams(max_tokens=24, ignore_eos=True, **s))[0].text
                for p, s in zip(prompts, sampling, strict=True)]
    with running_server(tmp_path, config) as server:
        async def run():
            async with httpx.AsyncClient(timeout=120) as client:
                return await asyncio.gather(*[
                    complete(client, server.url, {"model": "tiny", "prompt": p, "max_tokens": 24, "ignore_eos": True,
                                                  "stream": i % 3 == 0, **s})
                    for i, (p, s) in enumerate(zip(prompts, sampling, strict=True))])
        assert [r["text"] for r in asyncio.run(run())] == expected
        assert_nothing_booked(server.url)
