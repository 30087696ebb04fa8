"""A rolling restart on the real server (`pdserve serve`, local Ray, the embedded `tiny` model, UCX between
workers, 1 prefill + 2 decode workers; coordinator.backend.cycling) under load: streams from the test run all the
way through it, every one 200 with exactly the engine's text and token count, and every worker's process is a new
one afterwards. The lone prefill worker makes the restart refuse (409) until the pause is accepted; bad bodies are
400s naming the field, and a second restart while one runs is a 409."""

import asyncio
import json
import math
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
STREAMS = 4  # concurrent client loops


def _restart(url: str, body: object = None) -> httpx.Response:
    """POST /admin/workers/restart with a JSON body (json.dumps's, so NaN goes as the bare NaN some clients send)."""
    return httpx.post(f"{url}/admin/workers/restart", timeout=30, content=None if body is None else json.dumps(body),
                      headers={**OPERATOR, "Content-Type": "application/json"})


def _status(url: str) -> dict:
    return httpx.get(f"{url}/admin/workers/restart", headers=OPERATOR, timeout=10).json()


def _body(prompt: list[int], max_tokens: int) -> dict:
    return {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True}


def test_a_rolling_restart_under_load_replaces_every_worker_with_no_failed_request(tmp_path):
    config = {"model": "tiny", "prefill": HALF_CPU, "decode": {**HALF_CPU, "workers": 2},
              "transfer": {"backends": ["ucx"]}, "admission": {"timeout_s": 300}, "server": {"admin_api": True}}
    reference = LLM("tiny")
    bodies = [_body(p, 16 + 4 * i) for i, p in enumerate(random_prompts([6 + 5 * i for i in range(8)], VOCAB, seed=9))]
    wanted = [reference.generate([b["prompt"]], SamplingParams(temperature=0, max_tokens=b["max_tokens"],
                                                               ignore_eos=True))[0].text for b in bodies]
    with running_server(tmp_path, config) as server:
        url = server.url
        before = {**live_worker_pids(server, "prefill"), **live_worker_pids(server, "decode")}
        assert set(before) == {"prefill-0", "decode-0", "decode-1"}

        refused = _restart(url)  # the lone prefill worker: its restart pauses prefills
        assert refused.status_code == 409, refused.text
        assert "prefill-0 (the only live worker that can prefill)" in refused.json()["error"]["message"]
        for bad, field in (({"drain_timeout_s": math.nan}, "drain_timeout_s"), ({"drain_timeout_s": 0},
                           "drain_timeout_s"), ({"allow_pause": "yes"}, "allow_pause"), ({"pause": True}, "pause")):
            r = _restart(url, bad)
            assert r.status_code == 400 and r.json()["error"]["param"] == field, (bad, r.text)
        assert httpx.post(f"{url}/admin/workers/restart", timeout=10).status_code == 401
        assert _status(url)["state"] == "idle"

        results: list[tuple[int, dict]] = []
        stop = threading.Event()

        async def load(k: int) -> None:
            async with httpx.AsyncClient(timeout=DEADLINE_S) as client:
                i = k
                while not stop.is_set():
                    results.append((i % len(bodies), await complete(client, url, bodies[i % len(bodies)])))
                    i += STREAMS

        async def run() -> tuple[httpx.Response, httpx.Response, dict]:
            loops = [asyncio.create_task(load(k)) for k in range(STREAMS)]
            while len(results) < STREAMS:  # every loop has served once: load is on
                await asyncio.sleep(0.1)
            started = await asyncio.to_thread(_restart, url, {"allow_pause": True, "drain_timeout_s": 120})
            second = await asyncio.to_thread(_restart, url, {"allow_pause": True})
            status = await asyncio.to_thread(poll, lambda: (s := _status(url))["state"] != "running" and s,
                                             DEADLINE_S, 0.5)
            stop.set()
            await asyncio.gather(*loops)
            return started, second, status
        started, second, status = asyncio.run(run())

        assert started.status_code == 202, started.text
        assert started.json() == {"restart": "running", "order": ["prefill-0", "decode-0", "decode-1"]}
        assert second.status_code == 409 and "already running" in second.text
        assert status and status["state"] == "done", status
        steps = {s["worker"]: s for s in status["done"]}
        assert set(steps) == set(before) and all(s["old_pid"] != s["new_pid"] for s in steps.values()), steps
        assert "only live worker that can prefill" in steps["prefill-0"]["pause"]
        assert steps["decode-0"]["pause"] is None and steps["decode-1"]["pause"] is None
        after = {**live_worker_pids(server, "prefill"), **live_worker_pids(server, "decode")}
        assert all(after[name] != pid for name, pid in before.items()), (before, after)
        assert after == {name: s["new_pid"] for name, s in steps.items()}

        # every request of the load: 200 (complete() asserts it) with exactly the engine's text and token count
        assert len(results) > 3 * STREAMS, len(results)
        for i, result in results:
            assert result["text"] == wanted[i] and result["completion_tokens"] == bodies[i]["max_tokens"], (i, result)
        outcomes = metric_values(url, "pdserve_requests_total")
        assert outcomes.get('{outcome="failed"}', 0) == 0 and outcomes.get('{outcome="aborted"}', 0) == 0, outcomes
        assert outcomes['{outcome="finished"}'] == len(results)
        assert metric_values(url, "pdserve_backend_errors_total").get('{kind="worker_died"}', 0) == 0  # on purpose
        restarts = metric_values(url, "pdserve_worker_restarts_total")
        assert all(v == 1 for v in restarts.values()) and len(restarts) == 3, restarts
        assert_nothing_booked(url)
