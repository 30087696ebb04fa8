"""Overlapped (async) scheduling on the tiny model: the engine queues decode step N+1 before it reads step N's
tokens, and must give exactly what step-by-step scheduling gives, whatever happens between steps (requests
joining, stopping on a token, aborted, preempted), leaving every block accounted for."""

from types import SimpleNamespace

import pytest

from engine import LLM, SamplingParams
from engine.runner.model_runner import ModelRunner
from tests.engine_helpers import random_prompts

VOCAB = 2000


def _params(stop_token: int) -> list[SamplingParams]:
    return [
        SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
        SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=17, ignore_eos=True),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, stop_token_ids=(stop_token,)),
        SamplingParams(temperature=1.0, top_k=20, seed=6, max_tokens=40, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=7, max_tokens=12, ignore_eos=True),
    ]


def _drive(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[dict, int]:
    """Requests 0-3 start together; 4 and 5 join when request 0 has 5 and 9 tokens; 1 is aborted when request 0
    has 12. Events hang on tokens seen, not on step counts, so both modes meet them in the same state.
    Returns ({request: (tokens, logprobs, finish_reason)}, overlapped launches)."""
    engine = llm.engine
    launched_after = []
    launch = engine.runner.launch

    def spy(sched, params, after=None, on_layer_done=None, **extras):
        launched_after.append(after is not None)
        return launch(sched, params, after=after, on_layer_done=on_layer_done, **extras)
    engine.runner.launch = spy
    for i in range(4):
        engine.add_request(f"r{i}", prompts[i], params[i])
    got: dict[str, list] = {f"r{i}": [[], [], None] for i in range(6)}
    pending = {5: 4, 9: 5}
    aborted = False
    while engine.has_unfinished():
        for out in engine.step():
            entry = got[out.request_id]
            entry[0] += out.new_token_ids
            entry[1] += [(lp.token_id, round(lp.logprob, 3), sorted(lp.top_logprobs)) for lp in out.new_logprobs]
            entry[2] = out.finish_reason
        engine.check_integrity()
        seen = len(got["r0"][0])
        for at, i in list(pending.items()):
            if seen >= at:
                engine.add_request(f"r{i}", prompts[i], params[i])
                del pending[at]
        if seen >= 12 and not aborted:
            aborted = engine.abort("r1")
            got["r1"][2] = got["r1"][2] or "abort"
    counts = engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0
    return {k: tuple(v[:2]) + (v[2],) for k, v in got.items()}, sum(launched_after)


@pytest.mark.parametrize("num_kv_blocks", [None, 7])  # 7 blocks of 16 tokens: decodes preempt each other
def test_overlapped_decode_equals_step_by_step(checkpoints, num_kv_blocks):
    folder = str(checkpoints.tiny())
    prompts = random_prompts((9, 33, 17, 40, 5, 21), VOCAB, seed=8)
    probe = LLM(folder, async_scheduling=False).generate([prompts[2]], SamplingParams(temperature=0, max_tokens=30,
                                                                                       ignore_eos=True))
    stop = probe[0].token_ids[6]  # request 2 stops mid-stream on its own 7th token
    params = _params(stop)
    results = {}
    for overlap in (False, True):
        llm = LLM(folder, async_scheduling=overlap, num_kv_blocks=num_kv_blocks, max_num_seqs=8)
        results[overlap], results[overlap, "after"] = _drive(llm, prompts, params)
        if num_kv_blocks:
            assert llm.engine.scheduler.num_preemptions > 0
    assert results[True] == results[False]
    r = results[True]
    assert r["r2"][2] == "stop" and r["r2"][0][-1] == stop and len(r["r2"][0]) <= 7
    assert r["r1"][2] == "abort" and 0 < len(r["r1"][0]) < 17
    assert [len(r[f"r{i}"][0]) for i in (0, 3, 4, 5)] == [24, 40, 1, 12]
    assert results[False, "after"] == 0 and results[True, "after"] > 20  # most decode steps overlapped


def test_a_full_engine_with_requests_waiting_keeps_overlapping_and_equals_step_by_step(checkpoints):
    """More requests than max_num_seqs: while every slot is taken the waiting ones do not stop the overlap (they
    once did on every step: a saturated server lost it); a slot freed by length or by a stop token is filled."""
    folder = str(checkpoints.tiny())
    prompts = random_prompts((9, 33, 17, 40, 5, 21, 12, 28), VOCAB, seed=8)
    probe = LLM(folder, async_scheduling=False).generate([prompts[2]], SamplingParams(temperature=0, max_tokens=30,
                                                                                       ignore_eos=True))
    params = [_params(probe[0].token_ids[6])[i % 6] for i in range(8)]  # r2 stops on its 7th token
    results, overlapped = {}, {}
    for overlap in (False, True):
        llm = LLM(folder, async_scheduling=overlap, max_num_seqs=3)
        launch, queued_after = llm.engine.runner.launch, []

        def spy(sched, params, after=None, launch=launch, queued_after=queued_after, **kw):
            queued_after.append(after is not None)
            return launch(sched, params, after=after, **kw)
        llm.engine.runner.launch = spy
        outs = llm.generate(prompts, params)
        results[overlap] = [(o.token_ids, o.finish_reason) for o in outs]
        overlapped[overlap] = sum(queued_after) / len(queued_after)
        assert llm.engine.check_integrity()["in_use"] == 0
    assert results[True] == results[False]
    assert results[True][2][1] == "stop"
    assert overlapped[False] == 0 and overlapped[True] > 0.6


def test_overlap_is_on_by_default_where_the_device_runs_asynchronously(checkpoints):
    """On the CPU a step computes inside its launch: overlap would only hand its tokens out a step later."""
    assert LLM(str(checkpoints.tiny())).engine.overlap is False
    assert LLM(str(checkpoints.tiny()), async_scheduling=True).engine.overlap is True


def test_a_lone_request_overlaps_and_its_last_token_ends_the_pipeline(checkpoints):
    llm = LLM(str(checkpoints.tiny()), async_scheduling=True)
    engine = llm.engine
    engine.add_request("a", random_prompts((12,), VOCAB, seed=2)[0],
                       SamplingParams(temperature=0, max_tokens=6, ignore_eos=True))
    per_step = []
    while engine.has_unfinished():
        per_step.append([(o.new_token_ids, o.finish_reason) for o in engine.step()])
    # the prefill step is queued and the call returns nothing; each later call queues the next (decode) step and
    # returns the previous one's token; the step that samples token 6 is not followed by another
    assert [len(s) for s in per_step] == [0, 1, 1, 1, 1, 1, 1]
    assert per_step[-1][0][1] == "length" and engine._in_flight is None
    assert isinstance(engine.runner, ModelRunner) and engine.check_integrity()["in_use"] == 0


def test_a_handed_over_request_joins_the_next_overlapped_step_and_equals_step_by_step(checkpoints):
    """Decode side of a handoff: requests whose KV arrives from a prefill engine (add_prefilled_request) while
    decode steps overlap join the step queued right after (their first token is known), not the one after the
    in-flight step's tokens are read, and give exactly what step-by-step scheduling gives: greedy, seeded with
    logprobs, and penalties (which read the joining request's history)."""
    folder = str(checkpoints.tiny())
    prompts = random_prompts((9, 33, 20, 45, 17), VOCAB, seed=13)
    params = [SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=3, max_tokens=30, ignore_eos=True),
              SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=20, seed=4, max_tokens=15, ignore_eos=True, logprobs=2),
              SamplingParams(temperature=0.8, seed=5, max_tokens=15, ignore_eos=True, repetition_penalty=1.3,
                             frequency_penalty=0.5, presence_penalty=0.2)]
    prefill = LLM(folder).engine
    for i in (2, 3, 4):
        prefill.add_request(f"r{i}", prompts[i], params[i], prefill_only=True)
    firsts = {}
    while prefill.has_unfinished():
        firsts.update({o.request_id: o for o in prefill.step()})

    def drive(overlap: bool) -> tuple[dict, list[int]]:
        engine = LLM(folder, async_scheduling=overlap, max_num_seqs=8).engine
        calls, joined_at = [0], {}
        launch = engine.runner.launch

        def spy(sched, params, after=None, on_layer_done=None, **extras):
            for c in sched.chunks:
                joined_at.setdefault(c.request_id, calls[0])
            return launch(sched, params, after=after, on_layer_done=on_layer_done, **extras)
        engine.runner.launch = spy
        for i in (0, 1):
            engine.add_request(f"r{i}", prompts[i], params[i])
        got: dict[str, list[int]] = {f"r{i}": [] for i in range(5)}
        logprobs: list = []
        pending = {4: 2, 7: 3, 10: 4}  # r0's token count -> the request handed over then
        added_at = {}
        while engine.has_unfinished():
            calls[0] += 1
            for out in engine.step():
                got[out.request_id] += out.new_token_ids
                if out.request_id == "r3":
                    logprobs += [(lp.token_id, round(lp.logprob, 4)) for lp in out.new_logprobs]
            for at, i in list(pending.items()):
                if len(got["r0"]) >= at:
                    rid, first = f"r{i}", firsts[f"r{i}"]
                    dst = engine.reserve_blocks(rid, len(prompts[i]))
                    engine.kv_cache[dst] = prefill.kv_cache[first.pinned_block_ids]  # what kvtransfer does
                    engine.add_prefilled_request(rid, prompts[i], first.new_token_ids[0], params[i],
                                                 first.new_logprobs[0] if first.new_logprobs else None)
                    got[rid] += first.new_token_ids
                    added_at[rid] = calls[0]
                    del pending[at]
        counts = engine.check_integrity()
        assert counts["in_use"] == 0 and counts["pinned"] == 0
        return {**got, "r3 logprobs": logprobs}, [joined_at[r] - added_at[r] for r in ("r2", "r3", "r4")]

    sync, sync_join = drive(False)
    overlapped, overlapped_join = drive(True)
    assert overlapped == sync
    assert [len(overlapped[f"r{i}"]) for i in (2, 3, 4)] == [12, 15, 15]
    assert sync_join == [1, 1, 1]
    assert overlapped_join == [1, 1, 1]  # launched by the very next step() call, which overlaps r0 and r1's step


