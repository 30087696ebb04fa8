"""End to end in collocated mode (every worker runs both phases, the baseline): same outputs as the engine, a worker
killed mid-stream, and each request's phases (those of the mode; a moved stream's lost time named)."""

import asyncio

import httpx
import pytest

from coordinator.observability.phases import DISAGGREGATED_ONLY
from engine import SamplingParams
from tests.engine_helpers import random_prompts
from tests.phase_checks import (
    COLLOCATED,
    assert_partition,
    e2e_count,
    phase_histograms,
    stream_with_phases,
    wait_until_every_worker_is_live,
)
from tests.server_process import (
    HALF_CPU,
    admin_integrity,
    admin_kill,
    complete,
    metric_values,
    running_server,
    streams_with_a_kill,
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
    results = streams_with_a_kill(server_collocated.url, bodies,
                                  lambda: admin_kill(server_collocated.url, "decode-0"), timeout_s=300)
    for got, want in zip(results, expected, strict=True):
        assert (got["text"], got["completion_tokens"]) == (want, 120)
    wait_for_health(server_collocated.url, 200)
    wait_for_idle_workers(server_collocated.url)
    assert admin_integrity(server_collocated.url)["ok"]


def test_a_collocated_stream_has_the_phases_of_its_mode(server_collocated, llama):
    """Collocated: the phases that apply (no KV transfer, no join), none negative, summing to the latency the client
    measured within 5%; /metrics has a sample of each, none of the disaggregated-only ones. What lies outside the
    server's window (the connection, the request head, [DONE]) takes a few ms, but tens on a loaded machine: so the
    request is long, sent on a warm connection, once no replacement worker is still loading."""
    url, before = server_collocated.url, e2e_count(server_collocated.url)
    wait_until_every_worker_is_live(url)
    body = {"model": str(llama), "prompt": "The lighthouse keeper", "max_tokens": 400, "ignore_eos": True,
            "temperature": 0}

    async def run():
        async with httpx.AsyncClient(timeout=120) as client:
            await stream_with_phases(client, url, {**body, "max_tokens": 2})
            return await stream_with_phases(client, url, body)
    result = asyncio.run(run())
    assert result["completion_tokens"] == 400
    assert_partition(result, COLLOCATED)
    counts, _ = phase_histograms(url, before + 2)
    assert all(counts[p] >= 1 for p in COLLOCATED) and all(counts[p] == 0 for p in DISAGGREGATED_ONLY), counts


def test_a_migrated_stream_names_the_time_it_lost_and_its_phases_still_sum(server_collocated, llama):
    """Two streams, one per worker (each placed where most KV is unbooked, once both workers are live); decode-0 is
    killed while both decode: its stream moves and reports `migration` besides the phases of both attempts added up,
    the other does not, and both still sum to the latency their client measured within 5%."""
    url, before = server_collocated.url, e2e_count(server_collocated.url)
    wait_until_every_worker_is_live(url)
    bodies = [{"model": str(llama), "prompt": p, "max_tokens": 480, "ignore_eos": True, "temperature": 0}
              for p in random_prompts([20, 24], 2000, seed=41)]
    results = streams_with_a_kill(url, bodies, lambda: admin_kill(url, "decode-0"), stream=stream_with_phases)
    assert [r["completion_tokens"] for r in results] == [480, 480]
    moved = [r for r in results if "migration" in (r["phases"] or {})]
    assert len(moved) == 1, [r["phases"] for r in results]
    for r in results:
        # a worker's death and the migration load the 2-core runner just when this happens: a CI run saw the
        # client wait 0.17 s outside the server's window (5.3% of 3.2 s) while the phases covered the rest
        assert_partition(r, COLLOCATED | ({"migration"} if r in moved else set()), unseen_s=0.25)
    counts, _ = phase_histograms(url, before + 2)
    assert counts["migration"] >= 1
    wait_for_health(url, 200)
    wait_for_idle_workers(url)


def test_a_client_that_leaves_mid_stream_has_its_request_aborted_on_the_worker(server_collocated, llama):
    """The stream is closed after three chunks: the abort goes to the worker on the same stream as the request's
    start (decode_pool.worker_stream), so the engine stops it long before its max_tokens: the workers' sampled
    tokens grow by far less than the request asked for, and nothing stays booked."""
    wait_for_idle_workers(server_collocated.url)

    def sampled() -> float:
        return sum(metric_values(server_collocated.url, "pdserve_worker_engine_sampled_tokens_total").values())
    before = sampled()
    body = {"model": str(llama), "prompt": random_prompts([20], 2000, seed=5)[0], "max_tokens": 480,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=server_collocated.url, timeout=60) as client:
        with client.stream("POST", "/v1/completions", json=body) as r:
            assert r.status_code == 200
            chunks = 0
            for line in r.iter_lines():
                chunks += line.startswith("data: {")
                if chunks == 3:
                    break
    wait_for_idle_workers(server_collocated.url)
    assert sampled() - before < 240, "the request ran on after its client left"
    assert admin_integrity(server_collocated.url)["ok"]


def test_a_conversations_next_turn_goes_to_the_worker_holding_its_history(server_collocated, reference, llama):
    """Four conversations' first turns, one at a time (spread over both workers by room), then their second turns
    (history + reply + new tokens) in another order: each goes back to the worker whose prefix cache holds its
    history (Router.pick_whole) and reports those tokens cached, with the engine's exact output. Placed by room
    alone, the second turns alternated between the workers regardless of their histories."""
    url = server_collocated.url
    wait_until_every_worker_is_live(url)
    wait_for_idle_workers(url)
    firsts = random_prompts([40, 44, 48, 52], 2000, seed=61)

    def body(prompt):
        return {"model": str(llama), "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}

    with httpx.Client(base_url=url, timeout=120) as client:
        replies = []
        for prompt in firsts:
            r = client.post("/v1/completions", json=body(prompt))
            assert r.status_code == 200, r.text
            replies.append(reference.tokenizer.encode(r.json()["choices"][0]["text"], add_special_tokens=False))
        seconds = [first + reply + list(range(300 + 5 * i, 305 + 5 * i))
                   for i, (first, reply) in enumerate(zip(firsts, replies, strict=True))]
        expected = reference.generate(seconds, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        for i in (1, 0, 3, 2):
            r = client.post("/v1/completions", json=body(seconds[i]))
            assert r.status_code == 200, r.text
            data = r.json()
            assert data["choices"][0]["text"] == expected[i].text
            cached = data["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= len(firsts[i]) // 16 * 16, (i, cached)  # the first turn's full blocks at least
    wait_for_idle_workers(url)
