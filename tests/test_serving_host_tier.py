"""The host tier on the real server (issue 44; `pdserve serve`, tiny, real Ray workers, 1 prefill + 1 decode, both
with small device caches and a host tier).

- A conversation whose first turn was evicted from the prefill worker's device cache by other prompts: its second
  turn (the history resent with a new message) has its prefix copied back from the prefill worker's host tier:
  `usage.prompt_tokens_details.cached_tokens` says so, the tier's hits and bytes out count it
  (`pdserve_kv_tier_*{tier="host"}`), its phases hold `kv_restore`, and both turns' tokens equal a cold engine's
  (greedy and seeded).
- A flood of distinct prompts: each worker's host tier stays within its bytes (it evicts), and afterwards
  /admin/integrity is clean (every device block and host slot accounted for) and nothing is booked.
- The coordinator's prefix index learns each worker's host tier from the workers' reports (as many blocks as the
  tier holds).
- The prefill worker killed: its replacement starts with empty tiers (the next turn is computed: cached_tokens 0,
  still exact) and the index forgets the dead one's; the decode worker, its process, its tier's figures and its
  index entries, are untouched.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import pytest

from benchclient.cache_tiers import read_tier_counters, tier_shares
from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    assert_nothing_booked,
    metric_values,
    poll,
    running_server,
    wait_for_health,
    worker_pids,
)

pytestmark = pytest.mark.timeout(600)
VOCAB = 2000
SAMPLING = ({"temperature": 0}, {"temperature": 0.8, "seed": 44})  # greedy, seeded
MAX_TOKENS = 16
HOST_SLOTS = 8  # each worker's host tier, in blocks


@pytest.fixture(scope="module")
def reference() -> LLM:
    return LLM("tiny", kv_host_cache_bytes=0)


@pytest.fixture(scope="module")
def server(tmp_path_factory, reference):
    block_bytes = reference.engine.kv_cache[0].numel() * reference.engine.kv_cache.element_size()
    pool = {"num_cpus": 0.5, "kv_host_cache_bytes": HOST_SLOTS * block_bytes}
    config = {"model": "tiny", "prefill": {**pool, "num_kv_blocks": 8}, "decode": {**pool, "num_kv_blocks": 12},
              "transfer": {"backends": ["ucx"]}, "server": {"admin_api": True}}
    with running_server(tmp_path_factory.mktemp("host_tier"), config) as srv:
        yield srv


def _complete(url: str, prompt: list[int], sampling: dict, phases: bool = False) -> tuple[list[int], dict]:
    """A completion's token ids and its usage (streamed, with its phases, when `phases`)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "return_token_ids": True,
            **sampling}
    if not phases:
        r = httpx.post(f"{url}/v1/completions", timeout=120, json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"], r.json()["usage"]
    tokens, usage = [], None
    body |= {"stream": True, "stream_options": {"include_usage": True, "include_phases": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                tokens += [t for c in chunk["choices"] for t in c.get("token_ids", [])]
                if chunk.get("usage"):
                    usage = chunk["usage"] | {"phases": chunk["phases"]}
    return tokens, usage


def _tier(url: str, name: str, worker: str) -> float:
    values = metric_values(url, f"pdserve_kv_tier_{name}")
    return sum(v for labels, v in values.items() if f'worker="{worker}"' in labels and 'tier="host"' in labels)


def _quiet_counters(url: str) -> dict[str, float]:
    """The server's cache-tier counters once two reads 0.7 s apart agree (every worker's last load report in: an
    idle worker reports every 0.5 s)."""
    def settled():
        first = read_tier_counters(url)
        time.sleep(0.7)
        return first is not None and first == read_tier_counters(url) and first
    return poll(settled, 30)


def _indexed(url: str, worker: str) -> float:
    """The blocks the coordinator's prefix index says `worker`'s host tier holds."""
    return metric_values(url, "pdserve_prefix_index_host_blocks").get(f'{{worker="{worker}"}}', 0.0)


def _index_caught_up(url: str, worker: str) -> float:
    """The index's count for `worker`, once it equals what the worker's tier holds (its reports arrived)."""
    return poll(lambda: (n := _indexed(url, worker)) == _tier(url, "used_blocks", worker) and n > 0 and n, 30)


def _settled_tier(url: str, name: str, worker: str, at_least: float) -> float:
    """The figure once the worker's load report carrying it has reached the coordinator."""
    return poll(lambda: (v := _tier(url, name, worker)) >= at_least and v, 30)


@pytest.mark.parametrize("sampling", SAMPLING, ids=["greedy", "seeded"])
def test_an_evicted_turn_comes_back_from_the_host_tier_exactly(server, reference, sampling):
    seed = 4400 + len(sampling)
    first, *others = random_prompts((40,) * 6, VOCAB, seed=seed)
    new_message = random_prompts((9,), VOCAB, seed=seed + 1)[0]
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **sampling)
    a1 = reference.generate([first], params)[0].token_ids
    a2 = reference.generate([[*first, *a1, *new_message]], params)[0].token_ids
    hits_before = _tier(server.url, "hit_blocks_total", "prefill-0")
    tokens_before = _tier(server.url, "hit_tokens_total", "prefill-0")
    got1, usage1 = _complete(server.url, first, sampling)
    assert got1 == a1 and usage1["prompt_tokens_details"] == {"cached_tokens": 0}
    for other in others:  # 5 x 3 blocks through the prefill worker's 8: the first turn's 2 cached blocks go
        _complete(server.url, other, sampling)
    counters = _quiet_counters(server.url)
    got2, usage2 = _complete(server.url, [*first, *a1, *new_message], sampling, phases=True)
    assert got2 == a2
    # the prefill worker computed the first turn's prompt (2 full blocks); the answer's KV was computed on the decode
    # worker: those 2 blocks, evicted from the prefill worker's device cache, came back from its host tier
    assert usage2["prompt_tokens_details"] == {"cached_tokens": 32}
    assert "kv_restore" in usage2["phases"] and usage2["phases"]["kv_restore"] >= 0
    assert _settled_tier(server.url, "hit_blocks_total", "prefill-0", hits_before + 2) == hits_before + 2
    assert _tier(server.url, "hit_tokens_total", "prefill-0") == tokens_before + 32  # the prompt's host share
    # the bench's reading of the same counters: of the turn's tokens admitted, 32 came from the host tier
    turn2 = len(first) + len(a1) + len(new_message)
    assert tier_shares(counters, _quiet_counters(server.url)) == {"cache_share_device": 0.0,
                                                                     "cache_share_host": 32 / turn2}
    assert _tier(server.url, "out_bytes_total", "prefill-0") >= 2 * _tier(server.url, "capacity_bytes",
                                                                          "prefill-0") / HOST_SLOTS
    assert _index_caught_up(server.url, "prefill-0") >= 2  # the router knows where the history went


def test_a_flood_stays_within_each_tier_and_leaves_everything_accounted_for(server):
    for prompt in random_prompts([40] * 12, VOCAB, seed=4410):
        _complete(server.url, prompt, {"temperature": 0})
    for worker in ("prefill-0", "decode-0"):
        assert _tier(server.url, "total_blocks", worker) == HOST_SLOTS
        assert 0 < _tier(server.url, "used_bytes", worker) <= _tier(server.url, "capacity_bytes", worker)
    assert _settled_tier(server.url, "evictions_total", "prefill-0", 1) >= 1
    integrity = assert_nothing_booked(server.url)
    for name, counts in integrity["workers"].items():
        assert counts["host_free"] + counts["host_cached"] == counts["host_total"] == HOST_SLOTS, (name, counts)


def test_a_killed_worker_loses_its_tiers_and_nothing_else(server, reference):
    prompt, *others = random_prompts((40, 40, 40, 40), VOCAB, seed=4420)
    for p in (prompt, *others):  # the prompt's blocks end in the prefill worker's host tier
        _complete(server.url, p, {"temperature": 0})
    decode_pid, prefill_pid = worker_pids(server, "decode"), worker_pids(server, "prefill")
    decode_in = _tier(server.url, "in_bytes_total", "decode-0")
    _index_caught_up(server.url, "prefill-0")
    decode_index = _index_caught_up(server.url, "decode-0")
    os.kill(prefill_pid[0], signal.SIGKILL)
    poll(lambda: worker_pids(server, "prefill") not in ([], prefill_pid), 120)  # its replacement is up
    wait_for_health(server.url, 200)
    assert _indexed(server.url, "prefill-0") == 0 and _indexed(server.url, "decode-0") == decode_index
    expected = reference.generate([prompt + [7, 8, 9]], SamplingParams(temperature=0, max_tokens=MAX_TOKENS,
                                                                       ignore_eos=True))[0].token_ids
    got, usage = _complete(server.url, prompt + [7, 8, 9], {"temperature": 0})
    assert got == expected and usage["prompt_tokens_details"] == {"cached_tokens": 0}  # its tiers went with it
    assert worker_pids(server, "decode") == decode_pid
    assert _tier(server.url, "in_bytes_total", "decode-0") >= decode_in > 0
    assert_nothing_booked(server.url)
