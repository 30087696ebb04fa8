"""Growing bookings on the real server (issue 38; `pdserve serve`, tiny, real Ray workers), 1 prefill + 1 decode and
collocated: a decode worker with a small KV cache (40 blocks of 16 tokens) and more concurrent streams than fit at
their full max_tokens (160 tokens, 11 blocks each: 3 at once). With `admission.reserve_output: null` (the default)
each books its prompt and `reserve_ahead_tokens` (16 here) ahead, grown as it decodes, so more run at once and the
engine preempts when they outgrow the cache: every stream still ends with exactly the tokens engine.LLM gives
(greedy and seeded), some were preempted (/metrics, by cause), bookings grew, streams dropped mid-decode gave back
everything, and afterwards /admin/integrity is clean with nothing booked. With `reserve_output: 1.0` (the behaviour
before) the same load runs without a single preemption. A tenant whose tokens_per_minute is below the context window
is served a chat request without max_tokens (a 400 before), charged what it used.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import HALF_CPU, assert_nothing_booked, metric_values, running_server

pytestmark = pytest.mark.timeout(600)
KEY = {"Authorization": "Bearer k-open"}
MAX_TOKENS = 120
PROMPTS = random_prompts([30 + (7 * i) % 20 for i in range(12)], 2000, seed=3801)  # 30-49 tokens


def _config(mode: str, reserve_output: float | None = None, preemption_mode: str = "recompute") -> dict:
    small = {**HALF_CPU, "num_kv_blocks": 40, "preemption_mode": preemption_mode}  # 640 tokens: context capped at 624
    pools = {"decode": small} if mode == "collocated" else {"prefill": HALF_CPU, "decode": small,
                                                            "transfer": {"backends": ["ucx"]}}
    return {"model": "tiny", "mode": mode, **pools, "server": {"admin_api": True},
            "admission": {"timeout_s": 120, "reserve_output": reserve_output, "reserve_ahead_tokens": 16},
            "tenants": [{"name": "open", "api_keys": ["k-open"]},
                        {"name": "metered", "api_keys": ["k-tpm"], "tokens_per_minute": 500}]}


def _body(i: int) -> dict:
    sampling = {"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": 100 + i}
    return {"model": "tiny", "prompt": PROMPTS[i], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
            "return_token_ids": True, **sampling}


@pytest.fixture(scope="module")
def expected() -> list[list[int]]:
    params = [SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **{k: v for k, v in _body(i).items()
                                                                           if k in ("temperature", "seed")})
              for i in range(len(PROMPTS))]
    return [o.token_ids for o in LLM("tiny").generate(PROMPTS, params)]


async def _stream(client: httpx.AsyncClient, url: str, body: dict, drop_after: int | None = None) -> list[int]:
    """The token ids a streamed completion delivered (all of them, or the first chunks' if dropped)."""
    tokens, chunks = [], 0
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=KEY) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                tokens += [t for c in chunk["choices"] for t in c.get("token_ids") or []]
                chunks += 1
                if drop_after is not None and chunks >= drop_after:
                    break
    return tokens


def _preemptions(url: str) -> dict[str, float]:
    found = metric_values(url, "pdserve_worker_preemptions_total")
    causes: dict[str, float] = {}
    for labels, value in found.items():
        cause = labels.split('cause="')[1].split('"')[0]
        causes[cause] = causes.get(cause, 0) + value
    return causes


def _run_load(url: str) -> list[list[int]]:
    """Every stream at once, and 4 more dropped by their clients after 10 chunks."""
    async def run():
        async with httpx.AsyncClient(timeout=300, limits=httpx.Limits(max_connections=50)) as client:
            dropped = [_stream(client, url, _body(i), drop_after=10) for i in range(4)]
            return await asyncio.gather(*[_stream(client, url, _body(i)) for i in range(len(PROMPTS))], *dropped)
    return asyncio.run(run())[:len(PROMPTS)]


@pytest.mark.parametrize("mode", ["disaggregated", "collocated"])
def test_streams_outgrowing_a_small_decode_cache_are_preempted_and_end_exactly(tmp_path, expected, mode):
    with running_server(tmp_path, _config(mode)) as server:
        url = server.url
        got = _run_load(url)
        assert got == expected
        causes = _preemptions(url)
        assert sum(causes.values()) > 0 and causes.get("decode", 0) > 0, causes
        assert sum(metric_values(url, "pdserve_admission_booking_grown_blocks_total").values()) > 0
        assert metric_values(url, "pdserve_worker_used_kv_blocks")  # beside pdserve_worker_booked_kv_blocks
        assert_nothing_booked(url)
        if mode == "disaggregated":
            _metered_chat_without_max_tokens(url)
            assert_nothing_booked(url)


def test_streams_swapped_to_host_memory_end_exactly_and_leave_nothing_behind(tmp_path, expected):
    """preemption_mode swap on the decode worker: its victims' KV goes to host memory and back (counted in /metrics),
    every stream ends exactly, /admin/integrity (host slots included) is clean and nothing is booked afterwards."""
    with running_server(tmp_path, _config("disaggregated", preemption_mode="swap")) as server:
        url = server.url
        assert _run_load(url) == expected
        assert sum(_preemptions(url).values()) > 0
        out = sum(metric_values(url, "pdserve_worker_engine_swapped_out_total").values())
        assert out > 0 and sum(metric_values(url, "pdserve_worker_engine_swap_out_bytes_total").values()) > 0
        assert_nothing_booked(url)
        assert sum(metric_values(url, "pdserve_worker_engine_swap_used_blocks").values()) == 0
        # each came back in, unless the coordinator moved it first (a booking's own preemption aborts it on the
        # worker, host slots freed: swap_used_blocks is 0 above), so fewer may come in than went out
        assert 0 < sum(metric_values(url, "pdserve_worker_engine_swapped_in_total").values()) <= out


def _metered_chat_without_max_tokens(url: str) -> None:
    """tokens_per_minute 500, context 624: a chat request without max_tokens was charged 624 tokens (a 400); it
    is served, its output the allowance its tenant's limit leaves (500 - prompt tokens, issue 46), charged what it
    used."""
    messages = [{"role": "user", "content": "Tell me a long story about the sea."}]
    r = httpx.post(f"{url}/v1/chat/completions", timeout=300, headers={"Authorization": "Bearer k-tpm"},
                   json={"model": "tiny", "messages": messages, "temperature": 0})
    assert r.status_code == 200, r.text
    body = r.json()
    llm = LLM("tiny")
    prompt_len = body["usage"]["prompt_tokens"]
    want = llm.chat([messages], SamplingParams(temperature=0, max_tokens=500 - prompt_len))[0]
    assert body["choices"][0]["message"]["content"] == want.text
    used = body["usage"]["completion_tokens"]
    charged = metric_values(url, "pdserve_tenant_completion_tokens_total")['{tenant="metered"}']
    assert charged == used == len(want.token_ids)


def test_with_the_whole_output_booked_up_front_the_same_load_is_never_preempted(tmp_path, expected):
    with running_server(tmp_path, _config("disaggregated", reserve_output=1.0)) as server:
        assert _run_load(server.url) == expected
        assert sum(_preemptions(server.url).values()) == 0
        assert sum(metric_values(server.url, "pdserve_admission_booking_grown_blocks_total").values()) == 0
        assert_nothing_booked(server.url)
