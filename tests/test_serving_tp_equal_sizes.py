"""Disaggregated serving between two TP=2 workers (gloo, real UCX, real server): outputs equal the single engine's,
and a lost prefill rank replaces the whole prefill group while decode pulls from the new one."""

import asyncio
import os
import signal

import httpx
import pytest

from engine import SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    admin_integrity,
    complete,
    running_server,
    tp_followers,
    wait_for_health,
    wait_for_idle_workers,
    worker_pids,
)
from tests.test_serving_tp_disaggregated import TOKENS, check_outputs_equal_the_engine, tp_server_config


@pytest.fixture(scope="module")
def server(llama, tmp_path_factory):
    with running_server(tmp_path_factory.mktemp("tp_p2_d2"), tp_server_config(llama, 2, 2)) as server:
        yield server


def test_outputs_equal_the_single_engine(server, reference, llama):
    check_outputs_equal_the_engine(server, reference, llama)


def test_a_lost_prefill_rank_replaces_the_group_and_decode_pulls_from_the_new_one(server, reference, llama):
    [actor] = worker_pids(server, "prefill")
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
    assert worker_pids(server, "prefill") != [actor]  # the whole group was replaced
    wait_for_idle_workers(server.url)
    assert admin_integrity(server.url)["ok"]
