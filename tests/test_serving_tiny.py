"""End to end on the real server with the embedded `tiny` model (1 prefill + 1 decode): 128 concurrent streams,
the openai client, the chat template."""

import asyncio

import httpx
import openai
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import HALF_CPU, complete, running_server, wait_for_idle_workers


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
