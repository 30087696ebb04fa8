"""Penalties, logit_bias, min_tokens and bad words through the engine on `tiny`: a batch mixing rows with and
without them gives each row the tokens it gets alone, with overlapped scheduling on or off; a request resumed with
prior outputs continues exactly; out-of-vocabulary ids are refused naming the field."""

import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts

VOCAB = 2000  # prompts' ids below this; the model's vocabulary is 2048
PROCESSED = [
    SamplingParams(temperature=0, max_tokens=14, ignore_eos=True, presence_penalty=1.5, frequency_penalty=1.0),
    SamplingParams(temperature=0.8, seed=3, max_tokens=12, ignore_eos=True, repetition_penalty=1.6,
                   logit_bias={7: 5.0, 603: -100}),
    SamplingParams(temperature=0, max_tokens=10, min_tokens=6, repetition_penalty=1.3,
                   bad_words_token_ids=((11,), (12, 13))),
]
PLAIN = [SamplingParams(temperature=0, max_tokens=13, ignore_eos=True),
         SamplingParams(temperature=0.9, seed=8, max_tokens=11, ignore_eos=True)]


@pytest.fixture(scope="module")
def llms():
    return {mode: LLM("tiny", async_scheduling=mode) for mode in (True, False)}


def _plain(p: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=p.temperature, seed=p.seed, max_tokens=p.max_tokens, ignore_eos=p.ignore_eos)


@pytest.mark.parametrize("overlapped", [True, False])
def test_a_mixed_batch_gives_every_row_its_tokens_alone(llms, overlapped):
    llm = llms[overlapped]
    params = [PROCESSED[0], PLAIN[0], PROCESSED[1], PLAIN[1], PROCESSED[2]]
    prompts = random_prompts([9, 17, 5, 12, 7], VOCAB, seed=4)
    together = llm.generate(prompts, params)
    for prompt, p, got in zip(prompts, params, together, strict=True):
        assert got.token_ids == llm.generate([prompt], p)[0].token_ids
    if overlapped:  # the same tokens as steps that never overlap: the placeholder inputs were counted exactly
        assert [o.token_ids for o in llms[False].generate(prompts, params)] == [o.token_ids for o in together]
    unprocessed = llm.generate([prompts[i] for i in (0, 2, 4)], [_plain(p) for p in PROCESSED])
    assert all(a.token_ids != b.token_ids for a, b in zip(unprocessed, [together[i] for i in (0, 2, 4)],
                                                           strict=True))


def test_the_processing_does_what_it_says_on_tiny(llms):
    llm = llms[True]
    prompt = random_prompts([10], VOCAB, seed=6)[0]
    biased = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True,
                                                  logit_bias={42: 100}))[0]
    assert biased.token_ids == [42] * 6
    first = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids
    banned = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True,
                                                  bad_words_token_ids=((first[0],), (first[1], first[2]))))[0]
    assert banned.token_ids[0] != first[0]
    eos = llm.engine.model_config.eos_token_ids[0]
    held = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=12, min_tokens=5,
                                                logit_bias={eos: 100}))[0]
    assert held.token_ids[5:] == [eos] and eos not in held.token_ids[:5] and held.finish_reason == "stop"


def test_a_resumed_request_counts_its_prior_outputs(llms):
    llm = llms[True]
    prompt = random_prompts([8], VOCAB, seed=9)[0]
    for p in PROCESSED:
        full = llm.generate([prompt], p)[0].token_ids
        engine = llm.engine
        engine.add_request("resumed", prompt, p, prior_output_ids=full[:4])
        rest: list[int] = []
        while engine.has_unfinished():
            for out in engine.step():
                rest += out.new_token_ids
        assert rest == full[4:]


@pytest.mark.parametrize(("params", "what"), [
    (SamplingParams(logit_bias={2048: 1.0}), "logit_bias"),
    (SamplingParams(bad_words_token_ids=((1, 2048),)), "bad_words_token_ids"),
    (SamplingParams(stop_token_ids=(2048,)), "stop_token_ids"),
])
def test_token_ids_outside_the_vocabulary_are_refused(llms, params, what):
    with pytest.raises(ValueError, match=f"SamplingParams.{what}"):
        llms[True].engine.add_request("bad", [1, 2, 3], params)
