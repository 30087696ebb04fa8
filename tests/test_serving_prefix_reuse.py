"""Decode-side prefix reuse on the real server (issue 34, part 2; `pdserve serve`, tiny, real Ray workers, real UCX), 1
prefill + 1 decode, with pushed KV (transfer.push, the default) and with pulled KV (transfer.push false): a two-turn
conversation whose second prompt extends the first prompt and its answer. The decode worker's prefix cache holds the
first turn's blocks, so the second handoff moves only the blocks it lacks: the transfer agents' bytes for that turn
are exactly those blocks' bytes (fewer than the whole prompt's), the decode worker counts the blocks it skipped
(pdserve_worker_engine_handoff_hit_blocks_total), and both turns' tokens equal engine.LLM's (greedy and seeded).
Streams of such turns dropped by their clients during the handoff leave /admin/integrity clean and nothing booked, as
does a turn whose transfer failed (recomputed on the decode worker). The same with a decode worker of another TP size
(P TP=1 -> D TP=2, pulled, on a tiny Llama).
"""

from __future__ import annotations

import asyncio
import json
import math
import time

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import HALF_CPU, OPERATOR, assert_nothing_booked, metric_values, running_server

pytestmark = pytest.mark.timeout(600)
BLOCK = 16
FIRST = random_prompts((70,), 2000, seed=3402)[0]
EXTRA = random_prompts((150,), 2000, seed=3403)[0]  # the second turn's new text
SAMPLING = ({"temperature": 0}, {"temperature": 0.8, "seed": 34})  # greedy, seeded
MAX_TOKENS = 40
BYTES = ("pdserve_transfer_read_bytes", "pdserve_transfer_write_bytes")  # the pulls' and the pushes' payloads


def _config(model: str, push: bool, decode_tp: int = 1) -> dict:
    # small prefill chunks: the second turn's prompt takes several steps, so the push target is named in time
    decode = {**HALF_CPU, "tensor_parallel_size": decode_tp} if decode_tp == 1 else {
        "num_cpus": 1, "kv_cache_memory_bytes": 32 << 20, "tensor_parallel_size": decode_tp}
    return {"model": model, "prefill": {**HALF_CPU, "chunk_size": 16}, "decode": decode,
            "transfer": {"backends": ["ucx"], "push": push}, "server": {"admin_api": True}}


