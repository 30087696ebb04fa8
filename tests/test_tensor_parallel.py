"""Tensor parallelism on the CPU (gloo, real follower processes): greedy output and per-step logits equal
transformers' at TP=2 and TP=4 (TP=4 over 2 KV heads replicates them), logits and seeded sampling equal TP=1's,
prompt logprobs and overlapped decode steps work across ranks, a killed follower fails the engine, and one lost
while it starts fails the start at once, named."""

from __future__ import annotations

import os

import pytest

from engine import LLM, SamplingParams
from engine.async_engine import AsyncEngine
from engine.engine_config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.runner.tp_leader import TPError
from tests.engine_helpers import LogitsRecorder, hf_greedy, random_prompts
from tests.test_model_exactness import vocab_size_of

NEW_TOKENS = 8
LENGTHS = (5, 19)
ARCHS = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def greedy(n: int) -> list[SamplingParams]:
    return [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True) for _ in range(n)]


def run_recorded(llm: LLM, prompts, params):
    recorder = LogitsRecorder(llm.engine)
    try:
        outs = llm.generate(prompts, params)
    finally:
        llm.engine.runner.sampler = recorder.sampler
    return outs, [recorder.logits_of(p) for p in params]


def prompt_logprobs(llm: LLM, prompt: list[int]):
    """The prompt logprobs of one request through the engine API (chunked over several steps)."""
    engine = llm.engine
    engine.add_request("plp", prompt, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    found = []
    while engine.has_unfinished():
        found += [o.prompt_logprobs for o in engine.step() if o.prompt_logprobs is not None]
    assert len(found) == 1
    return found[0]


@pytest.fixture(scope="module")
def llama_tp2(checkpoints):
    llm = LLM(str(checkpoints.get("LlamaForCausalLM")), tensor_parallel_size=2, max_num_batched_tokens=8)
    yield llm
    llm.engine.close()


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("arch", ARCHS)
def test_greedy_and_logits_match_transformers(checkpoints, arch, size):
    folder = checkpoints.get(arch)
    prompts = random_prompts(LENGTHS, vocab_size_of(folder))
    refs = hf_greedy(folder, prompts, NEW_TOKENS)
    llm = LLM(str(folder), tensor_parallel_size=size)
    try:
        ranges = [r.as_tuple() for _, r in llm.engine.kv_shards]
        assert ranges == ([(0, 1), (1, 2)] if size == 2 else [(0, 1), (0, 1), (1, 2), (1, 2)])  # 2 KV heads
        assert llm.engine.kv_spec.num_kv_heads == 1 and llm.engine.kv_cache.shape[4] == 1
        outs, logits = run_recorded(llm, prompts, greedy(len(prompts)))
        for out, rows, (ref_tokens, ref_logits) in zip(outs, logits, refs, strict=True):
            assert out.token_ids == ref_tokens
            diff = (rows - ref_logits).abs().max().item()
            assert diff < 1e-4, f"max abs logits difference {diff}"
        assert llm.engine.check_integrity()["in_use"] == 0
    finally:
        llm.engine.close()


def test_logits_prompt_logprobs_and_seeded_sampling_equal_tp1(checkpoints, llama_tp2):
    """Chunked prefill (8-token budget), prompt logprobs (the followers mirror their logits calls) and seeded
    random sampling with top-p and logprobs: TP=2 equals TP=1."""
    folder = checkpoints.get("LlamaForCausalLM")
    prompts = random_prompts((6, 13, 21), vocab_size_of(folder), seed=3)
    single = LLM(str(folder), max_num_batched_tokens=8)

    def params():
        return [SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True),
                SamplingParams(temperature=0.9, top_p=0.9, seed=11, max_tokens=NEW_TOKENS, ignore_eos=True,
                               logprobs=3),
                SamplingParams(temperature=1.0, seed=12, max_tokens=NEW_TOKENS, ignore_eos=True)]
    want, want_logits = run_recorded(single, prompts, params())
    got, got_logits = run_recorded(llama_tp2, prompts, params())
    for a, b, la, lb in zip(want, got, want_logits, got_logits, strict=True):
        assert a.token_ids == b.token_ids
        assert (la - lb).abs().max().item() < 1e-4
    want_prompt, got_prompt = prompt_logprobs(single, prompts[2]), prompt_logprobs(llama_tp2, prompts[2])
    assert [p.token_id for p in got_prompt] == prompts[2][1:]
    for pa, pb in zip(want_prompt, got_prompt, strict=True):
        assert pa.rank == pb.rank and abs(pa.logprob - pb.logprob) < 1e-4
    for la, lb in zip(want[1].logprobs, got[1].logprobs, strict=True):
        assert la.token_id == lb.token_id and abs(la.logprob - lb.logprob) < 1e-4
    assert llama_tp2.engine.check_integrity()["in_use"] == 0