def test_a_joining_row_takes_its_own_token_when_the_step_before_sampled_fork_rows():
    """The step in flight may have sampled a group's extra choices after its rows (engine.step_extras.fork_rows):
    a joining request's known token is placed after all of them, not after the sampling rows only (found in
    review: it read a fork's token)."""
    import torch

    from engine.core.scheduler import PENDING_TOKEN, ScheduledChunk, SchedulerOutput
    from engine.runner.step_inputs import build_step_inputs

    def chunk(rid, token):
        return ScheduledChunk(rid, [token], 10, [0], True, 1)
    after = SimpleNamespace(sampling=[chunk("r0", PENDING_TOKEN), chunk("g", PENDING_TOKEN)],
                            sampled=SimpleNamespace(tokens=torch.tensor([11, 22, 33, 44])))  # r0, g, g's 2 forks
    sched = SchedulerOutput([chunk("r0", PENDING_TOKEN), chunk("j", 99),
                             ScheduledChunk("p", [5, 6, 7], 0, [1], True, 0)])  # a prompt joins too
    take = ModelRunner._take(after, sched)
    assert take == [0, -1]  # r0 takes row 0 of the step before; the joiner its own token
    step = build_step_inputs(sched, 16, torch.device("cpu"), None, take)
    ids = ModelRunner._ids_after(None, step, after.sampled.tokens)
    assert ids.tolist() == [11, 99, 5, 6, 7] and ids.dtype == torch.int32
    assert ModelRunner._take(after, SchedulerOutput([chunk("j", 99)])) is None  # no row waits: nothing to gather


