"""A request id taken again right after an abort (a client's retry), while the ended request's last step is still
on the device (overlapped scheduling) or its prompt still on a prefill lane (sm_split_decode_sms): the new request's
outputs are its own, as on an engine that steps one at a time, and nothing leaks. Each planned chunk carries its
request's incarnation (Request.incarnation, set by the scheduler), so the old step's tokens are dropped, not applied
to the new request (they were: its computed tokens ran past its length and it never finished) or sampled with its
parameters (a repetition penalty then read outputs it did not have, and the step raised); a grammar's matcher is
bound to its request's incarnation and dropped at abort."""

import pytest

from engine import LLM, SamplingParams
from engine.sampling.structured import StructuredSpec

RETRY = SamplingParams(temperature=0, max_tokens=5, repetition_penalty=1.3)


def _retry_while_in_flight(engine, on_lane: bool) -> dict[str, list[int]]:
    """"a" decodes; "x" (resuming 3 delivered outputs) joins; once its prompt is in flight (or on the lane) it is
    aborted and "x" is added again with other tokens and a repetition penalty. Every request's tokens."""
    tokens: dict[str, list[int]] = {}

    def step():
        for o in engine.step():
            tokens.setdefault(o.request_id, []).extend(o.new_token_ids)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    for _ in range(3):
        step()
    engine.add_request("x", list(range(3, 40)), SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
                       prior_output_ids=[11, 12, 13])
    step()
    if on_lane:
        assert "x" in engine.scheduler.held  # its prompt is the lane's job
    engine.abort("x")
    tokens.pop("x", None)
    engine.add_request("x", list(range(50, 60)), RETRY)
    for _ in range(200):
        if not engine.has_unfinished():
            break
        step()
    assert not engine.has_unfinished()
    assert engine.check_integrity()["in_use"] == 0 and not engine.scheduler.held
    return tokens


@pytest.mark.parametrize("options", [dict(async_scheduling=True), dict(sm_split_decode_sms=16)],
                         ids=["a step in flight", "a prompt on the lane"])
def test_a_request_id_taken_again_gets_its_own_outputs(options):
    expected = _retry_while_in_flight(LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=64,
                                          async_scheduling=False).engine, on_lane=False)
    engine = LLM("tiny", device="cpu", max_num_seqs=4, max_num_batched_tokens=64, **options).engine
    got = _retry_while_in_flight(engine, on_lane="sm_split_decode_sms" in options)
    assert len(expected["x"]) == RETRY.max_tokens and got == expected


REGEX = SamplingParams(temperature=0, max_tokens=30, structured=StructuredSpec("regex", "[a-z]{20}"))
PLAIN = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _alone(params: SamplingParams) -> tuple[list[int], str | None]:
    engine = LLM("tiny", device="cpu", max_num_seqs=4, async_scheduling=False).engine
    engine.add_request("x", [5, 6, 7, 8], params)
    return _drain(engine)


def _drain(engine) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    for _ in range(200):
        if not engine.has_unfinished():
            break
        for o in engine.step():
            if o.request_id == "x":
                tokens += o.new_token_ids
                reason = o.finish_reason or reason
    assert not engine.has_unfinished() and engine.check_integrity()["in_use"] == 0
    return tokens, reason


@pytest.mark.parametrize("overlap", [False, True], ids=["step by step", "overlapped"])
@pytest.mark.parametrize("steps", [1, 2, 3])
@pytest.mark.parametrize("retry", [PLAIN, REGEX], ids=["plain retry", "structured retry"])
def test_a_structured_requests_id_taken_again_gets_its_own_grammar_or_none(overlap, steps, retry):
    """A request with a grammar aborted after `steps` steps and its id taken again at once: the new request is
    constrained by its own grammar only (the old one masked a plain retry's tokens and ended it early, its matcher
    outliving the abort), and the old request's token in flight never advances the new matcher (it did, or the
    step raised "grammar at output 0, got output 2")."""
    engine = LLM("tiny", device="cpu", max_num_seqs=4, async_scheduling=overlap).engine
    engine.add_request("bg", [9, 10, 11], SamplingParams(temperature=0, max_tokens=40, ignore_eos=True))
    engine.add_request("x", [1, 2, 3], REGEX)
    for _ in range(steps):
        engine.step()
    engine.abort("x")
    engine.add_request("x", [5, 6, 7, 8], retry)
    assert _drain(engine) == _alone(retry)


def _hand_over_after_abort(new_id: str) -> tuple[int, list[int]]:
    """An overlapped decode engine: "x" decodes beside "bg"; with its step in flight "x" is aborted and a handed-over
    request (prefilled on another engine) starts under `new_id`. The steps until it ends, and its tokens."""
    prefill = LLM("tiny", device="cpu", async_scheduling=False).engine
    decode = LLM("tiny", device="cpu", max_num_seqs=4, async_scheduling=True).engine
    decode.add_request("bg", [9, 10, 11], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    decode.add_request("x", [1, 2, 3], SamplingParams(temperature=0, max_tokens=60, ignore_eos=True))
    for _ in range(3):
        decode.step()
    prompt = list(range(20, 45))
    prefill.add_request("p", prompt, PLAIN, prefill_only=True)
    first = None
    while prefill.has_unfinished():
        first = next((o for o in prefill.step() if o.request_id == "p"), first)
    decode.abort("x")
    blocks = decode.reserve_blocks(new_id, len(prompt))
    decode.kv_cache[blocks] = prefill.kv_cache[first.pinned_block_ids]
    assert decode.add_prefilled_request(new_id, prompt, first.new_token_ids[0], PLAIN) is None
    tokens, steps = list(first.new_token_ids), 0
    while new_id in decode.scheduler.requests:
        steps += 1
        tokens += [t for o in decode.step() if o.request_id == new_id for t in o.new_token_ids]
        assert steps < 50
    return steps, tokens


def test_a_handed_over_request_under_an_id_in_flight_joins_the_next_planned_step():
    """The handed-over request starts running at once; one taking the id of a request whose row is still on the
    device is planned into the very next step like one under a fresh id (it waited a step: the planned-ahead step
    skipped any id in the step in flight, though that row belonged to the aborted request)."""
    assert _hand_over_after_abort("x") == _hand_over_after_abort("fresh")
