"""End to end on the real server with the embedded `tiny` model (1 prefill + 1 decode): 128 concurrent streams,
the openai client, the chat template, a streamed request's phases."""

import asyncio
import json
import time

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.phase_checks import DISAGGREGATED, assert_partition, e2e_count, phase_histograms, stream_with_phases
from tests.server_process import HALF_CPU, complete, metric_values, running_server, wait_for_idle_workers


@pytest.fixture(scope="module")
def server_tiny(tmp_path_factory):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": {**HALF_CPU, "max_num_seqs": 256},
              "transfer": {"backends": ["ucx"]}}
    with running_server(tmp_path_factory.mktemp("server_tiny"), config) as server:
        yield server


def test_128_concurrent_streams_complete_with_the_right_token_counts(server_tiny):
    prompts = random_prompts([5 + (i * 13) % 120 for i in range(128)], 2000, seed=25)

    async def run():
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(timeout=300, limits=limits) as client:
            return await asyncio.gather(*[
                complete(client, server_tiny.url, {"model": "tiny", "prompt": p, "max_tokens": 8 + i % 9,
                                               "ignore_eos": True, "stream": True, "temperature": 0.7, "seed": i})
                for i, p in enumerate(prompts)])
    results = asyncio.run(run())
    assert [r["completion_tokens"] for r in results] == [8 + i % 9 for i in range(128)]
    assert all(r["finish_reason"] == "length" for r in results)
    wait_for_idle_workers(server_tiny.url)


def test_openai_client_chat_and_completions(server_tiny):
    client = openai.OpenAI(base_url=f"{server_tiny.url}/v1", api_key="unused", timeout=60)
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


def test_a_streamed_request_reports_its_phases_and_they_sum_to_its_latency(server_tiny):
    """1P+1D: every phase of the disaggregated path is present (no migration), none negative, summing to the
    latency the client measured within 5%; a plain stream's usage chunk has no phases; /metrics has every phase label,
    a sample of each disaggregated phase, and phase sums adding up to the end-to-end sum."""
    url, before = server_tiny.url, e2e_count(server_tiny.url)
    body = {"model": "tiny", "prompt": "The lighthouse keeper", "max_tokens": 128, "ignore_eos": True,
            "temperature": 0}

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            plain = await client.post(f"{url}/v1/completions", json={
                **body, "stream": True, "stream_options": {"include_usage": True}})
            return plain.text, await stream_with_phases(client, url, body)
    plain, result = asyncio.run(run())
    usage = [json.loads(line[6:]) for line in plain.splitlines() if line.startswith("data: {")][-1]
    assert usage["usage"]["completion_tokens"] == 128 and "phases" not in usage
    assert result["completion_tokens"] == 128
    assert_partition(result, DISAGGREGATED)
    counts, sums = phase_histograms(url, before + 2)
    assert all(counts[p] >= 1 and sums[p] >= 0 for p in DISAGGREGATED), counts
    assert counts["migration"] == 0


def test_prompts_pushed_during_their_prefill_decode_exactly(server_tiny):
    """transfer.push (the default): the prefill worker writes each prompt's KV into the decode worker's booked blocks
    during its forward (prefill_pool.kv_push); concurrent greedy prompts then generate exactly the offline engine's
    tokens, most of them pushed (a target that comes after a short prompt's last layer is pulled), none failed."""
    url = server_tiny.url
    before = {k: sum(metric_values(url, f"pdserve_transfer_{k}").values()) for k in PUSH_COUNTERS}
    prompts = random_prompts([200 + (i * 61) % 500 for i in range(16)], 2000, seed=26)
    want = LLM("tiny").generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))

    async def run():
        async with httpx.AsyncClient(timeout=300) as client:
            return await asyncio.gather(*[complete(client, url, {"model": "tiny", "prompt": p, "max_tokens": 10,
                                                                 "ignore_eos": True, "temperature": 0,
                                                                 "stream": i % 2 == 0})
                                          for i, p in enumerate(prompts)])
    results = asyncio.run(run())
    assert [r["text"] for r in results] == [w.text for w in want]
    deadline = time.monotonic() + 20  # transfer figures are collected every second or so
    while True:
        now = {k: sum(metric_values(url, f"pdserve_transfer_{k}").values()) for k in PUSH_COUNTERS}
        done = now["push_completed_total"] + now["push_late_total"] - before["push_completed_total"] - \
            before["push_late_total"]
        if done >= len(prompts) or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert now["push_completed_total"] - before["push_completed_total"] >= len(prompts) // 2, (before, now)
    assert now["push_fallbacks_total"] == before["push_fallbacks_total"], (before, now)
    wait_for_idle_workers(url)


PUSH_COUNTERS = ("push_completed_total", "push_late_total", "push_fallbacks_total")