def test_a_request_joining_while_a_group_prefill_is_in_flight_equals_step_by_step(checkpoints):
    """Collocated mode: a one-token group prefill (its extra choices sampled after its rows) has just run when a
    handed-over request joins; the joiner decodes exactly as step by step (it once read a fork's token, when a
    group prefill could be in flight; now its step is read before the next is planned)."""
    folder = str(checkpoints.tiny())
    prompts = random_prompts((9, 20), VOCAB, seed=13)
    forks = (SamplingParams(temperature=1.0, seed=11, max_tokens=5, ignore_eos=True),
             SamplingParams(temperature=1.0, seed=12, max_tokens=5, ignore_eos=True))
    joiner = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prefill = LLM(folder).engine
    prefill.add_request("j", prompts[1], joiner, prefill_only=True)
    first = [o for _ in range(3) for o in prefill.step()][0]

    def drive(overlap: bool) -> list[int]:
        engine = LLM(folder, async_scheduling=overlap, max_num_seqs=8).engine
        engine.add_request("r0", prompts[0], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        for _ in range(3):
            engine.step()
        engine.add_request("g", [7], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True),
                           prefill_only=True, fork_params=forks)
        out, added = list(first.new_token_ids), False
        while engine.has_unfinished():
            steps = engine.step()
            out += [t for o in steps if o.request_id == "j" for t in o.new_token_ids]
            assert engine._in_flight is None or "g" not in {c.request_id for c in engine._in_flight.sched.chunks}
            if not added and any(o.request_id == "g" for o in steps):
                dst = engine.reserve_blocks("j", len(prompts[1]))
                engine.kv_cache[dst] = prefill.kv_cache[first.pinned_block_ids]
                engine.add_prefilled_request("j", prompts[1], first.new_token_ids[0], joiner)
                added = True
            if "g" in engine.scheduler.requests and engine.scheduler.requests["g"].status.value == "pinned":
                engine.release("g")
        assert added and engine.check_integrity()["in_use"] == 0
        return out

    overlapped, sync = drive(True), drive(False)
    assert len(overlapped) == 8 and overlapped == sync
