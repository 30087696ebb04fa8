"""End to end in collocated mode (every worker runs both phases, the baseline): same outputs as the engine."""

import asyncio

import httpx
import pytest

from engine import SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import HALF_CPU, complete, running_server, wait_for_idle_workers


@pytest.fixture(scope="module")
def server_collocated(llama, tmp_path_factory):
    config = {"model": str(llama), "mode": "collocated", "decode": {**HALF_CPU, "workers": 2}}
    with running_server(tmp_path_factory.mktemp("server_collocated"), config) as server:
        yield server


def test_collocated_mode_gives_the_same_outputs(server_collocated, reference, llama):
    prompts = random_prompts([4, 33, 70, 9], 2000, seed=26)
    expected = reference.generate(prompts, SamplingParams(temperature=0, max_tokens=16, ignore_eos=True))

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            return await asyncio.gather(*[
                complete(client, server_collocated.url, {"model": str(llama), "prompt": p, "max_tokens": 16,
                                                     "temperature": 0, "ignore_eos": True, "stream": i % 2 == 1})
                for i, p in enumerate(prompts)])
    assert [r["text"] for r in asyncio.run(run())] == [e.text for e in expected]
    wait_for_idle_workers(server_collocated.url)
