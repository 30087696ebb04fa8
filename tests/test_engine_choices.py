"""n choices of one prompt in the engine: the block manager's copy-on-write fork, group prefills (n first tokens
from one logits row), forked decoding equal to separate seeded requests, and prompt logprobs against a float64
transformers reference; a group whose structured output ends on its first token ends each choice where it decodes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine import LLM, SamplingParams
from engine.core.choices import choice_params, choice_seed
from engine.sampling.structured import StructuredSpec
from tests.engine_helpers import random_prompts

VOCAB = 2000
N_TOKENS = 12
PARAMS = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=N_TOKENS, ignore_eos=True, logprobs=2)
PROMPTS = random_prompts((21, 32), VOCAB, seed=9)  # 21: a partial last block; 32: two full blocks (size 16)


@pytest.fixture(scope="module")
def folder(checkpoints) -> str:
    return str(checkpoints.tiny())


@pytest.fixture(scope="module")
def separate(folder) -> dict:
    """{(prompt index, choice j): the tokens of a separate request seeded with choice_seed(77, j)}."""
    llm = LLM(folder, enable_prefix_caching=False)
    return {(i, j): llm.generate([p], SamplingParams(**{**PARAMS.__dict__, "seed": choice_seed(77, j)}))[0].token_ids
            for i, p in enumerate(PROMPTS) for j in range(3)}


def group_prefill(engine, rid: str, prompt: list[int], n: int) -> tuple[list, list[int]]:
    """A group prefill of n choices: [(first token, logprob)] per choice and the pinned blocks."""
    params = choice_params(PARAMS, n)
    engine.add_request(rid, prompt, params[0], prefill_only=True, fork_params=params[1:])
    outs = []
    while not outs:
        outs = [o for o in engine.step() if o.request_id == rid]
    (out,) = outs
    assert out.finish_reason is None and len(out.fork_first) == n - 1
    return [(out.new_token_ids[0], out.new_logprobs[0])] + out.fork_first, out.pinned_block_ids


def drive(engine) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    while engine.has_unfinished():
        for out in engine.step():
            got.setdefault(out.request_id, []).extend(out.new_token_ids)
            engine.check_integrity()
    return got


@pytest.mark.parametrize("disaggregated", [False, True])
def test_forked_choices_equal_separate_seeded_requests(folder, separate, disaggregated):
    prefill = LLM(folder, enable_prefix_caching=False).engine
    decode = LLM(folder, enable_prefix_caching=False).engine if disaggregated else prefill
    n = 3
    all_firsts = [group_prefill(prefill, f"g{i}", prompt, n) for i, prompt in enumerate(PROMPTS)]
    for i, prompt in enumerate(PROMPTS):
        firsts, pinned = all_firsts[i]
        assert len({t for t, _ in firsts}) > 1  # distinct seeds, (almost surely) distinct tokens
        src = f"g{i}"
        if disaggregated:  # one transfer into a reservation, then forks of it
            src = f"g{i}#0"
            dst = decode.reserve_blocks(src, len(prompt))
            decode.kv_cache[dst] = prefill.kv_cache[pinned]
        for j in range(n):
            if f"g{i}#{j}" != src:
                assert decode.fork_reservation(src, f"g{i}#{j}", len(prompt))
        shared = decode.block_manager.table(f"g{i}#1")[:len(prompt) // 16]
        assert shared and all(decode.block_manager._blocks[b].ref_count == n + (not disaggregated) for b in shared)
        decode.check_integrity()
        assert prefill.release(f"g{i}")
        for j, params in enumerate(choice_params(PARAMS, n)):
            token, lp = firsts[j]
            assert decode.add_prefilled_request(f"g{i}#{j}", prompt, token, params, lp) is None
    rest = drive(decode)
    for i in range(len(PROMPTS)):
        for j in range(n):
            assert [all_firsts[i][0][j][0]] + rest[f"g{i}#{j}"] == separate[i, j], (i, j)
    for e in {id(prefill): prefill, id(decode): decode}.values():
        counts = e.check_integrity()
        assert counts["in_use"] == 0 and counts["pinned"] == 0


def test_group_first_tokens_equal_separate_first_tokens(folder, separate):
    engine = LLM(folder, enable_prefix_caching=False).engine
    for i, prompt in enumerate(PROMPTS):
        firsts, _ = group_prefill(engine, f"g{i}", prompt, 3)
        assert [t for t, _ in firsts] == [separate[i, j][0] for j in range(3)]
        engine.abort(f"g{i}")
    counts = engine.check_integrity()
    assert counts["pinned"] == 0 and counts["in_use"] == 0


def test_prompt_logprobs_equal_a_float64_reference(folder):
    engine = LLM(folder, enable_prefix_caching=True, max_prefill_chunk=16).engine  # chunked: 3 chunks for 40 tokens
    prompt = random_prompts((40,), VOCAB, seed=3)[0]
    engine.add_request("warm", prompt, SamplingParams(max_tokens=1))  # fills the prefix cache with this prompt
    drive(engine)
    engine.add_request("p", prompt, SamplingParams(max_tokens=1, prompt_logprobs=3))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == "p"]
    got = outs[0].prompt_logprobs
    assert len(got) == len(prompt) - 1 and [e.token_id for e in got] == prompt[1:]  # the cache was skipped
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64).eval()
    with torch.no_grad():
        ref = model(torch.tensor([prompt])).logits[0, :-1].log_softmax(dim=-1)  # [P-1, V] float64
    for pos, entry in enumerate(got):
        want = ref[pos, prompt[pos + 1]].item()
        assert abs(entry.logprob - want) < 1e-4, pos
        assert entry.rank == int((ref[pos] > ref[pos, prompt[pos + 1]]).sum()) + 1
        top_vals, top_ids = ref[pos].topk(3)
        assert list(entry.top_logprobs) == top_ids.tolist()
        assert all(abs(a - b) < 1e-4 for a, b in zip(entry.top_logprobs.values(), top_vals.tolist(), strict=True))
    engine.check_integrity()


@pytest.mark.parametrize("case", ["no allowed token", "complete after one token"])
def test_a_group_whose_grammar_ends_on_its_first_token_stays_pinned_and_each_choice_ends_where_it_decodes(folder,
                                                                                                          case):
    """A structured output that ends on the first token (banned words leave it no allowed token: "error"; a choice
    of one-token answers: "stop"): the group prefill still stays pinned, each choice's end being decided where it
    decodes (it was ended at the prefill with the fields that route its answer dropped, so the worker never answered
    the prefill and the request hung), and each choice started from its first token ends at once, as a single
    request does."""
    engine = LLM(folder, enable_prefix_caching=False).engine
    if case == "no allowed token":
        banned = (tuple(engine.tokenizer.encode("a", add_special_tokens=False)),)
        params, reason = SamplingParams(max_tokens=8, seed=5, bad_words_token_ids=banned,
                                        structured=StructuredSpec("grammar", 'root ::= "a" [0-9]+')), "error"
    else:
        params, reason = SamplingParams(max_tokens=8, seed=5, structured=StructuredSpec.choice(["a", "b"])), "stop"
    alone = LLM(folder, enable_prefix_caching=False).generate([PROMPTS[0]], params)[0]
    assert alone.finish_reason == reason and len(alone.token_ids) == 1
    choices = choice_params(params, 2)
    engine.add_request("g", PROMPTS[0], choices[0], prefill_only=True, fork_params=choices[1:])
    outs = []
    while not outs:
        outs = [o for o in engine.step() if o.request_id == "g"]
    (out,) = outs
    assert out.prefill_only and out.finish_reason is None and out.pinned_block_ids and len(out.fork_first) == 1
    firsts = [(out.new_token_ids[0], out.new_logprobs[0] if out.new_logprobs else None), *out.fork_first]
    for j in range(2):
        assert engine.fork_reservation("g", f"g#{j}", len(PROMPTS[0]))
    assert engine.release("g")
    for j, (token, lp) in enumerate(firsts):
        ended = engine.add_prefilled_request(f"g#{j}", PROMPTS[0], token, choices[j], lp)
        assert ended is not None and ended.finish_reason == reason
    assert not engine.has_unfinished()
    counts = engine.check_integrity()
    assert counts["in_use"] == 0 and counts["pinned"] == 0, counts
