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
    OPERATOR,
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


def _settles(url: str, name: str, labels: str, want: float) -> None:
    """Assert that metric `name{labels}` is (or becomes, within 30 s: the workers report every second) `want`."""
    poll(lambda: metric_values(url, name).get(labels) == want, 30)
    got = metric_values(url, name).get(labels)
    assert got == want, (name, labels, got, want)


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
        # their phases start with the fetch (kv_restore; the prefill worker has no host tier of its own), observed
        # as each request closed; the lender's counters come with its next load report
        _settles(url, "pdserve_request_phase_seconds_count", '{phase="kv_restore"}', 2)
        fetches = metric_values(url, "pdserve_prefix_fetches_total")
        assert fetches['{outcome="lent"}'] == 2 and fetches['{outcome="failed"}'] == 0, fetches
        # copied up from its host tier, both turns
        _settles(url, "pdserve_worker_engine_lent_host_blocks_total", '{worker="decode-0",role="decode"}', 2 * HELD)
        fetched = metric_values(url, "pdserve_worker_engine_fetched_blocks_total")
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
        _settles(url, "pdserve_worker_engine_lent_host_blocks_total", '{worker="decode-0",role="decode"}', 2 * HELD)
        assert sum(metric_values(url, "pdserve_worker_engine_fetched_blocks_total").values()) == 0
        wait_for_idle_workers(url)
        integrity = admin_integrity(url)
        assert integrity["ok"], integrity
        assert all(worker["pinned"] == 0 for worker in integrity["workers"].values()), integrity


def test_a_prefill_worker_fetches_a_prefix_another_prefill_worker_computed(llama, reference, tmp_path):
    """Two prefill workers, connected to each other while fetching is on (Pools.prefills_connect): a first turn is
    prefilled on prefill-0, which the operator then drains; the second turn goes to prefill-1, which fetches the
    prompt's blocks from prefill-0's device prefix cache (a drained worker still lends) instead of computing them."""
    config = _config(llama, 32)
    config["prefill"] = {**config["prefill"], "workers": 2}
    first = random_prompts([64], 2000, seed=73)[0]
    with running_server(tmp_path, config) as server, httpx.Client(base_url=server.url, timeout=120) as client:
        url = server.url
        reply = _complete(client, llama, first, 8, GREEDY)["choices"][0]["token_ids"]
        routed = metric_values(url, "pdserve_worker_requests_routed")
        holder = max(("prefill-0", "prefill-1"), key=lambda n: routed[f'{{worker="{n}",role="prefill"}}'])
        other = "prefill-1" if holder == "prefill-0" else "prefill-0"
        r = httpx.post(f"{url}/admin/workers/{holder}/drain", headers=OPERATOR, timeout=30)
        assert r.status_code == 200, r.text
        second = first + reply + list(range(600, 610))
        want = reference.generate([second], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))[0].text
        data = _complete(client, llama, second, 8, GREEDY)
        assert data["choices"][0]["text"] == want
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == 4 * BLOCK, data["usage"]  # the prompt's
        _settles(url, "pdserve_worker_engine_lent_blocks_total", f'{{worker="{holder}",role="prefill"}}', 4)
        _settles(url, "pdserve_worker_engine_fetched_blocks_total", f'{{worker="{other}",role="prefill"}}', 4)
        r = httpx.post(f"{url}/admin/workers/{holder}/undrain", headers=OPERATOR, timeout=30)
        assert r.status_code == 200, r.text
        wait_for_idle_workers(url)
        assert admin_integrity(url)["ok"]


def test_a_reply_the_decode_worker_holds_on_its_device_is_fetched_for_the_next_turn(llama, reference, tmp_path):
    """No eviction: the decode worker's device still holds the first turn's prompt and reply (the coordinator
    remembers both as its own when the request ends), the prefill worker only the prompt. The second turn's prefill
    fetches the reply's blocks from the decode worker's device (none from its host tier) and computes the rest."""
    with running_server(tmp_path, _config(llama, 32)) as server, httpx.Client(base_url=server.url, timeout=120) as c:
        url = server.url
        first = random_prompts([FIRST_LEN], 2000, seed=74)[0]
        reply = _complete(c, llama, first, REPLY, GREEDY)["choices"][0]["token_ids"]
        second = first + reply + list(range(700, 710))
        want = reference.generate([second], SamplingParams(max_tokens=8, ignore_eos=True, temperature=0))[0].text
        data = _complete(c, llama, second, 8, GREEDY)
        assert data["choices"][0]["text"] == want
        assert data["usage"]["prompt_tokens_details"]["cached_tokens"] == HELD * BLOCK, data["usage"]
        _settles(url, "pdserve_worker_engine_lent_blocks_total", '{worker="decode-0",role="decode"}', HELD)
        _settles(url, "pdserve_worker_engine_fetched_blocks_total", '{worker="prefill-0",role="prefill"}',
                 HELD - FIRST_LEN // BLOCK)  # the prompt's own blocks were the prefill worker's already
        host = metric_values(url, "pdserve_worker_engine_lent_host_blocks_total")
        assert host['{worker="decode-0",role="decode"}'] == 0, host
