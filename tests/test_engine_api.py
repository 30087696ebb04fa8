"""The engine's request API on the tiny model: disaggregation entry points, sampling, logprobs, stops, aborts."""

import time

import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import LogitsRecorder, random_prompts


@pytest.fixture(scope="module")
def llm(checkpoints):
    return LLM(str(checkpoints.tiny()))


@pytest.fixture(autouse=True)
def no_leaks(request):
    yield
    if "llm" in request.fixturenames:
        engine = request.getfixturevalue("llm").engine
        counts = engine.check_integrity()
        assert counts["in_use"] == 0 and counts["pinned"] == 0 and not engine.has_unfinished()


def run(engine):
    outs = {}
    while engine.has_unfinished():
        for o in engine.step():
            outs.setdefault(o.request_id, []).append(o)
    return outs


def test_prefill_on_one_engine_then_decode_on_another_equals_one_engine(checkpoints):
    folder = str(checkpoints.tiny())
    prompts = random_prompts((7, 31, 50), 2000, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.8, top_p=0.9, seed=11, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=1.0, top_k=5, seed=12, max_tokens=20, ignore_eos=True)]
    whole = LLM(folder).generate(prompts, params)

    prefill, decode = LLM(folder).engine, LLM(folder).engine
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        prefill.add_request(f"r{i}", prompt, p, prefill_only=True)
    firsts = {o.request_id: o for outs in run(prefill).values() for o in outs}
    for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
        first = firsts[f"r{i}"]
        assert first.finish_reason is None and len(first.pinned_block_ids) == -(-len(prompt) // 16)
        assert prefill.check_integrity()["pinned"] >= len(first.pinned_block_ids)
        dst = decode.reserve_blocks(f"r{i}", len(prompt))
        decode.kv_cache[dst] = prefill.kv_cache[first.pinned_block_ids]  # what kvtransfer will do
        assert prefill.release(f"r{i}")
        decode.add_prefilled_request(f"r{i}", prompt, first.new_token_ids[0], p)
    computed_before = decode.scheduler.num_prefix_hit_tokens
    recorder = LogitsRecorder(decode)
    outs = run(decode)
    assert decode.scheduler.num_prefix_hit_tokens == computed_before
    for i, ref in enumerate(whole):
        tokens = firsts[f"r{i}"].new_token_ids + [t for o in outs[f"r{i}"] for t in o.new_token_ids]
        assert tokens == ref.token_ids
        assert len(recorder.rows[id(params[i])]) == 19  # decode never re-ran the prompt: one sample per step
    for e in (prefill, decode):
        counts = e.check_integrity()
        assert counts["in_use"] == counts["pinned"] == 0


def test_pinned_blocks_expire_after_their_lease(checkpoints):
    llm = LLM(str(checkpoints.tiny()), pin_lease_s=0.05)
    engine = llm.engine
    engine.add_request("p", list(range(5, 40)), SamplingParams(max_tokens=4), prefill_only=True)
    run(engine)
    assert engine.check_integrity()["pinned"] == 3
    time.sleep(0.06)
    assert [o.finish_reason for o in engine.step()] == ["expired"]
    assert engine.check_integrity()["pinned"] == 0 and not engine.release("p")
    assert engine.check_integrity()["expired_pins"] == engine.load().expired_pins_total == 1  # counted: a leak


def test_reservation_can_be_given_back(llm):
    blocks = llm.engine.reserve_blocks("res", 40)
    assert len(blocks) == 3 and llm.engine.check_integrity()["pinned"] == 3
    with pytest.raises(ValueError, match="already in use"):
        llm.engine.reserve_blocks("res", 5)
    assert llm.engine.abort("res")


def test_seeded_sampling_is_reproducible_whatever_the_batch(llm):
    prompt = random_prompts((12,), 2000, seed=5)[0]
    p = SamplingParams(temperature=1.0, top_p=0.95, seed=1234, max_tokens=24, ignore_eos=True)
    alone = llm.generate([prompt], p)[0].token_ids
    others = random_prompts((3, 30, 50, 8), 2000, seed=6)
    mixed = llm.generate(others[:2] + [prompt] + others[2:],
                         [SamplingParams(temperature=1.0, max_tokens=30, ignore_eos=True)] * 2 + [p] +
                         [SamplingParams(temperature=0.5, seed=9, max_tokens=5, ignore_eos=True)] * 2)
    assert mixed[2].token_ids == alone
    assert llm.generate([prompt], SamplingParams(temperature=1.0, top_p=0.95, seed=4321, max_tokens=24,
                                                 ignore_eos=True))[0].token_ids != alone


def test_filters_that_leave_one_token_equal_greedy(llm):
    prompts = random_prompts((10, 20), 2000, seed=7)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(temperature=0, max_tokens=12,
                                                                        ignore_eos=True))]
    for kw in ({"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}):
        p = SamplingParams(temperature=1.5, max_tokens=12, ignore_eos=True, **kw)
        assert [o.token_ids for o in llm.generate(prompts, p)] == greedy, kw


def test_logprobs_are_the_model_distribution(llm):
    prompt = random_prompts((15,), 2000, seed=8)[0]
    recorder = LogitsRecorder(llm.engine)
    p = SamplingParams(temperature=0.7, seed=3, max_tokens=6, ignore_eos=True, logprobs=5)
    out = llm.generate([prompt], p)[0]
    assert len(out.logprobs) == 6
    for token, lp, logits in zip(out.token_ids, out.logprobs, recorder.logits_of(p), strict=True):
        ref = logits.log_softmax(-1)
        assert lp.token_id == token and abs(lp.logprob - ref[token].item()) < 1e-5
        top_vals, top_ids = ref.topk(5)
        assert list(lp.top_logprobs) == top_ids.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs.values(), top_vals.tolist(), strict=True)) < 1e-5
    assert llm.generate([prompt], SamplingParams(max_tokens=2))[0].logprobs is None


