"""Disaggregated serving between tensor-parallel workers of different sizes (gloo, real UCX, real server): every
decode rank pulls exactly the KV heads it holds from the prefill ranks that hold them, and the outputs equal the
single engine's, for P TP=1 -> D TP=2 and P TP=2 -> D TP=1 (P TP=2 -> D TP=2: test_serving_tp_equal_sizes.py, a
file of its own so that the test runner can spread the servers' start-ups over its workers)."""

import asyncio
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
    wait_for_idle_workers,
)

TOKENS = 24
LAYOUTS = [(1, 2), (2, 1)]  # (prefill TP, decode TP); P TP=2 -> D TP=2 and a lost rank: test_serving_tp_equal_sizes


def tp_server_config(llama, prefill_tp: int, decode_tp: int) -> dict:
    pool = {"num_cpus": 1, "kv_cache_memory_bytes": 32 << 20}
    return {"model": str(llama), "transfer": {"backends": ["ucx"]}, "server": {"admin_api": True},
            "recovery": {"backoff_initial_s": 0.1},
            "prefill": {**pool, "tensor_parallel_size": prefill_tp, "chunk_size": 32},
            "decode": {**pool, "tensor_parallel_size": decode_tp}}


@pytest.fixture(scope="module", params=LAYOUTS, ids=[f"p{p}-d{d}" for p, d in LAYOUTS])
def server(request, llama, tmp_path_factory):
    prefill_tp, decode_tp = request.param
    with running_server(tmp_path_factory.mktemp(f"tp_p{prefill_tp}_d{decode_tp}"),
                        tp_server_config(llama, prefill_tp, decode_tp)) as server:
        yield server


def test_outputs_equal_the_single_engine(server, reference, llama):
    check_outputs_equal_the_engine(server, reference, llama)


def check_outputs_equal_the_engine(server, reference, llama) -> None:
    """Greedy, seeded, streamed and whole requests, and an n=2 group, all equal to the single engine's outputs;
    the KV moved over the transfer layer; nothing leaked."""
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
