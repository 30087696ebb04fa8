"""End to end: the real server (`pdserve serve`: local Ray, prefill and decode actors, UCX KV transfer, uvicorn)
driven over HTTP and with the openai client; outputs equal the single engine's, nothing leaks."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import metric_values, running_server

HALF_CPU = {"num_cpus": 0.5, "kv_cache_memory_bytes": 64 << 20}


@pytest.fixture(scope="module")
def llama(checkpoints):
    return checkpoints.get("LlamaForCausalLM")


@pytest.fixture(scope="module")
def server_2p2d(llama, tmp_path_factory):
    config = {"model": str(llama), "prefill": {**HALF_CPU, "workers": 2, "chunk_size": 32},
              "decode": {**HALF_CPU, "workers": 2}, "transfer": {"backends": ["ucx"]}}
    with running_server(tmp_path_factory.mktemp("server_2p2d"), config) as url:
        yield url


@pytest.fixture(scope="module")
def reference(llama):
    return LLM(str(llama))


async def complete(client: httpx.AsyncClient, url: str, body: dict) -> dict:
    """POST a completion; for streams, reassemble text, token count and finish reason from the SSE chunks."""
    if not body.get("stream"):
        r = await client.post(f"{url}/v1/completions", json=body)
        assert r.status_code == 200, r.text
        data = r.json()
        return {"text": data["choices"][0]["text"], "finish_reason": data["choices"][0]["finish_reason"],
                "completion_tokens": data["usage"]["completion_tokens"]}
    body = {**body, "stream_options": {"include_usage": True}}
    text, finish, usage = [], None, None
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
    return {"text": "".join(text), "finish_reason": finish, "completion_tokens": usage["completion_tokens"]}


def wait_for_idle_workers(url: str, timeout_s: float = 20.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        free = metric_values(url, "pdserve_worker_free_blocks")
        total = metric_values(url, "pdserve_worker_total_blocks")
        if free == total and len(free) > 0:
            return free
        if time.monotonic() > deadline:
            raise AssertionError(f"workers hold blocks after {timeout_s} s: free {free}, total {total}")
        time.sleep(0.25)


def test_32_concurrent_greedy_requests_equal_the_single_engine(server_2p2d, reference, llama):
    prompts = random_prompts([3 + 7 * i for i in range(32)], 2000, seed=21)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    expected = reference.generate(prompts, params)

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                complete(client, server_2p2d, {"model": str(llama), "prompt": p, "max_tokens": 24, "temperature": 0,
                                               "ignore_eos": True, "stream": i % 2 == 0})
                for i, p in enumerate(prompts)])
    results = asyncio.run(run())
    for got, want in zip(results, expected, strict=True):
        assert got["text"] == want.text and got["completion_tokens"] == 24 and got["finish_reason"] == "length"
    routed = metric_values(server_2p2d, "pdserve_worker_requests_routed")
    assert len(routed) == 4 and all(v > 0 for v in routed.values()), routed  # both pools spread the load
    wait_for_idle_workers(server_2p2d)


def test_seeded_sampling_equals_the_engine_and_repeats(server_2p2d, reference, llama):
    prompt = random_prompts([30], 2000, seed=22)[0]
    body = {"model": str(llama), "prompt": prompt, "max_tokens": 20, "temperature": 0.9, "top_p": 0.95, "seed": 77,
            "ignore_eos": True}
    want = reference.generate([prompt], SamplingParams(temperature=0.9, top_p=0.95, seed=77, max_tokens=20,
                                                       ignore_eos=True))[0].text
    first = httpx.post(f"{server_2p2d}/v1/completions", json=body, timeout=60).json()["choices"][0]["text"]
    second = httpx.post(f"{server_2p2d}/v1/completions", json={**body, "stream": False},
                        timeout=60).json()["choices"][0]["text"]
    assert first == second == want


def test_prefix_affinity_sends_a_shared_prefix_to_the_same_prefill_worker(server_2p2d, llama):
    prefix = random_prompts([96], 2000, seed=23)[0]
    before = sum(metric_values(server_2p2d, "pdserve_prefix_affinity_hits_total").values())
    for i in range(4):
        r = httpx.post(f"{server_2p2d}/v1/completions", timeout=60,
                       json={"model": str(llama), "prompt": prefix + [100 + i], "max_tokens": 2})
        assert r.status_code == 200
    after = sum(metric_values(server_2p2d, "pdserve_prefix_affinity_hits_total").values())
    assert after - before >= 3


def test_cancelled_streams_free_every_block(server_2p2d, llama):
    prompts = random_prompts([40] * 8, 2000, seed=24)

    async def read_a_little(client, prompt):
        body = {"model": str(llama), "prompt": prompt, "max_tokens": 400, "ignore_eos": True, "stream": True}
        async with client.stream("POST", f"{server_2p2d}/v1/completions", json=body) as r:
            seen = 0
            async for line in r.aiter_lines():
                seen += line.startswith("data: ")
                if seen == 3:
                    return seen  # leaving the block closes the connection mid-stream

    async def run():
        async with httpx.AsyncClient(timeout=60) as client:
            return await asyncio.gather(*[read_a_little(client, p) for p in prompts])
    assert asyncio.run(run()) == [3] * 8
    wait_for_idle_workers(server_2p2d)


@pytest.fixture(scope="module")
def server_tiny(tmp_path_factory):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": {**HALF_CPU, "max_num_seqs": 256},
              "transfer": {"backends": ["ucx"]}}
    with running_server(tmp_path_factory.mktemp("server_tiny"), config) as url:
        yield url


def test_128_concurrent_streams_complete_with_the_right_token_counts(server_tiny):
    prompts = random_prompts([5 + (i * 13) % 120 for i in range(128)], 2000, seed=25)

    async def run():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*[
                complete(client, server_tiny, {"model": "tiny", "prompt": p, "max_tokens": 8 + i % 9,
                                               "ignore_eos": True, "stream": True, "temperature": 0.7, "seed": i})
                for i, p in enumerate(prompts)])
    results = asyncio.run(run())
    assert [r["completion_tokens"] for r in results] == [8 + i % 9 for i in range(128)]
    assert all(r["finish_reason"] == "length" for r in results)
    wait_for_idle_workers(server_tiny)


def test_openai_client_chat_and_completions(server_tiny):
    client = openai.OpenAI(base_url=f"{server_tiny}/v1", api_key="unused", timeout=60)
    reference = LLM("tiny")
    messages = [{"role": "user", "content": "Tell me about the sea."}]
    want = reference.chat([messages], SamplingParams(temperature=0, max_tokens=12))[0]
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0)
    assert chat.choices[0].message.content == want.text
    assert chat.usage.prompt_tokens == len(want.prompt_token_ids)
    stream = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, temperature=0, stream=True)
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices) == want.text
    text = client.completions.create(model="tiny", prompt="Once upon a time", max_tokens=10, temperature=0)
    assert text.choices[0].text == reference.generate(["Once upon a time"],
                                                      SamplingParams(temperature=0, max_tokens=10))[0].text
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="x", max_tokens=10, temperature=-1)


@pytest.fixture(scope="module")
def server_collocated(llama, tmp_path_factory):
    config = {"model": str(llama), "mode": "collocated", "decode": {**HALF_CPU, "workers": 2}}
    with running_server(tmp_path_factory.mktemp("server_collocated"), config) as url:
        yield url


def test_collocated_mode_gives_the_same_outputs(server_collocated, reference, llama):
    prompts = random_prompts([4, 33, 70, 9], 2000, seed=26)
    expected = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                complete(client, server_collocated, {"model": str(llama), "prompt": p, "max_tokens": 16,
                                                     "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1})
                for i, p in enumerate(prompts)])
    assert [r["text"] for r in asyncio.run(run())] == [e.text for e in expected]
    wait_for_idle_workers(server_collocated)
