"""End to end in collocated mode (every worker runs both phases, the baseline): same outputs as the engine."""

import asyncio

import httpx
import pytest

from engine import SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    HALF_CPU,
    admin_integrity,
    complete,
    running_server,
    wait_for_health,
    wait_for_idle_workers,
)


@pytest.fixture(scope="module")
def server_collocated(llama, tmp_path_factory):
    config = {"model": str(llama), "mode": "collocated", "decode": {**HALF_CPU, "workers": 2},
              "recovery": {"backoff_initial_s": 0.1}, "server": {"admin_api": True}}
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


def test_a_collocated_worker_killed_mid_stream_its_streams_finish_elsewhere(server_collocated, reference, llama):
    """Both workers serve; one is killed through the admin API while every stream decodes: the streams on it
    resume on the other worker (prompt + tokens already sent recomputed there) with exactly the engine's output."""
    prompts = random_prompts([15 + i for i in range(8)], 2000, seed=28)
    bodies = [{"model": str(llama), "prompt": p, "max_tokens": 120, "ignore_eos": True, "stream": True,
               **({"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i})} for i, p in enumerate(prompts)]
    expected = [reference.generate([b["prompt"]], SamplingParams(temperature=b["temperature"], seed=b.get("seed"),
                                                                 max_tokens=120, ignore_eos=True))[0].text
                for b in bodies]
    started: list[int] = []
    decoding = asyncio.Event()

    def progress(chunks: int) -> None:
        if chunks == 3:
            started.append(1)
            if len(started) == len(bodies):
                decoding.set()

    async def kill():
        await decoding.wait()
        async with httpx.AsyncClient(timeout=30) as client:
            r = await client.post(f"{server_collocated.url}/admin/workers/decode-0/kill")
            assert r.status_code == 200, r.text

    async def run():
        async with httpx.AsyncClient(timeout=240) as client:
            return await asyncio.gather(kill(), *[complete(client, server_collocated.url, b, progress) for b in bodies])
    _, *results = asyncio.run(asyncio.wait_for(run(), 300))
    for got, want in zip(results, expected, strict=True):
        assert (got["text"], got["completion_tokens"]) == (want, 120)
    wait_for_health(server_collocated.url, 200)
    wait_for_idle_workers(server_collocated.url)
    assert admin_integrity(server_collocated.url)["ok"]
