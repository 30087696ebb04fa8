"""Disaggregated serving between tensor-parallel workers of different sizes (gloo, real UCX, real server): every
decode rank pulls exactly the KV heads it holds from the prefill ranks that hold them, and the outputs equal the
single engine's, for P TP=1 -> D TP=2, P TP=2 -> D TP=1 and P TP=2 -> D TP=2."""

import asyncio
import os
import signal
import time

import httpx
import pytest

from engine import SamplingParams
from engine.core.choices import choice_seed
from tests.engine_helpers import random_prompts
from tests.server_process import (
    admin_integrity,
    complete,
    metric_values,
    running_server,
    tp_followers,
    wait_for_health,
    wait_for_idle_workers,
    worker_pids,
)

TOKENS = 24
LAYOUTS = [(1, 2), (2, 1), (2, 2)]  # (prefill TP, decode TP)


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"p{p}-d{d}" for p, d in LAYOUTS])
def server(request, llama, tmp_path_factory):
    prefill_tp, decode_tp = request.param
    pool = {"num_cpus": 1, "kv_cache_memory_bytes": 32 << 20}
    config = {"model": str(llama), "transfer": {"backends": ["ucx"]}, "server": {"admin_api": True},
              "recovery": {"backoff_initial_s": 0.1},
              "prefill": {**pool, "tensor_parallel_size": prefill_tp, "chunk_size": 32},
              "decode": {**pool, "tensor_parallel_size": decode_tp}}
    with running_server(tmp_path_factory.mktemp(f"tp_p{prefill_tp}_d{decode_tp}"), config) as server:
        yield server


def test_outputs_equal_the_single_engine(server, reference, llama):
    prompts = random_prompts([5, 17, 40, 71], 2000, seed=51)  # 71 tokens: several blocks, prefilled in chunks
    bodies = [{"model": str(llama), "prompt": p, "max_tokens": TOKENS, "ignore_eos": True, "stream": i % 2 == 0,
               **({"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": 7 + i})}
              for i, p in enumerate(prompts)]
    bodies.append({"model": str(llama), "prompt": prompts[2], "max_tokens": TOKENS, "ignore_eos": True,
                   "temperature": 0.9, "seed": 3, "n": 2})  # a group: the prompt's KV pulled once, then forked
    expected = [reference.generate([b["prompt"]], SamplingParams(temperature=b["temperature"], seed=b.get("seed"),
                                                                 max_tokens=TOKENS, ignore_eos=True))[0].text
                for b in bodies[:-1]]
    expected_group = [reference.generate([prompts[2]], SamplingParams(temperature=0.9, seed=choice_seed(3, j),
                                                                      max_tokens=TOKENS, ignore_eos=True))[0].text
                      for j in range(2)]

    async def run():
        async with httpx.AsyncClient(timeout=180) as client:
            plain = await asyncio.gather(*[complete(client, server.url, b) for b in bodies[:-1]])
            group = (await client.post(f"{server.url}/v1/completions", json=bodies[-1])).json()
            return plain, group
    plain, group = asyncio.run(run())
    assert [r["text"] for r in plain] == expected
    assert [c["text"] for c in sorted(group["choices"], key=lambda c: c["index"])] == expected_group, group
    deadline = time.monotonic() + 15  # the server sums the agents' figures every second or so
    while (pulled := sum(metric_values(server.url, "pdserve_transfer_read_count").values())) < 5:
        assert time.monotonic() < deadline, f"{pulled} reads: the KV was not pulled over the transfer layer"
        time.sleep(0.5)
    wait_for_idle_workers(server.url)
    assert admin_integrity(server.url)["ok"]


def test_a_lost_prefill_rank_replaces_the_group_and_decode_pulls_from_the_new_one(server, reference, llama,
                                                                                   request):
    if "p2-d2" not in request.node.name:
        pytest.skip("one layout is enough for the replacement path")
    [actor] = worker_pids(server, "PrefillWorker")
    [follower] = tp_followers(actor)
    os.kill(follower, signal.SIGKILL)  # rank 1 of the prefill group: its agent and cache shard are gone
    prompts = random_prompts([9, 33, 50], 2000, seed=52)
    params = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True)

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[complete(client, server.url, {
                "model": str(llama), "prompt": p, "max_tokens": TOKENS, "ignore_eos": True, "temperature": 0,
                "stream": True}) for p in prompts])
    results = asyncio.run(run())  # they wait for (or fail over onto) the replacement, never error
    assert [r["text"] for r in results] == [o.text for o in reference.generate(prompts, params)]
    wait_for_health(server.url, 200)
    assert worker_pids(server, "PrefillWorker") != [actor]  # the whole group was replaced
    wait_for_idle_workers(server.url)
    assert admin_integrity(server.url)["ok"]