def _expected(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Per sampling: the engine's answers to turn 1 and turn 2 (turn 2 = turn 1's prompt + its answer + EXTRA)."""
    out = []
    for sampling in SAMPLING:
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
        a1 = llm.generate([FIRST], params)[0].token_ids
        a2 = llm.generate([[*FIRST, *a1, *EXTRA]], params)[0].token_ids
        out.append((a1, a2))
    return out


@pytest.fixture(scope="module")
def expected() -> list[tuple[list[int], list[int]]]:
    return _expected(LLM("tiny"))


def _complete(url: str, model: str, prompt: list[int], sampling: dict) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True,
        **sampling})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _moved(url: str) -> float:
    return sum(sum(metric_values(url, name).values()) for name in BYTES)


def _settled(url: str, before: float) -> float:
    """The bytes moved, once the coordinator's transfer figures (collected every second) have caught up with a
    request that ended: changed from `before`, and the same in two readings 1.5 s apart."""
    deadline, last = time.monotonic() + 60, None
    while time.monotonic() < deadline:
        now = _moved(url)
        if now != before and now == last:
            return now
        last = now
        time.sleep(1.5)
    raise AssertionError(f"the transfer figures did not settle: {before} -> {last}")


def _hit_blocks(url: str) -> float:
    return sum(metric_values(url, "pdserve_worker_engine_handoff_hit_blocks_total").values())


@pytest.mark.parametrize("push", [True, False], ids=["push", "pull"])
def test_a_second_turn_moves_only_the_blocks_the_decode_worker_lacks(tmp_path, expected, push):
    with running_server(tmp_path, _config("tiny", push)) as server:
        url = server.url
        pushed_before = sum(metric_values(url, "pdserve_transfer_push_completed_total").values())
        if push:  # slow prefill steps: the target (two calls away) comes before the second turns' last chunks
            _faults(url, {"slow_step_s": 0.05, "slow_workers": ["prefill-0"]})
        _check_two_turns(url, "tiny", expected)
        if push:  # the second turns were pushed, not pulled after a late target
            pushed = sum(metric_values(url, "pdserve_transfer_push_completed_total").values()) - pushed_before
            assert pushed >= 2, pushed
            _faults(url, {})
        asyncio.run(_dropped_during_handoffs(url, "tiny", expected[0][0]))
        assert_nothing_booked(url)
        _failed_transfer_recomputes(url, expected[0])
        assert_nothing_booked(url)


def test_a_decode_worker_of_another_tp_size_pulls_only_the_heads_of_the_blocks_it_lacks(tmp_path, llama):
    """Prefill TP=1, decode TP=2 (pulled: pushes need TP=1 on both sides): each decode rank pulls its KV heads of
    the lacking blocks only (kvtransfer.head_slices works on any block list)."""
    expected = _expected(LLM(str(llama)))
    with running_server(tmp_path, _config(str(llama), push=False, decode_tp=2)) as server:
        _check_two_turns(server.url, str(llama), expected)
        assert_nothing_booked(server.url)


def _check_two_turns(url: str, model: str, expected: list[tuple[list[int], list[int]]]) -> None:
    """Two conversations, greedy then seeded, opening with the same prompt (the seeded one's first turn finds that
    prompt's full blocks cached on the decode side as well): each turn's tokens are the engine's, and each moves
    exactly the bytes of the blocks the decode worker lacked."""
    n1, per_block = len(FIRST), None
    for i, ((want1, want2), sampling) in enumerate(zip(expected, SAMPLING, strict=True)):
        base, hits_before = _moved(url), _hit_blocks(url)
        a1 = _complete(url, model, FIRST, sampling)
        assert a1 == want1
        after1 = _settled(url, base)
        hit1 = 0 if i == 0 else (n1 - 1) // BLOCK  # the greedy conversation's first prompt, cached
        if per_block is None:
            per_block = (after1 - base) / math.ceil(n1 / BLOCK)
            assert per_block == int(per_block) and per_block > 0
        assert after1 - base == (math.ceil(n1 / BLOCK) - hit1) * per_block
        turn2 = [*FIRST, *a1, *EXTRA]
        a2 = _complete(url, model, turn2, sampling)
        assert a2 == want2
        moved2 = _settled(url, after1) - after1
        n2, computed = len(turn2), n1 + len(a1) - 1  # the answer's last token's KV is never computed
        hit2 = min(computed // BLOCK, (n2 - 1) // BLOCK)
        assert hit2 >= 6
        assert moved2 == (math.ceil(n2 / BLOCK) - hit2) * per_block, (moved2, per_block, hit2)
        assert moved2 < math.ceil(n2 / BLOCK) * per_block
        deadline = time.monotonic() + 30  # the load reports come with steps and polls
        while _hit_blocks(url) - hits_before < hit1 + hit2 and time.monotonic() < deadline:
            time.sleep(0.25)
        assert _hit_blocks(url) - hits_before == hit1 + hit2


async def _dropped_during_handoffs(url: str, model: str, a1: list[int]) -> None:
    """Second turns of the conversation (its first turn's blocks cached on the decode side), streamed and dropped by
    their clients at their first chunk (the first token: the handoff is under way) or a few chunks later."""
    async def one(client: httpx.AsyncClient, i: int, drop_after: int) -> None:
        body = {"model": model, "prompt": [*FIRST, *a1, *EXTRA[:100 + i]], "max_tokens": MAX_TOKENS,
                "ignore_eos": True, "stream": True, "temperature": 0}
        chunks = 0
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    assert "error" not in json.loads(line[6:]), line
                    chunks += 1
                    if chunks >= drop_after:
                        break
    async with httpx.AsyncClient(timeout=300) as client:
        await asyncio.gather(*[one(client, i, 1 + i % 3) for i in range(8)])


def _failed_transfer_recomputes(url: str, answers: tuple[list[int], list[int]]) -> None:
    """Every transfer fails (injected): the greedy conversation's third turn, whose booking shares the blocks of the
    turns before, is recomputed on the decode worker (transfer.on_failure: recompute) and still equals the engine;
    the failed handoff gave its shared blocks back (the caller's integrity check)."""
    a1, a2 = answers
    turn3 = [*FIRST, *a1, *EXTRA, *a2, *EXTRA[:30]]
    want = LLM("tiny").generate([turn3], SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0))
    failed = metric_values(url, "pdserve_backend_errors_total").get('{kind="transfer_failed"}', 0)
    _faults(url, {"transfer_fail_fraction": 1.0, "seed": 1})
    try:
        assert _complete(url, "tiny", turn3, {"temperature": 0}) == want[0].token_ids
    finally:
        _faults(url, {})
    assert metric_values(url, "pdserve_backend_errors_total").get('{kind="transfer_failed"}', 0) == failed + 1


def _faults(url: str, faults: dict) -> None:
    r = httpx.post(f"{url}/admin/faults", headers=OPERATOR, json=faults, timeout=30)
    assert r.status_code == 200, r.text
