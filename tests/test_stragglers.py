"""A straggler on the real server (`pdserve serve`, local Ray, the embedded `tiny` model, UCX between workers,
1 prefill + 2 decode workers; coordinator.backend.stragglers): `POST /admin/faults` slows one decode worker (each
engine step sleeps `slow_step_s`), and under load from the test the watch finds it (its step time against its
peer's at a similar batch), exports it, drains and replaces it; every request is 200 with exactly the engine's
text, the slow worker's process is a new one and the other's is not. Bad fault inputs are 400s naming the field."""

import asyncio
import json
import threading

import httpx
import pytest

from engine import LLM, SamplingParams
from tests.engine_helpers import random_prompts
from tests.server_process import (
    HALF_CPU,
    OPERATOR,
    assert_nothing_booked,
    complete,
    live_worker_pids,
    metric_values,
    poll,
    running_server,
)

pytestmark = pytest.mark.timeout(900)
VOCAB = 2000
DEADLINE_S = 400.0  # generous bound for polled states on a loaded machine (never a measured duration)
STREAMS = 4


def _faults(url: str, body: str) -> httpx.Response:
    return httpx.post(f"{url}/admin/faults", content=body, timeout=30,
                      headers={**OPERATOR, "Content-Type": "application/json"})


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


def test_an_injected_slow_decode_worker_is_found_drained_and_replaced_while_requests_succeed(tmp_path):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": {**HALF_CPU, "workers": 2},
              "transfer": {"backends": ["ucx"]}, "admission": {"timeout_s": 300}, "server": {"admin_api": True},
              "stragglers": {"replace": True, "factor": 3.0, "window_s": 10, "min_steps": 10,
                             "drain_timeout_s": 30}}
    reference = LLM("tiny")
    bodies = [_body(p, 24) for p in random_prompts([6 + 5 * i for i in range(8)], VOCAB, seed=19)]
    wanted = [reference.generate([b["prompt"]], SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))[0].text
              for b in bodies]
    with running_server(tmp_path, config) as server:
        url = server.url
        for bad, field in (('{"slow_step_s": NaN}', "slow_step_s"), ('{"slow_step_s": 11}', "slow_step_s"),
                           ('{"slow_step_s": 0.2, "slow_workers": ["nobody"]}', "slow_workers"),
                           ('{"slow_workers": "decode-1"}', "slow_workers")):
            r = _faults(url, bad)
            assert r.status_code == 400 and field in r.json()["error"]["message"], (bad, r.text)
        before = live_worker_pids(server, "decode")
        slowed = _faults(url, json.dumps({"slow_step_s": 0.2, "slow_workers": ["decode-1"]}))
        assert slowed.status_code == 200 and slowed.json()["faults"]["slow_workers"] == ["decode-1"], slowed.text

        results: list[tuple[int, dict]] = []
        stop = threading.Event()

        async def load(k: int) -> None:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                i = k
                while not stop.is_set():
                    results.append((i % len(bodies), await complete(client, url, bodies[i % len(bodies)])))
                    i += STREAMS

        def replaced() -> bool:
            events = metric_values(url, "pdserve_stragglers_total")
            return events.get('{event="replaced"}', 0) >= 1

        async def run() -> tuple[dict, bool]:
            loops = [asyncio.create_task(load(k)) for k in range(STREAMS)]
            ratio = await asyncio.to_thread(poll, lambda: metric_values(url, "pdserve_worker_straggler").get(
                '{worker="decode-1",role="decode"}'), DEADLINE_S, 0.2)  # exported while it is found slow
            found = await asyncio.to_thread(poll, replaced, DEADLINE_S, 0.5)
            stop.set()
            await asyncio.gather(*loops)
            return {"flagged": ratio}, found
        flagged, found = asyncio.run(run())

        assert flagged["flagged"] == 1, flagged
        assert found, metric_values(url, "pdserve_stragglers_total")
        events = metric_values(url, "pdserve_stragglers_total")
        assert events['{event="detected"}'] == 1 and events['{event="replaced"}'] == 1, events  # only the slow one
        after = live_worker_pids(server, "decode")
        assert after["decode-1"] != before["decode-1"] and after["decode-0"] == before["decode-0"], (before, after)
        restarts = metric_values(url, "pdserve_worker_restarts_total")
        assert restarts['{worker="decode-1",role="decode"}'] == 1 and restarts['{worker="decode-0",role="decode"}'] == 0

        assert len(results) > STREAMS, len(results)
        for i, result in results:
            assert result["text"] == wanted[i] and result["completion_tokens"] == 24, (i, result)
        outcomes = metric_values(url, "pdserve_requests_total")
        assert outcomes.get('{outcome="failed"}', 0) == 0 and outcomes.get('{outcome="aborted"}', 0) == 0, outcomes
        assert_nothing_booked(url)
