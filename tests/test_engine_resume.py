"""Resumed requests on the tiny model (request migration, issue 11): a request restarted with its first k outputs
already known (`prior_output_ids`) must continue exactly as the uninterrupted run did, collocated or disaggregated,
batched with fresh requests, with overlapped scheduling on or off, and through preemption.

Tokens are compared exactly. Logprobs are compared to 1e-5: the resumed run computes the prior outputs' KV in one
prefill pass where the uninterrupted run computed it one decode step at a time, so float sums run in another order
(1-2 float32 ulps measured); top-logprob ids are compared exactly.
"""

from __future__ import annotations

import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts

VOCAB = 2000
N = 24  # tokens of the uninterrupted runs
CUTS = (1, 2, 9, 16, 17, N - 1)  # k: outputs already delivered when the request resumes
LOGPROB_TOL = 1e-5
PARAMS = {
    "greedy": SamplingParams(temperature=0, max_tokens=N, ignore_eos=True, logprobs=3),
    "seeded": SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=1234, max_tokens=N, ignore_eos=True,
                             logprobs=3),
}
PROMPTS = random_prompts((21, 32), VOCAB, seed=4)


@pytest.fixture(scope="module")
def folder(checkpoints) -> str:
    return str(checkpoints.tiny())


@pytest.fixture(scope="module")
def refs(folder) -> dict:
    """{(params name, prompt index): the uninterrupted RequestOutput}."""
    llm = LLM(folder, enable_prefix_caching=False)
    return {(name, i): llm.generate([prompt], p)[0] for name, p in PARAMS.items() for i, prompt in enumerate(PROMPTS)}


def drive(engine, pinned: dict | None = None) -> dict[str, list]:
    """Step until idle; {request id: [tokens, logprobs, finish_reason]} of what the StepOutputs carried (and the
    pinned blocks reported, into `pinned`)."""
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            entry = got.setdefault(out.request_id, [[], [], None])
            entry[0] += out.new_token_ids
            entry[1] += out.new_logprobs
            entry[2] = out.finish_reason
            if out.pinned_block_ids is not None and pinned is not None:
                pinned[out.request_id] = out.pinned_block_ids
    return got


def assert_continues(ref, k: int, tokens: list[int], logprobs: list, finish: str | None) -> None:
    assert tokens == ref.token_ids[k:], f"cut {k}"
    assert finish == ref.finish_reason == "length"
    assert len(logprobs) == len(tokens)
    for got, want in zip(logprobs, ref.logprobs[k:], strict=True):
        assert got.token_id == want.token_id and abs(got.logprob - want.logprob) <= LOGPROB_TOL, f"cut {k}"
        assert list(got.top_logprobs) == list(want.top_logprobs)


def check_clean(engine) -> None:
    counts = engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0 and not engine.has_unfinished()


@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("name", list(PARAMS))
def test_resumed_request_continues_the_uninterrupted_run(folder, refs, name, overlap):
    engine = LLM(folder, enable_prefix_caching=False, async_scheduling=overlap).engine  # a fresh worker: no cache
    for i, prompt in enumerate(PROMPTS):
        ref = refs[name, i]
        for k in CUTS:
            before = engine.load()
            engine.add_request(f"r{i}-{k}", prompt, PARAMS[name], prior_output_ids=ref.token_ids[:k])
            tokens, logprobs, finish = drive(engine)[f"r{i}-{k}"]
            assert_continues(ref, k, tokens, logprobs, finish)
            after = engine.load()
            # KV of prompt + prior outputs computed once, then one decode per new token after the first
            assert after.scheduled_tokens_total - before.scheduled_tokens_total == len(prompt) + k + (N - k - 1)
            assert after.sampled_tokens_total - before.sampled_tokens_total == N - k
    check_clean(engine)


def test_prefix_cache_serves_the_prompt_of_a_resumed_request(folder, refs):
    engine = LLM(folder).engine
    prompt, ref, k = PROMPTS[1], refs["seeded", 1], 5  # a 32-token prompt: two full blocks
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))
    drive(engine)
    before = engine.load()
    engine.add_request("r", prompt, PARAMS["seeded"], prior_output_ids=ref.token_ids[:k])
    tokens, logprobs, finish = drive(engine)["r"]
    assert_continues(ref, k, tokens, logprobs, finish)
    after = engine.load()
    assert after.prefix_hit_tokens_total - before.prefix_hit_tokens_total == 32
    assert after.prefix_query_tokens_total - before.prefix_query_tokens_total == 32 + k
    assert after.scheduled_tokens_total - before.scheduled_tokens_total == k + (N - k - 1)
    check_clean(engine)