def test_stop_tokens_eos_and_max_tokens(llm):
    prompt = random_prompts((9,), 2000, seed=9)[0]
    free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True))[0]
    assert free.finish_reason == "length" and len(free.token_ids) == 20
    stop_at = free.token_ids[5]
    first = free.token_ids.index(stop_at)
    stopped = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True,
                                                    stop_token_ids=[stop_at]))[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == free.token_ids[:first + 1]
    eos = llm.engine.model_config.eos_token_ids
    engine = llm.engine
    engine.add_request("e", prompt, SamplingParams(temperature=0, max_tokens=3))
    engine.scheduler.requests["e"].eos_token_ids = (free.token_ids[0],)  # make the greedy first token an eos
    assert run(engine)["e"][-1].finish_reason == "stop"
    assert eos == engine.model_config.eos_token_ids


def test_abort_at_every_point_frees_all_blocks(llm):
    engine = llm.engine
    prompts = random_prompts((40, 70, 5), 2000, seed=10)
    for when in range(6):
        for i, prompt in enumerate(prompts):
            engine.add_request(f"a{when}-{i}", prompt, SamplingParams(max_tokens=8))
        for _ in range(when):
            engine.step()
        for i in range(len(prompts)):
            engine.abort(f"a{when}-{i}")
        assert not engine.abort(f"a{when}-0") and not engine.has_unfinished()
        counts = engine.check_integrity()
        assert counts["in_use"] == 0


def test_bad_requests_are_refused_with_the_field_named(llm):
    with pytest.raises(ValueError, match="empty"):
        llm.generate([[]])
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[1, 10**7]])
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([[1] * 5000])
    with pytest.raises(ValueError, match="SamplingParams.top_p"):
        SamplingParams(top_p=0)
    with pytest.raises(ValueError, match="SamplingParams.temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(TypeError, match="unknown keyword"):
        LLM("tiny", max_num_seq=3)


def test_text_prompts_are_tokenized_and_outputs_detokenized(llm):
    out = llm.generate(["Hello, world"], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0]
    assert out.prompt == "Hello, world"
    assert out.prompt_token_ids == llm.tokenizer.encode("Hello, world")
    assert out.text == llm.tokenizer.decode(out.token_ids)


def test_chat_uses_the_template_without_a_second_bos(llm):
    out = llm.chat([[{"role": "user", "content": "Hi there"}]], SamplingParams(temperature=0, max_tokens=4))[0]
    bos = llm.tokenizer.bos_token_id
    assert out.prompt_token_ids[0] == bos and out.prompt_token_ids.count(bos) == 1
    assert out.prompt.endswith("assistant<|end_header_id|>\n\n")


def test_cli_generate_prints_a_completion(checkpoints, capsys):
    from engine.cli import main
    assert main(["generate", "--model", str(checkpoints.tiny()), "--max-tokens", "5", "Hello"]) == 0
    assert capsys.readouterr().out.startswith("'Hello' -> ")
    assert main(["generate", "--model", "/no/such/folder", "Hello"]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err


def test_offline_text_is_what_a_server_streams_after_the_prompt():
    """LLM.generate's text decodes the output after the prompt's last tokens, as the server's TextOutput does: a
    reply whose first token completes a character the prompt's last token began gave a leading U+FFFD offline and
    not served. This conversation's second turn is such a case (its reply starts with token 118)."""
    from coordinator.api.text_output import TextOutput
    from tests.engine_helpers import random_prompts

    llm = LLM("tiny")
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    history = random_prompts([100 + 13 * i for i in range(12)], 2000, seed=81)[6]
    first = llm.generate([history], greedy)[0]
    second_turn = history + list(first.token_ids) + random_prompts([26], 2000, seed=90)[0]
    for prompt in (history, second_turn):
        out = llm.generate([prompt], greedy)[0]
        served = TextOutput(llm.tokenizer, prompt)
        text = "".join(served.add_token(t) for t in out.token_ids) + served.finish()
        assert out.text == text
    assert out.token_ids[0] == 118 and not out.text.startswith("\ufffd")
    assert llm.tokenizer.decode(out.token_ids).startswith("\ufffd")  # the output alone begins mid-character
