"""The engine's waiting queue on the tiny model (issue 38): no head-of-line blocking, no starvation.

A large request whose blocks are not free yet waits at the head of the queue; small requests of its priority behind
it that fit start meanwhile (engine.core.waiting), and every output equals the run without contention (greedy and
seeded, tokens exact). The head is never starved: `head_bypass_steps` after it first did not fit, nobody passes it
any more, so it starts once the running requests free their blocks, even under a steady stream of small arrivals
that would otherwise take every block as it frees.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts

VOCAB = 2000
GREEDY = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=50, ignore_eos=True)
# 12 blocks of 16 tokens. "filler" (70-token prompt: 5 blocks, growing to 8) runs; "large" (120 tokens: 8 blocks)
# then cannot start until it ends; "small-*" (8-token prompts, 6 outputs: 1 block each) fit beside the filler.
PROMPTS = dict(zip(("filler", "large", "small-0", "small-1", "small-2", "small-3"),
                   random_prompts((70, 120, 8, 8, 8, 8), VOCAB, seed=38), strict=True))


def params_of(rid: str) -> SamplingParams:
    base = SEEDED if rid.endswith(("1", "3")) or rid == "large" else GREEDY
    return replace(base, max_tokens=6 if rid.startswith("small") else 8 if rid == "large" else 50)


@pytest.fixture(scope="module")
def folder(checkpoints) -> str:
    return str(checkpoints.tiny())


@pytest.fixture(scope="module")
def uncontended(folder) -> dict[str, list[int]]:
    """Each request's tokens on an engine with room for all of them at once."""
    llm = LLM(folder, enable_prefix_caching=False)
    return {rid: llm.generate([prompt], params_of(rid))[0].token_ids for rid, prompt in PROMPTS.items()}


def run(folder: str, head_bypass_steps: int) -> tuple[dict[str, list[int]], dict[str, int], dict[str, int], object]:
    """All six requests queued at once on the small cache: (tokens, step of the first token, step of the end)."""
    engine = LLM(folder, num_kv_blocks=12, enable_prefix_caching=False, head_bypass_steps=head_bypass_steps).engine
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, params_of(rid))
    tokens: dict[str, list[int]] = {rid: [] for rid in PROMPTS}
    first: dict[str, int] = {}
    ended: dict[str, int] = {}
    step = 0
    while engine.has_unfinished():
        step += 1
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
            first.setdefault(out.request_id, step)
            if out.finish_reason is not None:
                ended[out.request_id] = step
        engine.check_integrity()
    return tokens, first, ended, engine


def test_small_requests_pass_a_large_head_that_does_not_fit_and_every_output_is_exact(folder, uncontended):
    tokens, first, ended, engine = run(folder, head_bypass_steps=128)
    assert tokens == uncontended
    smalls = [rid for rid in PROMPTS if rid.startswith("small")]
    assert all(first[s] == 1 for s in smalls)  # started beside the filler, in the first step
    assert max(ended[s] for s in smalls) < first["large"]  # all done before the large head could start
    assert first["large"] > ended["filler"] - 1  # it needed the filler's blocks
    assert engine.load().head_bypassed_total == 4
    assert engine.scheduler.num_preemptions == 0
    counts = engine.check_integrity()
    assert counts["in_use"] == counts["pinned"] == 0


def test_strict_head_of_line_holds_the_small_requests_behind_the_large_one(folder, uncontended):
    # head_bypass_steps 0: the behaviour before (and the reservation once the head has waited long enough)
    tokens, first, ended, engine = run(folder, head_bypass_steps=0)
    assert tokens == uncontended
    assert all(first[s] >= first["large"] for s in PROMPTS if s.startswith("small"))
    assert engine.load().head_bypassed_total == 0


def stream_of_smalls(folder: str, head_bypass_steps: int, steps: int) -> tuple[int | None, dict, dict]:
    """A small request arrives every step for `steps` steps; at step 20 a large one arrives, which never fits while
    the smalls hold their blocks. Returns the step the large one started (None: not within the run), and every
    request's tokens and params."""
    engine = LLM(folder, num_kv_blocks=12, enable_prefix_caching=False, max_num_seqs=64,
                 head_bypass_steps=head_bypass_steps).engine
    prompts = random_prompts([4] * steps + [120], VOCAB, seed=5)
    params = {}
    tokens: dict[str, list[int]] = {}
    large_started = None
    for step in range(1, steps + 1):
        rid = f"s{step}"
        params[rid] = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True) if step % 2 else SamplingParams(
            temperature=1.0, seed=step, max_tokens=8, ignore_eos=True)
        engine.add_request(rid, prompts[step - 1], params[rid])
        if step == 20:
            params["large"] = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
            engine.add_request("large", prompts[-1], params["large"])
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
            if out.request_id == "large" and large_started is None:
                large_started = step
    while engine.has_unfinished():
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    assert engine.check_integrity()["in_use"] == 0
    return large_started, tokens, {rid: (prompts[-1] if rid == "large" else prompts[int(rid[1:]) - 1], p)
                                   for rid, p in params.items()}


def test_the_head_is_never_starved_by_a_stream_of_small_requests(folder):
    started, tokens, requests = stream_of_smalls(folder, head_bypass_steps=10, steps=50)
    # 10 steps of passing, then the smalls already running end (8 outputs each) and free its 8 blocks
    assert started is not None and 20 < started <= 20 + 10 + 8 + 2
    never, _, _ = stream_of_smalls(folder, head_bypass_steps=10**6, steps=50)
    assert never is None  # without the reservation the smalls take every block as it frees: starved
    ids = list(requests)
    outputs = LLM(folder, enable_prefix_caching=False).generate([requests[r][0] for r in ids],
                                                                [requests[r][1] for r in ids])
    assert {rid: tokens[rid] for rid in ids} == {rid: out.token_ids for rid, out in zip(ids, outputs, strict=True)}
