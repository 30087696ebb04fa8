"""A prefix held only by another worker's host tier is fetched, not recomputed (coordinator.backend.prefix_fetch,
pool_worker.prefix_share, engine.prefix_exchange), on the real server (`pdserve serve`, Ray, UCX, one prefill and
one decode worker, pushes on: the prefill worker reads the decode worker's blocks over the connection it writes
through).

Two conversations' first turns end on the decode worker, whose prefix cache then holds their histories (prompt and
reply); a flood of other requests evicts them from both workers' small device caches, into the decode worker's host
tier (the prefill worker has none). Each second turn (history + new tokens) is then prefilled on the prefill worker
with the history fetched from the decode worker's host tier: the response counts those tokens cached, the request
has a kv_restore phase, the lend and the blocks are counted on both sides, and the output equals the engine's
(greedy and seeded). With fetching off (transfer.prefix_fetch_min_tokens null) the same second turns are computed
but for what the prefill worker's own cache still held (the first turn's prompt, never its reply); so are they when
every transfer fails, every block given back.
"""

from __future__ import annotations

import httpx
import pytest

from engine import SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    HALF_CPU,
    admin_integrity,
    metric_values,
    poll,
    running_server,
    wait_for_idle_workers,
)

pytestmark = pytest.mark.timeout(300)
BLOCK = 16
# a history of 99 tokens with KV: 6 whole blocks on the decode worker, of which the prefill worker computed 2 (the
# coordinator's index still counts them there once they are gone: a stale hint, 64 tokens short of the lender's)
FIRST_LEN, REPLY, HELD = 40, 60, 6
GREEDY = {"temperature": 0}
SEEDED = {"temperature": 0.9, "top_p": 0.95, "seed": 11}


def _config(llama, fetch_min: int | None, **extra) -> dict:
    return {**extra, "model": str(llama),
            "prefill": {**HALF_CPU, "num_kv_blocks": 24, "kv_host_cache_bytes": 0},
            "decode": {**HALF_CPU, "num_kv_blocks": 24, "kv_host_cache_bytes": 64 << 20},
            "transfer": {"backends": ["ucx"], "prefix_fetch_min_tokens": fetch_min},
            "server": {"admin_api": True}}


def _complete(client: httpx.Client, llama, prompt: list[int], max_tokens: int, sampling: dict) -> dict:
    r = client.post("/v1/completions", json={"model": str(llama), "prompt": prompt, "max_tokens": max_tokens,
                                             "ignore_eos": True, "return_token_ids": True, **sampling})
    assert r.status_code == 200, r.text
    return r.json()


def _second_turns(url: str, llama, reference) -> list[tuple[dict, str]]:
    """Run the scenario of the module; each second turn's response with the engine's text for it."""
    firsts = random_prompts([FIRST_LEN, FIRST_LEN], 2000, seed=71)
    flood = random_prompts([FIRST_LEN] * 8, 2000, seed=72)
    with httpx.Client(base_url=url, timeout=120) as client:
        histories = []
        for prompt, sampling in zip(firsts, (GREEDY, SEEDED), strict=True):
            reply = _complete(client, llama, prompt, REPLY, sampling)["choices"][0]["token_ids"]
            histories.append(prompt + reply)
        for prompt in flood:  # 8 x 7 blocks through 24-block caches: the histories leave both devices
            _complete(client, llama, prompt, REPLY, GREEDY)
        # the decode worker's host tier reports what it took (every second): wait until the index has all of it
        poll(lambda: metric_values(url, "pdserve_prefix_index_host_blocks").get('{worker="decode-0"}', 0)
             >= metric_values(url, "pdserve_worker_engine_host_tier_used_blocks")
             .get('{worker="decode-0",role="decode"}', 1), 30)
        seconds = [h + list(range(400 + 7 * i, 410 + 7 * i)) for i, h in enumerate(histories)]
        out = []
        for prompt, sampling in zip(seconds, (GREEDY, SEEDED), strict=True):
            want = reference.generate([prompt], SamplingParams(max_tokens=8, ignore_eos=True, **sampling))[0].text
            out.append((_complete(client, llama, prompt, 8, sampling), want))
    return out


def test_a_history_in_the_decode_workers_host_tier_is_fetched_for_the_next_turn(llama, reference, tmp_path):
    with running_server(tmp_path, _config(llama, 32)) as server:
        url = server.url
        results = _second_turns(url, llama, reference)
        for data, want in results:
            assert data["choices"][0]["text"] == want
            # the history's whole blocks, fetched: not computed by the prefill worker
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == HELD * BLOCK, data["usage"]
        # their phases start with the fetch (kv_restore; the prefill worker has no host tier of its own)
        assert metric_values(url, "pdserve_request_phase_seconds_count")['{phase="kv_restore"}'] == 2
        fetches = metric_values(url, "pdserve_prefix_fetches_total")
        assert fetches['{outcome="lent"}'] == 2 and fetches['{outcome="failed"}'] == 0, fetches
        lent = metric_values(url, "pdserve_worker_engine_lent_host_blocks_total")
        fetched = metric_values(url, "pdserve_worker_engine_fetched_blocks_total")
        assert lent['{worker="decode-0",role="decode"}'] == 2 * HELD, lent  # copied up from its host tier, both turns
        # read over the transfer: all but what the prefill worker's own cache still held of the first turns' prompts
        own = 2 * (FIRST_LEN // BLOCK)
        assert 2 * HELD - own <= fetched['{worker="prefill-0",role="prefill"}'] <= 2 * HELD, fetched
        wait_for_idle_workers(url)
        integrity = admin_integrity(url)
        assert integrity["ok"], integrity
        for worker in integrity["workers"].values():
            assert worker["pinned"] == 0, integrity  # every lease ended


def test_with_fetching_off_the_next_turn_is_computed(llama, reference, tmp_path):
    with running_server(tmp_path, _config(llama, None)) as server:
        for data, want in _second_turns(server.url, llama, reference):
            assert data["choices"][0]["text"] == want
            # at most what the prefill worker's own cache still held: the first turn's prompt, not its reply
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] <= FIRST_LEN // BLOCK * BLOCK, data
        fetches = metric_values(server.url, "pdserve_prefix_fetches_total")
        assert sum(fetches.values()) == 0, fetches


def test_a_fetch_whose_transfer_fails_leaves_the_prompt_computed_and_nothing_held(llama, reference, tmp_path):
    """Every KV transfer fails (faults.transfer_fail_fraction 1: the handoffs recompute on the decode worker, and
    each fetch's pull fails): the second turns are lent, nothing is fetched, the prompts are computed exactly, and
    every booked and lent block is given back."""
    config = _config(llama, 32, faults={"transfer_fail_fraction": 1.0})
    with running_server(tmp_path, config) as server:
        url = server.url
        for data, want in _second_turns(url, llama, reference):
            assert data["choices"][0]["text"] == want
            assert data["usage"]["prompt_tokens_details"]["cached_tokens"] <= FIRST_LEN // BLOCK * BLOCK, data
        assert metric_values(url, "pdserve_prefix_fetches_total")['{outcome="lent"}'] == 2
        assert sum(metric_values(url, "pdserve_worker_engine_fetched_blocks_total").values()) == 0
        wait_for_idle_workers(url)
        integrity = admin_integrity(url)
        assert integrity["ok"], integrity
        assert all(worker["pinned"] == 0 for worker in integrity["workers"].values()), integrity
