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
from tests.server_process import (
    HALF_CPU,
    admin_integrity,
    assert_nothing_booked,
    complete,
    leave_after_s,
    leaver,
    running_server,
    stream_until,
)

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
            gone = asyncio.gather(*[leave_after_s(client, url, leaver(p), 0.002 * i)
                                    for i, p in enumerate(leaving[:40])],
                                  *[stream_until(client, url, leaver(p), 1) for p in leaving[40:48]],
                                  *[stream_until(client, url, leaver(p), 4) for p in leaving[48:]])
            return (await asyncio.gather(done, gone))[0]
    results = asyncio.run(run())
    assert [r["text"] for r in results] == want
    assert all(r["completion_tokens"] == 12 and r["finish_reason"] == "length" for r in results), results
    report = assert_nothing_booked(url)  # idle: nothing pinned, booked or in use, integrity ok
    assert {name: check["expired_pins"] for name, check in report["workers"].items()} == \
        {"prefill-0": 0, "decode-0": 0}, report
    assert admin_integrity(url)["mismatches"] == []