@pytest.mark.parametrize("name", list(PARAMS))
def test_disaggregated_resume_prefill_with_prior_outputs_then_decode_elsewhere(folder, refs, name):
    prefill, decode = LLM(folder).engine, LLM(folder, enable_prefix_caching=False).engine
    p = PARAMS[name]
    cases = [(f"r{i}-{k}", i, k) for i in range(len(PROMPTS)) for k in CUTS]
    for rid, i, k in cases:
        prefill.add_request(rid, PROMPTS[i], p, prefill_only=True, prior_output_ids=refs[name, i].token_ids[:k])
    pinned: dict[str, list[int]] = {}
    firsts = drive(prefill, pinned)
    for rid, i, k in cases:
        ref, prompt = refs[name, i], PROMPTS[i]
        (first,), (first_lp,), finish = firsts[rid]
        assert first == ref.token_ids[k] and abs(first_lp.logprob - ref.logprobs[k].logprob) <= LOGPROB_TOL
        if k == N - 1:  # the prefill sampled the last token: nothing is pinned, nothing to decode
            assert finish == "length" and rid not in pinned
            continue
        assert finish is None and len(pinned[rid]) == -(-(len(prompt) + k) // 16)
        dst = decode.reserve_blocks(rid, len(prompt) + k)
        decode.kv_cache[dst] = prefill.kv_cache[pinned[rid]]  # what kvtransfer does
        assert prefill.release(rid)
        started = decode.add_prefilled_request(rid, prompt, first, p, first_lp, prior_output_ids=ref.token_ids[:k])
        assert started is None
    before = decode.load()
    rest = drive(decode)
    for rid, i, k in cases:
        if k < N - 1:
            tokens, logprobs, finish = rest[rid]
            assert_continues(refs[name, i], k, [firsts[rid][0][0]] + tokens, firsts[rid][1] + logprobs, finish)
    # decode never recomputed the transferred KV: one token per step for each new output after the first
    assert decode.load().scheduled_tokens_total - before.scheduled_tokens_total == sum(
        N - k - 1 for _, _, k in cases if k < N - 1)
    check_clean(prefill)
    check_clean(decode)


@pytest.mark.parametrize("overlap", [True, False])
def test_resumed_and_fresh_requests_mixed_in_one_batch(folder, refs, overlap):
    engine = LLM(folder, async_scheduling=overlap, enable_prefix_caching=False).engine
    overlapped = _count_overlapped_launches(engine)
    start = [("fresh-g0", "greedy", 0, 0), ("res-s1-9", "seeded", 1, 9), ("fresh-s0", "seeded", 0, 0),
             ("res-g1-2", "greedy", 1, 2)]
    late = [("res-g0-16", "greedy", 0, 16), ("fresh-g1", "greedy", 1, 0), ("res-s0-1", "seeded", 0, 1)]
    for rid, name, i, k in start:
        engine.add_request(rid, PROMPTS[i], PARAMS[name], prior_output_ids=refs[name, i].token_ids[:k])
    got: dict[str, list] = {}
    while engine.has_unfinished():
        for out in engine.step():
            entry = got.setdefault(out.request_id, [[], [], None])
            entry[0] += out.new_token_ids
            entry[1] += out.new_logprobs
            entry[2] = out.finish_reason
        if late and len(got.get("fresh-g0", [[]])[0]) >= 4:  # join while decode steps are on the device
            rid, name, i, k = late.pop(0)
            engine.add_request(rid, PROMPTS[i], PARAMS[name], prior_output_ids=refs[name, i].token_ids[:k])
    assert not late
    for rid, name, i, k in start + [("res-g0-16", "greedy", 0, 16), ("fresh-g1", "greedy", 1, 0),
                                    ("res-s0-1", "seeded", 0, 1)]:
        assert_continues(refs[name, i], k, *got[rid])
    assert (overlapped[0] > 10) == overlap
    check_clean(engine)


def _count_overlapped_launches(engine) -> list[int]:
    count = [0]
    launch = engine.runner.launch

    def spy(sched, params, after=None, on_layer_done=None, **extras):
        count[0] += after is not None
        return launch(sched, params, after=after, on_layer_done=on_layer_done, **extras)
    engine.runner.launch = spy
    return count


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_of_resumed_requests_keeps_their_tokens(folder, refs, overlap):
    # 6 blocks of 16 tokens; each request grows to 45 or 56 tokens (3-4 blocks): they preempt each other
    engine = LLM(folder, num_kv_blocks=6, async_scheduling=overlap, max_num_seqs=8).engine
    cases = [("a", "greedy", 1, 3), ("b", "seeded", 0, 7), ("c", "seeded", 1, 12), ("d", "greedy", 0, 1)]
    requests = {}
    for rid, name, i, k in cases:
        engine.add_request(rid, PROMPTS[i], PARAMS[name], prior_output_ids=refs[name, i].token_ids[:k])
        requests[rid] = engine.scheduler.requests[rid]
    got = drive(engine)
    for rid, name, i, k in cases:
        assert_continues(refs[name, i], k, *got[rid])
    assert sum(r.num_preemptions for r in requests.values()) == engine.scheduler.num_preemptions > 0
    check_clean(engine)


def test_bad_prior_outputs_are_refused_with_the_field_named(folder):
    engine = LLM(folder, max_model_len=64).engine
    prompt, p = PROMPTS[0], SamplingParams(max_tokens=10)
    with pytest.raises(ValueError, match=r"prior_output_ids \[2048, -1\] are outside the vocabulary"):
        engine.add_request("x", prompt, p, prior_output_ids=[5, 2048, -1])
    with pytest.raises(ValueError, match="prior_output_ids holds 10 tokens, leaving none of SamplingParams.max_tokens"):
        engine.add_request("x", prompt, p, prior_output_ids=[5] * 10)
    with pytest.raises(ValueError, match="prior_output_ids of 43 leave no room .* max_model_len 64"):
        engine.add_request("x", prompt, SamplingParams(max_tokens=60), prior_output_ids=[5] * 43)
    with pytest.raises(TypeError):
        engine.add_request("x", prompt, p, prior_output_ids=[5.0])
    engine.reserve_blocks("y", len(prompt) + 2)
    with pytest.raises(ValueError, match="prior_output_ids"):
        engine.add_prefilled_request("y", prompt, 7, p, prior_output_ids=[5] * 10)
    with pytest.raises(ValueError, match="first_token_id"):
        engine.add_prefilled_request("y", prompt, 2048, p, prior_output_ids=[5, 6])
    engine.reserve_blocks("z", 16)  # one block, but the prompt and 3 prior outputs are 24 tokens of KV
    with pytest.raises(ValueError, match="cannot hold 24 tokens"):
        engine.add_prefilled_request("z", prompt, 7, p, prior_output_ids=[5] * 3)
    assert engine.abort("y") and engine.abort("z")  # refused requests leave their reservation to the caller
    engine.reserve_blocks("w", len(prompt) + 1)
    done = engine.add_prefilled_request("w", prompt, 7, SamplingParams(max_tokens=2), prior_output_ids=[5])
    assert done.finish_reason == "length" and done.new_token_ids == []  # its first token was its last
    check_clean(engine)



@pytest.mark.timeout(300)
def test_pool_workers_resume_over_a_real_transfer_and_after_their_prefill_peer_is_replaced(folder, refs):
    """Real Ray actors and a real UCX pull: prefill(prior_output_ids) -> decode(prior_output_ids) continues the
    uninterrupted run; after the prefill worker is killed and replaced under its name, replace_peer lets the
    decode worker pull from the new one; generate(prior_output_ids) recomputes on the decode worker itself."""
    import os

    import ray

    from decode_pool.step_delta import StepDelta
    from engine.engine_config import EngineConfig
    from kvtransfer import AgentConfig
    from pool_worker.worker import Worker

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    old_path = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (root, old_path) if p)  # Ray workers inherit it
    owner = not ray.is_initialized()
    if owner:
        ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    cfg, agent_cfg = EngineConfig(model=folder), AgentConfig(timeout_s=20.0, connect_timeout_s=10.0)
    worker_cls = ray.remote(num_cpus=0, max_concurrency=100)(Worker)
    actors = []

    def start_prefill():
        actors.append(worker_cls.remote("prefill-0", cfg, agent_cfg, 1, 10.0, role="prefill"))
        return actors[-1], ray.get(actors[-1].start.remote(), timeout=120)

    def run_disaggregated(prefill, rid: str, name: str, i: int, k: int) -> None:
        prior, p, prompt = refs[name, i].token_ids[:k], PARAMS[name], PROMPTS[i]
        first = ray.get(prefill.prefill.remote(rid, prompt, p, prior_output_ids=prior), timeout=60)
        assert len(first.block_ids) == -(-(len(prompt) + k) // 16)
        assert [p for p, _ in first.phases] == ["prefill_queue", "prefill_compute"]
        assert all(s >= 0 for _, s in first.phases) and first.phases[1][1] > 0
        ray.get(decode.decode.remote(rid, prompt, p, first.first_token_id, first.first_logprob, "prefill-0",
                                     first.block_ids, prior_output_ids=prior), timeout=60)
        assert ray.get(prefill.release.remote(rid), timeout=30)
        collect(rid, [first.first_token_id], [first.first_logprob], name, i, k,
                ["kv_transfer", "decode_join", "first_decode_step"])

    def collect(rid: str, tokens: list, logprobs: list, name: str, i: int, k: int, phases: list[str]) -> None:
        """The request's outputs, which continue the reference; its phase durations on the decode worker come
        once, with its first output."""
        finish, timed = None, []
        while finish is None:
            outs, _, durations = ray.get(decode.poll.remote(1.0), timeout=30)
            timed += [durations[rid]] if rid in durations else []
            for out in (StepDelta(*fields) for fields in outs):  # poll sends plain tuples
                assert out.request_id == rid
                tokens, logprobs, finish = tokens + out.new_token_ids, logprobs + out.new_logprobs, out.finish_reason
        assert_continues(refs[name, i], k, tokens, logprobs, finish)
        assert len(timed) == 1 and [p for p, _ in timed[0]] == phases and all(s >= 0 for _, s in timed[0])

    try:
        decode = worker_cls.remote("decode-0", cfg, agent_cfg, 1, 10.0, role="decode")
        actors.append(decode)
        prefill, info = start_prefill()
        ray.get(decode.start.remote(), timeout=120)
        ray.get(decode.add_peer.remote(info.agent_metadata), timeout=60)
        for worker in (prefill, decode):  # start-up's objects are kept out of later collections (no GC stalls)
            assert ray.get(worker.__ray_call__.remote(lambda _: __import__("gc").get_freeze_count()),
                           timeout=30) > 10_000
            ray.get(worker.__ray_call__.remote(lambda _: __import__("gc").collect()), timeout=30)
            assert ray.get(worker.load.remote(), timeout=30).gc_full_collections_total >= 1  # reported with loads
        run_disaggregated(prefill, "a", "greedy", 0, 9)
        run_disaggregated(prefill, "b", "seeded", 1, 16)
        ray.kill(prefill, no_restart=True)
        prefill, info = start_prefill()
        ray.get(decode.replace_peer.remote("prefill-0", info.agent_metadata), timeout=60)
        run_disaggregated(prefill, "c", "seeded", 0, 2)
        prior = refs["greedy", 1].token_ids[:5]
        ray.get(decode.generate.remote("d", PROMPTS[1], PARAMS["greedy"], prior_output_ids=prior), timeout=60)
        collect("d", [], [], "greedy", 1, 5, ["prefill_queue", "prefill_compute"])
        for worker in (prefill, decode):
            counts = ray.get(worker.check_integrity.remote(), timeout=30)
            assert counts["in_use"] == counts["pinned"] == 0
        load = ray.get(decode.load.remote(), timeout=30)
        assert load.sampled_tokens_total == (N - 9 - 1) + (N - 16 - 1) + (N - 2 - 1) + (N - 5)
    finally:
        for actor in actors:
            try:
                ray.get(actor.shutdown.remote(), timeout=30)
            except Exception:  # noqa: BLE001 - killed already, or shutting down anyway
                pass
            ray.kill(actor, no_restart=True)
        if owner:
            ray.shutdown()
        if old_path is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old_path
