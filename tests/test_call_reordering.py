"""Workers whose calls run out of order (faults.call_jitter_s: each request call a worker gets waits a random time
first, so the coordinator's calls to one worker arrive in any order, as Ray may run them anyway), on the real server
(`pdserve serve`, local Ray, 1 prefill + 1 decode over UCX, KV pushed or pulled, the embedded `tiny` model): greedy
requests still generate exactly the offline engine's tokens; clients that leave in every phase (during the prefill,
right after the first token, mid-decode) leave nothing behind: no pin freed by its lease, no booking, no block in use
(pool_worker.call_jitter; the orderings it found: decode_pool.reservations, pool_worker.worker.prefill)."""

import asyncio

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import HALF_CPU, admin_integrity, assert_nothing_booked, complete, running_server

pytestmark = pytest.mark.timeout(400)
VOCAB = 2000
JITTER_S = 0.04  # far longer than the gap between two calls the coordinator sends one worker back to back
LEASE_S = 10.0  # transfer.pin_lease_s: a pin nothing released is freed (and counted) soon after the test's requests
DEADLINE_S = 180.0  # generous bound for the streams of a loaded 2-core machine (never a measured duration)


@pytest.fixture(scope="module", params=[True, False], ids=["pushed", "pulled"])
def server(tmp_path_factory, request):
    """transfer.push on (booking, then the prefill worker writes into it) and off (booked early, then pulled)."""
    config = {"model": "tiny", "prefill": {**HALF_CPU, "chunk_size": 256, "kv_cache_memory_bytes": 128 << 20},
              "decode": {**HALF_CPU, "kv_cache_memory_bytes": 128 << 20},
              "transfer": {"backends": ["ucx"], "pin_lease_s": LEASE_S, "push": request.param},
              "server": {"admin_api": True},
              "faults": {"call_jitter_s": JITTER_S, "seed": 11}}
    with running_server(tmp_path_factory.mktemp("call_reordering"), config) as srv:
        yield srv


async def _leave_after(client: httpx.AsyncClient, url: str, prompt: list[int], chunks: float) -> None:
    """Stream a completion and drop the connection after `chunks` SSE events (inf: read it all)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 40, "ignore_eos": True, "stream": True}
    seen = 0
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                seen += 1
                if seen >= chunks:
                    return


async def _leave_at_once(client: httpx.AsyncClient, url: str, prompt: list[int], after_s: float) -> None:
    """A client that gives up `after_s` into its streamed request, whatever phase it is in (mostly its prefill's
    first calls: an abort sent then races them)."""
    task = asyncio.ensure_future(_leave_after(client, url, prompt, float("inf")))
    await asyncio.sleep(after_s)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


def test_requests_end_exactly_and_leave_nothing_when_calls_run_out_of_order(server):
    url = server.url
    prompts = random_prompts([60 + (i * 97) % 700 for i in range(24)], VOCAB, seed=71)
    greedy = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = [o.text for o in LLM("tiny").generate(prompts, greedy)]
    leaving = random_prompts([100 + 37 * (i % 24) for i in range(56)], VOCAB, seed=72)

    async def run():
        async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
            done = asyncio.gather(*[complete(client, url, {"model": "tiny", "prompt": p, "max_tokens": 12,
                                                           "ignore_eos": True, "temperature": 0,
                                                           "stream": i % 2 == 0}) for i, p in enumerate(prompts)])
            gone = asyncio.gather(*[_leave_at_once(client, url, p, 0.002 * i) for i, p in enumerate(leaving[:40])],
                                  *[_leave_after(client, url, p, 1) for p in leaving[40:48]],
                                  *[_leave_after(client, url, p, 4) for p in leaving[48:]])
            return (await asyncio.gather(done, gone))[0]
    results = asyncio.run(run())
    assert [r["text"] for r in results] == want
    assert all(r["completion_tokens"] == 12 and r["finish_reason"] == "length" for r in results), results
    report = assert_nothing_booked(url)  # idle: nothing pinned, booked or in use, integrity ok
    assert {name: check["expired_pins"] for name, check in report["workers"].items()} == \
        {"prefill-0": 0, "decode-0": 0}, report
    assert admin_integrity(url)["mismatches"] == []