def test_killed_follower_fails_the_engine(checkpoints):
    llm = LLM(str(checkpoints.get("LlamaForCausalLM")), tensor_parallel_size=2)
    try:
        assert llm.generate([[5, 6, 7]], greedy(1))[0].token_ids
        follower = llm.engine.followers.procs[0]
        loop = AsyncEngine(llm.engine, lambda outputs, load: None)
        with pytest.raises(ValueError, match="no tensor-parallel rank 2"):
            loop.kill_rank(2)
        assert loop.kill_rank(1) == follower.pid  # the drill's SIGKILL (POST /admin/workers/{name}/kill?rank=1)
        follower.join(10)
        with pytest.raises(TPError, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"):
            llm.generate([[5, 6, 7]], greedy(1))
        llm.engine.add_request("after", [5, 6, 7], greedy(1)[0])
        with pytest.raises(TPError, match="rank 1"):  # and it stays failed
            llm.engine.step()
    finally:
        llm.engine.close()
    assert not follower.is_alive()


class _LostStarting:
    """A rank service (engine.runner.rank_service) whose prepare() ends its follower before it joins the group:
    `exit` as a process lost starting (os._exit), else as one whose start raised."""

    def __init__(self, exit: bool) -> None:
        self.exit = exit

    def prepare(self, device: str) -> str:
        if self.exit:
            os._exit(7)
        raise KeyError("no such device")

    def start(self, *args):
        raise AssertionError("a follower lost starting starts nothing")


@pytest.mark.timeout(120)  # rank 0 once waited out the group's rendezvous (300 s) for such a rank
@pytest.mark.parametrize("exit, error", [(True, r"rank 1 \(pid \d+\) exited with code 7"),
                                         (False, r"rank 1 failed:\n(.|\n)*KeyError: 'no such device'")])
def test_a_follower_lost_before_it_joins_fails_the_start_naming_it(checkpoints, exit, error):
    config = EngineConfig(model=str(checkpoints.get("LlamaForCausalLM")), tensor_parallel_size=2)
    with pytest.raises(TPError, match=error):
        LLMEngine(config, rank_service=_LostStarting(exit))


def test_close_stops_the_followers(llama_tp2):
    procs = list(llama_tp2.engine.followers.procs)
    assert all(p.is_alive() for p in procs)
    llama_tp2.engine.close()
    assert all(p.exitcode == 0 for p in procs)
    with pytest.raises(TPError):
        llama_tp2.generate([[5, 6, 7]], greedy(1))


def test_the_all_reduce_choice_is_validated_and_gloo_has_no_one_shot(llama_tp2):
    from engine.engine_config import EngineConfig
    with pytest.raises(ValueError, match=r"EngineConfig.tp_all_reduce must be one of \('auto', 'nccl', 'one_shot'\)"):
        EngineConfig(tp_all_reduce="nvls")
    with pytest.raises(ValueError, match="EngineConfig.tp_all_reduce .*'one_shot' needs a cuda device"):
        EngineConfig(tp_all_reduce="one_shot", tensor_parallel_size=2)
    assert llama_tp2.engine.followers.tp.one_shot is None  # gloo sums every tensor itself


def test_a_rank_kill_needs_tensor_parallel_ranks():
    with pytest.raises(ValueError, match="no tensor-parallel rank 1: this worker runs tensor_parallel_size 1"):
        AsyncEngine(LLM("tiny").engine, lambda outputs, load: None).kill_rank(1)
